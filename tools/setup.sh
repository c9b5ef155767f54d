#!/usr/bin/env bash
# Installs the Debian packages the build and the tests need, when they are missing.
#   tools/setup.sh          everything: the build, the tests, the adapters, the benchmarks
#   tools/setup.sh --gate   only what building the command needs (cmake -DATTNORACLE_TESTS=OFF)
set -euo pipefail

gate_only=false
[[ ${1:-} == --gate ]] && gate_only=true

packages=(
  g++ cmake make pkg-config
  libmpfr-dev libgmp-dev libboost-dev nlohmann-json3-dev libcli11-dev nettle-dev libhwy-dev
)
if ! $gate_only; then
  packages+=(
    libgtest-dev librapidcheck-dev
    python3 python3-numpy
    pybind11-dev python3-dev python3-pytest  # python/: import attnoracle, the pytest plugin, their tests
    python3-venv python3-pip python3-setuptools python3-wheel  # python_pip_install_test: pip install . offline
    libbenchmark-dev python3-mpmath time  # bench/: Google Benchmark, the mpmath reference, GNU time
    libtorch-dev  # the libtorch plugin (conformance/plugins/libtorch)
    python3-torch  # the PyTorch adapter (conformance/adapters/torch) and its tests
    gappa sollya  # reference/proofs: the fast path's machine-checked error bounds
    clang libclang-rt-14-dev  # fuzz/: libFuzzer with AddressSanitizer and UBSan
    dpkg-dev  # tools_install_test: the Debian package built by cpack
    chromium  # conformance_html_chromium_test: the HTML report in headless Chromium
    slurm-wlm  # tools_slurm_test: its own single-node Slurm (and munge) runs tools/slurm/gen-array.sbatch
  )
  # Node.js and npm, for the ONNX Runtime adapter: Debian's only when none is on the PATH already.
  command -v node >/dev/null 2>&1 || packages+=(nodejs)
  command -v npm >/dev/null 2>&1 || packages+=(npm)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "attnoracle setup: installing ${missing[*]}" >&2
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The ONNX Runtime adapter's npm dependency (onnxruntime-node, which ships its CPU binaries), from
# its lockfile. Install scripts stay off: onnxruntime-node's would download GPU binaries.
ort_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/conformance/adapters/onnxruntime"
if ! $gate_only && command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
    && [[ ! -d "$ort_dir/node_modules/onnxruntime-node" ]]; then
  echo "attnoracle setup: installing onnxruntime-node in $ort_dir" >&2
  (cd "$ort_dir" && npm ci --ignore-scripts --no-audit --no-fund >/dev/null) \
    || echo "attnoracle setup: npm ci failed; the ONNX Runtime adapter and its tests are unavailable" >&2
fi
