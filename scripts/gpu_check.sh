#!/usr/bin/env bash
# One command on one CUDA GPU, in under 5 minutes: the CUDA tests, then the per-step cost curves of the
# SmolLM2-135M and Llama-7B shapes (random weights, bf16), transformers' DynamicCache (eager) against the
# preallocated cache (eager) and against CUDA graphs, and the #8 targets checked from them.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (PY=python3 by default; run from anywhere)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header comment above is the help
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
cd "$(dirname "$0")/.."
OUT_DIR=${1:-runs/gpu-check}
PY=${PY:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py || status=1  # the cost curves still run
for shape in smollm2-135m llama-7b; do
  "$PY" -m entmtp.cli step-costs --device cuda --dtype bfloat16 --random-model "$shape" \
    --kv dynamic,kv,graphs --trees chain_1,tree_16,mc_sim_7b_63 --steps 20 \
    --out "$OUT_DIR/profile-$shape.json" || status=1
done
"$PY" scripts/gpu_targets.py "$OUT_DIR/profile-smollm2-135m.json" "$OUT_DIR/profile-llama-7b.json" \
  | tee "$OUT_DIR/targets.md" || status=1
exit $status
