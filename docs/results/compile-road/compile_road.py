"""The other road (issue #38, item 6): where the PyTorch step's time goes on a CPU, and whether a compiled
fixed-shape step per tree size removes the per-operator overhead (what CUDA graphs do on a GPU).

Two parts, both on the embedded SmolLM2-135M through the engine's transformers backend (`BaseModel`):

- `--profile`: torch.profiler over the engine's eager steps (one token; the 8-node tree `tree_8`, 9 tokens)
  after a `--past`-token prompt: self CPU time by op, the share in the linear/matmul ops, and the share of
  the step spent outside every op (Python, transformers' module code, the dispatcher's glue).
- the comparison (default): for each dtype and tree size n in `--sizes`, the engine's eager step (the
  preallocated cache, packed bf16 linears: what `entmtp` runs today) against one `torch.compile`d step over a
  static `KVCache` with fixed shapes: n tokens, their depths and [n, n] tree mask, and the committed length as
  a tensor; attention reads the first `--kv-len` slots (512: one of graphs.py's kv buckets, the prompt and
  steps stay under it), so each size is one fixed shape and one compile. Inductor with frozen weights (`--no-freezing` to keep them as inputs), `dynamic=False`.
  It checks the compiled logits against eager ones on the same cache contents (max |diff|, argmax), the
  greedy tokens of `--greedy` plain steps on a few prompts, times eager and compiled steps interleaved
  (`--repeats` rounds, or fewer when `--budget` seconds run out; medians), and reports each compile's
  seconds apart.

Usage (from the checkout's root, PYTHONPATH=src):
  python docs/results/compile-road/compile_road.py --profile --out docs/results/compile-road/profile.json
  python docs/results/compile-road/compile_road.py --dtypes bfloat16,float32 --sizes 1,2,4,8,16 \
      --repeats 20 --budget 600 --out docs/results/compile-road/compile.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from entmtp.backends.transformers import BaseModel
from entmtp.cache import KVCache, static_mask
from entmtp.model import encode_prompt, load_model
from entmtp.tree import Tree, load_tree

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
    "Summarize the causes of the French Revolution in three short paragraphs.",
    "A train leaves at 3 pm at 60 km/h; another at 4 pm at 80 km/h. When does the second catch up?",
)
CAPACITY = 1024
LINEAR_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "mkldnn::", "onednn")


def node_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths [n] and ancestor mask [n, n] of the first n nodes of tree_16 (a prefix of a tree's nodes is a
    tree: every node's ancestors come before it)."""
    tree = load_tree("tree_16")
    return tree.depths[:n].clone(), tree.mask[:n, :n].clone()


def eager_step(base: BaseModel, cache: KVCache, ids, depths, mask):
    """The engine's eager forward (BaseModel.forward's non-static branch) for a tree given as depths + mask."""
    n, past = ids.numel(), cache.length
    cache.begin(n)
    full = torch.ones(n, past + n, dtype=torch.bool)
    full[:, past:] = mask
    return base.run(ids, past + depths, full, cache)


