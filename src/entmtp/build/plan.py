"""What `build` decided and why, in words (`Plan`: `entmtp doctor` and `generate -v` print it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..accept import ACCEPTANCE
from ..backends import describe_weights, weights_format
from ..backends.registry import DEFAULT, REGISTRY, split
from ..costs.curves import CostCurve
from ..engine import Engine
from ..lookup import Lookup
from ..routing import Router
from .composed import Composed
from .loaded import Loaded
from .spec import EngineSpec


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
    backend: str = DEFAULT.name
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


def weights_key(loaded: Loaded) -> str:
    """The weights' format of a loaded candidate (backends.weights_format), or, before a real model is
    loaded, the one its spec asks for."""
    found = weights_format(loaded.model)
    if found is not None:
        return found
    return "GGUF as given" if loaded.spec.gguf_as_given else loaded.spec.dtype


def weights_words(loaded: Loaded) -> str:
    return describe_weights(loaded.model) if weights_format(loaded.model) else weights_key(loaded)


def heads_words(loaded: Loaded, composed: Composed) -> str:
    if not composed.uses_heads:
        return "none"
    note = REGISTRY[loaded.spec.backend].heads_note(loaded.spec)  # llama.cpp: heads and weights differ there
    return f"{loaded.heads_spec}, computing in {loaded.spec.dtype}" + (f" ({note})" if note else "")


def unmixed(options: dict, chosen: str) -> str:
    """The route line where another backend was measured but decodes other weights ("": none was)."""
    mine = weights_key(options[chosen].loaded)
    others = sorted({weights_key(o.loaded) for c, o in options.items() if split(c)[0] != split(chosen)[0]})
    if not others:
        return ""
    return (
        f"none: {split(chosen)[0]} decodes {mine} weights and the other backend {', '.join(others)}, so every "
        "request runs on one weights format (--mixed-weights routes between them by prompt length)"
    )


def unprobed_costs(costs: CostCurve | None, composed: Composed, lookup: Lookup | None) -> str:
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


def reasons_for(spec: EngineSpec, backend: str, candidates: list[str], cached: str | None, speeds: dict[str, float],
         unmeasured: dict[str, float] | None = None):  # fmt: skip
    """(why this dtype, why this backend) for the plan; `unmeasured`: candidates not measured, by the most
    expected tokens/s they could have reached (`_best_cases`)."""
    if cached is not None:
        why = "measured earlier on this machine (dtype-choices.json in the cost cache holds the choice)"
        return why, why
    if len(candidates) > 1:
        one_backend = len({split(c)[0] for c in candidates}) == 1  # then the dtypes alone name the candidates
        name = (lambda c: split(c)[1]) if one_backend else (lambda c: c)
        why = "most expected tokens/s here: " + ", ".join(f"{name(c)} {s:.1f}" for c, s in speeds.items())
        if unmeasured:
            why += "; not measured, at most: " + ", ".join(
                f"{name(c)} {b:.1f}" for c, b in unmeasured.items()
            )
        return why, why
    reason = "CUDA" if spec.device.startswith("cuda") else "as asked" if spec.dtype != "auto" else None
    reason = reason or REGISTRY[backend].only_reason(spec)
    return reason, "as asked" if spec.backend != "auto" else single_backend_reason(spec)


def single_backend_reason(spec: EngineSpec) -> str:
    """Why `backend auto` measured one backend: why each other one does not fit `spec` here."""
    return "; ".join(b.why_not(spec) for b in REGISTRY.values() if b is not DEFAULT)
