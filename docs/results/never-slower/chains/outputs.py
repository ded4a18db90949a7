"""Plain greedy outputs on llama.cpp (the embedded Q4_1 GGUF, entmtp's plain steps) of every task's test
prompts, what `replay.py` replays lookup policies on: outputs.json beside this file, {task: [[prompt ids,
output ids], ...]}, and this machine's curve of steps without heads, measured now.

    python docs/results/never-slower/chains/outputs.py [--prompts 10] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.progress import Progress

from entmtp.bench.engines import engine
from entmtp.build import EngineSpec, Loader
from entmtp.costs import measure
from entmtp.model import encode_prompt
from entmtp.prompts import TASKS, load_prompts

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=10)
ap.add_argument("--tokens", type=int, default=96)
ap.add_argument("--out", default=str(Path(__file__).parent / "outputs.json"))
args = ap.parse_args()

spec = EngineSpec(backend="llama-cpp", threads=2, heads="none", lookup=None, probe=False)
loaded = Loader().load(spec)
plain = engine(loaded, loaded.spec)
curve = measure(loaded.model, None, sizes=tuple(range(17)), contexts=(128, 512), budget_s=40, progress=False)
out = {"curve": {"nodes": list(curve.nodes), "step_ms": list(curve.step_ms)}, "tasks": {}}
prompts = {t: load_prompts(t, "test", n=args.prompts) for t in TASKS}
with Progress() as bar:
    job = bar.add_task("plain outputs", total=sum(map(len, prompts.values())))
    for task, ps in prompts.items():
        rows = out["tasks"][task] = []
        for prompt in ps:
            ids = encode_prompt(loaded.tokenizer, prompt)
            rows.append([ids, plain.generate(ids, max_new_tokens=args.tokens).token_ids])
            bar.advance(job)
Path(args.out).write_text(json.dumps(out))
