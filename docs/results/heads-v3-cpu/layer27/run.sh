#!/usr/bin/env bash
# Issue 42, layer 27 through the library: Hydra heads from scratch on layer 27 (--hidden-state-offset 3, through
# the final norm) against a control on layer 30 (the last layer, as shipped), then both decoded by eval-heads.
# The arms' data differ in the stored layer alone (convert.py writes both from the same extraction), and they
# train with the same seed, steps, batches, lr schedule and draft vocabulary, one after the other with both
# cores. Each keeps checkpoints: after an interruption, RESUME=1 and the same settings continue.
# Usage: docs/results/heads-v3-cpu/layer27/run.sh [l27 l30 eval]   (default: all three, in that order)
#   settings by environment: D (heads-v3: the job's directory, with l27/ and l30/ from convert.py),
#   PYTHON, STEPS (380: 1.5 passes over the 199,826 training positions at ~787 a step), THREADS (2),
#   PRECISION (auto), RESUME, DTYPE (eval-heads' base model: auto), TREES (mc_sim_7b_63,tree_8), SAMPLING (sample: eval-heads' T=0.7 rules besides greedy; empty:
#   greedy only), PROMPTS (10 a task)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
D=${D:-heads-v3}
PYTHON=${PYTHON:-.venv/bin/python}
here=docs/results/heads-v3-cpu/layer27
train() {  # arm: l27 | l30
    local name=hydra-scratch-$1
    echo "$(date -u +%FT%TZ) $name: ${STEPS:-380} steps on $D/$1" | tee -a "$D/runs.log"
    PYTHONPATH=src nice -n 5 "$PYTHON" -m entmtp.cli train-heads --kind hydra --stages train \
        --distill-dir "$D/$1/distill,$D/$1/gsm8k/distill" --out "$D/runs/$name" --steps "${STEPS:-380}" \
        --precision "${PRECISION:-auto}" --vocab draft --draft-vocab 8192 --num-heads 4 --batch-size 8 \
        --window 128 --lr 1e-3 --checkpoint-every 100 --eval-every 100 --save-dtype bfloat16 \
        --threads "${THREADS:-2}" --no-progress ${RESUME:+--resume} >> "$D/runs/$name.log" 2>&1
    mkdir -p "$here/runs/$name"
    cp "$D/runs/$name/train_log.jsonl" "$D/runs/$name/learning_curve.png" "$D/runs/$name/config.json" \
        "$here/runs/$name/"
    tail -1 "$D/runs/$name/train_log.jsonl" | tee -a "$D/runs.log"
}
evaluate() {  # layer 27's heads against the control's, greedy (and at T=0.7), on the four tasks' test prompts
    local rules=${SAMPLING-sample}
    PYTHONPATH=src nice -n 5 "$PYTHON" -m entmtp.cli eval-heads "$D/runs/hydra-scratch-l27" \
        --against "$D/runs/hydra-scratch-l30" --split test --num-prompts "${PROMPTS:-10}" --max-new-tokens 96 \
        --tasks humaneval,sharegpt,gsm8k,writing --trees "${TREES:-mc_sim_7b_63,tree_8}" \
        ${rules:+--sampling "$rules"} --threads "${THREADS:-2}" --dtype "${DTYPE:-auto}" --out "$here/eval" \
        --no-progress 2>&1 | grep --line-buffered -v "^Loading\|Convert" | tee "$here/eval.log"
}
mkdir -p "$D/runs"
for what in ${@:-l27 l30 eval}; do
    case $what in
        l27 | l30) train "$what" ;;
        eval) evaluate ;;
        *) echo "unknown step $what: use l27, l30 or eval" >&2; exit 2 ;;
    esac
done
