#!/usr/bin/env bash
# One command for a GPU machine: build dpvr with the CUDA backend, run the GPU tests, run compute-sanitizer
# (memcheck, racecheck) over every kernel path, and benchmark the kernels.
#
#   bench/gpu.sh            (from anywhere; results go to $OUT if set, else results/)
#
# Nothing is downloaded: python with torch (CUDA build), pytest, pybind11, cmake and the CUDA toolkit (nvcc,
# compute-sanitizer) must already be installed. PYTHON picks the interpreter (default python3). The build is a
# CMake dev build in build/gpu; the package is staged next to it, so nothing is installed into the environment.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-results}"
BUILD=build/gpu
mkdir -p "$OUT_DIR"
failures=()

step() { printf '\n==== %s\n' "$*"; }
need() {
  if ! "$@" >/dev/null 2>&1; then
    echo "bench/gpu.sh: missing prerequisite: $MISSING" >&2
    exit 2
  fi
}

step "prerequisites"
MISSING="python with torch built for CUDA and a visible GPU" \
  need "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
MISSING="pytest (python -m pytest)" need "$PY" -m pytest --version
MISSING="pybind11 (python -m pybind11)" need "$PY" -c "import pybind11"
MISSING="cmake" need cmake --version
if [ -n "${CUDA_HOME:-}" ]; then PATH="$CUDA_HOME/bin:$PATH"; fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then PATH="/usr/local/cuda/bin:$PATH"; fi
MISSING="nvcc (set CUDA_HOME)" need nvcc --version
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

step "build (CMake, DPVR_CUDA=ON)"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DSKBUILD=ON -DDPVR_CUDA=ON \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DPython_EXECUTABLE="$(command -v "$PY")" >"$OUT_DIR/gpu_cmake.log" 2>&1 ||
  { tail -30 "$OUT_DIR/gpu_cmake.log"; echo "bench/gpu.sh: cmake failed" >&2; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" 2>&1 | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench/gpu.sh: build failed" >&2; exit 1; }
rm -rf "$BUILD/pkg" && mkdir -p "$BUILD/pkg"
cp -r python/dpvr "$BUILD/pkg/"
rm -f "$BUILD"/pkg/dpvr/_C*.so
cp "$BUILD"/_C*.so "$BUILD/pkg/dpvr/"
export PYTHONPATH="$PWD/$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import dpvr, sys; b = dpvr.backends(); print('dpvr', dpvr.__file__, b); sys.exit(0 if b['cuda_available'] else 1)" ||
  { echo "bench/gpu.sh: the CUDA build does not see the GPU" >&2; exit 1; }

step "GPU tests"
timeout 240 "$PY" -m pytest -m gpu tests/test_cuda.py -v -p no:cacheprovider 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("GPU tests")

step "compute-sanitizer"
sanitizer="$(command -v compute-sanitizer || true)"
cuda_root="$(dirname "$(dirname "$(command -v nvcc)")")"
for candidate in "$cuda_root/bin/compute-sanitizer" "$cuda_root/compute-sanitizer/compute-sanitizer"; do
  if [ -z "$sanitizer" ] && [ -x "$candidate" ]; then sanitizer="$candidate"; fi
done
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found (PATH, or next to nvcc): skipped" | tee "$OUT_DIR/gpu_sanitizer.log"
  failures+=("compute-sanitizer missing")
else
  for tool in memcheck racecheck; do
    echo "-- $tool"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 180 "$sanitizer" --tool "$tool" --kernel-name kns=dpvr \
      --error-exitcode 1 "$PY" bench/cuda_sanitize.py >"$OUT_DIR/gpu_$tool.log" 2>&1
    status=$?
    tail -5 "$OUT_DIR/gpu_$tool.log"
    [ "$status" -eq 0 ] || failures+=("compute-sanitizer $tool (exit $status)")
  done
fi

step "benchmark: dpvr bench kernels --device cuda"
timeout 180 "$PY" -c 'import sys; from dpvr.cli import main; sys.exit(main(sys.argv[1:]))' \
  bench kernels --device cuda --json "$OUT_DIR/bench_cuda.json" | tee "$OUT_DIR/bench_cuda.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("dpvr bench kernels --device cuda")

step "summary"
echo "results in $OUT_DIR/"
if [ "${#failures[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${failures[@]}"
  exit 1
fi
echo "all GPU checks passed"
