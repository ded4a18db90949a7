"""Per-step cost breakdown: where a speculative step spends its time, per tree, against plain decoding.

`entmtp step-costs` (formerly `entmtp profile`) prints a table (median milliseconds per phase over the measured steps, warm-up dropped)
and writes it as JSON. Non-model overhead = draft + accept + commit + bookkeeping (everything but the
verification forward).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from rich.progress import track
from rich.table import Table

from .backends.registry import DEFAULT, REGISTRY
from .build import EngineSpec, load
from .console import say, wide_console
from .engine import Engine
from .engine_args import setup_torch
from .errors import EntMTPError
from .heads import HeadsConfig, random_heads
from .machine import record
from .model import DTYPES
from .packing import pack_linears
from .policy import static
from .random_model import memory_bandwidth, random_model, weight_bytes
from .settings import from_args
from .shipped import bind_heads, default_heads_for, resolve_heads
from .tree import load_tree

PHASES = ("draft", "verify", "accept", "commit")
WARMUP = 3  # steps dropped per run: first calls allocate and warm caches
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


MODES = ("dynamic", "kv", "graphs")  # transformers' DynamicCache; the preallocated cache; + CUDA graphs


def measure_steps(engine, steps: int, prompt=PROMPT) -> list:
    """Run one generation for WARMUP + `steps` steps; return the measured (post-warm-up) steps."""
    taken = []
    for event in engine.stream(prompt, max_new_tokens=(steps + WARMUP) * 64):  # most steps emit < 64
        if event.step is not None:
            taken.append(event.step)
        if len(taken) == WARMUP + steps:
            break
    if len(taken) <= WARMUP:
        raise RuntimeError("generation ended before any step could be measured: use a longer prompt")
    return taken[WARMUP:]


def summarize(measured: list) -> dict:
    """Median ms per phase over measured steps, and their mean tokens per step."""
    row = {p: 1000 * statistics.median(s.seconds[p] for s in measured) for p in PHASES}
    row["total"] = 1000 * statistics.median(s.seconds["total"] for s in measured)
    row["bookkeeping"] = max(0.0, row["total"] - sum(row[p] for p in PHASES))
    row["overhead"] = row["total"] - row["verify"]
    row["tokens_per_step"] = statistics.mean(s.tokens for s in measured)
    row["steps"] = len(measured)
    return row


def run_step_costs(args) -> int:
    modes = _modes(args.kv, args.device, args.backend)
    trees = [load_tree(n) for n in args.trees.split(",")]  # bad names fail before any model loads
    model, tokenizer, prompt, spec = _base_model(args)
    heads, spec = _heads(spec, model, not args.no_draft_int8)
    runs = _runs(model, tokenizer, heads, trees, modes)
    # rounds interleave every run, so drift in the machine's speed hits all of them alike
    order = [key for _ in range(args.rounds) for key in runs]
    for key in track(order, description="profiling", console=wide_console(stderr=True)):
        row, engine, measured = runs[key]
        measured += measure_steps(engine, args.steps, prompt)
    rows = {key: {**row, **summarize(measured)} for key, (row, engine, measured) in runs.items()}
    captures = {key: e.graphs.captures for key, (_, e, _) in runs.items() if e.graphs is not None}
    nbytes, bandwidth = _weight_bytes(model), memory_bandwidth(args.device)
    floor_ms = 1000 * nbytes / bandwidth
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    what = f"random {args.random_model}" if args.random_model else (args.model or "embedded SmolLM2-135M")
    what += f" on {args.backend}" if REGISTRY[args.backend] is not DEFAULT else ""
    drafting = "int8" if getattr(heads, "int8", False) else args.dtype
    _print_table(
        rows,
        title=f"per-step cost, ms (median of {args.rounds} x {args.steps} steps; {what}; heads: {spec}, drafting "
        f"in {drafting}; {args.dtype}; {where})",
        caption=f"weights {nbytes / 2**20:.0f} MiB / measured copy bandwidth {bandwidth / 1e9:.1f} GB/s = "
        f"{floor_ms:.2f} ms: the floor of a step that reads every weight once",
    )
    meta = {
        "model": what,
        "heads": spec,
        "backend": args.backend,
        "drafting_weights": drafting,
        "dtype": args.dtype,
        "device": where,
        "steps": args.steps,
        "rounds": args.rounds,
        "prompt_tokens": len(prompt) if isinstance(prompt, list) else None,
        "weight_bytes": nbytes,
        "bandwidth_bytes_per_s": bandwidth,
        "floor_ms": floor_ms,
        "graph_captures": captures,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
        "machine": record(model.device),  # the CPU and its kernel flags (or the GPU), threads, versions
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


def _base_model(args) -> tuple:
    """(model, tokenizer, prompt, heads spec): a random model of --random-model's shape with a random prompt
    of --past token ids (and no heads unless named), or --model with a text prompt (and its shipped heads)."""
    if args.random_model:
        model, tokenizer = random_model(args.random_model, dtype=DTYPES[args.dtype], device=args.device)
        if not args.no_pack:
            pack_linears(model)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (args.past,), generator=gen).tolist()
        return model, tokenizer, prompt, args.heads or "none"
    # the model, backend, dtype, device, threads and packing flags as generate's; this command's --heads and
    # --kv mean other things (heads bound below; cache modes), and nothing is probed (this command times)
    spec = from_args(
        EngineSpec, args, heads="none", lookup=None, kv="auto", probe=False,
        gguf_as_given=not REGISTRY[args.backend].torch_model,  # the file timed as it is
    )  # fmt: skip
    loaded = load(spec)  # the model as `generate` loads it on this backend (its heads are bound below)
    heads = args.heads or default_heads_for(loaded.model, args.model, say)
    return loaded.model, loaded.tokenizer, PROMPT, heads


def _heads(spec: str, model, int8: bool) -> tuple:
    """(heads, the name the table gives them), drafting from int8 copies where the engine's default would."""
    if spec != "none":
        return resolve_heads(spec, model, int8=int8), spec
    # nothing shipped: random heads still measure drafting cost (acceptance will be low)
    cfg = model.config
    heads = random_heads(
        HeadsConfig(kind="medusa", num_heads=4, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    )
    return bind_heads(heads, model, int8=int8), "random medusa"


def _runs(model, tokenizer, heads, trees: list, modes: list[str]) -> dict:
    """key -> (row, engine, measured steps) for plain decoding and each tree in each cache mode: built once,
    measured round after round."""
    runs = {}
    for tree in [None, *trees]:
        for mode in modes:
            kw = dict(kv="dynamic" if mode == "dynamic" else "auto", graphs=mode == "graphs")
            policy = static(tree) if tree is not None else None  # None: plain decoding
            engine = Engine(model, tokenizer, heads=heads if tree else None, policy=policy, **kw)
            name = tree.name if tree is not None else "plain"
            row = {"tree": name, "mode": mode, "nodes": 0 if tree is None else tree.num_nodes}
            runs[name if len(modes) == 1 else f"{name}@{mode}"] = (row, engine, [])
    return runs


def _print_table(rows: dict, title: str, caption: str) -> None:
    table = Table(title=title, caption=caption)
    for col in ("run", "kv", "nodes", *PHASES, "bookkeeping", "overhead", "total", "tokens/step"):
        table.add_column(col, justify="right")
    for r in rows.values():
        cells = [f"{r[p]:.2f}" for p in (*PHASES, "bookkeeping", "overhead", "total")]
        table.add_row(r["tree"], r["mode"], str(r["nodes"]), *cells, f"{r['tokens_per_step']:.2f}")
    wide_console().print(table)


def _weight_bytes(model) -> int:
    """Bytes of weights one forward reads: the GGUF file's on llama.cpp (its tensors live there), else the
    module's parameters."""
    runtime = getattr(model, "runtime", None)
    return runtime.path.stat().st_size if runtime is not None else weight_bytes(model)


def _modes(spec: str, device: str, backend: str = DEFAULT.name) -> list[str]:
    if not REGISTRY[backend].torch_model:
        if spec != "auto":
            raise EntMTPError(f"--kv is transformers' cache: {backend} keeps its own, so drop --kv {spec}")
        return ["own"]
    if spec == "auto":
        return ["graphs" if device.startswith("cuda") else "kv"]
    modes = spec.split(",")
    for m in modes:
        if m not in MODES:
            raise EntMTPError(f"unknown --kv mode {m!r}: use auto or a comma list of {', '.join(MODES)}")
    if "graphs" in modes and not device.startswith("cuda"):
        raise EntMTPError("--kv graphs needs a CUDA device: pass --device cuda, or drop graphs")
    return modes


def _version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


# ---- `entmtp step-costs` --------------------------------------------------------------------------------

NAMED_BACKEND = dict(
    default=DEFAULT.name,
    choices=list(REGISTRY),  # a named one: this command times one backend's step
    help="what runs the base model: transformers (default) or llama-cpp (a GGUF file as it is: --model "
    "FILE.gguf, or the embedded model's; --dtype is then the heads' dtype)",
)


def register(sub) -> None:
    """`step-costs` (and its old name `profile`) on the subcommand parsers `sub`."""
    from .engine_args import MODEL_FIELDS, add_model_arguments
    from .shipped import HEAD_KINDS

    p = sub.add_parser(
        "step-costs",
        aliases=["profile"],
        help="per-step cost breakdown (draft/verify/accept/commit) per tree size (`profile`: its old name)",
    )
    p.add_argument(
        "--heads", default=None, help=f"{' | '.join(HEAD_KINDS)} | PATH (default: shipped, else random heads)"
    )
    p.add_argument("--trees", default="chain_1,tree_4,tree_16,mc_sim_7b_63")
    p.add_argument("--steps", type=int, default=40, help="decode steps measured per tree (after warm-up)")
    p.add_argument("--out", default="runs/step-costs.json")
    p.add_argument(
        "--random-model",
        default=None,
        metavar="SHAPE|CONFIG.json",
        help="time a model shape with random weights instead of --model: smollm2-135m, llama-7b or a config.json",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="measure every run this many times, interleaved (less drift)"
    )
    p.add_argument(
        "--past", type=int, default=300, help="prompt tokens before the measured steps (random model)"
    )
    p.add_argument(
        "--kv",
        default="auto",
        help="auto (graphs on CUDA, else kv) or a comma list of: dynamic (transformers' DynamicCache), kv "
        "(the preallocated cache), graphs (kv + CUDA graphs)",
    )
    add_model_arguments(p, fields=(*MODEL_FIELDS, "backend", "draft_int8"), backend=NAMED_BACKEND)
    p.set_defaults(func=run_step_costs_command)


def run_step_costs_command(args) -> int:
    """Check the arguments, then measure (`run_step_costs`)."""
    if args.command == "profile":
        print(
            "entmtp: `entmtp profile` is now `entmtp step-costs` (a profile is a scheduler profile, see "
            "`entmtp calibrate`); the old name will go in a later version",
            file=sys.stderr,
        )
    if args.random_model and args.model:
        raise EntMTPError("give either --model or --random-model, not both")
    if args.random_model and not REGISTRY[args.backend].torch_model:
        raise EntMTPError(
            "--random-model builds a transformers model: for llama.cpp give --model FILE.gguf (cpu_curves.py "
            "in docs/results/llama-cpp/ writes random GGUFs of the 1B and 7B shapes)"
        )
    if args.past < 1 or args.steps < 1 or args.rounds < 1:
        raise EntMTPError("--past, --steps and --rounds must be >= 1")
    setup_torch(args)
    return run_step_costs(args)
