#!/usr/bin/env bash
# Unit tests (GoogleTest, RapidCheck) and end-to-end tests of the attnoracle command under
# AddressSanitizer and UBSan: builds the command and the test executables of SANITIZE_TESTS with
# gcc, RelWithDebInfo, -fsanitize=address,undefined -fno-sanitize-recover=undefined (no Python
# module, benchmarks or libtorch plugin: their hosts are not instrumented) into
# ${ASAN_DIR:-build-asan}, and runs their tests (CTest labels unit:<executable>). Any sanitizer
# report, a leak included, fails its test. tools/test.sh (CI) runs it after the whole ctest.
#   bash tools/sanitize.sh                      the default selection below
#   SANITIZE_TESTS=all bash tools/sanitize.sh   every GoogleTest executable
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${ASAN_DIR:-build-asan}
# The default: the readers and validators of what users give (safetensors, case files, hostile
# inputs, suite specs, profiles) and the end-to-end tests of eval, gen/verify, run/check and
# sharding, which run the instrumented command on good and bad input. Left out: the evaluation
# and oracle tests (random problems evaluated two ways, properties, backward, the fast path), the
# gate's statistics and metamorphic runs: several times their unsanitized minutes under ASan, and
# the command's tests evaluate cases through the same code.
tests=(reference_safetensors_test reference_case_file_test reference_hostile_input_test
  vectors_suite_test conformance_profile_test tools_eval_refusal_test vectors_cli_test
  conformance_gate_test tools_shard_test)
[[ -n ${SANITIZE_TESTS:-} ]] && read -r -a tests <<<"$SANITIZE_TESTS"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNORACLE_TESTS=ON -DATTNORACLE_PYTHON=OFF \
  -DATTNORACLE_BENCHMARKS=OFF -DATTNORACLE_TORCH=OFF "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags" \
  >/dev/null
if [[ ${tests[*]} == all ]]; then
  cmake --build "$dir" -j "$(nproc)" --target attnoracle_unit_tests >/dev/null
  labels='^unit:'
else
  cmake --build "$dir" -j "$(nproc)" --target attnoracle "${tests[@]}" >/dev/null
  labels="^unit:($(IFS='|'; echo "${tests[*]}"))\$"
fi
# The first report ends the process with status 23, which fails the test (an end-to-end test
# sees the command exit 23, not 0 or 2); leaks are reported at exit.
export ASAN_OPTIONS="halt_on_error=1:exitcode=23:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=23"
export LSAN_OPTIONS="exitcode=23"
# Left out too: the test of a plugin that dies of SIGSEGV on purpose (ASan's handler makes the
# host exit 23 instead of dying of the signal that the test expects).
ctest --test-dir "$dir" -L "$labels" -E '^Gate\.PluginCrashingOnOneCaseFailsThatCaseOnly$' --output-on-failure \
  -j "$(nproc)"
