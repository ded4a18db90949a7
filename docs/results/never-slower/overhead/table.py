"""The overhead table of this folder's runs: per run and backend, the default's and plain decoding's ms per token
outside the verification forward, and the difference as a share of the default's ms per token.

    python docs/results/never-slower/overhead/table.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
PHASES = ("probe", "choose", "draft", "accept", "commit", "outside")  # every part but the forward ("verify")


def main() -> None:
    print(
        "| run | code | backend | default: choose, outside the phases | default, not the forward | plain, not the forward | difference (share of a token) |"
    )
    print("|---|---|---|---|---|---|---|")
    for path in sorted(HERE.glob("*.json")):
        run = json.loads(path.read_text())
        if "rows" not in run:  # outside_decode.py's files: another table
            continue
        for backend in ("llama-cpp", "transformers"):
            d, p = run["rows"][f"default@{backend}"], run["rows"][f"plain@{backend}"]
            dn, pn = sum(d[k] for k in PHASES), sum(p[k] for k in PHASES)
            print(
                f"| {path.stem} | {run['checkout']} | {backend} | {d['choose']:.3f}, {d['outside']:.3f} | {dn:.3f} | "
                f"{pn:.3f} | {dn - pn:+.3f} ms ({100 * (dn - pn) / d['ms_per_token']:.1f}%) |"
            )


if __name__ == "__main__":
    main()
