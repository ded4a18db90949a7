"""The methods a bench compares, loaded once for all tasks and composed as `entmtp generate` composes its engine.

One `build.Loader` loads the model once per dtype (and llama.cpp's, for --defaults), each heads once on it,
bound and packed before this machine's step costs are measured with them. A method is an `EngineSpec` on
those: plain decoding and lookup without heads, a static tree (`+lookup`), a policy from the task's profile
(`+lookup`), and --defaults' `default` (the very `build` of `entmtp generate`, sharing the loaded models).
`build.compose` turns each into its policies, so the bench measures what `generate` runs; every engine of the
bench is built by `engine`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..backends.registry import REGISTRY
from ..build import EngineSpec, Loaded, Loader, assemble, compose
from ..engine import Engine
from ..heads import Heads
from ..lookup import Lookup
from ..scheduler.policies import POLICIES
from ..scheduler.profiles import Profile
from ..settings import from_args
from .peers import build_peers, llama_cpp_available
from .plan import LOOKUP_VARIANTS, Plan


def engine(loaded: Loaded, spec: EngineSpec, profile: Profile | None = None, log=None) -> Engine:
    """The one place the bench builds an `Engine`: `spec`'s policies composed on `loaded` by `build.compose`
    (what `entmtp generate` runs); `profile`: the one `spec.policy` comes from, read and checked once."""
    return assemble(loaded, compose(loaded, spec, profile=profile, log=log), spec)


@dataclass
class Methods:
    """Everything a bench runs, loaded. Method names are plain, peers, lookup variants and HEADS/ITEM."""

    plan: Plan
    loader: Loader
    spec: EngineSpec  # the command line's model, dtype, sampling and probe: every method's spec starts here
    loaded: dict[str, Loaded]  # "none" or heads spec -> the model with those heads, and their step costs
    labels: dict[str, str]  # heads spec -> the heads part of its methods' names
    static: dict[str, object] = field(
        default_factory=dict
    )  # method -> engine or peer, every task; plain first
    profiles: dict[tuple[str, str], Profile] = field(default_factory=dict)  # (heads spec, task) -> profile
    plans: dict[str, str] = field(default_factory=dict)  # --defaults: each built engine's plan, for the meta
    said: set[str] = field(default_factory=set)  # composition notes printed once, not once per task

    @property
    def model(self):
        return self.loaded["none"].model

    @property
    def tokenizer(self):
        return self.loaded["none"].tokenizer

    @property
    def heads(self) -> dict[str, Heads]:
        """Heads spec -> its loaded heads (bound to `model`, packed like it)."""
        return {k: x.heads for k, x in self.loaded.items() if k != "none"}

    @property
    def costs(self) -> dict:
        """ "none" or heads spec -> this machine's step costs with them (None: the profiles' latencies)."""
        return {k: x.costs for k, x in self.loaded.items()}

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
        for kind in self.heads:
            for item in self.policies(kind):
                engines[f"{self.labels[kind]}/{item}"] = self.engine(kind, item, task)
        return engines

    def method_spec(self, kind: str, item: str, task: str | None = None) -> EngineSpec:
        """The spec of heads `kind`'s method `item`: a policy (from `task`'s profile) or a static tree, each
        optionally `+lookup`."""
        name, lookup = self.plan.split_lookup(item)
        spec = replace(self.spec, heads=kind, lookup=lookup)
        if name not in POLICIES:
            return replace(spec, tree=name)
        return replace(spec, policy=name, profile=str(self.profiles[(kind, task)].path))

    def engine(self, kind: str, item: str, task: str | None = None) -> Engine:
        """Heads `kind`'s method `item` on `task` (see `method_spec`), through `engine`."""
        profile = self.profiles.get((kind, task))
        return engine(self.loaded[kind], self.method_spec(kind, item, task), profile, self.say)

    def policy(self, kind: str, item: str, task: str):
        """The greedy policy of heads `kind`'s method `item` on `task`, composed as its engine's is (a replay
        of plain greedy outputs runs it)."""
        spec = replace(self.method_spec(kind, item, task), temperature=0.0, acceptance="auto")
        return compose(self.loaded[kind], spec, profile=self.profiles[(kind, task)], log=self.say).policy

    def say(self, msg: str) -> None:
        if msg not in self.said:
            self.said.add(msg)
            print(f"entmtp: {msg}")


