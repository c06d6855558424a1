#!/usr/bin/env bash
# Prepares the GPU kit (issue 31) here, on CPU, with network: fetches the wheels the GPU machine lacks into
# analysis/gpu/wheels (ignored by git, carried by the device call), checks that the tree plus the wheels fit
# the 64 MiB the device call carries, and prints the exact device call.
#   bash analysis/gpu/prepare.sh            (PYTHON=... picks the Python whose pip downloads; any version)
# The GPU machine has Python 3.12, torch 2.11 (CUDA 13), triton 3.6, transformers, accelerate, safetensors,
# tokenizers, seaborn, pytest and hypothesis; of diffquant's dependencies it lacks optimum-quanto,
# bitsandbytes and gguf (ninja: optimum-quanto's own dependency). lm-eval is not carried: its dependencies
# include pyarrow (55 MB) and sqlitedict (no wheel at all), and no stage uses it.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
wheels=analysis/gpu/wheels
# Downloaded into a fresh folder, trimmed there, then moved: pip would find a trimmed wheel's hash "bad" and
# download it again, and wheels of earlier pins must not travel.
fresh=$(mktemp -d -t diffquant-wheels.XXXXXX)
trap 'rm -rf "$fresh"' EXIT

# Pinned: the sizes in analysis/gpu/README.md are these wheels'.
"$python" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check --quiet \
  --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d "$fresh" \
  optimum-quanto==0.2.7 gguf==0.19.0 ninja==1.13.2 bitsandbytes==0.50.2

# bitsandbytes: 41.1 MiB as published, one library per CUDA / ROCm release; only the CUDA 13 ones (and the
# CPU one) can load next to the machine's torch, so the rest is dropped (kit.py trim-bnb).
"$python" analysis/gpu/kit.py trim-bnb "$fresh"
mkdir -p "$wheels"
rm -f "$wheels"/*.whl
mv "$fresh"/*.whl "$wheels"/
"$python" analysis/gpu/kit.py manifest "$wheels" >/dev/null

echo
"$python" analysis/gpu/kit.py size --carry "$wheels"
echo
cat <<CALL
device call (the run tool):
  command:   bash analysis/gpu/run.sh
  carry:     ["$wheels"]
  timeout_s: 600
rehearse here first:  bash analysis/gpu/run.sh --rehearse
CALL
