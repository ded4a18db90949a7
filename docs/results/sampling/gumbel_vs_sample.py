"""The gumbel rule against lossless rejection sampling on the same texts: each sampled test generation
(OUT/outputs-sample.json, made by scripts/replay_sampling.py) is traced twice, under `sample` (the heads'
top-k drafts) and under `gumbel` with noise drawn from its posterior given the generation's tokens (the
Gumbel-max posterior: the winning value is Gumbel(0) at the emitted token, the others truncated below it, so a
text with such noise is distributed as a gumbel generation). Both traces then replay the same methods on the
same cost curves: a paired comparison, free of the texts' own variance.

    python docs/results/sampling/gumbel_vs_sample.py [--out docs/results/sampling] [--draws 4] [--heads hydra]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from entmtp.accept import GumbelNoise
from entmtp.calibration.traces import GUMBEL, SAMPLE, trace_generation
from entmtp.costs import CostCurve
from entmtp.engine import Engine
from entmtp.model import load_model
from entmtp.prompts import FOUR_TASKS
from entmtp.scheduler.profiles import resolve_profile
from entmtp.shipped import resolve_heads

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # replay_sampling.py and its kin
from machine_curves import shared_curves  # noqa: E402
from replay_policies import _commit  # noqa: E402
from replay_sampling import _replay_methods  # noqa: E402

METHODS = ("mc_sim_7b_63", "EntMTP*", "cost", "dynamic", "dynamic+lookup", "oracle")


class PosteriorNoise(GumbelNoise):
    """Gumbel noise given the tokens it produced: rows [V] per position of one generation."""

    def __init__(self, rows: dict[int, torch.Tensor], vocab_size: int):
        super().__init__(0, vocab_size)
        self._given = rows

    def row(self, position: int) -> torch.Tensor:
        return self._given[position] if position in self._given else super().row(position)


@torch.inference_mode()
def posterior(engine, tokens: list[int], prompt_len: int, temperature: float, g: torch.Generator):
    """Noise rows for positions prompt_len .. len(tokens) - 1 such that argmax(logits / T + row) is the token."""
    ids = torch.tensor(tokens)
    fwd = engine.base.forward(ids, None, engine.base.new_cache(len(tokens)))
    rows = {}
    for p in range(prompt_len, len(tokens)):
        lp = torch.log_softmax(fwd.logits[p - 1].float() / temperature, dim=-1)  # [V]
        u = torch.rand(lp.numel() + 1, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
        top = -torch.log(-torch.log(u[0]))  # the max of lp + g: Gumbel(log sum exp lp = 0)
        others = lp.double() - torch.log(-torch.log(u[1:]))  # lp + fresh Gumbel, then truncated below top
        z = -torch.log(torch.exp(-top) + torch.exp(-others))
        z[tokens[p]] = top
        rows[p] = (z - lp.double()).float()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/sampling"))
    ap.add_argument("--draws", type=int, default=4, help="posterior noise draws per generation")
    ap.add_argument("--heads", default="hydra")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = json.loads((args.out / "outputs-sample.json").read_text())
    settings = saved["settings"]
    model, tokenizer = load_model(dtype=settings["dtype"])
    heads = resolve_heads(args.heads, model)
    engine = Engine(model, tokenizer, heads=heads)
    temperature, vocab = settings["temperature"], model.get_output_embeddings().weight.shape[0]
    curves = shared_curves()
    g = torch.Generator().manual_seed(0)
    result = {
        "command": "python docs/results/sampling/gumbel_vs_sample.py",
        "commit": _commit(),
        "settings": settings,
    }
    rows = {}
    for task in FOUR_TASKS:
        pairs = [(list(a), list(b)) for a, b in saved["tasks"][task] if len(b) >= 2]
        profile = resolve_profile(task, args.heads)
        mode = profile.mode_for(temperature, "sample")
        sample = [trace_generation(engine.base, heads, a + b, len(a), SAMPLE) for a, b in pairs]
        gumbel = [
            trace_generation(
                engine.base,
                heads,
                a + b,
                len(a),
                GUMBEL,
                noise=PosteriorNoise(posterior(engine, a + b, len(a), temperature, g), vocab),
            )
            for a, b in pairs
            for _ in range(args.draws)
        ]
        stored = profile.latency.model()
        for name, curve in {
            "calibration": CostCurve.from_latency(list(stored.nodes), list(stored.ms), "stored"),
            "h200 graphs": curves["h200 graphs"],
        }.items():
            rows[(task, name)] = {
                "sample": _replay_methods(profile, mode, sample, curve, "sample"),
                "gumbel": _replay_methods(profile, mode, gumbel, curve, "gumbel"),
            }
    console = Console(width=200)
    for name in ("calibration", "h200 graphs"):
        table = Table(
            title=f"T={temperature}, {args.heads} heads, {name} costs: tokens/step sample -> gumbel (x)"
        )
        for col in ("task", *METHODS):
            table.add_column(col, justify="left" if col == "task" else "right")
        for task in FOUR_TASKS:
            r = rows[(task, name)]
            cells = []
            for m in METHODS:
                a, b = r["sample"][m]["tokens_per_step"], r["gumbel"][m]["tokens_per_step"]
                sa, sb = r["sample"][m]["speedup"], r["gumbel"][m]["speedup"]
                cells.append(f"{a:.2f} -> {b:.2f} ({sb / sa:.3f}x)")
            table.add_row(task, *cells)
        console.print(table)
    result["replays"] = {f"{t}/{c}": v for (t, c), v in rows.items()}
    ratios = [
        v["gumbel"]["EntMTP*"]["speedup"] / v["sample"]["EntMTP*"]["speedup"]
        for v in result["replays"].values()
    ]
    console.print(f"EntMTP* gumbel/sample: {statistics.mean(ratios):.3f}x mean")
    path = args.out / "gumbel-vs-sample.json"
    path.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
