"""Command line: `entmtp generate`, `chat`, `trees`, `profile`, `bench`, `calibrate`, `train-heads`, `eval-heads`,
`doctor`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import EntMTPError
from .prompts import TASKS


def _add_model_args(p: argparse.ArgumentParser, auto_dtype: bool = False) -> None:
    from .build import DTYPE_CHOICES
    from .model import DTYPES

    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model id, local path or .gguf file (default: embedded SmolLM2)",
    )
    if auto_dtype:
        from .backends import BACKENDS

        p.add_argument(
            "--backend",
            default="auto",
            choices=BACKENDS,
            help="what runs the base model: transformers (PyTorch) or llama-cpp (llama.cpp's CPU kernels on a "
            "GGUF file, through llama-cpp-python); auto (default): on a CPU with llama-cpp-python installed, "
            "the one with the most expected tokens/s on this machine's measured step costs (cached)",
        )
        p.add_argument(
            "--dtype",
            default="auto",
            choices=DTYPE_CHOICES,
            help="auto (default): on a CPU, the dtype with the most expected tokens/s on this machine's "
            "measured step costs (bf16 or float32, measured once and cached); bf16 on CUDA. float32: output "
            "identical to plain decoding, token for token",
        )
    else:
        p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default="cpu")
    _add_threads_arg(p)
    p.add_argument(
        "--no-graphs",
        action="store_true",
        help="on CUDA, verify eagerly instead of replaying one captured CUDA graph per tree size",
    )
    p.add_argument(
        "--no-pack",
        action="store_true",
        help="on a CPU in bfloat16, leave the linear layers unpacked (packing: same outputs, faster steps)",
    )


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _add_acceptance_arg(p: argparse.ArgumentParser) -> None:
    from .accept import ACCEPTANCE

    p.add_argument(
        "--acceptance",
        default="auto",
        choices=["auto", *ACCEPTANCE],
        help="how drafts are accepted (auto: greedy at temperature 0, else lossless tree rejection sampling "
        "`sample`; gumbel: lossless Gumbel-max sampling whose seeded output does not depend on the tree; "
        "typical: Medusa's, not lossless)",
    )


def _setup_torch(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def engine_spec(args):
    """The `EngineSpec` that generate, chat and serve's options name."""
    from .build import EngineSpec

    return EngineSpec(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        heads=args.heads,
        tree=args.tree,
        policy=args.policy,
        profile=args.profile,
        lookup=_lookup(args),  # bad lookup settings fail before any model loads
        temperature=getattr(args, "temperature", 0.0),
        acceptance=getattr(args, "acceptance", "auto"),
        probe=not args.no_probe,
        pack=not args.no_pack,
        graphs=not args.no_graphs,
    )


def _engine(args, **overrides):
    """The engine that `generate`, `chat` and `serve` share (build.py); `-v` prints the plan behind it.
    `overrides`: `EngineSpec` fields the command sets itself."""
    from dataclasses import replace

    from .build import build

    built = build(replace(engine_spec(args), **overrides))
    if getattr(args, "verbose", False):
        print(built.plan.describe(), file=sys.stderr)
    return built.engine


def _sampling_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        acceptance=args.acceptance,
        seed=args.seed,
        stop=args.stop or None,
    )


def _read_prompt(args):
    """The prompt: the argument, `-` or nothing for stdin (when it is not a terminal), or --prompt-file;
    with --system, a system message and a user message."""
    if args.prompt_file is not None:
        if args.prompt not in (None, "-"):
            raise EntMTPError("give the prompt either as an argument or with --prompt-file, not both")
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise EntMTPError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from e
    elif args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    elif args.prompt is None:
        raise EntMTPError(
            'no prompt: give one as an argument (entmtp generate "..."), pipe it on stdin, or use --prompt-file'
        )
    else:
        text = args.prompt
    if args.system is None:
        return text
    if args.no_chat:
        raise EntMTPError("--system needs the chat template: drop --no-chat")
    if not text.strip():
        raise EntMTPError("the prompt is empty: give some text after --system")
    return [{"role": "system", "content": args.system}, {"role": "user", "content": text}]


