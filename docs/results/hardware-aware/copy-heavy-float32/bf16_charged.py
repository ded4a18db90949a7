"""A one-off check (#21): does the hybrid choose worse than lookup alone under this machine's bf16 cost curve?

Decodes in float32 (every method writes the same text) and charges each step the cached bf16 Hydra curve's
ms at its size (the heads' drafting share taken off steps without head nodes, as the hybrid assumes); probe,
choice and prefill are not charged. Needs that curve in the cost cache (`entmtp generate` measures it).

    python docs/results/hardware-aware/copy-heavy-float32/bf16_charged.py
"""

from __future__ import annotations

import json

import torch

from entmtp.costs import CostCurve, costs_dir
from entmtp.engine import Engine
from entmtp.lookup import Lookup
from entmtp.model import load_model
from entmtp.prompts import load_prompts
from entmtp.scheduler import resolve_profile
from entmtp.scheduler.factory import profile_policy
from entmtp.scheduler.hybrid import hybrid
from entmtp.shipped import resolve_heads


def bf16_heads_curve() -> CostCurve:
    for path in sorted(costs_dir().glob("*.json")):
        data = json.loads(path.read_text())
        key = data.get("key", {})
        if key.get("hardware", {}).get("dtype") == "bfloat16" and key.get("heads"):
            return CostCurve.from_json(data)
    raise SystemExit("no bf16 Hydra curve in the cost cache: run `entmtp generate --dtype bfloat16 hi` first")


def main() -> None:
    torch.set_num_threads(2)
    curve = bf16_heads_curve()
    lat, share_ms = curve.latency(), curve.draft_share * curve.plain_ms
    model, tok = load_model(dtype="float32")
    heads = resolve_heads("hydra", model)
    dynamic = profile_policy(resolve_profile("mixed", "hydra"), "dynamic", latency=lat)
    methods = {
        "lookup": Engine(model, tok, policy=hybrid(None, Lookup(), curve)),
        "hybrid": Engine(model, tok, heads=heads, policy=hybrid(dynamic, Lookup(), curve)),
    }
    print(f"bf16 curve: {curve.summary()}")
    for task in ("specbench-translation", "specbench-rag", "specbench-qa"):
        for name, engine in methods.items():
            tokens, steps, ms = 0, 0, 0.0
            for prompt in load_prompts(task, "test", n=4):
                result = engine.generate(prompt, max_new_tokens=96)
                tokens += sum(s.tokens for s in result.steps)
                steps += len(result.steps)
                for s in result.steps:
                    no_heads = s.tree_nodes == s.lookup_nodes
                    ms += float(lat(s.tree_nodes)) - (share_ms if no_heads else 0.0)
            print(
                f"{task:24s} {name:7s} tokens/step {tokens / steps:.2f}  bf16-charged tokens/s {1000 * tokens / ms:.1f}"
            )


if __name__ == "__main__":
    main()
