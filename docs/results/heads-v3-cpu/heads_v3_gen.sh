#!/usr/bin/env bash
# Heads v3 (issue 42): the self-distillation data at scale on the CPU, started (or resumed) as a background job.
#
# `entmtp train-heads --stages gen`: every training prompt of $PROMPTS (shared/data/train only: never a benchmark
# set) answered twice by the base model, greedy and sampled at T=0.7 (--both-answers), with the batched engine;
# then the teacher-forced pass writes the shards (bf16 features, top-10 log-probs). Each shard is written
# atomically and listed in the manifest, so the job can be killed at any time and this script run again: it
# continues with the first shard not listed (a half-written shard is generated again, the same samples).
#
# The job runs under `nice -n 19`, detached (setsid + nohup: it outlives the shell that started it), from a
# snapshot of the committed src/ at $REV (edits to the checkout do not reach a running job). $PIDFILE holds the
# Python process's id: SIGSTOP pauses it while something else is timed, SIGCONT resumes it; nothing it decides
# depends on time, only the wall seconds it records for a shard grow (the CPU seconds beside them do not).
# The log ($OUT/gen.log) has one line per shard: tokens/s of generation, positions/s of the teacher-forced pass.
# The answers themselves (2 bytes a token) go to $ANSWERS, by default docs/results/heads-v3-cpu/answers/ in this
# checkout: commit them, and a later start on a fresh machine only teacher-forces the shards they cover.
# Usage: docs/results/heads-v3-cpu/heads_v3_gen.sh   (settings by environment: OUT, PROMPTS, PROMPT_FILE, ANSWERS, PYTHON, PIDFILE,
# REV, BATCH, THREADS, DTYPE)
# A second data set beside the first, from one prompt file (GSM8K's train split; train on both with
# `--distill-dir A,B`): OUT=heads-v3/gsm8k PROMPT_FILE=../shared/data/gsm8k/train.jsonl
# ANSWERS=docs/results/heads-v3-cpu/answers-gsm8k docs/results/heads-v3-cpu/heads_v3_gen.sh
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header comment above is the help
  sed -n '2,/^set -/{/^set -/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
cd "$(dirname "$0")/../../.."
OUT=${OUT:-heads-v3}  # relative to the checkout (gitignored outputs: name your own)
PROMPTS=${PROMPTS:-../shared/data/train}
ANSWERS=${ANSWERS:-$PWD/docs/results/heads-v3-cpu/answers}
PYTHON=${PYTHON:-.venv/bin/python}
PIDFILE=${PIDFILE:-$OUT/gen.pid}
REV=${REV:-HEAD}
BATCH=${BATCH:-32}  # rows of the continuous batch; not part of the data's identity (may change on resume)
# torch threads: 1 while other work shares the cores (2 threads on a busy 2-core machine wait at every op's
# barrier: ~10x slower a step, measured under load), 2 on a quiet machine. Not part of the data's identity.
THREADS=${THREADS:-2}
# the base model's dtype for generation and the teacher-forced pass: train-heads' default, auto, is bfloat16 where
# the CPU has bf16 dot products (avx512_bf16, amx_bf16) and float32 on one without (on the AVX2-only EPYC the
# teacher-forced pass ran at 33 tokens/s in bf16 and 213 in float32, 2 threads: dtype-speed-avx2.txt beside the
# heads-v3 README). The features are stored in bfloat16 either way. Not part of the data's identity.
DTYPE=${DTYPE:-auto}

if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "a generation is already running: pid $(cat "$PIDFILE") ($PIDFILE)" >&2
    exit 1
fi
mkdir -p "$OUT"
if [ -n "${PROMPT_FILE:-}" ]; then  # one prompt file (its records' question/instruction/prompt field)
    prompt_args=(--prompts "$(realpath "$PROMPT_FILE")")
else
    mkdir -p "$OUT/prompts"
    ln -sfn "$(realpath "$PROMPTS")" "$OUT/prompts/train"  # --data-dir reads DIR/train/*.json(l) (and DIR/gsm8k/)
    prompt_args=(--data-dir "$OUT/prompts")
fi
code="$OUT/code-$(git rev-parse --short "$REV")"
if [ ! -d "$code/src" ]; then
    mkdir -p "$code"
    git archive "$REV" src | tar -x -C "$code"
fi
# Settings are the data's identity (a resumed run must give the same ones):
# prompts up to 384 tokens (the longer ones skipped), answers up to 256 tokens, 1% of prompts held out,
# 256 sequences (128 prompts, two answers each) a shard.
args=(train-heads --kind hydra --stages gen --out "$OUT/run" --distill-dir "$OUT/distill" "${prompt_args[@]}"
      --answers-dir "$(realpath -m "$ANSWERS")"
      --num-prompts 1000000 --both-answers --max-prompt-tokens 384 --max-new-tokens 256 --val-fraction 0.01
      --shard-size 256 --top-k 10 --seed 0 --gen-batch-size "$BATCH" --dtype "$DTYPE" --device cpu --threads "$THREADS"
      --no-progress)
echo "$(date -u +%FT%TZ) start: code $code, $PYTHON -m entmtp.cli ${args[*]}" >> "$OUT/gen.log"
PYTHONPATH="$code/src" setsid nohup nice -n 19 "$PYTHON" -m entmtp.cli "${args[@]}" >> "$OUT/gen.log" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$PIDFILE"
sleep 1
ps -o pid=,ni=,stat=,comm= -p "$pid" || { echo "the job did not start: see $OUT/gen.log" >&2; exit 1; }
echo "started pid $pid (written to $PIDFILE); log $OUT/gen.log"