def cmd_generate(args) -> int:
    prompt = _read_prompt(args)  # before loading anything: a bad prompt fails fast
    engine = _engine(args)
    kwargs = dict(_sampling_kwargs(args), chat=not args.no_chat)
    if args.system is not None and not getattr(engine.tokenizer, "chat_template", None):
        raise EntMTPError(
            "--system needs a chat template, and this model's tokenizer has none: drop --system"
        )
    if args.json:
        result = engine.generate(prompt, **kwargs)
        print(json.dumps(result.to_json()))
        return 0
    for event in engine.stream(prompt, **kwargs):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    result = event.result
    print(
        f"\n[{len(result.token_ids)} tokens, {result.num_steps} steps, "
        f"{result.mean_tokens_per_step:.2f} tokens/step, {result.tokens_per_second:.1f} tokens/s, "
        f"finish: {result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_chat(args) -> int:
    from .chat import run_chat

    engine = _engine(args)
    interactive = sys.stdin.isatty()
    return run_chat(
        engine,
        sys.stdin,
        sys.stdout,
        sys.stderr,
        system=args.system,
        interactive=interactive,
        **_sampling_kwargs(args),
    )


def cmd_serve(args) -> int:
    if args.max_queue < 0 or args.max_body < 1:
        raise EntMTPError("--max-queue must be >= 0 and --max-body >= 1")
    if args.max_batch < 1:
        raise EntMTPError(f"--max-batch must be >= 1 (1: one request at a time), got {args.max_batch}")
    if args.drain_timeout < 0 or args.header_timeout <= 0 or args.body_timeout <= 0:
        raise EntMTPError("--drain-timeout must be >= 0, --header-timeout and --body-timeout > 0 (seconds)")
    from .server.ray_config import check_ray_arguments

    check_ray_arguments(args)
    if args.ray:  # Ray Serve: replicas of the engine on a cluster (server/ray_serve.py)
        from .server.ray_serve import serve_ray

        return serve_ray(args, engine_spec(args))
    try:
        from .server.run import bind, serve  # light: the port is bound before torch is even imported

        sock = bind(args.host, args.port)  # a busy port fails at once, not after the model loads
        from .server.app import create_app
    except ImportError as e:
        raise EntMTPError(
            f"`entmtp serve` needs the server extra ({e.name} is missing): pip install 'entmtp[server]'"
        ) from e
    from .server.thread import TorchThread

    batched = args.max_batch > 1
    thread = TorchThread()  # every torch call of the server on one thread (server/thread.py says why)
    # a batch steps eagerly (batch.py)
    engine = thread.call(_engine, args, graphs=not args.no_graphs and not batched)
    name = args.model_name or args.model or "smollm2-135m-instruct"
    if batched and not args.no_graphs and engine.base.device.type == "cuda":
        print(
            f"entmtp: --max-batch {args.max_batch}: batched steps run without CUDA graphs, so a request "
            "alone decodes slower than with them; --max-batch 1 serves one request at a time with graphs",
            file=sys.stderr,
        )
    costs = thread.call(_batch_costs, engine, args) if batched else None
    app = create_app(
        engine,
        name,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body,
        max_batch=args.max_batch,
        costs=costs,
        thread=thread,
        acceptance=args.request_acceptance,
        body_timeout=args.body_timeout,
    )
    print(f"entmtp: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve(
        app,
        sock,
        drain_timeout=args.drain_timeout,
        header_timeout=args.header_timeout,
        access_log=not args.no_access_log,
        verbose=args.verbose,
    )
    return 0


def _batch_costs(engine, args):
    """The cost surface (costs/: ms of a batched step by rows and nodes per row, measured once per
    machine and cached) that a batch's policies weigh their trees by; None with --no-probe, or when this
    model cannot be batched (the server then says why and serves one request at a time)."""
    from .costs import probing_disabled

    if args.no_probe or probing_disabled() or not engine.base.preallocate:
        return None
    from .costs import surface_for

    return surface_for(engine.model, engine.heads, max_batch=args.max_batch)


def cmd_doctor(args) -> int:
    from .doctor import format_report, probe_report, report

    _setup_torch(args)
    plan = probe_report() if args.probe else None  # first: its measurement then shows in step_costs
    r = report()
    if plan is not None:
        r["default_engine"] = plan
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0


def _lookup(args):
    """--lookup / --no-lookup and the lookup settings -> a `Lookup` or None. Unsaid, lookup drafts go with
    the scheduled default (heads and no --tree) except under typical acceptance; `--heads none` stays plain
    decoding, a --tree that tree. Said, they go into every step's tree, typical acceptance's too."""
    from .lookup import Lookup

    on = args.lookup
    if on is None:
        on = args.heads != "none" and args.tree is None
    if not on:
        return None
    return Lookup(
        max_ngram=args.lookup_ngram,
        tokens=args.lookup_tokens,
        adaptive=not args.lookup_fixed,
        node_cost=args.lookup_node_cost,
        typical=args.lookup is True,  # said: under typical acceptance too (Lookup.typical)
    )


def add_lookup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-lookup",
        dest="lookup",
        action="store_false",
        default=None,
        help="no prompt-lookup drafts in the scheduled default's trees (they are on unless --heads none or --tree, "
        "except under typical acceptance)",
    )
    p.add_argument(
        "--lookup",
        action="store_true",
        default=None,
        help="add prompt-lookup drafts (copies from the prompt and output) to every step's tree, typical "
        "acceptance's too; with --heads none: prompt lookup decoding for any model",
    )
    p.add_argument(
        "--lookup-fixed",
        action="store_true",
        help="always draft --lookup-tokens lookup tokens when there is a match (default: sized per step)",
    )
    add_lookup_settings(p)


