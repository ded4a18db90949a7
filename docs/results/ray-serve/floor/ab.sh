#!/bin/bash
# Interleaved at 8 clients: serve, Ray 1x2 as shipped, Ray 1x2 with all but the engine at nice 19, Ray 1x2 with
# the background at nice 19; ROUNDS rounds. X_NICE needs experiment.patch applied (not shipped).
# Usage (from the checkout's root): ROUNDS=2 docs/results/ray-serve/floor/ab.sh
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/results/ray-serve/floor}; mkdir -p $OUT
SA="--backend transformers --dtype float32 --max-batch 8"
run() { # name env... -- configargs
  local name=$1; shift
  env "$@" PYTHONPATH=src .venv/bin/python scripts/load_server.py --configs "$CFG" --serve-args="$SA" \
     --clients 8 --requests-per-level 16 --max-tokens 128 --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$? $(date +%T)"
}
for r in $(seq ${START:-1} ${ROUNDS:-2}); do
  CFG="serve=--threads 2" run serve-$r X=1
  CFG="ray-1x2=--ray --replicas 1 --threads 2" run raydef-$r X=1
  CFG="ray-1x2=--ray --replicas 1 --threads 2" run rayniceall-$r X_NICE=19
  CFG="ray-1x2=--ray --replicas 1 --threads 2" run raynicebg-$r X_NICE=19 X_NICE_KEEP=raylet,EntmtpEngine,EntmtpFront,ProxyActor
done
echo done $(date +%T)
