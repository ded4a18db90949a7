"""Which lookup chains the default on llama.cpp drafts, and what they earn: every task's test prompts through
entmtp's plain steps, the default as built, lookup alone, and the default with each `--caution` z, on
llama.cpp (the embedded Q4_1 GGUF), greedy. Per method and chain length: steps, tokens, and the step cost in
plain steps read from this machine's heads-less llama.cpp curve (counts times a measured curve: nothing here is
timed unless --time, so the modelled figures hold while other jobs run). Outputs that differ from plain's are
counted (llama.cpp's Q4_1 verification of several rows rounds unlike a one-token step's). Writes results.json beside this file (or --out) and prints a table.

    python docs/results/never-slower/chains/run.py [--prompts 8] [--tokens 96] [--caution 0,1] [--time]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from entmtp.bench.engines import engine
from entmtp.build import EngineSpec, Loader, build
from entmtp.costs import measure
from entmtp.costs.curves import relative_cost
from entmtp.lookup import Lookup
from entmtp.model import encode_prompt
from entmtp.prompts import TASKS, load_prompts

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--tokens", type=int, default=96)
ap.add_argument("--caution", default="")
ap.add_argument("--tasks", default=",".join(TASKS))
ap.add_argument("--time", action="store_true")
ap.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
args = ap.parse_args()

loader = Loader()
spec = EngineSpec(backend="llama-cpp", threads=2, lookup=Lookup())
built = build(spec, loader=loader)
plain_spec = replace(built.loaded.spec, heads="none", lookup=None)
heads_less = loader.load(plain_spec)
engines = {
    "plain": engine(heads_less, plain_spec),
    "default": built.engine,
    "lookup": engine(heads_less, replace(plain_spec, lookup=Lookup())),
}
for z in (float(x) for x in args.caution.split(",") if x):
    engines[f"default-z{z:g}"] = build(replace(spec, lookup=Lookup(caution=z)), loader=loader).engine
# the modelled cost: this machine's heads-less steps measured now (the cached curve may have been corrected)
truth = measure(
    heads_less.model, None, sizes=tuple(range(12)), contexts=(128, 512), budget_s=40, progress=False
)
cost = relative_cost(truth.latency())
print("curve (plain steps by nodes):", [round(float(c), 2) for c in cost(range(12))])
print(
    "the engines' curve:", [round(float(c), 2) for c in relative_cost(heads_less.costs.latency())(range(12))]
)

rows: dict = {}
tok = built.loaded.tokenizer
for name in engines.values():
    name.generate(encode_prompt(tok, "Hello!"), max_new_tokens=8)
for task in args.tasks.split(","):
    for prompt in load_prompts(task, "test", n=args.prompts):
        ids = encode_prompt(tok, prompt)
        kw = {"prediction": prompt.prediction} if getattr(prompt, "prediction", None) else {}
        ref = None
        for name, e in engines.items():
            t0 = time.perf_counter()
            r = e.generate(ids, max_new_tokens=args.tokens, **({} if name == "plain" else kw))
            wall = time.perf_counter() - t0
            ref = r.token_ids if ref is None else ref
            acc = rows.setdefault(task, {}).setdefault(
                name, {"by_len": {}, "decode_s": 0.0, "tokens": 0, "differs": 0}
            )
            acc["differs"] += r.token_ids != ref  # Q4_1 on llama.cpp: a batch of rows rounds unlike one row
            acc["decode_s"] += wall - r.prefill_seconds
            acc["tokens"] += len(r.token_ids) - 1
            for s in r.steps:
                b = acc["by_len"].setdefault(str(s.tree_nodes), [0, 0, 0.0])
                b[0] += 1
                b[1] += s.tokens
                b[2] += float(cost(s.tree_nodes))
    print(task, flush=True)

print("| task | method | tokens/step | modelled speed over plain | drafted nodes: steps, tokens/step |")
print("|---|---|---|---|---|")
for task, by in rows.items():
    for name, acc in by.items():
        steps = sum(b[0] for b in acc["by_len"].values())
        tokens = sum(b[1] for b in acc["by_len"].values())
        c = sum(b[2] for b in acc["by_len"].values())
        chains = ", ".join(
            f"L{n} {b[0]} {b[1] / b[0]:.2f}"
            for n, b in sorted(acc["by_len"].items(), key=lambda x: int(x[0]))
            if n != "0"
        )
        timed = f" ({acc['tokens'] / acc['decode_s']:.1f} tok/s)" if args.time else ""
        print(f"| {task} | {name} | {tokens / steps:.2f} | {tokens / c:.3f}{timed} | {chains} |")
Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
