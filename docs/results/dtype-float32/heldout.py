"""Issue #70's held-out check: under --dtype float32, whatever `auto` chooses (measured, probing on), speculative
greedy decoding equals plain greedy on 5 prompts of no prompt set, for plain, Hydra and Medusa on mc_sim_7b_63 and
the Hydra default; prints each configuration's plan line and route, then per configuration the 5 comparisons.
Run from the checkout's root: .venv/bin/python docs/results/dtype-float32/heldout.py"""

from entmtp.build import EngineSpec, build

P = [
    "Describe a cat to someone who has never seen one.",
    "Explain why the sky is blue in three sentences.",
    "Write a haiku about autumn rain.",
    "List four uses of a paperclip.",
    "Summarize: The meeting moved to Thursday because the room was booked. Bring the budget draft and the hiring plan; the hiring plan needs two more reviewers. The budget draft is due Friday.",
]
outs = {}
for heads, tree in (("none", None), ("hydra", "mc_sim_7b_63"), ("medusa", "mc_sim_7b_63"), ("hydra", None)):
    b = build(EngineSpec(dtype="float32", heads=heads, tree=tree), log=lambda m: None)
    print(heads, tree, b.plan.describe().splitlines()[1], b.plan.route, flush=True)
    outs[heads, tree] = [b.engine.generate(p, max_new_tokens=40).token_ids for p in P]
ref = outs["none", None]
for k, v in outs.items():
    print(k, [a == b for a, b in zip(v, ref, strict=True)])
