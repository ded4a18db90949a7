"""One way to build an engine: `EngineSpec` names what is wanted, `build` resolves it once.

Every face (the CLI's generate / chat / serve, the bench, library users) goes through here: model and dtype,
heads, a static tree or a scheduling policy from a profile, prompt lookup, and this machine's cost curve
(costs/). Every name is checked before a model loads. Building is two steps, so that a bench can load once
and compose each of its methods exactly as `generate` does:

  load     `load(spec) -> Loaded`: the model and tokenizer, the heads bound, moved and packed for it (once,
           before any probe times them), and the costs measured on that pair (the curve; the surface of
           batched steps when asked). A `Loader` keeps what it loaded, for the next spec on the same model.
  compose  `compose(loaded, spec) -> Composed`: one policy per acceptance rule, the prompt-lookup branch
           wrapped around each once, and why; `assemble` hands them to an `Engine`, which coerces nothing.

`build(spec)` loads and composes each (backend, dtype) candidate and keeps the fastest. Each rule lives in one
place:

  backend  `auto`: on a CPU, with llama-cpp-python installed and a GGUF to run (the embedded model's, or
           `--model X.gguf`), both transformers and llama.cpp are candidates, measured like dtypes; else
           transformers. A named backend is used as it is (backends/__init__.py). Requests are routed by
           prompt length (routing.py) between the kept candidate and the other backend's best only where
           the two decode the same weights, or where `mixed_weights` allows formats to mix.
  weights  A named dtype names the weights on every backend: transformers in that dtype, llama.cpp on a GGUF
           of that dtype (the embedded model's written once from its own file; a user's GGUF must be of it),
           so that `--dtype float32` decodes float32 weights whichever backend runs. `auto`: on CUDA bf16
           where supported (else fp16); on a CPU, each candidate (transformers in bf16 and float32,
           llama.cpp on the GGUF as given, e.g. the embedded Q4_1) is loaded and its cost curve measured
           (once: cached), and the one with the most expected tokens/s is kept (the choice is cached too):
           one weights format per engine, which the plan names. The heads on llama.cpp compute in the named
           dtype, or (auto) bf16 where the CPU has native bf16.
  heads    `None`: the shipped heads if any; `none`: plain decoding (or prompt lookup with `lookup`).
  policy   `--tree` alone: that static tree. Otherwise a policy from a profile (default: the shipped `mixed`
           profile and the policy it recommends), built on this machine's cost curve. When no bank tree is
           expected to beat a plain step here, the engine decodes plain steps (no heads' probe either):
           never slower than plain decoding by construction, up to the curve's accuracy.
  costs    measured here unless `probe=False` (or ENTMTP_NO_PROBE=1): then nothing is measured (or corrected),
           and the curve is this machine's cached one if it was measured before, else the profile's stored
           latencies, and a lookup branch is sized on `costs.CPU_COST` (another machine's: the plan says so).

Expected tokens/s of a (dtype, policy) pair: the best bank tree's simulated tokens per step on the profile's
calibration positions over its step cost on this curve (plain decoding: 1 / the plain step).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import metrics
from .accept import ACCEPTANCE, Sampling
from .backends import BACKENDS, describe_kernels, describe_weights, weights_format
from .costs import (
    CostCorrector,
    CostCurve,
    cached_curve,
    costs_dir,
    costs_for,
    prefill_for,
    probing_disabled,
    surface_for,
)
from .engine import Engine
from .errors import EntMTPError
from .files import write_text_atomic
from .lookup import Lookup, add_lookup_arguments, lookup_from_args
from .machine import auto_dtype, cpu_info, digest, native_bf16
from .model import DTYPES, is_embedded, is_gguf
from .policy import TreePolicy, static
from .routing import Lane, Router
from .scheduler.factory import section_policy
from .scheduler.hybrid import hybrid
from .scheduler.policies import POLICIES
from .scheduler.profiles import PROFILE_TASKS
from .settings import setting
from .shipped import HEAD_KINDS, default_heads
from .tree import Tree

DTYPE_CHOICES = ("auto", *DTYPES)
CPU_CANDIDATES = ("bfloat16", "float32")  # what `auto` compares on a CPU (fp16 matmuls are slow there)
AUTO_BUDGET_S = 12.0  # per dtype candidate when `auto` measures two (one probe: costs.BUDGET_S)
QUICK_PROBE_S = 1.0  # a candidate's plain step, timed before any curve: its best case (`_best_cases`)


@dataclass(frozen=True)
class EngineSpec:
    """What to build. Defaults are what `entmtp generate` does with no options. Each field but the generation's
    own two (temperature, acceptance: `GenerationOptions`' flags) is a flag of generate, chat and serve,
    made from its `setting` (settings.py; engine_args.py)."""

    model: str | None = setting(
        None, help="Hugging Face model id, local path or .gguf file (default: embedded SmolLM2)"
    )
    backend: str = setting(
        "auto",
        choices=BACKENDS,
        help="what runs the base model: transformers (PyTorch) or llama-cpp (llama.cpp's CPU kernels on a "
        "GGUF file, through llama-cpp-python); auto (default): on a CPU with llama-cpp-python installed, "
        "the one with the most expected tokens/s on this machine's measured step costs (cached)",
    )
    dtype: str = setting(
        "auto",
        choices=DTYPE_CHOICES,
        help="the weights' format on whichever backend runs (llama.cpp: a GGUF of that dtype, written once "
        "from the embedded model's). auto (default): on a CPU, the format with the most expected tokens/s on "
        "this machine's measured step costs (bf16 or float32 on transformers, the GGUF as given on "
        "llama.cpp; measured once and cached); bf16 on CUDA. float32: output identical to plain decoding, "
        "token for token",
    )
    device: str = setting("cpu", help="cpu or cuda[:N] (default cpu)")
    threads: int | None = setting(
        None,
        help="CPU threads of torch and of llama.cpp (default: torch's choice; under serve --ray: 1 a replica)",
    )
    heads: str | None = setting(
        None, help=f"{' | '.join(HEAD_KINDS)} | none | PATH (default: shipped heads, if any)"
    )
    tree: str | None = setting(
        None,
        help='a static tree: name (see `entmtp trees`) or JSON file of paths; "L0" elements are prompt-lookup '
        'nodes, e.g. [[0], [0, "L0"], ["L0"]] (default: the scheduler, see --policy)',
    )
    policy: str | None = setting(
        None,
        choices=POLICIES,
        help="tree scheduling policy (default: the one the profile recommends; static = the profile's EntMTP*)",
    )
    profile: str | None = setting(
        None,
        help=f"scheduler profile: {' | '.join(PROFILE_TASKS)} (shipped) or a JSON file from `entmtp calibrate` "
        "(default: mixed)",
    )
    # lookup.py; "auto" (the default, as `entmtp generate`'s): lookup drafts with the scheduled default (heads
    # and no tree), none for --heads none or a named tree; None: none; a Lookup: these
    lookup: Lookup | None | str = setting("auto", add=add_lookup_arguments, read=lookup_from_args)
    temperature: float = 0.0  # with `acceptance`, picks the profile's section (Profile.mode_for)
    acceptance: str = "auto"  # auto | greedy | sample | typical | gumbel (accept.Sampling)
    probe: bool = setting(
        True,
        help="do not measure this machine's step costs (~10-20 s, once): read them from the cost cache if they "
        "were measured before, else use the profile's stored latencies (also: ENTMTP_NO_PROBE=1)",
    )
    pack: bool = setting(
        True,
        help="on a CPU in bfloat16, leave the linear layers unpacked (packing: same outputs, faster steps)",
    )
    graphs: bool = setting(
        True, help="on CUDA, verify eagerly instead of replaying one captured CUDA graph per tree size"
    )
    draft_int8: bool = setting(
        True,
        help="on a CPU in bfloat16, draft from the heads' own bf16 weights instead of int8 copies of them "
        "(int8: the same outputs, about half the bytes a draft reads; heads/int8.py)",
    )
    suffix_cache: int = setting(
        0,
        flag="--suffix-cache",
        metavar="MB",
        help="draft from what earlier requests wrote (suffix.py, arctic-inference's suffix tree), in a cache of "
        "at most MB megabytes; lossless like every draft (default: 0, off)",
    )
    mixed_weights: bool = setting(
        False,
        help="with --dtype auto: route each request by its prompt length between backends even where they "
        "decode different weights (llama.cpp's Q4_1 GGUF for short prompts, transformers' bf16 for long "
        "ones), so that two requests may decode different numerics (default: off, one weights format per "
        "engine, routed only between backends that decode the same weights)",
    )
    gguf_as_given: bool = False  # llama.cpp runs the GGUF file as it is (`build` sets it for --dtype auto)
    gguf_format: str = (
        ""  # llama.cpp runs the embedded model written in this format (Q8_0, F16, BF16: `build`
    )
    # measures them under --dtype auto where AMX's kernels run; "" the file as given, or --dtype's)
    kv: str = setting(
        "auto",
        choices=("auto", "dynamic"),
        help="the KV cache: auto (default: preallocated where the model allows it) or dynamic "
        "(transformers' DynamicCache)",
    )

    def __post_init__(self):
        if isinstance(self.lookup, str):  # "auto": `entmtp generate`'s rule (lookup.lookup_from_args)
            if self.lookup != "auto":
                raise EntMTPError(f"lookup must be a Lookup, None or 'auto', got {self.lookup!r}")
            on = self.heads != "none" and self.tree is None
            object.__setattr__(self, "lookup", Lookup() if on else None)


@dataclass(frozen=True)
class Plan:
    """What `build` decided and why (`entmtp doctor` and `generate -v` print it)."""

    dtype: (
        str  # the compute dtype: transformers' weights, the heads' on llama.cpp (`weights` names the GGUF's)
    )
    dtype_reason: str  # why these weights
    policy: str  # a policy name, "tree <name>", "plain" or "lookup"
    policy_reason: str
    costs: CostCurve | None
    expected_tokens_per_second: dict[str, float] = field(default_factory=dict)  # per dtype candidate
    other_rules: dict[str, str] = field(default_factory=dict)  # acceptance rule -> its own policy's name
    lookup_rules: tuple[str, ...] = ()  # acceptance rules whose trees get prompt-lookup drafts
    backend: str = "transformers"
    backend_reason: str = "as asked"
    route: str = ""  # how requests are routed between backends by prompt length (routing.py); "": one backend
    costs_note: str = ""  # where the step costs came from when nothing was measured (--no-probe)
    weights: str = ""  # the weights the engine decodes, in words (backends.describe_weights)
    heads: str = ""  # the heads and the dtype they compute in ("none": plain or lookup decoding)
    threads: int = 0
    kernels: str = ""  # on llama.cpp: its build and whether its AMX kernels run (backends.describe_kernels)

    def describe(self) -> str:
        lines = [
            f"backend: {self.backend} ({self.backend_reason})",
            f"weights: {self.weights or self.dtype} ({self.dtype_reason})",
            *([f"llama.cpp: {self.kernels}"] if self.kernels else []),
            f"heads: {self.heads or 'none'}",
            f"threads: {self.threads}",
            f"policy: {self.policy} ({self.policy_reason})",
        ]
        if self.other_rules:
            rules = ", ".join(f"{rule}: {name}" for rule, name in self.other_rules.items())
            lines.append(f"other acceptance rules, each from its profile section: {rules}")
        if self.lookup_rules:
            off = [r for r in ACCEPTANCE if r not in self.lookup_rules]
            note = (
                f"; not {', '.join(off)} (it copies the text into itself there: --lookup adds them)"
                if off
                else ""
            )
            lines.append(f"prompt-lookup drafts: {', '.join(self.lookup_rules)}{note}")
        if self.costs is not None:
            lines.append(f"step costs ({self.costs.source}): {self.costs.summary()}")
        if self.costs_note:
            lines.append(f"step costs: {self.costs_note}")
        if self.route:
            lines.append(f"route: {self.route}")
        return "\n".join(lines)


@dataclass
class Built:
    engine: Engine | Router  # a Router over one engine per backend where requests are routed (`Plan.route`)
    plan: Plan
    loaded: Loaded | None = None  # the chosen candidate's model, heads and costs (`surface` for batching)
    composed: Composed | None = None  # its policies, one per acceptance rule


def build_engine(spec: EngineSpec = EngineSpec(), *, log=None) -> Engine | Router:
    """The engine `spec` names (see the module docstring)."""
    return build(spec, log=log).engine


def build(
    spec: EngineSpec = EngineSpec(),
    *,
    loader: Loader | None = None,
    max_batch: int | None = None,
    log=None,
    route: bool = True,
) -> Built:
    """The engine and the plan behind it: each (backend, dtype) candidate loaded (`load`) and composed
    (`compose`), the one with the most expected tokens/s kept. Where both backends were measured (`auto`),
    the engine is a `routing.Router` over the fastest candidate and the other backend's best, each request
    on the one its prompt length favours (`route=False`: the fastest alone, e.g. for a server's batches).
    `loader`: models loaded already (the bench shares its own); `max_batch`: also measure the cost surface of
    batches up to that many rows (`Built.loaded.surface`); `log(str)`: notes for the user (default: stderr)."""
    log = log or _say
    check_spec(spec)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    loader = loader or Loader()
    probe = spec.probe and not probing_disabled()
    candidates = _candidates(spec, probe)
    choice_key = _choice_key(spec, _heads_spec(spec)) if len(candidates) > 1 and probe else None
    choices = _read_choices() if choice_key is not None else {}  # read once: a bad file is named once
    cached = choices.get(choice_key)
    cached = cached if cached in candidates else None
    second = choices.get(_route_key(choice_key)) if cached is not None else None
    if cached is not None and second is not None:  # the route's other candidate too ("": none), to route
        candidates = [cached] + ([second] if route and second in candidates and second != cached else [])
    options: dict[str, _Option] = {}
    bounds = _best_cases(loader, spec, candidates, route) if probe and cached is None else {}
    if bounds:  # the most promising first, so that the others can stop at their bound
        candidates = sorted(candidates, key=lambda c: -bounds[c][1] if c in bounds else float("-inf"))
    for n, cand in enumerate(candidates, 1):
        first = next(iter(options.values()), None)
        if first and not loader.has(_at(spec, cand)) and not _room_for_another(first.loaded.model, cand):
            log(f"not comparing {cand}: a second copy of the model would not fit in free memory")
            break
        leader = max(options, key=lambda c: options[c].composed.expected, default=None)
        if cand in bounds and leader is not None and bounds[cand][1] < options[leader].composed.expected:
            log(
                f"not measuring {cand}: at most {bounds[cand][1]:.1f} tokens/s here (its plain step "
                f"{bounds[cand][0]:.1f} ms, every tree priced as one), below {leader}'s "
                f"{options[leader].composed.expected:.1f}"
            )
            continue
        budget = AUTO_BUDGET_S if len(candidates) > 1 else None
        if cand in bounds:
            log(
                f"measuring {cand}'s step costs ({n} of {len(candidates)}, at most {AUTO_BUDGET_S:.0f} s, once)"
            )
        options[cand] = _load(loader, spec, cand, budget, max_batch, log)
    speeds = {c: option.composed.expected for c, option in options.items()}
    chosen = cached if cached in speeds else max(speeds, key=speeds.get)
    backend, dtype = _split(chosen)
    unmeasured = {c: bound for c, (_, bound) in bounds.items() if c not in speeds}
    reason, backend_reason = _why(spec, backend, candidates, cached, speeds, unmeasured)
    loaded, composed = options[chosen].loaded, options[chosen].composed
    engine = assemble(loaded, composed, spec)
    other = _other_backend(options, chosen, spec.mixed_weights)
    router, route_note = route_between(spec, options, chosen, other, engine) if route else (None, "")
    if route and other is None:
        route_note = _unmixed(options, chosen) or route_note
    if not route and (other or second):
        route_note = f"off: every request on {backend} (asked for one engine: a server batches on one)"
    if choice_key is not None and (cached is None or second is None):
        _save_choices({choice_key: chosen, _route_key(choice_key): other or ""})
    plan = Plan(
        dtype, reason, composed.name, composed.reason, loaded.costs, speeds, composed.others,
        composed.lookup_rules, backend, backend_reason, route_note,
        "" if probe else _unprobed_costs(loaded.costs, composed, spec.lookup),
        _weights_words(loaded), _heads_words(loaded, composed), spec.threads or torch.get_num_threads(),
        describe_kernels(loaded.model),
    )  # fmt: skip
    return Built(router or engine, plan, loaded, composed)


def _weights_key(loaded: Loaded) -> str:
    """The weights' format of a loaded candidate (backends.weights_format), or, before a real model is
    loaded, the one its spec asks for."""
    found = weights_format(loaded.model)
    if found is not None:
        return found
    return "GGUF as given" if loaded.spec.gguf_as_given else loaded.spec.dtype


def _weights_words(loaded: Loaded) -> str:
    return describe_weights(loaded.model) if weights_format(loaded.model) else _weights_key(loaded)


def _heads_words(loaded: Loaded, composed: Composed) -> str:
    if not composed.uses_heads:
        return "none"
    dtype = loaded.spec.dtype
    if loaded.spec.backend == "llama-cpp":  # the heads' dtype differs from the weights' there
        why = (
            "as asked"
            if not (loaded.spec.gguf_as_given or loaded.spec.gguf_format)
            else _heads_dtype_reason()
        )
        return f"{loaded.heads_spec}, computing in {dtype} ({why})"
    return f"{loaded.heads_spec}, computing in {dtype}"


def _unmixed(options: dict[str, _Option], chosen: str) -> str:
    """The route line where another backend was measured but decodes other weights ("": none was)."""
    mine = _weights_key(options[chosen].loaded)
    others = sorted({_weights_key(o.loaded) for c, o in options.items() if _split(c)[0] != _split(chosen)[0]})
    if not others:
        return ""
    return (
        f"none: {_split(chosen)[0]} decodes {mine} weights and the other backend {', '.join(others)}, so every "
        "request runs on one weights format (--mixed-weights routes between them by prompt length)"
    )


def _unprobed_costs(costs: CostCurve | None, composed: Composed, lookup: Lookup | None) -> str:
    """Where the step costs come from when nothing was measured (--no-probe): this machine's cost cache, or
    nothing of this machine's: then a lookup branch sized by measured latencies is sized on another machine's."""
    if costs is not None:
        return "read from this machine's cost cache (--no-probe: nothing measured or corrected now)"
    note = "none of this machine's (--no-probe, and no curve of this model and heads in the cost cache)"
    if composed.lookup_rules and lookup is not None and lookup.node_cost is None:
        note += (
            "; the lookup branch is sized on costs.CPU_COST and costs.HEADS_DRAFT_COST, measured on other "
            "machines (a 2-core AMD EPYC's and a 2-core Intel Xeon's), not on this one: run once without "
            "--no-probe to measure this machine's (cached), or give --lookup-node-cost"
        )
    return note


def _other_backend(options: dict[str, _Option], chosen: str, mixed: bool = False) -> str | None:
    """The candidate with the most expected tokens/s on the backend `chosen` is not on, decoding the same
    weights unless `mixed` (None: no such candidate)."""
    mine = _weights_key(options[chosen].loaded)
    others = [
        c
        for c in options
        if _split(c)[0] != _split(chosen)[0] and (mixed or _weights_key(options[c].loaded) == mine)
    ]
    return max(others, key=lambda c: options[c].composed.expected) if others else None


def route_between(spec: EngineSpec, options: dict, chosen: str, other: str | None, engine: Engine):
    """(a Router over `chosen`'s engine and `other`'s, or None; the plan's route line). No route without a
    second backend measured, or when the two tokenize differently (a user GGUF's own vocabulary)."""
    if other is None:
        return None, ""
    first, second = options[chosen], options[other]
    if not same_tokenizer(first.loaded.tokenizer, second.loaded.tokenizer):
        why = f"{_split(other)[0]} tokenizes differently, so every request runs on {_split(chosen)[0]}"
        return None, f"none: {why}"
    engines = (engine, assemble(second.loaded, second.composed, spec))
    lanes = [
        Lane(_split(c)[0], e, _prefill(o), o.composed.expected, _weights_words(o.loaded))
        for c, o, e in zip((chosen, other), (first, second), engines, strict=True)
    ]
    router = Router(*lanes)
    return router, router.describe()


def _prefill(option: _Option):
    """The prefill cost of `option`'s engine (measured once and cached): with its heads when it drafts."""
    heads = option.loaded.heads if option.composed.uses_heads else None
    return prefill_for(option.loaded.model, heads)


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids for every text and chat: one vocabulary, one template."""
    if a is b:
        return True
    try:
        return (
            a.get_vocab() == b.get_vocab()
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
            and a.all_special_ids == b.all_special_ids
        )
    except AttributeError:
        return False


def _why(spec: EngineSpec, backend: str, candidates: list[str], cached: str | None, speeds: dict[str, float],
         unmeasured: dict[str, float] | None = None):  # fmt: skip
    """(why this dtype, why this backend) for the plan; `unmeasured`: candidates not measured, by the most
    expected tokens/s they could have reached (`_best_cases`)."""
    if cached is not None:
        why = "measured earlier on this machine (dtype-choices.json in the cost cache holds the choice)"
        return why, why
    if len(candidates) > 1:
        one_backend = (
            len({_split(c)[0] for c in candidates}) == 1
        )  # then the dtypes alone name the candidates
        name = (lambda c: _split(c)[1]) if one_backend else (lambda c: c)
        why = "most expected tokens/s here: " + ", ".join(f"{name(c)} {s:.1f}" for c, s in speeds.items())
        if unmeasured:
            why += "; not measured, at most: " + ", ".join(
                f"{name(c)} {b:.1f}" for c, b in unmeasured.items()
            )
        return why, why
    reason = "CUDA" if spec.device.startswith("cuda") else "as asked" if spec.dtype != "auto" else None
    reason = reason or (
        "the GGUF file as given: --dtype names float weights"
        if backend == "llama-cpp"
        else "the only candidate"
    )
    return reason, "as asked" if spec.backend != "auto" else _single_backend_reason(spec)


def _say(msg: str) -> None:
    print(f"entmtp: {msg}", file=sys.stderr)


def check_spec(spec: EngineSpec) -> None:
    """Every name in `spec` that can be checked before a model loads."""
    if spec.dtype not in DTYPE_CHOICES:
        raise EntMTPError(f"unknown dtype {spec.dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
    if spec.policy is not None and spec.policy not in POLICIES:
        raise EntMTPError(f"unknown policy {spec.policy!r}: use one of {', '.join(POLICIES)}")
    if spec.backend not in BACKENDS:
        raise EntMTPError(f"unknown backend {spec.backend!r}: use one of {', '.join(BACKENDS)}")
    if spec.suffix_cache < 0:
        raise EntMTPError(f"--suffix-cache is megabytes (0: off), got {spec.suffix_cache}")
    if spec.suffix_cache:
        from .suffix import arctic

        arctic()  # not installed: one line that says how
    if spec.backend == "llama-cpp":
        from .backends.llama_cpp import import_llama_cpp

        import_llama_cpp()  # not installed: one line that says how
        if not (is_embedded(spec.model) or is_gguf(spec.model)):
            raise EntMTPError(
                f"--backend llama-cpp runs GGUF files: give --model FILE.gguf (not {spec.model!r}), or "
                "omit --model for the embedded model's GGUF"
            )
        if not spec.device.startswith("cpu"):
            raise EntMTPError("--backend llama-cpp runs on the CPU here: drop --device, or use transformers")
    if spec.mixed_weights and spec.dtype != "auto":
        raise EntMTPError(
            f"--mixed-weights routes between weights formats, and --dtype {spec.dtype} names one: drop one of them"
        )
    if spec.kv not in ("auto", "dynamic"):
        raise EntMTPError(f"unknown kv cache {spec.kv!r}: use 'auto' or 'dynamic'")
    if spec.tree is not None:
        from .tree import load_tree

        load_tree(spec.tree)  # a bad name or file fails here, with the tree module's message


# ---- load: the model, its heads and this machine's costs, once --------------------------------------------


@dataclass
class Loaded:
    """A model loaded once with one heads ready for it, and this machine's costs for the pair: what `compose`
    makes policies on, as many times as asked (the bench composes every method on one)."""

    spec: EngineSpec  # what was loaded, backend and dtype concrete (never `auto`)
    model: object
    tokenizer: object
    heads: object | None  # bound, on the model's device and dtype, packed like it (shipped.bind_heads)
    heads_spec: str  # medusa | hydra | none | a heads directory: the spec's, or the shipped default
    costs: CostCurve | None  # ms per step by drafted nodes, measured with these heads (None: not measured)
    surface: object | None = None  # surface.CostSurface of batched steps, when loaded for batching
    # False: --no-probe (`costs` read from the cache, or None): nothing measured or corrected
    probed: bool = True


class Loader:
    """Loads each (model, backend, dtype, device) once and each heads on it once, with their costs: `build`
    and the bench share one, so every method they compose runs on the same loaded weights."""

    def __init__(self):
        self._bases: dict[tuple, tuple] = {}  # base key -> (model, tokenizer)
        self._loaded: dict[tuple, Loaded] = {}

    def has(self, spec: EngineSpec) -> bool:
        """Whether `spec`'s model is loaded already (backend and dtype concrete)."""
        return _base_key(spec) in self._bases

    def load(
        self, spec: EngineSpec, *, budget_s: float | None = None, max_batch: int | None = None
    ) -> Loaded:
        """See `load`; what was loaded before is reused."""
        spec = _concrete(spec)
        probe = spec.probe and not probing_disabled()
        key = (_base_key(spec), _heads_spec(spec), probe, spec.graphs, spec.kv, spec.draft_int8, max_batch)
        if key not in self._loaded:
            if not self.has(spec):
                self._bases[_base_key(spec)] = load_base(spec, spec.backend, spec.dtype)
            model, tokenizer = self._bases[_base_key(spec)]
            self._loaded[key] = _ready(spec, model, tokenizer, probe, budget_s, max_batch)
        return self._loaded[key]


def load(
    spec: EngineSpec = EngineSpec(), *, budget_s: float | None = None, max_batch: int | None = None
) -> Loaded:
    """`spec`'s model and tokenizer, its heads bound, moved and packed for the model before anything times
    them, and this machine's step costs for the pair (measured once and cached, unless `spec.probe` is off or
    ENTMTP_NO_PROBE=1; `budget_s`: a first measurement's time) and, with `max_batch`, the cost surface of
    batched steps up to that many rows. An `auto` backend or dtype is the unmeasured default (transformers;
    bf16 on a CPU): `build` measures the candidates and keeps the fastest."""
    check_spec(spec)
    return Loader().load(spec, budget_s=budget_s, max_batch=max_batch)


def _ready(spec: EngineSpec, model, tokenizer, probe: bool, budget_s: float | None, max_batch: int | None):
    """`Loaded` for a loaded model: the heads ready first (shipped.bind_heads), then the probes time them."""
    from .shipped import default_heads_for, resolve_heads

    # unnamed heads: the shipped ones where they fit this model, else none (one line says so)
    heads_spec = spec.heads if spec.heads is not None else default_heads_for(model, spec.model, _say)
    # bound, packed, int8 for drafting where asked: heads made for another model fail here
    heads = resolve_heads(heads_spec, model, int8=spec.draft_int8)
    kwargs = {} if budget_s is None else {"budget_s": budget_s}
    sampling = Sampling(spec.temperature, spec.acceptance)  # steps priced under the rule they will run
    if probe:
        costs = costs_for(model, heads, graphs=spec.graphs, sampling=sampling, **kwargs)
    else:  # nothing measured: this machine's curve if it was measured before
        costs = cached_curve(model, heads, graphs=spec.graphs, sampling=sampling)
    surface = None
    if probe and max_batch and _batchable(spec, model):
        surface = surface_for(model, heads, max_batch=max_batch, sampling=sampling)
    return Loaded(spec, model, tokenizer, heads, heads_spec, costs, surface, probe)


def _batchable(spec: EngineSpec, model) -> bool:
    """Whether the engine can step a batch of rows over `model` (batch.py: the preallocated cache of
    transformers); else the server serves one request at a time and no surface is measured."""
    from .cache import preallocation_blocker

    return spec.backend == "transformers" and spec.kv == "auto" and preallocation_blocker(model) is None


def _heads_spec(spec: EngineSpec) -> str:
    return spec.heads if spec.heads is not None else default_heads()


def _concrete(spec: EngineSpec) -> EngineSpec:
    """`spec` with an `auto` backend or dtype made the unmeasured default (`_candidates` without a probe)."""
    if "auto" not in (spec.backend, spec.dtype):
        return spec
    return _at(spec, _candidates(spec, probe=False)[0])


def _at(spec: EngineSpec, cand: str) -> EngineSpec:
    """`spec` with the candidate "backend/dtype[:format]"'s backend, dtype and GGUF format."""
    backend, dtype = _split(cand)
    as_given = spec.gguf_as_given or (backend == "llama-cpp" and spec.dtype == "auto")
    fmt = cand.partition(":")[2]
    return replace(spec, backend=backend, dtype=dtype, gguf_as_given=as_given and not fmt, gguf_format=fmt)


def _base_key(spec: EngineSpec) -> tuple:
    return (spec.model, spec.backend, spec.dtype, spec.device, spec.pack, spec.threads, spec.gguf_as_given,
            spec.gguf_format)  # fmt: skip


# ---- compose: one policy per acceptance rule -------------------------------------------------------------


@dataclass
class Composed:
    """The policies an engine runs, one per acceptance rule, and why (what `Plan` reports)."""

    policies: dict[str, TreePolicy]  # every rule of accept.ACCEPTANCE -> the policy its generations run
    rule: str  # the spec's own rule (its temperature and acceptance)
    name: str  # the rule's policy: a policy name, "tree <name>", "plain" or "lookup"
    reason: str
    expected: float  # tokens/s expected of the rule's policy on the loaded costs (0: not measured)
    others: dict[str, str]  # rules with a policy from their own profile section -> its name
    lookup_rules: tuple[str, ...]  # rules whose trees get prompt-lookup drafts
    uses_heads: bool  # whether any policy drafts with the heads (else the engine runs without them)
    observers: tuple = ()  # told each generation's steps: the cost curve's corrector (costs.CostCorrector)

    @property
    def policy(self) -> TreePolicy:
        return self.policies[self.rule]


def compose(loaded: Loaded, spec: EngineSpec = EngineSpec(), *, profile=None, log=None) -> Composed:
    """One policy per acceptance rule on `loaded` (the module docstring's `policy`): each rule's own from its
    profile section (a tree is the same for all), made a policy once (`_as_policy`), and the prompt-lookup
    branch wrapped around it once where `spec.lookup` asks for it under that rule (scheduler.hybrid, sized on
    `loaded.costs`). `profile`: one resolved for `spec.profile` and checked against `loaded` already (the bench
    reads each once); None: resolved and checked here. The cost curve's corrector observes the generations."""
    inner, name, reason, expected, others = _policy(spec, loaded, profile, log or _say)
    main = _as_policy(inner)
    inners = {r: _as_policy(others[r][0]) if r in others else main for r in ACCEPTANCE}
    uses_heads = loaded.heads is not None and any(_drafts(p) for p in inners.values())
    lookup = spec.lookup
    # typical acceptance gets lookup drafts only when asked (Lookup.typical) or without heads
    rules = tuple(
        r for r in ACCEPTANCE if lookup is not None and (r != "typical" or not uses_heads or lookup.typical)
    )
    wrapped: dict[int, TreePolicy] = {}  # id(inner) -> its wrap: rules that share a policy share its wrap
    for r in rules:
        if id(inners[r]) not in wrapped:
            wrapped[id(inners[r])] = hybrid(inners[r], lookup, loaded.costs)
    policies = {r: wrapped[id(inners[r])] if r in rules else inners[r] for r in ACCEPTANCE}
    rule = Sampling(spec.temperature, spec.acceptance).rule
    names = {r: n for r, (_, n) in others.items()}
    corrector = CostCorrector.for_curve(loaded.costs) if loaded.costs is not None and loaded.probed else None
    observers = (corrector,) if corrector is not None else ()
    return Composed(policies, rule, name, reason, expected, names, rules, uses_heads, observers)


def assemble(loaded: Loaded, composed: Composed, spec: EngineSpec = EngineSpec()) -> Engine:
    """The engine running `composed`'s policies on `loaded`'s model: with its heads when a policy drafts with
    them, and the costs the policies were sized on (steps that disagree with them correct the cached curve)."""
    return Engine(
        loaded.model,
        loaded.tokenizer,
        heads=loaded.heads if composed.uses_heads else None,
        policy=composed.policy,
        policies=composed.policies,
        kv=spec.kv,
        graphs=spec.graphs,
        costs=loaded.costs,
        observers=composed.observers,
        suffix=_suffix_cache(spec),
    )


def _suffix_cache(spec: EngineSpec):
    if not spec.suffix_cache:
        return None
    from .suffix import SuffixCache

    return SuffixCache(max_bytes=spec.suffix_cache * 2**20)


def _as_policy(inner: str | TreePolicy | None) -> TreePolicy:
    """The one place a name from the user becomes a policy: a spec's tree name (`--tree`) or a tree (a profile
    section's when no bank tree beats a plain step here: the root alone) the static policy of that tree, None
    (no heads, no tree) plain decoding, a profile section's policy itself."""
    if inner is None:
        return static(Tree.root_only())
    return static(inner) if isinstance(inner, (str, Tree)) else inner


def _drafts(policy: TreePolicy) -> bool:
    """Whether any tree `policy` may verify (its master included) has head nodes."""
    master = [policy.master] if policy.master is not None else []
    return any(t.heads_tree.num_nodes for t in (*policy.trees, *master))


@dataclass
class _Option:
    """One (backend, dtype) candidate, loaded and composed."""

    loaded: Loaded
    composed: Composed


def _best_cases(loader: Loader, spec: EngineSpec, candidates: list[str], route: bool) -> dict:
    """candidate -> (its plain step's ms, the most expected tokens/s it could reach) for each candidate whose
    curve is not cached, before any curve is measured: the plain step timed briefly (QUICK_PROBE_S) and every
    tree priced as if verifying it cost one plain step, which no tree beats. None where nothing may be skipped:
    one candidate, or a route that needs the other backend measured (named dtype, --mixed-weights)."""
    if len(candidates) < 2 or (route and (spec.mixed_weights or spec.dtype != "auto")):
        return {}
    from .costs import measured

    out, first = {}, None
    for cand in candidates:
        at = _at(spec, cand)
        if first is not None and not loader.has(at) and not _room_for_another(first.model, cand):
            break
        bare = loader.load(replace(at, probe=False))  # the model (shared with the measured load), no curve
        first = first or bare
        if bare.costs is not None:
            continue  # its curve is cached: measuring it costs nothing
        plain = measured.measure(bare.model, bare.heads, sizes=(0,), contexts=(128,), budget_s=QUICK_PROBE_S,
                                 progress=False).plain_ms  # fmt: skip
        flat = CostCurve((0, 64), (plain, plain), (0.0, 0.0), source="best case")
        best = compose(replace(bare, costs=flat), spec, log=lambda _: None).expected
        out[cand] = (plain, best)
    return out


def _load(loader: Loader, spec: EngineSpec, cand: str, budget, max_batch, log) -> _Option:
    loaded = loader.load(_at(spec, cand), budget_s=budget, max_batch=max_batch)
    return _Option(loaded, compose(loaded, spec, log=log))


def _policy(spec: EngineSpec, loaded: Loaded, profile, log):
    """(tree or policy, its name, why, expected tokens/s, {other acceptance rule: (policy, name)}) on `loaded`.
    A policy from a profile has one per rule, each from the profile's section for it (a server's requests
    differ in temperature); a tree is the same under every rule. `profile`: see `compose`."""
    heads_spec, model, heads, costs = loaded.heads_spec, loaded.model, loaded.heads, loaded.costs
    plain_speed = metrics.replay_tokens_per_second(1, costs.plain_ms) if costs is not None else 0.0
    if heads is None:
        name = (
            "lookup" if spec.lookup is not None else ("plain" if spec.tree is None else f"tree {spec.tree}")
        )
        return spec.tree, name, "no heads", plain_speed, {}
    if spec.tree is not None and spec.policy in (None, "static"):
        return spec.tree, f"tree {spec.tree}", "as asked", _tree_speed(spec.tree, costs), {}
    from .scheduler.profiles import ProfileError, resolve_profile, shipped_profiles_dir

    if profile is None:
        if spec.profile is None and heads_spec not in HEAD_KINDS:
            if spec.policy is not None:
                raise EntMTPError(
                    f"--policy {spec.policy} needs a profile for these heads: make one with `entmtp calibrate "
                    f"--heads {heads_spec} --task TASK --out P.json` and pass --profile P.json"
                )
            log("no --profile for these heads: using the static tree tree_8")
            return "tree_8", "tree tree_8", "no profile for these heads", _tree_speed("tree_8", costs), {}
        if spec.profile is None and not (shipped_profiles_dir(heads_spec) / "mixed.json").exists():
            log(f"no shipped scheduler profile for {heads_spec} heads: using the static tree tree_8")
            return "tree_8", "tree tree_8", "no shipped profile", _tree_speed("tree_8", costs), {}
        profile = resolve_profile(spec.profile, heads_spec)
        profile.check(model, heads, warn_hardware=costs is None)
    rule = Sampling(spec.temperature, spec.acceptance).rule
    mode = profile.mode_for_rule(rule)
    policy, name, reason, expected = section_policy(profile, mode, costs, spec.policy)
    others, built = {}, {}  # rules that share a section (gumbel runs sample's) share its policy
    for other in ACCEPTANCE:
        other_mode = profile.mode_for_rule(other)
        if other == rule or other_mode == mode:
            continue
        if other_mode not in built:
            try:
                built[other_mode] = section_policy(profile, other_mode, costs, spec.policy)[:2]
            except ProfileError as e:  # a forced --policy this section cannot build: the rule runs `policy`
                log(f"{other} acceptance runs the {rule} policy: {e}")
                continue
        others[other] = built[other_mode]
    return policy, name, reason, expected, others


def _tree_speed(tree: str, costs: CostCurve | None) -> float:
    """A forced tree accepts the same under any dtype: its speed ranks dtypes by its step cost alone."""
    if costs is None:
        return 0.0
    from .tree import load_tree

    return metrics.replay_tokens_per_second(1, float(costs.latency()(load_tree(tree).num_nodes)))


def load_base(spec: EngineSpec, backend: str, dtype: str):
    """(model, tokenizer) of `spec.model` on `backend` in `dtype`: transformers' model, or a GGUF file on
    llama.cpp (`spec.model` a .gguf, else the embedded model's GGUF with its converted tokenizer)."""
    if backend == "llama-cpp":
        from .backends.llama_cpp import load_gguf
        from .model import embedded_model_dir

        embedded = is_embedded(spec.model)
        if spec.gguf_format:
            path = _embedded_in_format(spec.gguf_format)
        else:
            path = gguf_for(spec.model, None if spec.gguf_as_given else dtype)
        tokenizer_dir = str(embedded_model_dir()) if embedded else None
        return load_gguf(path, dtype=DTYPES[dtype], threads=spec.threads, tokenizer_dir=tokenizer_dir)
    from .model import load_model

    return load_model(spec.model, dtype=dtype, device=spec.device, pack=spec.pack)


def gguf_for(model: str | None, dtype: str | None) -> str:
    """The GGUF file llama.cpp runs for `model` (None: the embedded model): the file as given (`dtype` None),
    else one whose weights are `dtype`'s: the embedded model's written once in that dtype from its own file
    (backends.llama_cpp.embedded_gguf_in), a user's file when it is of that dtype (else a clear error)."""
    from .backends.llama_cpp import FLOAT_GGUF_TYPES, embedded_gguf_in, gguf_weights
    from .model import embedded_gguf

    if is_embedded(model):
        return str(embedded_gguf() if dtype is None else embedded_gguf_in(dtype))
    held = gguf_weights(model) if dtype is not None else None  # the file's type, read once
    if dtype is not None and held != FLOAT_GGUF_TYPES.get(dtype):
        raise EntMTPError(
            f"{model} holds {held} weights and --dtype {dtype} names {dtype} weights: drop --dtype (llama.cpp "
            f"runs the file as it is), or give a GGUF of {dtype} weights"
        )
    return model


def _embedded_in_format(fmt: str) -> str:
    """The embedded model's GGUF written in `fmt` (written once, checked by loading its header); a file that
    cannot be written or read: one line, and the shipped Q4_1 file."""
    from .backends.llama_cpp import embedded_gguf_as, read_gguf
    from .model import embedded_gguf

    try:
        path = embedded_gguf_as(fmt)
        read_gguf(path)
        return str(path)
    except (OSError, EntMTPError, ValueError) as e:
        _say(
            f"the embedded model's {fmt} GGUF could not be written or read ({e}): llama.cpp decodes the shipped "
            f"Q4_1 file instead (delete the file named there to have it written again)"
        )
        return str(embedded_gguf())


def _split(cand: str) -> tuple[str, str]:
    """A candidate "backend/dtype[:format]" as (backend, dtype)."""
    backend, _, dtype = cand.partition("/")
    return backend, dtype.partition(":")[0]


def _gguf_formats(spec: EngineSpec) -> tuple[str, ...]:
    """The other formats llama.cpp's candidates decode the embedded model in under --dtype auto: on a CPU whose
    AMX kernels run (a float or 8-bit format's batch curve is flatter there, so trees may pay), each of
    WRITTEN_FORMATS, measured like a dtype; elsewhere none (the Q4_1 file as given)."""
    from .backends.amx import extra_bufts_safe, has_amx
    from .backends.llama_cpp import WRITTEN_FORMATS
    from .model import embedded_gguf

    if spec.dtype != "auto" or not is_embedded(spec.model) or not has_amx():
        return ()
    return WRITTEN_FORMATS if extra_bufts_safe(embedded_gguf()) else ()


def _backends(spec: EngineSpec) -> list[str]:
    if spec.backend != "auto":
        return [spec.backend]
    from .backends.llama_cpp import available

    gguf = is_embedded(spec.model) or is_gguf(spec.model)
    if spec.device.startswith("cpu") and gguf and available() and _gguf_fits_dtype(spec):
        return ["transformers", "llama-cpp"]
    return ["transformers"]


def _gguf_fits_dtype(spec: EngineSpec) -> bool:
    """Whether llama.cpp can decode the weights `spec.dtype` names: any GGUF under `auto` (as given), the
    embedded model's in any float dtype (written from it), a user's file only in its own float type."""
    if spec.dtype == "auto" or is_embedded(spec.model):
        return True
    from .backends.llama_cpp import FLOAT_GGUF_TYPES, LlamaCppError, gguf_weights

    try:
        return gguf_weights(spec.model) == FLOAT_GGUF_TYPES.get(spec.dtype)
    except LlamaCppError:
        return True  # a bad file: loading it says so


def _single_backend_reason(spec: EngineSpec) -> str:
    from .backends.llama_cpp import LLAMA_CPP_HINT, available

    if not spec.device.startswith("cpu"):
        return "llama.cpp runs on the CPU only here"
    if not available():
        return f"llama-cpp-python is not installed ({LLAMA_CPP_HINT})"
    if is_gguf(spec.model) and not _gguf_fits_dtype(spec):
        return f"llama.cpp would decode other weights than --dtype {spec.dtype} names (the GGUF's own)"
    return "llama.cpp needs a GGUF model" if spec.model else "nothing measured (--no-probe)"


def _heads_dtype_reason() -> str:
    return "native bf16 on this CPU" if native_bf16() else "no native bf16 on this CPU"


def _candidates(spec: EngineSpec, probe: bool) -> list[str]:
    """ "backend/dtype" pairs `build` measures (one: nothing to compare)."""
    out = []
    backends = _backends(spec) if probe or spec.backend != "auto" else ["transformers"]
    for backend in backends:
        if backend == "llama-cpp":
            heads_dtype = spec.dtype if spec.dtype != "auto" else auto_dtype("cpu")
            out.append(f"llama-cpp/{heads_dtype}")
            if probe:
                out += [f"llama-cpp/{heads_dtype}:{fmt}" for fmt in _gguf_formats(spec)]
        else:
            out += [f"transformers/{d}" for d in _dtype_candidates(spec, probe)]
    return out


def _dtype_candidates(spec: EngineSpec, probe: bool) -> list[str]:
    if spec.dtype != "auto":
        return [spec.dtype]
    if spec.device.startswith("cuda"):
        return ["bfloat16" if torch.cuda.is_bf16_supported() else "float16"]
    if not probe:
        return ["bfloat16"]  # nothing measured: the dtype that is faster on most CPUs for one-token steps
    return list(CPU_CANDIDATES)


def _room_for_another(model, cand: str) -> bool:
    """Whether a copy of `model`'s weights in candidate `cand`'s dtype fits in half the memory free now (Linux;
    else yes)."""
    params = sum(p.numel() for p in model.parameters())
    need = params * torch.tensor([], dtype=DTYPES[_split(cand)[1]]).element_size()
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        free = next(int(x.split()[1]) * 1024 for x in lines if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    return need < free / 2


# ---- the cached dtype choice ------------------------------------------------------------------------------


def _route_key(choice_key: str | None) -> str | None:
    """Where the route's second candidate is cached beside the choice (absent in a cache from before routing:
    then every candidate is loaded again, on its cached curve, to find it)."""
    return None if choice_key is None else f"route:{choice_key}"


def _choices_path():
    return costs_dir() / "dtype-choices.json"


def _choice_key(spec: EngineSpec, heads_spec: str) -> str:
    cpu = cpu_info()
    return digest(
        {
            "cpu": cpu,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "model": spec.model,
            "backend": spec.backend,
            "dtype": spec.dtype,
            "mixed_weights": spec.mixed_weights,
            "heads": heads_spec,
            "tree": spec.tree,
            "policy": spec.policy,
            "profile": spec.profile,
            "pack": spec.pack,
            "temperature": spec.temperature > 0,
        }
    )


def _read_choices(say=_say) -> dict:
    """The cached choices (an empty cache where the file is missing; one line to `say` naming a file that
    cannot be used, which is then written afresh)."""
    path = _choices_path()
    try:
        choices = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # JSON and Unicode errors are ValueErrors
        say(f"{path} is unreadable ({type(e).__name__}): measuring again, and writing it afresh")
        return {}
    if not isinstance(choices, dict) or not all(isinstance(v, str) for v in choices.values()):
        say(f"{path} holds no choices (not a JSON object of names): measuring again, and writing it afresh")
        return {}
    return choices


def _save_choice(key: str, dtype: str) -> None:
    _save_choices({key: dtype})


def _save_choices(new: dict[str, str]) -> None:
    """`new` choices into the cache file, beside those another process may have written since it was read
    (read again, silently: a file that could not be used was named when it was read first)."""
    choices = _read_choices(say=lambda m: None) | new
    path = _choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(choices, indent=1) + "\n")
