#!/usr/bin/env bash
# The GPU visit in two stages, each planned to finish within 5 minutes on a 16-core machine with one GPU:
#
#   bench/gpu.sh check    stage 1: build dpvr with the CUDA backend, run the GPU tests, run compute-sanitizer
#                         (memcheck, racecheck) over a driver of every kernel path
#   bench/gpu.sh bench    stage 2: the kernels against a device-to-device copy, torch eager and Opacus; one
#                         full step (non-private, Opacus hooks and ghost, dpvr's make_private DP-SGD step and
#                         its DIFF2 round) at the sizes users train (dpvr bench step --real), with peak memory
#                         and host syncs: the two target cases (GPT-2 small T = 512 B = 16, ResNet-18 B = 256)
#                         under bf16 autocast and the kernels each of their steps launches (bench/step_profile.py)
#                         first; then BERT-base T = 128 B = 32, GPT-2 B = 32 and ResNet-18 B = 1024 under bf16,
#                         the two targets in float32; then, as time allows, the small MLP, CNN and transformer
#                         cases and their profile
#   bench/gpu.sh steps CASE:PRECISION...
#                         a short rerun: the build, the host-sync test, and the named real cases' step
#                         benchmarks only (e.g. gpt2-small-b16:bf16 resnet18-b256:none), each within 120 s
#   bench/gpu.sh all      both, one after the other (planned to fit one 10-minute call: stage 1 about 80 s,
#                         stage 2 at most BENCH_BUDGET seconds, default 420)
#
# DRY_RUN=1 runs either stage on a machine without a GPU: the same build (CUDA compiled in), the same Python
# code paths on the CPU (the real cases at their reduced size, --reduced), and only the calls that need a
# device skipped; run it before a visit.
#
# Each stage writes its whole output to $OUT/gpu_<stage>.log (OUT defaults to results/) and its figures as JSON
# beside it, and prints a one-line verdict last. Nothing is downloaded: python with torch, pytest, pybind11,
# cmake and the CUDA toolkit must be installed; the packages a GPU image lacks travel as wheels
# (bench/gpu_wheels.sh). PYTHON picks the interpreter (default python3). CUDAARCHS (default 90-real on a GPU
# machine) picks the architectures compiled.
set -uo pipefail
cd "$(dirname "$0")/.."

STAGE="${1:-all}"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-results}"
DRY="${DRY_RUN:-0}"
BUILD=build/gpu
LOGS="$BUILD/logs"
mkdir -p "$OUT_DIR" "$LOGS"
case "$STAGE" in
  check | bench) ;;
  steps) shift; STEPS=("$@") ;;
  all)
    "$0" check
    first=$?
    "$0" bench
    second=$?
    exit $((first > second ? first : second))
    ;;
  *) echo "usage: bench/gpu.sh check|bench|all|steps CASE:PRECISION..." >&2; exit 2 ;;
esac
exec > >(tee "$OUT_DIR/gpu_$STAGE.log") 2>&1
failures=()
started=$SECONDS

step() { printf '\n==== [%3ds] %s\n' "$((SECONDS - started))" "$*"; }
verdict() {
  local seconds=$((SECONDS - started))
  if [ "${#failures[@]}" -gt 0 ]; then
    printf 'VERDICT gpu.sh %s: FAILED (%s) in %ds%s\n' "$STAGE" "$(IFS=';'; echo "${failures[*]}")" "$seconds" \
      "$([ "$DRY" = 1 ] && echo ', dry run')"
    exit 1
  fi
  printf 'VERDICT gpu.sh %s: passed in %ds%s\n' "$STAGE" "$seconds" "$([ "$DRY" = 1 ] && echo ', dry run')"
  exit 0
}
run() {  # run NAME SECONDS COMMAND...: the command's output into the stage log; a failure is recorded
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@"
  local status=$?
  [ "$status" -eq 0 ] || failures+=("$name (exit $status)")
  return "$status"
}

step "prerequisites"
if [ -n "${CUDA_HOME:-}" ]; then PATH="$CUDA_HOME/bin:$PATH"; fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then PATH="/usr/local/cuda/bin:$PATH"; fi
for tool in cmake nvcc; do
  command -v "$tool" >/dev/null || { failures+=("$tool missing"); verdict; }
