#!/usr/bin/env bash
# cmake --install of a build tree into a fresh prefix, then a project outside the tree built
# against it (find_package(AttnOracle), and pkg-config for the plugin ABI): its plugin passes
# the gate run by the installed command, and its program reads a case file.
# The Debian package made by cpack is checked and unpacked, and its command runs the gate.
# Usage: install_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/attnoracle"
test -f "$work/prefix/include/attnoracle/plugin.h"
test -f "$work/prefix/include/attnoracle/version.hpp"

cmake -S "$src/tools/tests/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DATTNORACLE_PLUGIN_SOURCE="$src/conformance/plugins/naive_c/attention.c" >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/consumer_read" "$src/vectors/examples/example.safetensors"
"$work/prefix/bin/attnoracle" run "$src/vectors/core" --plugin "$work/consumer/libconsumer_plugin.so" \
  --profile fp32 --tag causal

# pkg-config gives the plugin ABI's flags from the installed tree.
flags=$(PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" pkg-config --cflags attnoracle)
cc -std=c99 -shared -fPIC $flags -o "$work/pc_plugin.so" "$src/conformance/plugins/naive_c/attention.c" -lm
"$work/prefix/bin/attnoracle" run "$src/vectors/core" --plugin "$work/pc_plugin.so" --profile fp32 --tag gqa
# The Debian package of the same install: its control data, and the gate run from its contents.
(cd "$work" && cpack --config "$build/CPackConfig.cmake" -G DEB -B "$work/deb" >/dev/null)
deb=$(ls "$work"/deb/attnoracle_*.deb)
dpkg-deb --field "$deb" Package Version Depends
dpkg-deb -x "$deb" "$work/root"
"$work/root/usr/bin/attnoracle" verify "$src/vectors/core" >/dev/null
"$work/root/usr/bin/attnoracle" run "$src/vectors/core" --plugin "$work/pc_plugin.so" --profile fp32 --tag mqa
# The Python package, when it was built (ATTNORACLE_PYTHON): importable from the prefix and from
# the Debian package, reading a vector set.
for dir in "$work/prefix/lib/python3/dist-packages" "$work/root/usr/lib/python3/dist-packages"; do
  if [[ -d "$work/prefix/lib/python3/dist-packages/attnoracle" ]]; then
    PYTHONPATH="$dir" /usr/bin/python3 -c 'import sys, attnoracle; assert attnoracle.__file__.startswith(sys.argv[1]); assert len(attnoracle.Suite(sys.argv[2])) > 0' "$dir" "$src/vectors/core"
  fi
done
echo "install test: passed"