class LayerKV(KVCache):
    """A static `KVCache` whose layers' keys and values are separate tensors [1, kv_heads, capacity, head_dim]
    instead of views of one [2, L, ...] tensor. Compiled, an in-place write into a view of a graph input is
    functionalized into a copy of the whole base tensor in every layer (inductor's output for `KVCache`:
    a [2, 30, 1, 3, 1024, 64] buffer, 23.6 MB, rewritten per layer); into a whole input it stays in place."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(num_layers, capacity, static=True)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not self.keys:
            b, h, _, d = key_states.shape
            for kv in (self.keys, self.values):
                kv.extend(
                    torch.zeros(b, h, self.capacity, d, dtype=key_states.dtype)
                    for _ in range(self.num_layers)
                )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]

    def commit(self, path: list[int]) -> None:
        n = len(path)
        if path[-1] != n - 1:
            src = torch.tensor(path) + self.length
            for t in (*self.keys, *self.values):
                t[:, :, self.length : self.length + n] = t[:, :, src]
        self.length += n


class CompiledStep:
    """One torch.compile'd forward over a static per-layer cache: a fixed shape per n tokens."""

    def __init__(self, base: BaseModel, *, freezing: bool, mode: str | None, kv_len: int):
        self.base, self.cache, self.kv_len = base, LayerKV(base.num_layers, CAPACITY), kv_len
        self.past = torch.zeros(
            (), dtype=torch.int64
        )  # the committed length, a tensor: no recompile per step
        torch._inductor.config.freezing = freezing
        self.fn = torch.compile(self._body, dynamic=False, mode=mode)

    def _body(self, ids, depths, mask, kv_len: int):
        cache = self.cache
        cache.slots, cache.kv_len = self.past + torch.arange(ids.shape[0]), kv_len
        out = self.base.run(
            ids, self.past + depths, static_mask(mask, self.past, kv_len), cache, fixed_shape=True
        )
        return out.logits, out.hidden

    def prefill(self, ids) -> torch.Tensor:
        self.cache.reset()
        out = self.base.forward(ids, None, self.cache, logits_to_keep=1)  # eager, static mask
        self.cache.commit(list(range(ids.numel())))
        return out.logits

    def step(self, ids, depths, mask):
        self.past.fill_(self.cache.length)
        if self.cache.length + ids.numel() > self.kv_len:
            raise ValueError(f"{self.cache.length + ids.numel()} slots in use exceed --kv-len {self.kv_len}")
        return self.fn(ids, depths, mask, self.kv_len)


def models(dtype: str):
    """(eager BaseModel as the engine runs it, BaseModel for compiling: unpacked, inductor packs), tokenizer."""
    eager, tok = load_model(dtype=dtype)
    plain, _ = load_model(dtype=dtype, pack=False)
    return BaseModel(eager), BaseModel(plain), tok


def prompt_ids(tok, past: int) -> torch.Tensor:
    """A chat prompt padded with text to `past` tokens."""
    ids = encode_prompt(tok, " ".join(PROMPTS * 20))
    return torch.tensor(ids[:past])


def timed(fn, *args):
    """(fn's result, wall ms, process CPU ms: every thread's CPU time, less inflated by other processes)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, 1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0)


def profile(args) -> dict:
    """Self CPU time by op of the engine's eager plain and tree_8 steps (bf16, packed)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    base, _, tok = models(args.dtypes.split(",")[0])
    ids = prompt_ids(tok, args.past)
    report = {}
    for name, tree in (("plain", Tree.root_only()), ("tree_8", load_tree("tree_8"))):
        cache = base.new_cache(CAPACITY)
        base.forward(ids, None, cache, logits_to_keep=1)
        base.commit(cache, list(range(ids.numel())))
        toks = ids[: tree.size]
        for _ in range(3):
            base.forward(toks, tree, cache)
        walls = []
        for _ in range(args.steps):  # unprofiled wall time
            walls.append(timed(base.forward, toks, tree, cache)[1])
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                base.forward(toks, tree, cache)
            prof_wall = 1000 * (time.perf_counter() - t0) / args.steps
        report[name] = summarize(prof, prof_wall, statistics.median(walls), args.steps, tree.size)
        print_profile(name, report[name])
    return report


def summarize(prof, prof_wall: float, wall: float, steps: int, n: int) -> dict:
    """Per-step self CPU ms by op; linear share; time outside every op (wall with profiler - sum of self)."""
    ops = {e.key: e.self_cpu_time_total / 1000 / steps for e in prof.key_averages()}
    counts = {e.key: e.count / steps for e in prof.key_averages()}
    inside = sum(ops.values())
    linear = sum(v for k, v in ops.items() if any(k.startswith(p) or p in k for p in LINEAR_OPS))
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:15]
    return {
        "tokens": n,
        "wall_ms": wall,
        "wall_ms_profiled": prof_wall,
        "ops_self_ms": inside,
        "linear_self_ms": linear,
        "outside_ops_ms": prof_wall - inside,
        "op_calls": sum(counts.values()),
        "top": [{"op": k, "self_ms": v, "calls": counts[k]} for k, v in top],
    }