done
"$PY" -c "import torch, pytest, pybind11" || { failures+=("python lacks torch, pytest or pybind11"); verdict; }
if [ "$DRY" = 1 ]; then
  "$PY" -c "import torch; print('dry run: torch', torch.__version__, 'on the CPU')"
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { failures+=("torch sees no GPU"); verdict; }
  "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
  export CUDAARCHS="${CUDAARCHS:-90-real}"
fi
nvcc --version | tail -1

step "build (CMake, DPVR_CUDA=ON, $(nproc) jobs)"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
build_start=$SECONDS
if ! cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DSKBUILD=ON -DDPVR_CUDA=ON \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DPython_EXECUTABLE="$(command -v "$PY")" >"$LOGS/cmake.log" 2>&1; then
  tail -30 "$LOGS/cmake.log"; failures+=("cmake configure"); verdict
fi
if ! cmake --build "$BUILD" -j "$(nproc)" >"$LOGS/build.log" 2>&1; then
  grep -E -m 30 "error|Error" "$LOGS/build.log"; tail -10 "$LOGS/build.log"; failures+=("build"); verdict
fi
grep -c -i "warning" "$LOGS/build.log" | xargs printf 'compiler warnings: %s\n'
echo "built in $((SECONDS - build_start))s"
rm -rf "$BUILD/pkg" && mkdir -p "$BUILD/pkg"
cp -r python/dpvr "$BUILD/pkg/"
cp -r lab/dpvr_lab "$BUILD/pkg/"  # the benchmarks (the separate distribution dpvr-lab), beside the library
rm -f "$BUILD"/pkg/dpvr/_C*.so
cp "$BUILD"/_C*.so "$BUILD/pkg/dpvr/"
# The staged package's metadata (dpvr reads its version from it), as an installation would write it.
"$PY" - "$BUILD/pkg" <<'PY'
import pathlib, sys, tomllib
version = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["version"]
info = pathlib.Path(sys.argv[1]) / f"dpvr-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dpvr\nVersion: {version}\n")
PY
export PYTHONPATH="$PWD/$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import dpvr, sys; b = dpvr.backends(); print('dpvr', dpvr.__version__, dpvr.__file__, b)
staged = dpvr.__file__.startswith('$PWD/$BUILD/pkg/')
sys.exit(0 if (staged or '$DRY' == '1') and b['cuda_compiled'] and (b['cuda_available'] or '$DRY' == '1') else 1)" ||
  { failures+=("the staged CUDA build is not the dpvr imported, or does not see the GPU"); verdict; }
export PYTHONUNBUFFERED=1

# The benchmark stages' machinery (bench, steps).
cli=("$PY" -c 'import sys; from dpvr.cli import main; sys.exit(main(sys.argv[1:]))')
device=cuda quick=(--quick) reduced=()
if [ "$DRY" = 1 ]; then device=cpu quick=(--quick --repeats 1) reduced=(--reduced); fi
# Seconds for a stage, from its start. A dry run on a shared CPU is slower than the device and must reach
# every code path: there the budget and each limit are four times larger.
slow=1
if [ "$DRY" = 1 ]; then slow=4; fi
budget="${BENCH_BUDGET:-$((420 * slow))}"
left() { echo $((budget - (SECONDS - started))); }
within() {  # within NAME SECONDS COMMAND...: run it with at most what the budget has left
  local name=$1 limit=$(($2 * slow)) rest
  shift 2
  rest=$(left)
  if [ "$rest" -lt 20 ]; then echo "not run: the stage's budget (${budget}s) is spent: $name"; return 0; fi
  run "$name" "$((limit < rest ? limit : rest))" "$@"
}
real_step() {  # real_step CASE PRECISION SECONDS: one real case's step benchmark
  local case=$1 precision=$2 limit=$3
  step "benchmark: one step at real size, $case, autocast $precision (dpvr bench step --device $device)"
  # --one-process: a process per method would spend the device's minutes starting CUDA six times a case
  within "step benchmark $case $precision" "$limit" "${cli[@]}" bench step --device "$device" --case "$case" \
    --autocast "$precision" --memory --one-process "${quick[@]}" "${reduced[@]}" \
    --json "$OUT_DIR/bench_step_real_${case}_${precision}_$device.json"
}

