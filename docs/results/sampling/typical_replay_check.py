"""How far a typical-acceptance replay is from real decodes on SmolLM2 (bf16): per tree, tokens per step
replayed on the traces of tree_8's typical generations (docs/results/sampling/outputs-typical.json, made by
scripts/replay_sampling.py), against real typical decodes with that tree of the same prompts and lengths (other
seeds). The tree_8 row is the seed noise: the replay of tree_8's own trajectories is exact per step.

    python docs/results/sampling/typical_replay_check.py [N]     # the first N prompts of GSM8K and ShareGPT (default 4)
"""

import json
import sys

import torch

from entmtp.calibration.search import step_tokens
from entmtp.calibration.traces import TYPICAL, trace_generation
from entmtp.engine import Engine
from entmtp.model import load_model
from entmtp.policy import static
from entmtp.scheduler.profiles import resolve_profile
from entmtp.shipped import resolve_heads
from entmtp.tree import load_tree

torch.set_num_threads(2)
model, tok = load_model(dtype="bfloat16")
heads = resolve_heads("hydra", model)
out = json.load(open("docs/results/sampling/outputs-typical.json"))["tasks"]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
for task in ("gsm8k", "sharegpt"):
    prof = resolve_profile(task, "hydra")
    union = prof.mode("typical").trace_tree.tree()
    pairs = out[task][:n]
    eng = Engine(model, tok, heads=heads)
    traces = [trace_generation(eng.base, heads, ids + o, len(ids), TYPICAL, union) for ids, o in pairs]
    for name in ("tree_8", "mc_sim_7b_63", prof.mode("typical").measured_on.best):
        tree = load_tree(name) if name in ("tree_8", "mc_sim_7b_63") else prof.trees("typical")[name]
        rep = [k for tr in traces for k in step_tokens(tree, tr)]
        e = Engine(model, tok, heads=heads, policy=static(tree))
        real = []
        for i, (ids, o) in enumerate(pairs):
            r = e.generate(ids, max_new_tokens=len(o), temperature=0.7, acceptance="typical", seed=100 + i)
            real += [s.tokens for s in r.steps]
        print(
            f"{task} {name}: replayed {sum(rep) / len(rep):.2f} tokens/step ({len(rep)} steps), real {sum(real) / len(real):.2f} ({len(real)} steps)",
            flush=True,
        )
