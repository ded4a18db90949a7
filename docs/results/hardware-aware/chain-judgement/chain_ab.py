"""Greedy tokens/step and trees of the default on transformers (bf16, Hydra, lookup, this machine's cached
curve: `--no-probe`), per test prompt: deterministic counts, nothing timed; "curve tok/s" prices each step
by the cached curve (the heads' drafting saved on lookup-only steps is not subtracted).

    PYTHONPATH=SRC python docs/results/hardware-aware/chain-judgement/chain_ab.py TAG [tasks] [n] [--lookup-only]

SRC: the checkout whose scheduler/hybrid.py is measured; writes OUT/chain-TAG.json (OUT: this folder)."""

import collections
import json
import sys
from pathlib import Path

from entmtp.build import EngineSpec, build
from entmtp.lookup import Lookup
from entmtp.prompts import load_prompts

only = "--lookup-only" in sys.argv
sys.argv = [a for a in sys.argv if a != "--lookup-only"]
tag = sys.argv[1]
tasks = (
    sys.argv[2] if len(sys.argv) > 2 else "specbench-summarization,specbench-rag,specbench-translation"
).split(",")
n = int(sys.argv[3]) if len(sys.argv) > 3 else 2
b = build(
    EngineSpec(
        backend="transformers", lookup=Lookup(), probe=False, threads=2, heads="none" if only else None
    )
)
print(b.plan.describe(), flush=True)
curve = b.loaded.costs
out = {}
for task in tasks:
    for i, p in enumerate(load_prompts(task, "test", n)):
        r = b.engine.generate(p, max_new_tokens=96)
        trees = collections.Counter(s.tree for s in r.steps)
        nodes = [s.tree_nodes for s in r.steps]
        lat = curve.latency() if curve is not None else None
        est_ms = float(sum(lat([k])[0] for k in nodes)) if lat is not None else float("nan")
        out[f"{task}/{i}"] = dict(
            tokens=len(r.token_ids),
            steps=len(r.steps),
            tps=len(r.token_ids) / len(r.steps),
            lookup_tokens=sum(s.lookup_nodes for s in r.steps),
            est_ms=est_ms,
            trees=dict(trees.most_common(8)),
            ids=r.token_ids,
        )
        o = out[f"{task}/{i}"]
        print(
            f"{tag} {task}/{i}: {o['tokens']} tok {o['steps']} steps {o['tps']:.2f} tok/step, est {o['est_ms']:.0f} ms "
            f"({1000 * o['tokens'] / o['est_ms']:.1f} tok/s on the curve) {o['trees']}",
            flush=True,
        )
json.dump(out, open(Path(__file__).parent / f"chain-{tag}.json", "w"))