if [ "$STAGE" = steps ]; then
  step "the host-sync test (tests/lab/test_bench_step.py -m gpu)"
  run "host-sync test" 60 "$PY" -m pytest -m gpu tests/lab/test_bench_step.py -q -p no:cacheprovider -rs \
    >"$LOGS/steps_tests.log" 2>&1
  tail -5 "$LOGS/steps_tests.log"
  for spec in "${STEPS[@]}"; do
    IFS=: read -r case precision <<<"$spec"
    real_step "$case" "$precision" 120
  done
elif [ "$STAGE" = check ]; then
  step "GPU tests (tests/ops/test_cuda.py, tests/lab/test_bench_step.py: tests marked gpu)"
  run "GPU tests" 150 "$PY" -m pytest -m gpu tests/ops/test_cuda.py tests/lab/test_bench_step.py -q -p no:cacheprovider -rs --durations=5 \
    >"$LOGS/tests.log" 2>&1
  tail -25 "$LOGS/tests.log"

  step "compute-sanitizer over bench/cuda_sanitize.py"
  sanitizer="$(command -v compute-sanitizer || true)"
  cuda_root="$(dirname "$(dirname "$(command -v nvcc)")")"
  for candidate in "$cuda_root/bin/compute-sanitizer" "$cuda_root/compute-sanitizer/compute-sanitizer"; do
    if [ -z "$sanitizer" ] && [ -x "$candidate" ]; then sanitizer="$candidate"; fi
  done
  if [ "$DRY" = 1 ]; then
    echo "dry run: the driver's Python compiles; the sanitizers need a GPU"
    "$PY" -m py_compile bench/cuda_sanitize.py || failures+=("bench/cuda_sanitize.py does not compile")
  elif [ -z "$sanitizer" ]; then
    failures+=("compute-sanitizer not found")
  else
    for tool in memcheck racecheck; do
      echo "-- $tool"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 run "compute-sanitizer $tool" 100 "$sanitizer" --tool "$tool" \
        --kernel-name kns=dpvr --error-exitcode 1 "$PY" bench/cuda_sanitize.py >"$LOGS/$tool.log" 2>&1
      tail -4 "$LOGS/$tool.log"
    done
  fi
else
  step "benchmark: the kernels (dpvr bench kernels --device cuda)"
  if [ "$DRY" = 1 ]; then
    run "kernel benchmark (import)" 60 "$PY" -c "from dpvr_lab.bench import cuda_kernels; print(cuda_kernels.markdown([]))"
  else
    run "kernel benchmark" 120 "${cli[@]}" bench kernels --device cuda --json "$OUT_DIR/bench_kernels_cuda.json"
  fi
  "$PY" -c "import transformers" 2>/dev/null ||
    echo "transformers is missing: the GPT-2 and BERT cases will fail (bench/gpu_wheels.sh carries it)"
  rounds=3
  if [ "$DRY" = 1 ]; then rounds=1; fi
  # The two target cases under bf16 autocast (as users train) and their profiles first, so that a visit cut
  # short still has their ratios and launch counts; then the other real cases, and float32 for the targets.
  # One process per case: a case that fails or runs out of time leaves the others' figures.
  real_step gpt2-small-b16 bf16 90
  real_step resnet18-b256 bf16 70
  for case in gpt2-small-b16 resnet18-b256; do
    step "profile at real size: kernels launched and device time per step, $case, bf16 (bench/step_profile.py)"
    within "step profile $case" 90 "$PY" bench/step_profile.py --device "$device" --case "$case" --autocast bf16 \
      --rounds "$rounds" "${reduced[@]}" > >(grep -v "^USDT:") 2>&1
  done
  for spec in bert-base-b32:bf16:70 gpt2-small-b32:bf16:100 resnet18-b1024:bf16:100 gpt2-small-b16:none:90 \
    resnet18-b256:none:70; do
    IFS=: read -r case precision limit <<<"$spec"
    real_step "$case" "$precision" "$limit"
  done
  for case in mlp cnn transformer; do
    step "benchmark: one step, $case (dpvr bench step --device $device), as time allows"
    within "step benchmark $case" 60 "${cli[@]}" bench step --device "$device" --case "$case" --memory \
      --one-process "${quick[@]}" --json "$OUT_DIR/bench_step_${case}_$device.json"
  done
  step "profile: where each method's step time goes (bench/step_profile.py --device $device), as time allows"
  within "step profile" 90 "$PY" bench/step_profile.py --device "$device" --rounds "$rounds" > >(grep -v "^USDT:") 2>&1
fi
verdict
