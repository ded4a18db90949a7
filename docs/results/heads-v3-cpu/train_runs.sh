#!/usr/bin/env bash
# Heads v3 (issue 42): the training runs on the shards in $D/distill, then their evaluation against the shipped
# heads. Each run starts from the shipped heads (--init; Hydra++ puts the shipped Hydra behind a new prefix
# layer), trains in bf16 over the draft vocabulary only (--vocab draft: ~8x the positions/s of the full
# vocabulary on this CPU, train_speed.txt), with checkpoints and a log; the same command with --resume continues
# an interrupted run. Run it on a quiet machine: it uses both cores.
# Usage: docs/results/heads-v3-cpu/train_runs.sh [hydra|hydra-pp|medusa|eval-KIND ...]   (default: all three)
#   settings by environment: D (the job's directory, heads-v3), DISTILL (the data: directories, comma-
#   separated; default $D/distill, the instruction prompts' data, and $D/gsm8k/distill when it exists), PYTHON,
#   EPOCHS (2), STEPS (optimiser steps: overrides EPOCHS), V (draft vocabulary size, 8192), RESUME (set: --resume),
#   THREADS (2), LR (3e-4), PRECISION (auto: bfloat16 where the CPU has bf16 dot products, else float32), TAG (a
#   suffix for the run's name), EVAL_EVERY (steps between validations, 200), GROW (train-heads arguments that grow the shipped heads: e.g. "--num-layers 2" or
#   "--own-lm-head"; see "Capacity" in the README)
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-heads-v3}
PYTHON=${PYTHON:-.venv/bin/python}
EPOCHS=${EPOCHS:-2}
V=${V:-8192}
here=docs/results/heads-v3-cpu
if [ -z "${DISTILL:-}" ]; then
    DISTILL=$D/distill
    if [ -f "$D/gsm8k/distill/manifest.json" ]; then DISTILL=$DISTILL,$D/gsm8k/distill; fi
fi
# optimiser steps for EPOCHS passes over the training split's response positions, counted by the trainer's own
# window sampler (make_windows) over the shards' sequence offsets and prompt lengths: a Hydra or Medusa step
# takes 8 windows of up to $WINDOW anchors (a sequence's last window shorter), a Hydra++ step 8 whole sequences
# (it reads every earlier position). STEPS: a fixed number instead (part of a pass).
WINDOW=128
read -r positions window_step sequence_step < <(PYTHONPATH=src "$PYTHON" - "$DISTILL" "$WINDOW" <<'PY'
import json, sys
from pathlib import Path
from types import SimpleNamespace
import torch
from safetensors import safe_open
from entmtp.train.trainer import make_windows
offsets, prompt_lens = [torch.zeros(1, dtype=torch.long)], []  # only what make_windows reads, no features
for d in sys.argv[1].split(","):
    for shard in json.loads((Path(d) / "manifest.json").read_text())["shards"]:
        if shard["split"] == "train":
            with safe_open(str(Path(d) / shard["file"]), "pt") as f:
                offsets.append(f.get_tensor("offsets")[1:] + offsets[-1][-1])
                prompt_lens.append(f.get_tensor("prompt_lens").long())
offsets, prompt_lens = torch.cat(offsets), torch.cat(prompt_lens)
split = SimpleNamespace(num_sequences=len(prompt_lens), offsets=offsets, prompt_lens=prompt_lens)
windows, whole = make_windows(split, int(sys.argv[2]), 4), make_windows(split, int(sys.argv[2]), 4, whole_sequences=True)
anchors = int((windows.hi - windows.lo).sum())
print(anchors, round(8 * anchors / len(windows.start)), round(8 * anchors / len(whole.start)))
PY
)
PRECISION=${PRECISION:-auto}  # train-heads' auto: bfloat16 where the CPU has bf16 dot products, else float32
common=(--stages train --distill-dir "$DISTILL" --precision "$PRECISION" --vocab draft
        --batch-size 8 --window "$WINDOW" --lr "${LR:-3e-4}" --checkpoint-every 200 --eval-every "${EVAL_EVERY:-200}" --draft-vocab "$V"
        --max-draft-vocab "$V" --num-heads 4 --save-dtype bfloat16 --threads "${THREADS:-2}" --no-progress
        ${RESUME:+--resume})
run() {  # name, response positions a step, then train-heads' own arguments
    local name=$1${TAG:-} per_step=$2 steps=${STEPS:-$(( positions * EPOCHS / $2 ))}; shift 2
    echo "$(date -u +%FT%TZ) $name: $positions training positions ($DISTILL), $steps steps of ~$per_step ${GROW:-}" \
        | tee -a "$D/runs.log"
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
            hydra) run hydra "$window_step" --kind hydra --init hydra ${GROW:-} ;;
            hydra-pp) run hydra-pp "$sequence_step" --kind hydra --head-arch prefix-mlp --init hydra ${GROW:-} ;;
            medusa) run medusa "$window_step" --kind medusa --init medusa ${GROW:-} ;;
            eval-*) evaluate "${w#eval-}" ;;
            *) echo "unknown run $w: use hydra, hydra-pp, medusa or eval-NAME" >&2; exit 2 ;;
        esac
    done
done
