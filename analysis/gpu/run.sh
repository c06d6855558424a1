#!/usr/bin/env bash
# The GPU kit's one command (issue 31), run on the GPU machine from the repository root:
#   bash analysis/gpu/run.sh                 # the stages on CUDA, results into $OUT (summary.json + zips)
#   bash analysis/gpu/run.sh --rehearse      # the same stages on CPU at toy sizes (a test runs this)
# Further options go to the driver (python analysis/gpu/kit.py run --help), e.g. --stages trio --budget trio=480.
# The carried wheels (analysis/gpu/wheels, made by prepare.sh) are installed into a temporary site folder,
# offline; diffquant itself is imported from this tree (PYTHONPATH), not installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
started=$(date +%s)
python=${PYTHON:-$(command -v python3 || command -v python)}
out=${OUT:-}
if [[ -z "$out" ]]; then
  out=$(mktemp -d -t diffquant-kit-out.XXXXXX)
fi
mkdir -p "$out"
tmp=$(mktemp -d -t diffquant-kit.XXXXXX)

# shellcheck disable=SC2329  # invoked by the EXIT trap
finish() {
  local rc=$?
  if [[ ! -s "$out/summary.json" ]]; then
    # the driver never wrote a summary (no Python, a broken install): say so where the results are read
    printf '{"kit": "diffquant GPU kit (issue 31)", "status": "failed", "reason": "run.sh exited with code %s before the driver wrote a summary; see setup.log", "stages": {}}\n' "$rc" >"$out/summary.json"
    if [[ -f "$tmp/setup.log" ]]; then cp "$tmp/setup.log" "$out/setup.log"; fi
  fi
  rm -rf "$tmp"
}
trap finish EXIT

mkdir -p "$tmp/work"
"$python" analysis/gpu/kit.py install-wheels analysis/gpu/wheels "$tmp/site" \
  --record "$tmp/setup.json" >"$tmp/setup.log" 2>&1 || { cat "$tmp/setup.log"; exit 1; }
cat "$tmp/setup.log"

export PYTHONPATH="$repo:$tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export MPLBACKEND=Agg
export MPLCONFIGDIR="$tmp/matplotlib"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRITON_CACHE_DIR="$tmp/triton"
export PYTHONDONTWRITEBYTECODE=1

status=0
"$python" analysis/gpu/kit.py run --out "$out" --work "$tmp/work" --started "$started" \
  --setup "$tmp/setup.json" "$@" || status=$?
echo "results in $out:" "$out"/*
exit "$status"