def print_profile(name: str, r: dict) -> None:
    w = r["wall_ms_profiled"]
    print(
        f"\n{name} ({r['tokens']} tokens): wall {r['wall_ms']:.1f} ms ({w:.1f} ms profiled), "
        f"{r['op_calls']:.0f} op calls; linear/matmul ops {r['linear_self_ms']:.1f} ms "
        f"({100 * r['linear_self_ms'] / w:.0f}%), other ops {r['ops_self_ms'] - r['linear_self_ms']:.1f} ms "
        f"({100 * (r['ops_self_ms'] - r['linear_self_ms']) / w:.0f}%), outside ops (Python, glue) "
        f"{r['outside_ops_ms']:.1f} ms ({100 * r['outside_ops_ms'] / w:.0f}%)"
    )
    for t in r["top"]:
        print(f"  {t['op']:<44} {t['self_ms']:7.2f} ms  {t['calls']:6.0f} calls")


def check(base, comp, ids, sizes) -> dict:
    """Compiled logits against eager ones after the same prefill, per size (compiles each size: seconds)."""
    cache = base.new_cache(CAPACITY)
    base.forward(ids, None, cache, logits_to_keep=1)
    base.commit(cache, list(range(ids.numel())))
    comp.prefill(ids)
    out = {}
    for n in sizes:
        depths, mask = node_inputs(n)
        toks = ids[:n]
        ref = eager_step(base, cache, toks, depths, mask).logits
        (logits, _), compile_s, _ = timed(comp.step, toks, depths, mask)
        diff = (logits.float() - ref.float()).abs().max().item()
        same = bool((logits.argmax(-1) == ref.argmax(-1)).all())
        out[n] = {"compile_s": compile_s / 1000, "max_abs_diff": diff, "argmax_equal": same}
        print(
            f"  {n:>2} tokens: first call {compile_s / 1000:.1f} s, max |diff| {diff:.3g}, argmax equal {same}"
        )
    return out


def greedy(base, comp, tok, steps: int) -> dict:
    """Greedy plain decoding of `steps` tokens on each prompt, eager (engine) vs compiled."""
    same, first_diff = 0, []
    for p in PROMPTS:
        ids = torch.tensor(encode_prompt(tok, p))
        cache = base.new_cache(CAPACITY)
        a = [int(base.forward(ids, None, cache, logits_to_keep=1).logits[-1].argmax())]
        base.commit(cache, list(range(ids.numel())))
        b = [int(comp.prefill(ids)[-1].argmax())]
        d1, m1 = node_inputs(1)
        for _ in range(steps - 1):
            a.append(int(base.forward(torch.tensor(a[-1:]), Tree.root_only(), cache).logits[-1].argmax()))
            base.commit(cache, [0])
            logits, _ = comp.step(torch.tensor(b[-1:]), d1, m1)
            comp.cache.commit([0])
            b.append(int(logits[-1].argmax()))
        same += a == b
        first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None))
    print(f"  greedy {steps} tokens: {same}/{len(PROMPTS)} prompts identical, first differences {first_diff}")
    return {"prompts": len(PROMPTS), "identical": same, "first_difference": first_diff, "tokens": steps}


