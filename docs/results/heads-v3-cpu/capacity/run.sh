#!/usr/bin/env bash
# Issue 42's capacity experiment, every arm and the comparison in one command: the shipped Hydra continued as it
# is (the control), grown to 2 residual blocks a head, and grown to a vocab projection of each head's own (its
# draft rows train: trainer.DraftRows), each for one pass over the same shards with the same seed, batches and lr
# schedule, one after the other with both cores (train_runs.sh), then capacity.py's table, JSON and plot.
# Each arm keeps checkpoints: after an interruption, RESUME=1 and the same settings continue where it stopped.
# The shards come first, from docs/results/heads-v3-cpu/heads_v3_gen.sh (both data sets; see the heads-v3 README).
# Usage: docs/results/heads-v3-cpu/capacity/run.sh   (settings by environment: SIZE, the runs' name tag, e.g.
# "full" -> hydra-full-ctl, hydra-full-l2, hydra-full-own; LR (5e-5); RESUME; ARMS (ctl l2 own); and
# train_runs.sh's D, DISTILL, PYTHON, EPOCHS (1 here), STEPS, THREADS, PRECISION, EVAL_EVERY)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
SIZE=${SIZE:-full}
# 5e-5: continuing the shipped heads at 2e-4 (train_runs.sh's 3e-4) first lowers their top-1 and spends ~150k
# positions climbing back; at 5e-5 and 2e-5 they gain from the first steps (capacity/lr/, thirteenth session)
export LR=${LR:-5e-5} EPOCHS=${EPOCHS:-1}
declare -A grow=([ctl]="" [l2]="--num-layers 2" [own]="--own-lm-head")
runs=()
for arm in ${ARMS:-ctl l2 own}; do
    [[ -v grow[$arm] ]] || { echo "unknown arm $arm: use ctl, l2 or own" >&2; exit 2; }
    TAG=-$SIZE-$arm GROW="${grow[$arm]}" docs/results/heads-v3-cpu/train_runs.sh hydra
    runs+=("hydra-$SIZE-$arm")
done
here=docs/results/heads-v3-cpu/capacity
mkdir -p "$here/$SIZE"
PYTHONPATH=src "${PYTHON:-.venv/bin/python}" "$here/capacity.py" --runs "$(IFS=,; echo "${runs[*]}")" \
    --out "$here/$SIZE" | tee "$here/$SIZE/capacity.md"
