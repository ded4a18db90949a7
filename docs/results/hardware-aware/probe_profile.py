"""Where the Hydra probe's time goes on this machine (#21: the probe is paid on every step of the default,
also on steps that then drop the heads' tree).

Times `Drafter.probe` of mc_sim_7b_63 with the shipped Hydra heads on the embedded model in bf16 (median of
repeated calls after a warm-up), then profiles it with torch.profiler and prints the ops by self CPU time and
the draft projection's shape and bytes (its weight is read in full on every probe).

    .venv/bin/python docs/results/hardware-aware/probe_profile.py [--threads 2] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from entmtp.engine import Engine
from entmtp.machine import describe, hardware
from entmtp.model import load_model
from entmtp.shipped import resolve_heads
from entmtp.tree import load_tree

PROMPT = "Translate to German: The weather is nice today, and we are going for a walk in the park."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(dtype="bfloat16")
    heads = resolve_heads("hydra", model)
    Engine(model, tokenizer, heads=heads)  # binds and packs the heads as the engine does
    drafter = heads.drafter()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]
    drafter.extend(hidden)
    master, root = load_tree("mc_sim_7b_63"), ids[0, -1]
    for _ in range(20):
        drafter.probe(master, root)
    times = []
    for _ in range(args.calls):
        t = time.perf_counter()
        drafter.probe(master, root)
        times.append(time.perf_counter() - t)
    print(f"{describe(hardware(model))}, {args.threads} threads, bf16")
    print(f"probe: median {statistics.median(times) * 1000:.2f} ms over {args.calls} calls")
    vocab = heads.draft_vocab.numel() if heads.draft_vocab is not None else heads.config.vocab_size
    mb = vocab * heads.config.hidden_size * model.dtype.itemsize / 1e6
    print(
        f"draft projection: [{vocab}, {heads.config.hidden_size}] {model.dtype}, {mb:.1f} MB read per probe"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            drafter.probe(master, root)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
