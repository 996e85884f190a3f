#!/usr/bin/env bash
# Build the native core with AddressSanitizer + UBSan (CMake option DPVR_SANITIZE) and run the binding fuzz,
# bad-input and kernel tests against it. Too slow for CI; run it by hand after native changes:
#
#   bench/asan.sh            (from anywhere; PYTHON picks the interpreter, default python3)
#
# SKBUILD=ON builds the Python extension as the wheel build does. The instrumented extension is staged in build/asan/stage next to a copy of the Python package, so the
# source tree and the environment are untouched. Python itself is not instrumented, so libasan is preloaded;
# leak checking is off (the interpreter's own allocations would drown the report).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
BUILD=build/asan
cmake -S . -B "$BUILD" -G Ninja -DSKBUILD=ON -DDPVR_SANITIZE=ON -DDPVR_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
ninja -C "$BUILD" >/dev/null

rm -rf "$BUILD/stage" && mkdir -p "$BUILD/stage"
cp -r python/dpvr "$BUILD/stage/dpvr"
rm -f "$BUILD"/stage/dpvr/_C*.so
cp "$BUILD"/_C*.so "$BUILD/stage/dpvr/"

LIBASAN="$(${CXX:-c++} -print-file-name=libasan.so)"
LIBUBSAN="$(${CXX:-c++} -print-file-name=libubsan.so)"
export LD_PRELOAD="$LIBASAN:$LIBUBSAN"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$PWD/$BUILD/stage"
"$PY" -c "import dpvr, os; assert os.path.dirname(dpvr.__file__).endswith('stage/dpvr'), dpvr.__file__"
"$PY" -m pytest -q -p no:cacheprovider tests/ops/test_fuzz.py tests/ops/test_bad_input.py tests/ops/test_kernels.py \
  tests/ops/test_ghost.py
echo "bench/asan.sh: no AddressSanitizer or UBSan report"