def add_lookup_settings(p: argparse.ArgumentParser) -> None:
    """How lookup drafts are made and sized (`generate`, `chat`, `serve` and `bench`)."""
    p.add_argument("--lookup-tokens", type=int, default=10, help="most lookup tokens per step (default 10)")
    p.add_argument("--lookup-ngram", type=int, default=3, help="longest n-gram matched (default 3)")
    p.add_argument(
        "--lookup-node-cost",
        type=float,
        default=None,
        help="sizing the lookup branch, a step of n drafted tokens costs 1 + C*n one-token steps (~0.01 on a "
        "GPU; default: measured step latencies, the profile's or a 2-core CPU's)",
    )


def cmd_trees(args) -> int:
    from .tree import list_trees, load_tree

    print(f"{'name':<16} {'nodes':>5}  per depth")
    for name in list_trees():
        t = load_tree(name)
        print(f"{name:<16} {t.num_nodes:>5}  {'/'.join(map(str, t.nodes_per_depth))}")
    return 0


def cmd_step_costs(args) -> int:
    from .step_costs import run_step_costs

    if args.command == "profile":
        print(
            "entmtp: `entmtp profile` is now `entmtp step-costs` (a profile is a scheduler profile, see "
            "`entmtp calibrate`); the old name will go in a later version",
            file=sys.stderr,
        )

    if args.random_model and args.model:
        raise EntMTPError("give either --model or --random-model, not both")
    if args.past < 1 or args.steps < 1 or args.rounds < 1:
        raise EntMTPError("--past, --steps and --rounds must be >= 1")
    _setup_torch(args)
    return run_step_costs(args)


def cmd_bench(args) -> int:
    from .bench import run_bench

    if args.render is not None:
        from .bench.report import render_again

        print(f"wrote {render_again(Path(args.render))}")
        return 0
    _setup_torch(args)
    return run_bench(args)


