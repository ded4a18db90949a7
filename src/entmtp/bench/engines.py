"""The methods a bench compares, loaded once for all tasks: the model, its heads, this machine's step costs, the
profiles, and an engine (or peer decoder) per method. Every engine of the bench is built by `engine`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from ..costs import CostCurve, costs_for, probing_disabled
from ..engine import Engine, default_tree
from ..heads import Heads
from ..lookup import Lookup
from ..scheduler.hybrid import hybrid
from ..scheduler.profiles import Profile
from ..shipped import resolve_heads
from .peers import build_peers, llama_cpp_available
from .plan import LOOKUP_VARIANTS, Plan


def engine(model, tokenizer, heads=None, tree=None, lookup: Lookup | None = None, costs=None) -> Engine:
    """The one place the bench builds an `Engine`: `tree` is a tree name or a policy, `lookup` adds a prompt
    lookup branch sized on `costs`, this machine's cost curve (None: the hybrid's `CPU_COST`)."""
    if lookup is not None:
        tree = hybrid(tree if tree is not None else default_tree(heads), lookup, costs)
    return Engine(model, tokenizer, heads=heads, tree=tree, costs=costs)


@dataclass
class Methods:
    """Everything a bench runs, loaded. Method names are plain, peers, lookup variants and HEADS/ITEM."""

    plan: Plan
    model: object
    tokenizer: object
    heads: dict[str, Heads]  # heads spec -> loaded heads (a spec that resolves to no heads is left out)
    labels: dict[str, str]  # heads spec -> the heads part of its methods' names
    costs: dict[str, CostCurve | None]  # "none" or heads spec -> step costs (None: the profiles' latencies)
    static: dict[str, object]  # method -> engine or peer decoder, the same on every task; plain first
    profiles: dict[tuple[str, str], Profile]  # (heads spec, task) -> the profile its policies come from
    plans: dict[str, str]  # --defaults: each built engine's plan, for the results' meta

    def policies(self, kind: str) -> list[str]:
        return self.plan.policies(kind)

    @property
    def count(self) -> int:
        """Methods run on every prompt, plain decoding included."""
        return len(self.static) + sum(len(self.policies(k)) for k in self.heads)

    @property
    def logged(self) -> str | None:
        """The method whose first generation with steps is kept step by step: the first policy, else the first
        static tree."""
        policy = next((f"{self.labels[k]}/{p}" for k in self.heads for p in self.policies(k)), None)
        return policy or next((n for n in self.static if "/" in n), None)

    def for_task(self, task: str) -> dict[str, object]:
        """The static methods, then every heads' policies built from the task's profile."""
        engines = dict(self.static)
        mode_args = (self.plan.args.temperature, self.plan.args.acceptance)
        for kind, heads in self.heads.items():
            profile, costs = self.profiles.get((kind, task)), self.costs[kind]
            for item in self.policies(kind):
                name, lookup = self.plan.split_lookup(item)
                latency = costs.latency() if costs is not None else None
                policy = profile.policy(name, profile.mode_for(*mode_args), latency=latency)
                engines[f"{self.labels[kind]}/{item}"] = self.engine(
                    heads=heads, tree=policy, lookup=lookup, costs=costs
                )
        return engines

    def engine(self, **kw) -> Engine:
        """An engine on the benchmarked model (see `engine`)."""
        return engine(self.model, self.tokenizer, **kw)


def load(plan: Plan) -> Methods:
    """Load the model and heads, measure (or read) this machine's step costs, and build the static methods,
    --defaults' engines and each heads' profiles."""
    from ..model import load_model

    args = plan.args
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, pack=not args.no_pack)
    heads = {kind: h for kind in plan.heads if (h := resolve_heads(kind, model)) is not None}
    # this machine's step costs (costs.py; measured once, cached): what policies and lookup branches are sized
    # by, unless --no-probe or ENTMTP_NO_PROBE=1 (then the profiles' stored latencies, and the lookup-only rule's CPU_COST)
    measured = not (args.no_probe or probing_disabled())
    costs = {k: costs_for(model, h) if measured else None for k, h in [("none", None), *heads.items()]}
    methods = Methods(plan, model, tokenizer, heads, heads_labels(list(heads)), costs, {}, {}, {})
    methods.static = _static(methods)
    if args.defaults:
        defaults, methods.plans = _defaults(methods)
        methods.static |= defaults
    methods.profiles = {
        (k, t): _profile(methods, k, t) for k in heads for t in plan.tasks if plan.policies(k)
    }
    return methods


def heads_labels(specs: list[str]) -> dict[str, str]:
    """Method names' heads part: medusa, hydra, or a heads directory's name (its path if two share it)."""
    names = [Path(s).name for s in specs]
    return {s: n if names.count(n) == 1 else s for s, n in zip(specs, names, strict=True)}


def _static(m: Methods) -> dict[str, object]:
    """Plain decoding, the peers, lookup without heads, and every heads with each static tree."""
    plan = m.plan
    static = {"plain": m.engine()}
    static |= build_peers(plan.peers, m.model, m.tokenizer, embedded=plan.args.model is None)
    for x in plan.lookup_only:
        static[LOOKUP_VARIANTS[x]] = m.engine(lookup=plan.lookup(x), costs=m.costs["none"])
    for kind, heads in m.heads.items():
        for item in plan.trees(kind):
            tree, lookup = plan.split_lookup(item)
            static[f"{m.labels[kind]}/{item}"] = m.engine(
                heads=heads, tree=tree, lookup=lookup, costs=m.costs[kind]
            )
    return static


def _profile(m: Methods, kind: str, task: str) -> Profile:
    """The profile heads `kind` run `task` with: --profile, or with `auto` the task's shipped one (else mixed),
    checked against the model and heads (its hardware warning only in bfloat16, the profiles' dtype)."""
    from ..scheduler.profiles import PROFILE_TASKS, resolve_profile

    args = m.plan.args
    spec = args.profile if args.profile != "auto" else (task if task in PROFILE_TASKS else "mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if args.dtype != "bfloat16" else "default")
        profile = resolve_profile(spec, kind)
        profile.check(m.model, m.heads[kind])
    return profile


def _defaults(m: Methods) -> tuple[dict[str, Engine], dict[str, str]]:
    """--defaults: add plain decoding in the other CPU dtype, `default` (what `entmtp generate` builds: auto
    backend and dtype, this machine's step costs, lookup drafts) and `previous-default` (before the measured
    defaults: bfloat16, the shipped `mixed` profile's recommended policy on its stored latencies, no lookup).
    With llama-cpp-python installed and the embedded model: the default built on each backend
    (`default@transformers`, `default@llama-cpp`), and llama.cpp's plain decoding and prompt lookup through
    entmtp's engine (`plain@llama-cpp`, `lookup@llama-cpp`). Returns the engines by method name and the built
    engines' plans, for the results' meta."""
    from ..build import EngineSpec, build
    from ..model import load_model
    from ..scheduler.profiles import resolve_profile

    args = m.plan.args
    other = "float32" if args.dtype == "bfloat16" else "bfloat16"
    m2, t2 = load_model(args.model, dtype=other, device=args.device, pack=not args.no_pack)
    engines = {f"plain@{other}": engine(m2, t2)}
    spec = EngineSpec(model=args.model, device=args.device, threads=args.threads, lookup=Lookup())
    built = build(spec)
    engines["default"] = built.engine
    plans = {"default": built.plan.describe()}
    if args.model is None and llama_cpp_available() and args.device == "cpu":
        engines |= _llama_cpp_defaults(spec, plans)
    old_model, old_tok = (m.model, m.tokenizer) if args.dtype == "bfloat16" else (m2, t2)
    profile = resolve_profile("mixed", "hydra")
    previous = profile.policy(profile.recommended_policy())
    engines["previous-default"] = engine(
        old_model, old_tok, heads=resolve_heads("hydra", old_model), tree=previous
    )
    return engines, plans


def _llama_cpp_defaults(spec, plans: dict[str, str]) -> dict[str, Engine]:
    """The default on each backend, and llama.cpp's plain decoding and prompt lookup (see `_defaults`)."""
    from dataclasses import replace

    from ..build import build

    engines = {}
    for backend in ("transformers", "llama-cpp"):
        built = build(replace(spec, backend=backend))
        engines[f"default@{backend}"] = built.engine
        plans[f"default@{backend}"] = built.plan.describe()
    llama = engines["default@llama-cpp"]
    model, tokenizer = llama.model, llama.tokenizer
    engines["plain@llama-cpp"] = engine(model, tokenizer)
    costs = llama.costs if llama.heads is None else None  # the heads-less curve is measured below
    if costs is None and not probing_disabled():
        costs = costs_for(model, None)
    engines["lookup@llama-cpp"] = engine(model, tokenizer, lookup=Lookup(), costs=costs)
    return engines
