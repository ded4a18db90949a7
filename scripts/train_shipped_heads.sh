#!/usr/bin/env bash
# Reproduces the heads shipped in src/entmtp/assets/heads: self-distillation data from the embedded
# SmolLM2-135M-Instruct, then Medusa and Hydra heads trained on the same data. The shipped heads were made
# on one H200 with the defaults below (see issue #3's note); on a CPU use DEVICE=cpu and smaller sizes.
# Time limits bound each stage: generation starts no new shard after GEN_LIMIT seconds, and training plans
# as many steps (with a full lr schedule) as fit in its limit.
# Usage: [DEVICE=cpu] [WORK=runs/shipped] [STEPS=...] scripts/train_shipped_heads.sh   (every setting below is an
# environment variable with its default)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header comment above is the help
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
DEVICE=${DEVICE:-cuda}
DATA_DIR=${DATA_DIR:-../shared/data}  # training prompts; never the benchmark sets
WORK=${WORK:-runs/shipped}
NUM_PROMPTS=${NUM_PROMPTS:-24000}
MAX_NEW=${MAX_NEW:-320}
GEN_BATCH=${GEN_BATCH:-1024}
GEN_LIMIT=${GEN_LIMIT:-200}
STEPS=${STEPS:-20000}
BATCH=${BATCH:-64}
MEDUSA_LIMIT=${MEDUSA_LIMIT:-100}
HYDRA_LIMIT=${HYDRA_LIMIT:-120}
ENTMTP=${ENTMTP:-entmtp}

common=(--device "$DEVICE" --distill-dir "$WORK/distill" --data-dir "$DATA_DIR" --num-prompts "$NUM_PROMPTS"
        --max-new-tokens "$MAX_NEW" --gen-batch-size "$GEN_BATCH" --shard-size "$GEN_BATCH" --num-heads 4
        --steps "$STEPS" --batch-size "$BATCH" --checkpoint-every 1000 --eval-every 500
        --save-dtype bfloat16 --no-progress)
$ENTMTP train-heads --kind medusa --out "$WORK/medusa" --stages gen,train --gen-time-limit "$GEN_LIMIT" \
    --time-limit "$MEDUSA_LIMIT" "${common[@]}"
$ENTMTP train-heads --kind hydra --out "$WORK/hydra" --stages train --time-limit "$HYDRA_LIMIT" "${common[@]}"
# Hydra++ (issue #10): the prefix-mlp architecture on the same data with the same budget as Hydra
$ENTMTP train-heads --kind hydra --head-arch prefix-mlp --out "$WORK/hydra-pp" --stages train \
    --time-limit "$HYDRA_LIMIT" "${common[@]}"
# Then compare each against the shipped heads of its kind, on the CPU that will run them (tokens/s is the
# criterion): entmtp eval-heads "$WORK/medusa" (and hydra, hydra-pp) --threads N
