"""Suffix drafts across requests (issue #61 item 3) on a repeated-structure workload: the `extraction` task (one
JSON-extraction instruction and schema over GSM8K test problems), sent one request after another to one engine,
as an extraction job does; then the same requests again (retries).

Per backend (transformers bf16, llama.cpp on the shipped Q4_1 file), three engines over one model: plain steps;
prompt lookup (the n-gram hybrid, nothing across requests); and prompt lookup with a suffix cache (suffix.py), a
fresh cache at the start of the run. Each request runs on the three in turn (the order rotating), so drift hits
all alike, and llama-cpp-python's own plain decoding of the Q4_1 file runs beside them (the strongest plain
baseline of the run). Greedy; every entmtp output is checked equal to its backend's plain output. With both
backends, `routed`: a router (routing.py) over a lookup + suffix engine per backend sharing one fresh cache,
each request to the lane it expects to finish sooner (a retry of a prompt the cache answered, priced by that
answer on each lane's curve); its speed is compared with llama.cpp's plain steps, its lanes counted.

    python docs/results/suffix-drafts/measure.py --out docs/results/suffix-drafts/extraction.json

It times: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from entmtp.backends import describe_weights
from entmtp.bench.peers import LlamaCppPlain
from entmtp.build import EngineSpec, load_base
from entmtp.costs import costs_for
from entmtp.costs.prefill import prefill_for
from entmtp.engine import Engine
from entmtp.lookup import Lookup
from entmtp.machine import record
from entmtp.policy import static
from entmtp.prompts import load_prompts
from entmtp.routing import Lane, Router
from entmtp.scheduler.hybrid import hybrid
from entmtp.suffix import SuffixCache
from entmtp.tree import Tree

BACKENDS = {"transformers": "bfloat16", "llama-cpp": "bfloat16"}  # llama.cpp: the Q4_1 file, heads' side bf16


def engines(backend: str, dtype: str, threads: int) -> dict[str, Engine]:
    model, tok = load_base(EngineSpec(backend=backend, dtype=dtype, threads=threads, gguf_as_given=True))
    costs = costs_for(model)  # this machine's curve (cached): what the hybrid sizes its chains on
    root = static(Tree.root_only())
    return {
        "plain": Engine(model, tok, policy=root, costs=costs),
        "lookup": Engine(model, tok, policy=hybrid(None, Lookup(), costs), costs=costs),
        "lookup+suffix": Engine(
            model, tok, policy=hybrid(None, Lookup(), costs), costs=costs, suffix=SuffixCache()
        ),
    }


def routed(built: dict[str, dict[str, Engine]]) -> Router:
    """A router over a lookup + suffix engine per backend (llama.cpp first: ties go to the faster decode), one
    fresh cache between them; each lane's decode speed without drafts is its plain step's, its weights named as
    `build` names them (a retry's copy rate is learned per weights: routing.Router.copy_rate)."""
    lanes = []
    for backend in ("llama-cpp", "transformers"):
        own = built[backend]["lookup+suffix"]
        costs = own.costs
        engine = Engine(own.model, own.tokenizer, policy=own.policy, costs=costs, suffix=SuffixCache())
        lanes.append(
            Lane(
                backend,
                engine,
                prefill_for(own.model),
                1000 / costs.plain_ms,
                describe_weights(own.model),
                latency=costs.latency(),
            )  # fmt: skip
        )
    return Router(*lanes)


def query_cost(engine: Engine, prompts: list[str], n: int = 2000) -> float:
    """Median microseconds of one `Session.draft` (a step asks once) over the engine's cache as the run left it,
    the contexts the prompts' texts at every length."""
    session = engine.suffix.begin([])
    contexts = [ids[:k] for ids in (engine.encode(p, 1) for p in prompts) for k in range(8, len(ids), 8)]
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        session.draft(contexts[i % len(contexts)], 32)
        times.append(time.perf_counter() - t0)
    session.end()
    return 1e6 * sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/suffix-drafts/extraction.json")
    ap.add_argument("--task", default="extraction", help="the bench's task whose test prompts are sent")
    ap.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS)
    )
    ap.add_argument("--no-retries", action="store_true", help="the first pass only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.task, "test", args.num_prompts)
    runs: dict = {}
    peer = LlamaCppPlain(n_threads=args.threads)
    unknown = sorted(set(args.backends.split(",")) - set(BACKENDS))
    if unknown:
        ap.error(f"--backends: unknown {', '.join(unknown)}; use some of {', '.join(BACKENDS)}")
    built = {b: engines(b, BACKENDS[b], args.threads) for b in args.backends.split(",")}
    methods = [(b, name) for b in built for name in built[b]] + [("peer", "llama-cpp-python")]
    router, lanes = (routed(built), []) if len(built) == len(BACKENDS) else (None, [])
    if router is not None:
        router.log = lanes.append
        methods.append(("routed", "lookup+suffix"))
    for label in ("first pass",) if args.no_retries else ("first pass", "retries"):
        for i, prompt in enumerate(track(prompts, description=label)):
            order = methods[i % len(methods) :] + methods[: i % len(methods)]
            outs = {}
            for backend, name in order:
                if backend == "peer":
                    ids = next(iter(built.values()))["plain"].encode(prompt, args.max_new_tokens)
                    t0 = time.perf_counter()
                    r = peer.generate(ids, max_new_tokens=args.max_new_tokens)
                else:
                    engine = router if backend == "routed" else built[backend][name]
                    t0 = time.perf_counter()
                    r = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
                seconds = time.perf_counter() - t0
                outs[backend, name] = r.token_ids
                rec = runs.setdefault(label, {}).setdefault(f"{backend}/{name}", [])
                steps = len(r.steps) or len(r.token_ids)
                copied = sum(s.lookup_accepted for s in r.steps)
                drafted = sum(s.tree_nodes for s in r.steps)
                sources = r.drafts.to_json() if backend != "peer" else {}  # drafted and accepted by source
                rec.append({"prompt": i, "tokens": len(r.token_ids), "seconds": seconds, "steps": steps,
                            "copied": copied, "drafted": drafted, "sources": sources})  # fmt: skip
                if backend == "routed":  # the lane it took, and why (the router's -v line)
                    rec[-1]["lane"] = lanes[-1].split(":")[0].removeprefix("routed to ").split(" ")[0]
                    rec[-1]["why"] = lanes[-1]
            for backend in built:
                for name in ("lookup", "lookup+suffix"):
                    runs[label][f"{backend}/{name}"][-1]["identical"] = (
                        outs[backend, name] == outs[backend, "plain"]
                    )
            if router is not None:  # against the plain output of the lane it took
                last = runs[label]["routed/lookup+suffix"][-1]
                last["identical"] = outs["routed", "lookup+suffix"] == outs[last["lane"], "plain"]
    table = Table(
        title=f"{args.task}, {len(prompts)} requests x {len(runs)} passes, {args.max_new_tokens} new tokens, greedy"
    )
    for col in ("pass", "method", "tokens/s", "vs same backend plain", "vs llama-cpp-python", "tokens/step",
                "drafted/step", "copied", "identical"):  # fmt: skip
        table.add_column(col, justify="right")
    summary: dict = {}
    for label, rows in runs.items():
        speed = {m: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for m, rs in rows.items()}
        for m, rs in rows.items():
            backend = m.split("/")[0]
            base = speed.get(f"{backend if backend != 'routed' else 'llama-cpp'}/plain", speed[m])
            tokens = sum(r["tokens"] for r in rs)
            row = summary.setdefault(label, {})[m] = {
                "tokens_per_second": speed[m],
                "over_plain": speed[m] / base,
                "over_llama_cpp_python": speed[m] / speed["peer/llama-cpp-python"],
                "tokens_per_step": tokens / sum(r["steps"] for r in rs),
                "drafted_per_step": sum(r["drafted"] for r in rs) / sum(r["steps"] for r in rs),
                "copied_share": sum(r["copied"] for r in rs) / tokens,
                "identical": sum(r.get("identical", True) for r in rs),
            }
            if backend == "routed":
                row["lanes"] = {b: sum(r["lane"] == b for r in rs) for b in BACKENDS}
            table.add_row(label, m, f"{row['tokens_per_second']:.1f}", f"{row['over_plain']:.2f}x",
                          f"{row['over_llama_cpp_python']:.2f}x", f"{row['tokens_per_step']:.2f}",
                          f"{row['drafted_per_step']:.1f}", f"{row['copied_share']:.0%}", f"{row['identical']}/{len(rs)}")  # fmt: skip
    Console(width=150).print(table)
    for label, rows in summary.items():
        if "routed/lookup+suffix" in rows:
            print(f"{label}: routed to {rows['routed/lookup+suffix']['lanes']}")
    query_us = query_cost(next(iter(built.values()))["lookup+suffix"], prompts)
    print(f"a suffix-cache query (the step's one): median {query_us:.1f} us over the run's cache")
    meta = {"task": args.task, "query_us": query_us, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
            "machine": record("cpu"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
