"""Two methods of an `entmtp bench` run compared on like-for-like text: only the prompts where both wrote plain
decoding's exact tokens (in bf16 each tree shape rounds differently, so methods drift onto different texts,
and a text that ends sooner or copies more changes tokens/step whatever the method does).

    .venv/bin/python scripts/same_text.py docs/results/hardware-aware/skip/copy-heavy-bf16 default lookup

Prints, per task, the prompts kept and each method's tokens/s over plain decoding's on them (prefill
included, as the bench counts it), and writes same-text-A-B.json into the run's folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from entmtp.files import write_text_atomic


def _tokens_per_second(runs: list[dict], kept: list[int]) -> float:
    return sum(runs[i]["tokens"] for i in kept) / sum(runs[i]["seconds"] for i in kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an `entmtp bench --out` folder (its results.json)")
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    path = args.run / "results.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: give the folder an `entmtp bench --out` wrote")
    results = json.loads(path.read_text())
    differ = {(m["task"], m["prompt"], m["config"]) for m in results["mismatches"]}
    out = {}
    for task, runs in results["runs"].items():
        for name in (args.a, args.b, "plain"):
            if name not in runs:
                raise SystemExit(f"{task} has no method {name!r}: the run has {', '.join(runs)}")
        kept = [
            i
            for i, r in enumerate(runs["plain"])
            if all((task, r["prompt"], m) not in differ for m in (args.a, args.b))
        ]

        if not kept:
            print(f"{task}: no prompt where both wrote plain decoding's text")
            out[task] = {"prompts": 0}
            continue
        plain = _tokens_per_second(runs["plain"], kept)
        a, b = _tokens_per_second(runs[args.a], kept) / plain, _tokens_per_second(runs[args.b], kept) / plain
        out[task] = {
            "prompts": len(kept),
            "of": len(runs["plain"]),
            args.a: a,
            args.b: b,
            f"{args.a}/{args.b}": a / b,
        }
        print(
            f"{task}: {len(kept)} of {len(runs['plain'])} prompts; {args.a} {a:.2f}x plain, {args.b} {b:.2f}x plain,"
            f" {args.a}/{args.b} {a / b:.3f}"
        )
    target = args.run / f"same-text-{args.a}-{args.b}.json"
    write_text_atomic(target, json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
