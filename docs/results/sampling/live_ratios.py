"""#25's ratios from a sampling bench run: each method's tokens/s over plain sampling (ratio of sums, prefill
included), and the recommended policies against EntMTP* (`hydra/static`) and Hydra's mc_sim_7b_63.

    .venv/bin/python docs/results/sampling/live_ratios.py docs/results/sampling/live-epyc-avx512/sample ...

Reads RUN/results.json of `entmtp bench --heads hydra,medusa --trees mc_sim_7b_63 --policies
hydra:static,hydra:binary,hydra:cost,hydra:dynamic,hydra:dynamic+lookup,medusa:static` (docs/results/sampling).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METHODS = (
    "hydra/mc_sim_7b_63",
    "hydra/static",
    "hydra/binary",
    "hydra/cost",
    "hydra/dynamic",
    "hydra/dynamic+lookup",
    "medusa/static",
)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for run in sys.argv[1:]:
        runs = json.loads((Path(run) / "results.json").read_text())["runs"]
        print(run)
        print(f"  {'task':<10}{'plain tok/s':>12}" + "".join(f"{m:>22}" for m in METHODS))
        for task, methods in runs.items():
            rate = {m: sum(x["tokens"] for x in r) / sum(x["seconds"] for x in r) for m, r in methods.items()}
            x = {m: rate[m] / rate["plain"] for m in METHODS}
            print(f"  {task:<10}{rate['plain']:>12.1f}" + "".join(f"{x[m]:>21.2f}x" for m in METHODS))
            star, mc = x["hydra/static"], x["hydra/mc_sim_7b_63"]
            print(
                f"  {'':<10}dynamic / EntMTP* {x['hydra/dynamic'] / star:.3f}, dynamic+lookup / EntMTP* "
                f"{x['hydra/dynamic+lookup'] / star:.3f}, dynamic / mc_sim_7b_63 {x['hydra/dynamic'] / mc:.2f}, "
                f"dynamic+lookup / mc_sim_7b_63 {x['hydra/dynamic+lookup'] / mc:.2f}"
            )


if __name__ == "__main__":
    main()
