#!/usr/bin/env bash
# Heads v2 on a 2-core CPU (issue #10, no GPU): continue the shipped Medusa and Hydra heads on the project's
# context-copy and multi-turn prompts (data/train/, built by scripts/build_training_prompts.py; see
# docs/training-data.md), then measure them against the shipped heads with `entmtp eval-heads`.
# The time limits bound each stage: generation starts no new shard after GEN_LIMIT seconds, training plans as
# many steps (with a full lr schedule) as fit in its limit. Everything lands in $WORK, with logs.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header comment above is the help
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
WORK=${WORK:-runs/heads-v2}
ENTMTP=${ENTMTP:-.venv/bin/entmtp}
GEN_LIMIT=${GEN_LIMIT:-1500}
HYDRA_LIMIT=${HYDRA_LIMIT:-720}
MEDUSA_LIMIT=${MEDUSA_LIMIT:-420}
EVAL_PROMPTS=${EVAL_PROMPTS:-2}
mkdir -p "$WORK"

# Prompts up to 384 tokens: on a CPU the prompt positions (prefill, then the targets' forward) cost most of a
# shard, and only response positions train the heads; small shards so the validation split is one shard.
common=(--device cpu --threads 2 --distill-dir "$WORK/distill" --data-dir data --num-prompts 4000
        --max-new-tokens 160 --max-prompt-tokens 384 --gen-batch-size 32 --shard-size 32 --val-fraction 0.008
        --num-heads 4
        --batch-size 8 --window 128 --lr 3e-4 --checkpoint-every 100 --eval-every 200 --save-dtype bfloat16
        --no-progress)
# RUNS picks the runs (each reads the data the hydra run generates); every run is then evaluated.
RUNS=${RUNS:-"hydra medusa hydra-pp"}
for run in $RUNS; do
    case $run in
    hydra) $ENTMTP train-heads --kind hydra --init hydra --out "$WORK/hydra" --stages gen,train \
        --gen-time-limit "$GEN_LIMIT" --time-limit "$HYDRA_LIMIT" "${common[@]}" 2>&1 | tee "$WORK/hydra.log" ;;
    medusa) $ENTMTP train-heads --kind medusa --init medusa --out "$WORK/medusa" --stages train \
        --time-limit "$MEDUSA_LIMIT" "${common[@]}" 2>&1 | tee "$WORK/medusa.log" ;;
    # Hydra++: the shipped Hydra heads behind a new prefix layer that starts near the identity, on the same
    # data with the same time budget as the hydra run
    hydra-pp) $ENTMTP train-heads --kind hydra --head-arch prefix-mlp --init hydra --out "$WORK/hydra-pp" \
        --stages train --time-limit "$HYDRA_LIMIT" "${common[@]}" 2>&1 | tee "$WORK/hydra-pp.log" ;;
    *) echo "unknown run $run: use hydra, medusa or hydra-pp" >&2; exit 2 ;;
    esac
done
for run in $RUNS; do
    $ENTMTP eval-heads "$WORK/$run" --num-prompts "$EVAL_PROMPTS" --max-new-tokens 96 --threads 2 \
        --no-progress 2>&1 | tee "$WORK/eval-$run.log"
done