def load(plan: Plan) -> Methods:
    """Load the model and heads, measure (or read) this machine's step costs, and build the static methods,
    --defaults' engines and each heads' profiles."""
    args = plan.args
    # generate's flags the bench shares (model, dtype, device, threads, packing, graphs, probe); its --heads and
    # --profile name several, each method its own, and each method says its own lookup drafts
    spec = from_args(
        EngineSpec, args, heads=None, profile=None, lookup=None, temperature=args.temperature,
        acceptance=args.acceptance,
    )  # fmt: skip
    # this machine's step costs (costs/; measured once, cached): what policies and lookup branches are sized
    # by; with --no-probe or ENTMTP_NO_PROBE=1 nothing is measured: the curve cached here before, else the
    # profiles' stored latencies and, for the lookup-only rule, CPU_COST (another machine's; build.Plan says so)
    loader = Loader()
    loaded = {k: loader.load(replace(spec, heads=k)) for k in ("none", *plan.heads)}
    methods = Methods(plan, loader, spec, loaded, heads_labels(plan.heads))
    methods.profiles = {
        (k, t): _profile(methods, k, t) for k in plan.heads for t in plan.tasks if plan.policies(k)
    }
    methods.static = _static(methods)
    if args.defaults:
        defaults, methods.plans = _defaults(methods)
        methods.static |= defaults
    # the peers are loaded last, after every model of entmtp's: in one process a llama.cpp model loaded first
    # decoded 3-6% slower than the same file loaded after it (docs/results/never-slower/overhead, "load
    # order"), so whatever the order gives goes to the baselines; they keep their place after plain decoding
    peers = build_peers(plan.peers, methods.model, methods.tokenizer, embedded=args.model is None)
    static = list(methods.static.items())
    methods.static = dict(static[:1] + list(peers.items()) + static[1:])
    return methods


def heads_labels(specs: list[str]) -> dict[str, str]:
    """Method names' heads part: medusa, hydra, or a heads directory's name (its path if two share it)."""
    names = [Path(s).name for s in specs]
    return {s: n if names.count(n) == 1 else s for s, n in zip(specs, names, strict=True)}


def _static(m: Methods) -> dict[str, object]:
    """Plain decoding, lookup without heads, and every heads with each static tree (the peers join after
    plain decoding once every engine is built: `load`)."""
    plan, plain = m.plan, replace(m.spec, heads="none")
    static = {"plain": engine(m.loaded["none"], plain)}
    for x in plan.lookup_only:
        static[LOOKUP_VARIANTS[x]] = engine(m.loaded["none"], replace(plain, lookup=plan.lookup(x)))
    for kind in m.heads:
        for item in plan.trees(kind):
            static[f"{m.labels[kind]}/{item}"] = m.engine(kind, item)
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
    (`default@transformers`, `default@llama-cpp`), `default-routed` (`generate --mixed-weights`: each request
    routed by its length and its prediction between the Q4_1 GGUF on llama.cpp and transformers' bf16, routing.py)
    and llama.cpp's plain decoding and prompt lookup through entmtp's engine (`plain@llama-cpp`,
    `lookup@llama-cpp`). Every one on the bench's loaded models where they
    share one. Returns the engines by method name and the built engines' plans, for the results' meta."""
    from ..build import build

    args = m.plan.args
    other = replace(m.spec, heads="none", dtype="float32" if args.dtype == "bfloat16" else "bfloat16")
    engines = {f"plain@{other.dtype}": engine(m.loader.load(other), other)}
    spec = EngineSpec(model=args.model, device=args.device, threads=args.threads, lookup=Lookup())
    built = build(spec, loader=m.loader)
    engines["default"] = built.engine
    plans = {"default": built.plan.describe()}
    if args.model is None and llama_cpp_available() and args.device == "cpu":
        engines |= _llama_cpp_defaults(m, spec, plans)
    previous = replace(m.spec, heads="hydra", dtype="bfloat16", profile="mixed", probe=False)
    engines["previous-default"] = engine(m.loader.load(previous), previous, log=m.say)
    return engines, plans


def _llama_cpp_defaults(m: Methods, spec: EngineSpec, plans: dict[str, str]) -> dict[str, Engine]:
    """The default on each backend, and llama.cpp's plain decoding and prompt lookup (see `_defaults`)."""
    from ..build import build

    engines, llama = {}, None
    routed = build(replace(spec, mixed_weights=True), loader=m.loader)
    engines["default-routed"], plans["default-routed"] = routed.engine, routed.plan.describe()
    for backend in REGISTRY:  # every backend (the bench runs this where llama.cpp is installed)
        built = build(replace(spec, backend=backend), loader=m.loader)
        engines[f"default@{backend}"] = built.engine
        plans[f"default@{backend}"] = built.plan.describe()
        llama = built.loaded
    plain = replace(llama.spec, heads="none", lookup=None)
    heads_less = m.loader.load(plain)  # the same llama.cpp model, its curve without heads
    engines["plain@llama-cpp"] = engine(heads_less, plain)
    engines["lookup@llama-cpp"] = engine(heads_less, replace(plain, lookup=Lookup()))
    return engines