def _add_generation_args(g: argparse.ArgumentParser) -> None:
    """Model, heads, tree, policy, lookup and sampling options: shared by `generate` and `chat`."""
    _add_engine_args(g)
    g.add_argument("--system", default=None, help="a system message (uses the chat template)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    _add_acceptance_arg(g)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_engine_args(g: argparse.ArgumentParser) -> None:
    """Model, heads, tree, policy and lookup options: what builds an `Engine`."""
    from .scheduler.policies import POLICIES
    from .scheduler.profiles import PROFILE_TASKS
    from .shipped import HEAD_KINDS

    g.add_argument(
        "--heads",
        default=None,
        help=f"{' | '.join(HEAD_KINDS)} | none | PATH (default: shipped heads, if any)",
    )
    g.add_argument(
        "--tree",
        default=None,
        help='a static tree: name (see `entmtp trees`) or JSON file of paths; "L0" elements are prompt-lookup '
        'nodes, e.g. [[0], [0, "L0"], ["L0"]] (default: the scheduler, see --policy)',
    )
    g.add_argument(
        "--policy",
        default=None,
        choices=POLICIES,
        help="tree scheduling policy (default: the one the profile recommends; static = the profile's EntMTP*)",
    )
    g.add_argument(
        "--profile",
        default=None,
        help=f"scheduler profile: {' | '.join(PROFILE_TASKS)} (shipped) or a JSON file "
        "from `entmtp calibrate` (default: mixed)",
    )
    add_lookup_arguments(g)
    _add_model_args(g, auto_dtype=True)
    g.add_argument(
        "--no-probe",
        action="store_true",
        help="do not measure this machine's step costs (cached after the first run, ~10-20 s): use the "
        "profile's stored latencies (also: ENTMTP_NO_PROBE=1)",
    )


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", help="the prompt; - or nothing reads it from stdin")
    g.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    _add_generation_args(g)
    g.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.set_defaults(func=cmd_generate)


def _add_chat(sub) -> None:
    ch = sub.add_parser("chat", help="an interactive multi-turn chat (one turn per line when piped)")
    _add_generation_args(ch)
    ch.set_defaults(func=cmd_chat)


def _add_serve(sub) -> None:
    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (chat, completions, streaming, metrics)"
    )
    _add_engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--model-name", default=None, help="the model id clients see (default: the --model value)"
    )
    sv.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests generating together as one continuous batch, every row's tree verified in one forward "
        "(default 8); requests join and leave between steps. Above 1 the engine runs without CUDA graphs and "
        "weighs trees by this machine's batched step costs (measured once, ~20-30 s; not with --no-probe). "
        "1: one request at a time, as before",
    )
    sv.add_argument(
        "--max-queue", type=int, default=8, help="requests that may wait past --max-batch; more get 503"
    )
    sv.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes")
    sv.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds open requests may still run before they are cut (default 30)",
    )
    sv.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="close a connection that sends no complete request headers within this many seconds",
    )
    sv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="answer 408 and close a connection whose request body has not all arrived this many seconds "
        "after its headers (default 30)",
    )
    sv.add_argument("--no-access-log", action="store_true", help="no log line per request on stderr")
    from .accept import SAMPLED_CHOICES

    sv.add_argument(
        "--acceptance",
        dest="request_acceptance",
        default="auto",
        choices=SAMPLED_CHOICES,
        help="the acceptance rule of requests at temperature > 0 (default auto: lossless tree rejection "
        "sampling, the output distribution of plain sampling; typical: Medusa's typical acceptance, which "
        "accepts more drafts but is not lossless: its text repeats itself more, see docs/results/sampling; gumbel: "
        "lossless Gumbel-max sampling with the heads drafting under the same noise, a seed's text the same "
        "with or without speculation); "
        "each rule runs its profile section's policy",
    )
    from .server.ray_config import add_ray_arguments

    add_ray_arguments(sv)
    # the profile's greedy section picks the engine's policy; requests at T > 0 run their rule's section's
    sv.set_defaults(func=cmd_serve, temperature=0.0)


def _add_doctor(sub) -> None:
    dr = sub.add_parser(
        "doctor", help="versions, device, caches, shipped heads and profiles, optional extras"
    )
    dr.add_argument("--json", action="store_true")
    dr.add_argument(
        "--probe",
        action="store_true",
        help="also build the default engine: measure this machine's step costs if not cached (~20 s), and "
        "print the dtype and policy it chooses and why",
    )
    _add_threads_arg(dr)
    dr.set_defaults(func=cmd_doctor)


def _add_trees(sub) -> None:
    t = sub.add_parser("trees", help="list the named trees")
    t.set_defaults(func=cmd_trees)


def _add_step_costs(sub) -> None:
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
    _add_model_args(p)
    p.set_defaults(func=cmd_step_costs)


def _add_bench(sub) -> None:
    b = sub.add_parser(
        "bench", help="tokens/s and tokens/step against plain decoding, per task (table + JSON)"
    )
    _add_bench_methods_args(b)
    add_lookup_settings(b)
    b.add_argument("--replay", action="store_true", help="also replay the policies and the oracle (greedy)")
    b.add_argument(
        "--no-probe",
        action="store_true",
        help="size policies and lookup branches by the profiles' stored latencies, not this machine's measured "
        "step costs",
    )
    b.add_argument(
        "--defaults",
        action="store_true",
        help="also run plain decoding in the other CPU dtype, `default` (what `entmtp generate` builds: auto "
        "dtype, this machine's costs, lookup) and `previous-default` (bf16, mixed profile, stored latencies)",
    )
    b.add_argument("--temperature", type=float, default=0.0)
    _add_acceptance_arg(b)
    b.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    _add_bench_workload_args(b)
    b.add_argument(
        "--out",
        default=None,
        help="directory for results.json, report.md and the plots (default: runs/bench-DATE-TIME)",
    )
    b.add_argument("--no-progress", action="store_true")
    b.add_argument(
        "--render",
        metavar="RUN",
        default=None,
        help="run nothing: write RUN/report.md again from RUN/results.json (today's legend and columns, the "
        "same plots); RUN may also name a results file (X-results.json -> X-report.md)",
    )
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)


