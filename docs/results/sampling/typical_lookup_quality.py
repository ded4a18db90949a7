"""Is typical acceptance with lookup drafts fast because it repeats itself? The continuations' quality at T > 0.

Under typical acceptance Hydra `dynamic` + lookup (the default until lookup drafts under typical acceptance became
opt-in) ran at 2.41-3.23x plain sampling in the live bench, with a third to a half of its tokens copied by lookup
nodes (docs/results/sampling/). A copied token passes the typical test whenever the base model finds it likely
enough, so the text may drift into copying itself. This decodes the first test prompts of each task (seed = prompt
index, T = 0.7) with the default engine under each rule (typical acceptance gets no lookup drafts unless asked:
`Lookup.typical`) and with lookup drafts under typical acceptance too (`--lookup`), and compares them with plain
sampling's continuations of the same prompts (seeds 1000 + index, OUT/outputs-plain.json from
scripts/replay_sampling.py) and typical acceptance with tree_8 (OUT/outputs-typical.json):

  nll       mean negative log-likelihood per token under the base model at temperature 1 (+- its standard
            error over generations): a text that repeats itself scores low, a text the model would not
            write scores high
  repeated  the share of a continuation's 4-grams that already occurred earlier in the same continuation
  lookup    the share of an engine's emitted tokens drafted by lookup nodes, and its tokens per step

    .venv/bin/python docs/results/sampling/typical_lookup_quality.py [--num-prompts 8] [--out docs/results/sampling]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from entmtp.build import EngineSpec, build
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import FOUR_TASKS

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # replay_sampling.py and its kin
from replay_policies import _commit  # noqa: E402
from replay_sampling import continuation_nll  # noqa: E402

SAMPLED_KEY = {"max_new_tokens": 96, "dtype": "bfloat16", "temperature": 0.7}  # replay_sampling.py's outputs


def repeated_share(out: list[int], n: int = 4) -> float:
    """Share of the n-grams of `out` that already occurred earlier in `out`."""
    grams = [tuple(out[i : i + n]) for i in range(len(out) - n + 1)]
    seen, again = set(), 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return again / len(grams) if grams else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/results/sampling"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = {}
    for name in ("plain", "typical"):
        path = args.out / f"outputs-{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        settings = data.get("settings", {})
        if {k: settings.get(k) for k in SAMPLED_KEY} != SAMPLED_KEY or settings.get(
            "num_prompts", 0
        ) < args.num_prompts:
            raise SystemExit(
                f"{path} is missing or made with other settings: run scripts/replay_sampling.py --num-prompts "
                f"{args.num_prompts} --max-new-tokens 96 --out {args.out} first"
            )
        saved[name] = {
            t: [(list(a), list(b)) for a, b in data["tasks"][t][: args.num_prompts]] for t in FOUR_TASKS
        }
    console = Console(width=160)
    rows: dict[str, dict] = {}
    engines = {}  # column -> (acceptance rule, engine)
    for name, rule, lookup in (
        ("lossless, default (dynamic+lookup)", "sample", Lookup()),
        ("typical, dynamic+lookup (--lookup)", "typical", Lookup(typical=True)),
        ("typical, default (dynamic, no lookup)", "typical", Lookup()),
    ):
        spec = EngineSpec(heads="hydra", lookup=lookup, dtype="bfloat16", temperature=0.7, acceptance=rule)
        engines[name] = rule, build(spec, log=lambda m: None).engine
    model = next(iter(engines.values()))[1].model
    for task in FOUR_TASKS:
        rows[task] = {}
        methods = {"plain sampling": saved["plain"][task], "typical, tree_8": saved["typical"][task]}
        lookup = {}
        for name, (rule, engine) in engines.items():
            pairs, copied, emitted, steps = [], 0, 0, 0
            for i, (ids, _) in enumerate(saved["plain"][task]):
                r = engine.generate(ids, max_new_tokens=96, temperature=0.7, acceptance=rule, seed=i)
                pairs.append((ids, r.token_ids))
                copied += sum(s.lookup_accepted for s in r.steps)
                emitted += sum(s.tokens for s in r.steps)
                steps += len(r.steps)
            methods[name] = pairs
            lookup[name] = {
                "lookup_share": copied / max(1, emitted),
                "tokens_per_step": emitted / max(1, steps),
            }
        for name, pairs in methods.items():
            nll, se, _ = continuation_nll(model, pairs)
            rep = sum(repeated_share(out) for _, out in pairs) / len(pairs)
            rows[task][name] = {"nll": nll, "nll_se": se, "repeated_4grams": rep, **lookup.get(name, {})}
        console.print(f"{task} done")
    table = Table(title="T=0.7, Hydra, 96 tokens: NLL/token under the base model (+- s.e.), repeated 4-grams")
    names = list(next(iter(rows.values())))
    for col in ("task", *names):
        table.add_column(col, justify="left" if col == "task" else "right")
    for task, r in rows.items():
        cells = []
        for name in names:
            c = r[name]
            extra = (
                f", lookup {c['lookup_share']:.0%}, {c['tokens_per_step']:.2f}/step"
                if "lookup_share" in c
                else ""
            )
            cells.append(f"{c['nll']:.3f} +- {c['nll_se']:.3f}, rep {c['repeated_4grams']:.1%}{extra}")
        table.add_row(task, *cells)
    console.print(table)
    doc = {
        "command": f"python docs/results/sampling/typical_lookup_quality.py --num-prompts {args.num_prompts} --out {args.out}",
        "commit": _commit(),
        "machine": describe(hardware(model)),
        "rows": rows,
    }
    path = args.out / "typical-lookup-quality.json"
    path.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
