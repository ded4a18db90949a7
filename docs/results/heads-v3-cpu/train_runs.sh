#!/usr/bin/env bash
# Heads v3 (issue 42): the training runs on the shards in $D/distill, then their evaluation against the shipped
# heads. Each run starts from the shipped heads (--init; Hydra++ puts the shipped Hydra behind a new prefix
# layer), trains in bf16 over the draft vocabulary only (--vocab draft: ~8x the positions/s of the full
# vocabulary on this CPU, train_speed.txt), with checkpoints and a log; the same command with --resume continues
# an interrupted run. Run it on a quiet machine: it uses both cores.
# Usage: docs/results/heads-v3-cpu/train_runs.sh [hydra|hydra-pp|medusa|eval-KIND ...]   (default: all three)
#   settings by environment: D (the job's directory, /work/heads-v3), DISTILL (the data: directories, comma-
#   separated; default $D/distill, the instruction prompts' data, and $D/gsm8k/distill when it exists), PYTHON,
#   EPOCHS (2), STEPS (optimiser steps: overrides EPOCHS), V (draft vocabulary size, 8192), RESUME (set: --resume), THREADS (2), LR (3e-4), TAG (a suffix
#   for the run's name)
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-/work/heads-v3}
PYTHON=${PYTHON:-.venv/bin/python}
EPOCHS=${EPOCHS:-2}
V=${V:-8192}
here=docs/results/heads-v3-cpu
if [ -z "${DISTILL:-}" ]; then
    DISTILL=$D/distill
    if [ -f "$D/gsm8k/distill/manifest.json" ]; then DISTILL=$DISTILL,$D/gsm8k/distill; fi
fi
# optimiser steps for EPOCHS passes over the training split's response positions: a step of windows of 128
# takes ~636 of them (8 x 128, ends of answers shorter); a Hydra++ step takes 8 whole sequences' (it reads every
# earlier position), 8 x the mean per sequence. STEPS: a fixed number instead (part of a pass).
read -r positions sequences < <("$PYTHON" -c "import json,sys; ms=[json.load(open(d+'/manifest.json')) for d in sys.argv[1].split(',')]; \
tr=[s for m in ms for s in m['shards'] if s['split']=='train']; print(sum(s['anchors'] for s in tr), sum(s['sequences'] for s in tr))" "$DISTILL")
common=(--stages train --distill-dir "$DISTILL" --precision bfloat16 --vocab draft
        --batch-size 8 --window 128 --lr "${LR:-3e-4}" --checkpoint-every 200 --eval-every 200 --draft-vocab "$V"
        --max-draft-vocab "$V" --num-heads 4 --save-dtype bfloat16 --threads "${THREADS:-2}" --no-progress
        ${RESUME:+--resume})
run() {  # name, response positions a step, then train-heads' own arguments
    local name=$1${TAG:-} steps=${STEPS:-$(( positions * EPOCHS / $2 ))}; shift 2
    echo "$(date -u +%FT%TZ) $name: $positions training positions ($DISTILL), $steps steps" | tee -a "$D/runs.log"
    PYTHONPATH=src nice -n 5 "$PYTHON" -m entmtp.cli train-heads "$@" --steps "$steps" --out "$D/runs/$name" \
        "${common[@]}" >> "$D/runs/$name.log" 2>&1
    mkdir -p "$here/runs/$name"
    cp "$D/runs/$name/train_log.jsonl" "$D/runs/$name/learning_curve.png" "$D/runs/$name/config.json" "$here/runs/$name/"
    tail -1 "$D/runs/$name/train_log.jsonl" | tee -a "$D/runs.log"
}
evaluate() {  # name: the trained heads against the shipped ones of their kind, greedy and at T=0.7
    PYTHONPATH=src nice -n 5 "$PYTHON" -m entmtp.cli eval-heads "$D/runs/$1" --against shipped --split test \
        --sampling "${SAMPLING:-sample}" --out "$here/eval/$1" --no-progress 2>&1 | grep -v "^Loading\|Convert"
}
mkdir -p "$D/runs"
for what in "${@:-hydra medusa hydra-pp}"; do
    for w in $what; do
        case $w in
            hydra) run hydra 636 --kind hydra --init hydra ;;
            hydra-pp) run hydra-pp $(( 8 * positions / sequences )) --kind hydra --head-arch prefix-mlp --init hydra ;;
            medusa) run medusa 636 --kind medusa --init medusa ;;
            eval-*) evaluate "${w#eval-}" ;;
            *) echo "unknown run $w: use hydra, hydra-pp, medusa or eval-NAME" >&2; exit 2 ;;
        esac
    done
done
