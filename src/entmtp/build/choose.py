"""Choose: each (backend, dtype) candidate loaded and composed, the fastest kept, and requests routed by prompt
length between it and the other backend's best where both decode the same weights."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..backends import describe_kernels
from ..backends.registry import at, split
from ..console import say
from ..costs import CostCurve, prefill_for, probing_disabled
from ..costs.candidates import choice_key, read_choices, route_key, save_choices
from ..engine import Engine
from ..model import DTYPES
from ..routing import Lane, Router
from ..scheduler.profiles import ProfileError
from .bounds import tighten
from .composed import Composed, assemble, compose
from .loaded import Loaded, Loader
from .plan import Built, Plan, heads_words, reasons_for, unmixed, unprobed_costs, weights_key, weights_words
from .spec import EngineSpec, candidates, check_spec, heads_spec

AUTO_BUDGET_S = 12.0  # per dtype candidate when `auto` measures two (one probe: costs.BUDGET_S)
QUICK_PROBE_S = 1.0  # a candidate's plain step, timed before any curve: its best case (`_best_cases`)


def build_engine(spec: EngineSpec = EngineSpec(), *, log=None) -> Engine | Router:
    """The engine `spec` names (see build/__init__.py)."""
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
    `loader`: models loaded already (the bench shares its own); `max_batch`: also measure the chosen one's cost
    surface of batches up to that many rows (`Built.loaded.surface`: a server's batches weigh their trees by
    it; None where nothing is probed or the backend steps no batch); `log(str)`: notes for the user (default:
    stderr)."""
    log = log or say
    check_spec(spec)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    loader = loader or Loader()
    probe = spec.probe and not probing_disabled()
    cands = candidates(spec, probe)
    key = choice_key(spec, heads_spec(spec)) if len(cands) > 1 and probe else None
    choices = read_choices(say) if key is not None else {}  # read once: a bad file is named once
    cached = choices.get(key) if choices.get(key) in cands else None
    second = choices.get(route_key(key)) if cached is not None else None
    if cached is not None and second is not None:  # the route's other candidate too ("": none), to route
        cands = [cached] + ([second] if route and second in cands and second != cached else [])
    bounds = _best_cases(loader, spec, cands, route, log) if probe and cached is None else {}
    options = _measure(loader, spec, cands, bounds, log)
    speeds = {c: option.composed.expected for c, option in options.items()}
    chosen = cached if cached in speeds else max(speeds, key=speeds.get)
    loaded, composed = options[chosen].loaded, options[chosen].composed
    if max_batch:  # the chosen one's batched steps (the others' are never run): same model, costs read again
        loaded = loader.load(at(spec, chosen), max_batch=max_batch)
    engine = assemble(loaded, composed, spec)
    other = _other_backend(options, chosen, spec.mixed_weights)
    router, route_note = route_between(spec, options, chosen, other, engine) if route else (None, "")
    if route and other is None:
        route_note = unmixed(options, chosen) or route_note
    if not route and (other or second):
        route_note = (
            f"off: every request on {split(chosen)[0]} (asked for one engine: a server batches on one)"
        )
    if key is not None and (cached is None or second is None):
        save_choices({key: chosen, route_key(key): other or ""})
    unmeasured = {c: bound for c, (_, bound) in bounds.items() if c not in speeds}
    reason, backend_reason = reasons_for(spec, split(chosen)[0], cands, cached, speeds, unmeasured)
    plan = Plan(
        split(chosen)[1], reason, composed.name, composed.reason, composed.costs, speeds, composed.others,
        composed.lookup_rules, split(chosen)[0], backend_reason, route_note,
        "" if probe else unprobed_costs(composed.costs, composed, spec.lookup),
        weights_words(loaded), heads_words(loaded, composed), spec.threads or torch.get_num_threads(),
        describe_kernels(loaded.model),
    )  # fmt: skip
    return Built(router or engine, plan, loaded, composed)


def _measure(loader: Loader, spec: EngineSpec, cands: list[str], bounds: dict, log) -> dict:
    """candidate -> `_Option` for each candidate that may still win: the most promising first (`bounds`:
    `_best_cases`), each skipped once its best case is below the leader's measured speed (where it is not, a
    tighter one first: `bounds.tighten`, written into `bounds`), or once a second copy of the model would not
    fit in memory."""
    if bounds:  # the most promising first, so that the others can stop at their bound
        cands = sorted(cands, key=lambda c: -bounds[c][1] if c in bounds else float("-inf"))
    options: dict[str, _Option] = {}
    for n, cand in enumerate(cands, 1):
        first = next(iter(options.values()), None)
        if first and not loader.has(at(spec, cand)) and not _room_for_another(first.loaded.model, cand):
            log(f"not comparing {cand}: a second copy of the model would not fit in free memory")
            break
        leader = max(options, key=lambda c: options[c].composed.expected, default=None)
        if cand in bounds and leader is not None:
            lead = options[leader].composed.expected
            how = tighten(loader, spec, cand, bounds, lead, log)
            if bounds[cand][1] < lead:
                log(f"not measuring {cand}: at most {bounds[cand][1]:.1f} tokens/s here ({how}), below "
                    f"{leader}'s {lead:.1f}")  # fmt: skip
                continue
        budget = AUTO_BUDGET_S if len(cands) > 1 else None
        if cand in bounds:
            log(f"weighing {cand}, candidate {n} of {len(cands)} (once: later runs read the choice)")
        try:
            options[cand] = _load(loader, spec, cand, budget, log)
        except ProfileError as e:  # a written weight format the heads' profile was not made for (F16's
            if len(cands) == 1 or (n == len(cands) and not options):  # rounded embeddings): not compared
                raise
            why = e.args[0][:80]
            log(f"not comparing {cand}: the heads' scheduler profile was not made for its weights ({why}...)")
    return options


