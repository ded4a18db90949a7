#!/bin/bash
# The default on llama.cpp against its plain steps, before (206d074) and after (bb4d8e2) the hybrid reads only
# the part of the offered lookup chain it judges: two interleaved rounds, run from the checkout's root.
set -euo pipefail
D=docs/results/never-slower
git worktree add -f runs/before 206d074
ARGS=(--defaults --peers llama-cpp --heads hydra --trees '' --policies '' --lookup-only adaptive
      --tasks gsm8k,humaneval,specbench-qa,writing --num-prompts 3 --max-new-tokens 96 --threads 2 --no-progress)
for round in 1 2; do
  PYTHONPATH=runs/before/src .venv/bin/entmtp bench "${ARGS[@]}" --out $D/before-$round
  .venv/bin/entmtp bench "${ARGS[@]}" --out $D/after-$round
done
.venv/bin/python $D/compare.py $D
