"""entmtp's plain decoding against transformers' own greedy `generate`, on the same model object and the same
chat-templated token ids, interleaved round by round in one process (medians, warm-up round dropped).

    python docs/results/plain-step/plain_step_check.py [--dtypes bfloat16 float32] [--rounds 6] [--tokens 64] [--threads 2]
        [--unpacked] [--out FILE.json]

Per prompt and dtype, in ms: the prefill (entmtp: `result.prefill_seconds`; transformers: from calling
`generate` to its first stopping-criteria call, i.e. its setup, the prefill and the first token); the
per-token step (entmtp: the median `step.seconds["total"]`, the six phases of `engine.decode`;
transformers: the median time between consecutive stopping-criteria calls, one per token); the wall time
per token after the first (entmtp: the whole `Engine.generate` after the prefill, streaming and
detokenizing included); and the whole generation (`result.seconds`; `generate`'s call). transformers runs
as the benchmark's peer does (peers.HFGenerate: its generation config, inference mode). Each figure is the
median over the rounds after the warm-up, with [min-max] over those rounds; `same`: both sides gave the
same tokens in every round. Before each A/B pair the script waits (up to a minute) until other processes
leave the CPUs idle: on a shared 2-core machine a competing process makes 2-thread forwards tens of times
slower.

The bfloat16 model is loaded packed by default (packing.py): transformers' generate then runs the same
packed linears, so both sides run the same kernels; `--unpacked` loads it without packing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import StoppingCriteria, StoppingCriteriaList

from entmtp.bench.peers import HFGenerate
from entmtp.engine import Engine
from entmtp.model import encode_prompt, load_model
from entmtp.prompts import load_prompts

PROMPTS = {  # name -> (task, test-split index): two short chat prompts and a ~630-token one
    "chat": ("mt_bench", 0),
    "gsm8k": ("gsm8k", 0),
    "summ-627": ("specbench-summarization", 0),
}


class _Stamps(StoppingCriteria):
    """Called by generate once per generated token (after the prefill's, then after each step's): the time."""

    def __init__(self):
        self.t: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.t.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _cpu() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return busy, int(own[11]) + int(own[12])  # utime + stime


def wait_quiet(limit: float = 0.25, max_wait: float = 60.0) -> float:
    """Wait (up to max_wait s) until other processes use less than `limit` of the machine's CPUs over half a
    second; returns the share they used in the last sample (timings on a shared 2-core machine are noisy)."""
    ncpu = os.cpu_count() or 1
    deadline = time.monotonic() + max_wait
    while True:
        b0, o0 = _cpu()
        time.sleep(0.5)
        b1, o1 = _cpu()
        share = ((b1 - b0) - (o1 - o0)) / (0.5 * os.sysconf("SC_CLK_TCK") * ncpu)
        if share < limit or time.monotonic() > deadline:
            return share


def run_hf(peer: HFGenerate, ids: list[int], n: int) -> dict:
    """transformers' generate as the benchmark's peer runs it (bench/peers.py: its generation config, inference
    mode), with a stopping criterion that only notes the time of each token."""
    stamps = _Stamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = peer.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            generation_config=peer.generation_config(n, 0.0),
            stopping_criteria=StoppingCriteriaList([stamps]),
        )
    total = time.perf_counter() - t0
    t = stamps.t
    steps = [b - a for a, b in zip(t, t[1:], strict=False)]
    return {
        "tokens": out[0, len(ids) :].tolist(),
        "prefill": t[0] - t0,
        "step": statistics.median(steps),
        "wall_per_token": (t[-1] - t[0]) / max(1, len(t) - 1),
        "total": total,
    }


def run_entmtp(engine: Engine, ids: list[int], n: int) -> dict:
    r = engine.generate(ids, max_new_tokens=n)
    return {
        "tokens": r.token_ids,
        "prefill": r.prefill_seconds,
        "step": statistics.median(s.seconds["total"] for s in r.steps),
        "wall_per_token": (r.seconds - r.prefill_seconds) / max(1, len(r.token_ids) - 1),
        "total": r.seconds,
    }


def summarise(rounds: list[dict]) -> dict:
    out = {}
    for key in ("prefill", "step", "wall_per_token", "total"):
        ms = [r[key] * 1e3 for r in rounds]
        out[key] = {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}
    return out


def machine() -> dict:
    model_name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": model_name,
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per prompt, the first dropped as warm-up")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--unpacked", action="store_true", help="load bfloat16 without prepacked linears")
    ap.add_argument("--out", default="docs/results/plain-step/plain-step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=170)
    transformers.logging.set_verbosity_error()

    report = {"machine": machine(), "args": vars(args), "date": time.strftime("%Y-%m-%d"), "runs": []}
    table = Table(
        title=f"plain decoding, ms (median of {args.rounds - 1} interleaved rounds \\[min-max]; "
        f"{args.tokens} new tokens; {args.threads} threads)"
    )
    for col in ("dtype", "prompt", "P", "n", "same", "what", "entmtp", "transformers", "hf / entmtp"):
        table.add_column(col, justify="right")
    for dtype in args.dtypes:
        model, tok = load_model(dtype=dtype, pack=not args.unpacked)
        engine, peer = Engine(model, tok), HFGenerate(model, tok)
        prompts = {k: encode_prompt(tok, load_prompts(t, "test")[i]) for k, (t, i) in PROMPTS.items()}
        runs = {k: {"entmtp": [], "transformers": []} for k in prompts}
        others: list[float] = []  # other processes' CPU share just before each A/B pair
        for rnd in range(args.rounds):
            for name, ids in prompts.items():
                others.append(wait_quiet())
                order = ("entmtp", "transformers") if rnd % 2 == 0 else ("transformers", "entmtp")
                for who in order:
                    r = (
                        run_entmtp(engine, ids, args.tokens)
                        if who == "entmtp"
                        else run_hf(peer, ids, args.tokens)
                    )
                    runs[name][who].append(r)
            console.print(
                f"{dtype}: round {rnd + 1}/{args.rounds} done (others' CPU share before pairs: "
                f"{', '.join(f'{x:.2f}' for x in others[-len(prompts) :])})"
            )
        report["others_cpu_share"] = report.get("others_cpu_share", {}) | {dtype: others}
        for name, ids in prompts.items():
            e, h = runs[name]["entmtp"], runs[name]["transformers"]
            same = all(x["tokens"] == e[0]["tokens"] for x in e + h)
            se, sh = summarise(e[1:]), summarise(h[1:])
            report["runs"].append(
                {
                    "dtype": dtype,
                    "packed": dtype == "bfloat16" and not args.unpacked,
                    "prompt": name,
                    "task": PROMPTS[name],
                    "prompt_tokens": len(ids),
                    "new_tokens": len(e[0]["tokens"]),
                    "hf_new_tokens": len(h[0]["tokens"]),
                    "identical_tokens": same,
                    "entmtp": se,
                    "transformers": sh,
                }
            )
            rows = (
                ("prefill", "prefill"),
                ("step (phases)", "step"),
                ("wall / token", "wall_per_token"),
                ("whole generation", "total"),
            )
            for i, (label, key) in enumerate(rows):
                ek, hk = se[key], sh[key]
                first = i == 0
                table.add_row(
                    dtype if first else "",
                    name if first else "",
                    str(len(ids)) if first else "",
                    str(len(e[0]["tokens"])) if first else "",
                    str(same) if first else "",
                    label,
                    f"{ek['median']:.2f} [{ek['min']:.2f}-{ek['max']:.2f}]",
                    f"{hk['median']:.2f} [{hk['min']:.2f}-{hk['max']:.2f}]",
                    f"{hk['median'] / ek['median']:.3f}x",
                )
        del engine, peer, model
    console.print(table)
    console.print(
        "hf / entmtp > 1: transformers takes longer (entmtp faster). transformers' 'step (phases)' and "
        "'wall / token' are both its time between tokens (median of steps / mean)."
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