def timing(base, comp, ids, sizes, repeats: int, deadline: float) -> dict:
    """Eager and compiled steps of each size, interleaved (order alternating), medians over the rounds."""
    cache = base.new_cache(CAPACITY)
    base.forward(ids, None, cache, logits_to_keep=1)
    base.commit(cache, list(range(ids.numel())))
    comp.prefill(ids)
    inputs = {n: (ids[:n], *node_inputs(n)) for n in sizes}
    eager = {n: [] for n in sizes}
    compiled = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            pair = (
                (eager, lambda x=inputs[n]: eager_step(base, cache, *x)),
                (compiled, lambda x=inputs[n]: comp.step(*x)),
            )
            for store, fn in pair if r % 2 == 0 else pair[::-1]:
                _, ms, cpu = timed(fn)
                if r > 0:  # round 0: warm-up
                    store[n].append((ms, cpu))
        if time.perf_counter() > deadline and r >= 3:
            break
    return {n: {**stats("eager", eager[n]), **stats("compiled", compiled[n])} for n in sizes}


def stats(name: str, times: list[tuple[float, float]]) -> dict:
    """Median and range of the wall ms, median of the process CPU ms, rounds."""
    wall, cpu = [w for w, _ in times], [c for _, c in times]
    return {
        f"{name}_ms": statistics.median(wall),
        f"{name}_range": [min(wall), max(wall)],
        f"{name}_cpu_ms": statistics.median(cpu),
        "rounds": len(times),
    }


def compare(args) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    deadline = time.perf_counter() + args.budget
    report = {}
    for dtype in args.dtypes.split(","):
        print(f"\n{dtype}:")
        base, plain, tok = models(dtype)
        comp = CompiledStep(plain, freezing=not args.no_freezing, mode=args.mode, kv_len=args.kv_len)
        ids = prompt_ids(tok, args.past)
        with torch.no_grad():
            checks = check(base, comp, ids, sizes)
            same = greedy(base, comp, tok, args.greedy)
            times = timing(base, comp, ids, sizes, args.repeats, deadline)
        for n in sizes:
            t, c = times[n], checks[n]
            t.update(
                c,
                speedup=t["eager_ms"] / t["compiled_ms"],
                cpu_speedup=t["eager_cpu_ms"] / t["compiled_cpu_ms"],
            )
        report[dtype] = {"sizes": times, "greedy": same}
        print_table(dtype, times)
    return report


def print_table(dtype: str, times: dict) -> None:
    print(
        f"\n{dtype}: tokens | eager ms | compiled ms | speedup | eager CPU ms | compiled CPU ms | CPU speedup | "
        "compile s | max |diff| | argmax equal | rounds"
    )
    for n, t in times.items():
        print(
            f"  {n:>2} | {t['eager_ms']:7.1f} | {t['compiled_ms']:7.1f} | {t['speedup']:5.2f}x | "
            f"{t['eager_cpu_ms']:7.1f} | {t['compiled_cpu_ms']:7.1f} | {t['cpu_speedup']:5.2f}x | "
            f"{t['compile_s']:6.1f} | {t['max_abs_diff']:.3g} | {t['argmax_equal']} | {t['rounds']}"
        )


def cpu_record() -> dict:
    """The CPU model and the flags that decide the bf16 kernels (from /proc/cpuinfo where there is one)."""
    info = {"arch": platform.machine(), "model": None, "flags": []}
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    info["model"] = fields.get("model name")
    info["flags"] = [f for f in wanted if f in fields.get("flags", "").split()]
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", action="store_true", help="profile the eager steps instead of comparing")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--past", type=int, default=300, help="committed prompt tokens before the steps")
    ap.add_argument(
        "--kv-len", type=int, default=512, help="slots the compiled step attends over (one graph per size)"
    )
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds (after one warm-up round)")
    ap.add_argument("--budget", type=float, default=600, help="seconds for the whole run's timed rounds")
    ap.add_argument("--steps", type=int, default=10, help="--profile: steps per profile")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens per prompt in the identity check")
    ap.add_argument("--mode", default=None, help="torch.compile mode (default; max-autotune-no-cudagraphs)")
    ap.add_argument("--no-freezing", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        results = profile(args) if args.profile else compare(args)
    meta = {
        "args": vars(args),
        "torch": torch.__version__,
        "machine": cpu_record(),
        "threads": torch.get_num_threads(),
        "note": "timings on a shared 2-core machine under load: indicative only",
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
