"""Prepacked bf16 linears on this CPU: verification forward and heads' drafting per tree, packed against
unpacked, interleaved round by round (medians), and whether the logits and drafts are bit-for-bit the same.

    python docs/results/packing-cpu/pack_check.py [--rounds 5] [--steps 10] [--past 300] [--threads 2] [--out FILE.json] [--ops]

Prints a table and writes JSON (default docs/results/packing-cpu/pack-check.json). `--ops` adds where a packed
one-token forward's time goes, operator by operator (torch.profiler; the profiler's own overhead inflates
the many small operators somewhat).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from entmtp.backends.transformers import BaseModel
from entmtp.model import load_model
from entmtp.packing import PackedLinear, pack_linears
from entmtp.random_model import memory_bandwidth, weight_bytes
from entmtp.shipped import resolve_heads
from entmtp.tree import Tree, load_tree

TREES = ("root", "chain_1", "tree_4", "tree_8", "tree_16", "mc_sim_7b_63")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed calls per tree, mode and round")
    ap.add_argument("--past", type=int, default=300, help="committed tokens before the timed forwards")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/packing-cpu/pack-check.json")
    ap.add_argument("--ops", action="store_true", help="also profile a packed one-token forward by operator")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=160)

    models = {
        "unpacked": load_model(dtype="bfloat16", pack=False)[0],
        "packed": load_model(dtype="bfloat16")[0],
    }
    assert any(isinstance(m, PackedLinear) for m in models["packed"].modules()), "nothing was packed here"
    bases = {k: BaseModel(m) for k, m in models.items()}
    heads = {k: resolve_heads("hydra", m).to(dtype=torch.bfloat16) for k, m in models.items()}
    pack_linears(heads["packed"])  # as Engine does for a packed model
    gen = torch.Generator().manual_seed(0)
    past = torch.randint(0, models["packed"].config.vocab_size, (args.past,), generator=gen)
    trees = {n: Tree.root_only() if n == "root" else load_tree(n) for n in TREES}
    caches, drafters, identical, drafts_same = {}, {}, {}, {}
    with torch.inference_mode():
        for k, base in bases.items():
            caches[k] = base.new_cache(args.past + 128)
            fwd = base.forward(past, None, caches[k])
            base.commit(caches[k], list(range(args.past)))
            drafters[k] = heads[k].drafter()
            drafters[k].extend(fwd.hidden)
        root = past[-1:]
        for name, tree in trees.items():  # correctness first: same logits, same drafts
            toks = past[: tree.size]
            out = {k: bases[k].forward(toks, tree, caches[k]).logits for k in bases}
            for k in bases:
                caches[k].length = args.past  # drop the forward's scratch: every call sees the same past
            identical[name] = torch.equal(out["packed"], out["unpacked"])
            if tree.num_nodes:
                d = {k: drafters[k].draft(tree, root, None).tokens for k in heads}
                drafts_same[name] = torch.equal(d["packed"], d["unpacked"])

        times = {(n, k, what): [] for n in trees for k in bases for what in ("verify", "draft")}
        for _ in track(range(args.rounds), description="timing", console=console):
            for name, tree in trees.items():
                toks = past[: tree.size]
                for k in bases:  # interleaved: both modes see the same machine state
                    for _ in range(2):
                        bases[k].forward(toks, tree, caches[k])
                        caches[k].length = args.past
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        bases[k].forward(toks, tree, caches[k])
                        caches[k].length = args.past
                    times[name, k, "verify"].append(1000 * (time.perf_counter() - t) / args.steps)
                    if tree.num_nodes:
                        t = time.perf_counter()
                        for _ in range(args.steps):
                            drafters[k].draft(tree, root, None)
                        times[name, k, "draft"].append(1000 * (time.perf_counter() - t) / args.steps)

    med = {key: statistics.median(v) if v else 0.0 for key, v in times.items()}
    wb = weight_bytes(models["unpacked"])
    bw = memory_bandwidth("cpu")
    table = Table(
        title=f"per-call ms, median of {args.rounds} x {args.steps} (SmolLM2-135M bf16, {args.threads} threads, "
        f"{args.past}-token past; heads: hydra)"
    )
    for col in ("tree", "tokens", "verify unpacked", "verify packed", "ratio", "draft unpacked", "draft packed",
                "ratio", "logits identical", "drafts identical"):  # fmt: skip
        table.add_column(col, justify="right")
    rows = []
    for name, tree in trees.items():
        v0, v1 = med[name, "unpacked", "verify"], med[name, "packed", "verify"]
        d0, d1 = med[name, "unpacked", "draft"], med[name, "packed", "draft"]
        rows.append(
            dict(tree=name, tokens=tree.size, verify_unpacked_ms=v0, verify_packed_ms=v1, draft_unpacked_ms=d0,
                 draft_packed_ms=d1, logits_identical=identical[name], drafts_identical=drafts_same.get(name))
        )  # fmt: skip
        table.add_row(
            name, str(tree.size), f"{v0:.2f}", f"{v1:.2f}", f"{v1 / v0:.2f}x",
            f"{d0:.2f}" if d0 else "", f"{d1:.2f}" if d1 else "", f"{d1 / d0:.2f}x" if d0 else "",
            str(identical[name]), "" if name not in drafts_same else str(drafts_same[name]),
        )  # fmt: skip
    console.print(table)
    floor = wb / bw * 1000
    console.print(
        f"weights {wb / 2**20:.0f} MiB / measured copy bandwidth {bw / 1e9:.1f} GB/s = {floor:.2f} ms: the floor "
        "of a forward that reads every weight once"
    )
    ops = _ops(bases["packed"], caches["packed"], past, args) if args.ops else None
    if ops is not None:
        ops_table = Table(
            title="packed one-token forward by operator (torch.profiler, self time per forward)"
        )
        for col in ("operator", "calls", "ms", "share"):
            ops_table.add_column(col, justify="right")
        total = sum(o["ms"] for o in ops)
        for o in ops[:14]:
            ops_table.add_row(o["name"], str(o["calls"]), f"{o['ms']:.2f}", f"{o['ms'] / total:.0%}")
        ops_table.add_row("all operators", str(sum(o["calls"] for o in ops)), f"{total:.2f}", "100%")
        console.print(ops_table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        command="python docs/results/packing-cpu/pack_check.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        date=time.strftime("%Y-%m-%dT%H:%M:%S"), torch=torch.__version__, machine=platform.machine(),
        threads=args.threads, weight_bytes=wb, copy_bandwidth=bw, floor_ms=floor,
    )  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "rows": rows, "ops": ops}, indent=1) + "\n")
    console.print(f"wrote {out}")


def _ops(base: BaseModel, cache, past: torch.Tensor, args) -> list[dict]:
    """Self CPU time per operator of one packed one-token forward (mean over `args.steps` forwards)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            base.forward(past[:1], None, cache)
            cache.length = args.past
    rows = [
        {"name": e.key, "calls": e.count // args.steps, "ms": e.self_cpu_time_total / 1000 / args.steps}
        for e in prof.key_averages()
    ]
    return sorted((r for r in rows if r["ms"] > 0), key=lambda r: -r["ms"])


if __name__ == "__main__":
    main()