@dataclass
class _Option:
    """One (backend, dtype) candidate, loaded and composed."""

    loaded: Loaded
    composed: Composed


def _best_cases(loader: Loader, spec: EngineSpec, candidates: list[str], route: bool, log=None) -> dict:
    """candidate -> (its plain step's ms, the most expected tokens/s it could reach) for each candidate whose
    curve is not cached, before any curve is measured: the plain step timed briefly (QUICK_PROBE_S) and every
    tree priced as if verifying it cost one plain step, which no tree beats. None where nothing may be skipped:
    one candidate, or a route that needs the other backend measured (named dtype, --mixed-weights). `log(str)`:
    the line that says so before the candidates load."""
    if len(candidates) < 2 or (route and (spec.mixed_weights or spec.dtype != "auto")):
        return {}
    if log is not None:
        log(f"loading {len(candidates)} candidates and timing each one's plain step briefly, to measure only "
            "those that can win here (once)")  # fmt: skip
    from ..costs import measured

    out, first = {}, None
    for cand in candidates:
        cand_spec = at(spec, cand)
        if first is not None and not loader.has(cand_spec) and not _room_for_another(first.model, cand):
            break
        bare = loader.load(
            replace(cand_spec, probe=False)
        )  # the model (shared with the measured load), no curve
        first = first or bare
        if bare.costs is not None:
            continue  # its curve is cached: measuring it costs nothing
        # without heads: a plain step with them costs more (llama.cpp's embeddings on), and one without may win
        plain = measured.measure(bare.model, None, sizes=(0,), contexts=(128,), budget_s=QUICK_PROBE_S,
                                 progress=False).plain_ms  # fmt: skip
        flat = CostCurve((0, 64), (plain, plain), (0.0, 0.0), source="best case")
        best = compose(replace(bare, costs=flat), spec, log=lambda _: None).expected
        out[cand] = (plain, best)
    return out


def _load(loader: Loader, spec: EngineSpec, cand: str, budget, log) -> _Option:
    loaded = loader.load(at(spec, cand), budget_s=budget)
    return _Option(loaded, compose(loaded, spec, log=log))


def _other_backend(options: dict[str, _Option], chosen: str, mixed: bool = False) -> str | None:
    """The candidate with the most expected tokens/s on the backend `chosen` is not on, decoding the same
    weights unless `mixed` (None: no such candidate)."""
    mine = weights_key(options[chosen].loaded)
    others = [
        c
        for c in options
        if split(c)[0] != split(chosen)[0] and (mixed or weights_key(options[c].loaded) == mine)
    ]
    return max(others, key=lambda c: options[c].composed.expected) if others else None


def route_between(spec: EngineSpec, options: dict, chosen: str, other: str | None, engine: Engine):
    """(a Router over `chosen`'s engine and `other`'s, or None; the plan's route line). No route without a
    second backend measured, or when the two tokenize differently (a user GGUF's own vocabulary)."""
    if other is None:
        return None, ""
    first, second = options[chosen], options[other]
    if not same_tokenizer(first.loaded.tokenizer, second.loaded.tokenizer):
        why = f"{split(other)[0]} tokenizes differently, so every request runs on {split(chosen)[0]}"
        return None, f"none: {why}"
    engines = (engine, assemble(second.loaded, second.composed, spec))
    lanes = [
        Lane(split(c)[0], e, _prefill(o), o.composed.expected, weights_words(o.loaded), _latency(o))
        for c, o, e in zip((chosen, other), (first, second), engines, strict=True)
    ]
    router = Router(*lanes)
    return router, router.describe()


def _latency(option: _Option):
    """ms of a step by drafted nodes on `option`'s backend (what a request's prediction is priced on), if known."""
    costs = option.composed.costs
    return costs.latency() if costs is not None else None


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


def _room_for_another(model, cand: str) -> bool:
    """Whether a copy of `model`'s weights in candidate `cand`'s dtype fits in half the memory free now (Linux;
    else yes)."""
    params = sum(p.numel() for p in model.parameters())
    need = params * torch.tensor([], dtype=DTYPES[split(cand)[1]]).element_size()
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        free = next(int(x.split()[1]) * 1024 for x in lines if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    return need < free / 2
