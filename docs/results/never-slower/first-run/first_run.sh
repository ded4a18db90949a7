#!/bin/bash
# one first run on a fresh cost cache: $1 = label, $2 = src dir; WRITE_FORMATS=1: without the written GGUF formats
# (Q8_0, F16, BF16 of the embedded model), which the run then writes
# run from the checkout root: docs/results/never-slower/first-run/first_run.sh LABEL SRC_DIR (SRC_DIR: the src/ of the commit to time)
C=$(mktemp -d); mkdir -p $C/models; ln -s ~/.cache/entmtp/models/smollm2-135m-instruct $C/models/smollm2-135m-instruct
[ -n "$WRITE_FORMATS" ] || for f in ~/.cache/entmtp/models/*.gguf; do ln -s $f $C/models/; done
ln -s ~/.cache/entmtp/llama-cpp-python $C/llama-cpp-python
t0=$(date +%s.%N)
ENTMTP_CACHE=$C PYTHONPATH=$2 .venv/bin/python -m entmtp.cli -v generate "Write a Python function that checks whether a number is prime." --max-new-tokens 32 > $C/out.txt 2> $C/err.txt
t1=$(date +%s.%N)
echo "$1 wall $(echo "$t1 - $t0" | bc) s"
grep -E "measuring|not measuring|backend:|weights:|most expected" $C/err.txt | cut -c1-220
