#!/usr/bin/env bash
# Fetches, into .whl/, the wheels a GPU machine without network needs to run bench/gpu.sh: the packages dpvr
# and its GPU tests import that such a machine's image lacks (CPython 3.12, manylinux x86-64), without their
# dependencies (named here one by one, so that nothing the image already has is replaced).
#
#   bench/gpu_wheels.sh        then carry .whl and install it with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-index --find-links .whl/hf transformers
#
# transformers (the GPT-2 and BERT step cases, from configs: no weights are downloaded) goes into .whl/hf with
# its whole dependency closure; pip installs from it only what the image lacks or has too old.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(dp-accounting==0.6.0 dm-tree==0.1.9 blake3==1.0.11 opacus==1.6.0)
PLATFORMS=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do PLATFORMS+=(--platform "manylinux_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
TRANSFORMERS="transformers==$("${PYTHON:-python3}" -c 'import transformers; print(transformers.__version__)' \
  2>/dev/null || echo 5.24.0)"
mkdir -p .whl/hf
"${PYTHON:-python3}" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl/hf "$TRANSFORMERS"
ls -1 .whl .whl/hf