def _add_bench_methods_args(b: argparse.ArgumentParser) -> None:
    """What `bench` runs: heads, static trees, policies, peers and lookup-only decoding."""
    from .scheduler.policies import POLICIES
    from .shipped import HEAD_KINDS

    b.add_argument(
        "--heads", default="hydra,medusa", help=f"comma list: {', '.join(HEAD_KINDS)} or heads directories"
    )
    b.add_argument(
        "--trees",
        default=None,
        help="static trees (comma list; HEADS:TREE for one heads only; default: mc_sim_7b_63 (the published "
        "default) for each heads and hydra:tree_8; --quick: hydra:mc_sim_7b_63; '' for none)",
    )
    b.add_argument(
        "--policies",
        default=None,
        help=f"scheduling policies (comma list of {','.join(POLICIES)}, each optionally +lookup; "
        "HEADS:POLICY for one heads only; default: every policy for hydra and dynamic+lookup, EntMTP* (static) "
        "for medusa; --quick: hydra's static, dynamic and dynamic+lookup; '' for none)",
    )
    b.add_argument(
        "--profile", default="auto", help="auto (each task's shipped profile, else mixed) | TASK | FILE"
    )
    b.add_argument(
        "--peers",
        default=None,
        help="peer decoders on the same prompt ids (comma list): hf-generate (transformers' generate), "
        "hf-prompt-lookup (its prompt lookup decoding, 10 tokens), llama-cpp (plain decoding of the GGUF; "
        "needs `pip install llama-cpp-python`); default: the first two (--quick: hf-prompt-lookup)",
    )
    b.add_argument(
        "--lookup-only",
        default=None,
        help="entmtp prompt lookup without heads (comma list; default adaptive): adaptive (branch sized per step), fixed; "
        "TREE+lookup in --trees and POLICY+lookup in --policies add a lookup branch to heads configs",
    )


def _add_bench_workload_args(b: argparse.ArgumentParser) -> None:
    """What `bench` decodes: tasks or a prompt file, how many prompts and tokens."""
    b.add_argument("--tasks", default=",".join(TASKS), help="comma list (default: all of them)")
    b.add_argument(
        "--prompts",
        default=None,
        help="benchmark your own prompts instead of --tasks: a JSONL file with a 'prompt' or 'turns' field per line",
    )
    b.add_argument("--split", default="test", choices=["calib", "test"])
    b.add_argument("--num-prompts", type=int, default=None, help="prompts per task (default 10; --quick 2)")
    b.add_argument("--max-new-tokens", type=int, default=None, help="default 128; --quick 48")
    b.add_argument(
        "--quick",
        action="store_true",
        help="2 prompts per task, 48 tokens, the main methods (peer prompt lookup, lookup, Hydra mc_sim_7b_63, "
        "EntMTP*, dynamic, dynamic+lookup): about 7 minutes for all 11 tasks on a 2-core CPU",
    )


def _add_calibrate(sub) -> None:
    from .calibration.command import add_calibrate_arguments, run_calibrate

    c = sub.add_parser(
        "calibrate", help="build a task's scheduler profile (tree bank, frontiers, thresholds)"
    )
    add_calibrate_arguments(c)
    _add_model_args(c)
    c.set_defaults(func=lambda a: (_setup_torch(a), run_calibrate(a))[1])


def _add_train_heads(sub) -> None:
    from .train import add_train_arguments, run_train

    tr = sub.add_parser("train-heads", help="train Medusa or Hydra heads by self-distillation")
    add_train_arguments(tr)
    # --data-dir's default, relative to the working directory (a source checkout's root): the shared data
    # directory beside the checkout, plus the project's own prompts once scripts/build_training_prompts.py
    # has built data/train/. The library assumes no folder of its own.
    train_data = ["../shared/data"] + (["data"] if Path("data/train").is_dir() else [])
    tr.set_defaults(func=run_train, data_dir=",".join(train_data))


def _add_eval_heads(sub) -> None:
    from .train import add_eval_arguments, run_eval

    ev = sub.add_parser(
        "eval-heads",
        help="evaluate heads per task and dev category against the shipped ones (accuracy, tokens per step, tokens/s)",
    )
    add_eval_arguments(ev)
    ev.set_defaults(func=run_eval)


_SUBCOMMANDS = (
    _add_generate,
    _add_chat,
    _add_serve,
    _add_doctor,
    _add_trees,
    _add_step_costs,
    _add_bench,
    _add_calibrate,
    _add_train_heads,
    _add_eval_heads,
)  # in the order `entmtp --help` lists them


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="entmtp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"entmtp {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show library logs and progress bars (transformers)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(sub)
    return parser


def _quiet_libraries() -> None:
    """No transformers / Hub logs or progress bars (e.g. "Loading weights") unless -v: stdout stays ours."""
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what reports quote as the command
    if not args.verbose:
        _quiet_libraries()
    try:
        return args.func(args)
    except EntMTPError as e:
        print(f"entmtp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
