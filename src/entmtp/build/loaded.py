"""Load: the model, its heads and this machine's costs, once (`Loader` keeps them for the next spec)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..accept import Sampling
from ..backends.registry import REGISTRY, backend_of, name_of
from ..console import say
from ..costs import CostCurve, cached_curve, costs_for, probing_disabled, surface_for
from ..model import DTYPES
from .spec import EngineSpec, base_key, check_spec, concrete, heads_spec

HEADS_LESS_BUDGET_S = 6.0  # measuring the curve without heads where no policy drafts with them (sizes past it
# are extrapolated; a lookup branch, what it prices, is at most `Lookup.tokens` nodes)


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
    heads_less: CostCurve | None = None  # the curve without heads, once `curve_without_heads` read it

    def curve_without_heads(self) -> CostCurve | None:
        """This model's cost curve with no heads: what an engine whose policies draft no head runs (no hidden
        states read, nothing drafted; on llama.cpp one drafted node costs ~1.8 plain steps either way, but
        the heads' steps keep the embeddings on). `costs` when no heads are loaded; else measured once like
        it and cached, or read from the cost cache when nothing is probed (None: never measured here)."""
        if self.heads is None:
            return self.costs
        if self.heads_less is None:
            sampling = Sampling(self.spec.temperature, self.spec.acceptance)
            kw = dict(graphs=self.spec.graphs, sampling=sampling)
            if self.probed:  # briefly: a first run measures the heads' curve already (the issue's ~20 s)
                what = f"{name_of(self.spec)}'s step costs without heads"
                curve = costs_for(self.model, None, budget_s=HEADS_LESS_BUDGET_S, what=what, **kw)
            else:
                curve = cached_curve(self.model, None, **kw)
            self.heads_less = curve
        return self.heads_less


class Loader:
    """Loads each (model, backend, dtype, device) once and each heads on it once, with their costs: `build`
    and the bench share one, so every method they compose runs on the same loaded weights."""

    def __init__(self):
        self._bases: dict[tuple, tuple] = {}  # base key -> (model, tokenizer)
        self._loaded: dict[tuple, Loaded] = {}

    def has(self, spec: EngineSpec) -> bool:
        """Whether `spec`'s model is loaded already (backend and dtype concrete)."""
        return base_key(spec) in self._bases

    def load(
        self, spec: EngineSpec, *, budget_s: float | None = None, max_batch: int | None = None
    ) -> Loaded:
        """See `load`; what was loaded before is reused."""
        spec = concrete(spec)
        probe = spec.probe and not probing_disabled()
        key = (base_key(spec), heads_spec(spec), probe, spec.graphs, spec.kv, spec.draft_int8)
        if key not in self._loaded:
            if not self.has(spec):
                self._bases[base_key(spec)] = load_base(spec)
            model, tokenizer = self._bases[base_key(spec)]
            self._loaded[key] = _ready(spec, model, tokenizer, probe, budget_s)
        if not max_batch:
            return self._loaded[key]
        if (
            *key,
            max_batch,
        ) not in self._loaded:  # the same model, heads and curve, with the batches' surface
            self._loaded[(*key, max_batch)] = _with_surface(self._loaded[key], max_batch)
        return self._loaded[(*key, max_batch)]


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


def given(model, tokenizer, heads=None, spec: EngineSpec = EngineSpec(lookup=None, probe=False)) -> Loaded:
    """`Loaded` for a model and heads an offline command loaded itself (calibrate's and eval-heads' heads: a
    training run's or a directory's, bound to the model), with no costs measured: what `composed.fixed` makes
    engines on. `spec`: the engine's settings (its kv cache and graphs); its backend is the model's."""
    backend = backend_of(model)
    dtype = backend.weights_format(model)
    spec = replace(spec, backend=backend.name, dtype=dtype if dtype in DTYPES else spec.dtype, probe=False)
    return Loaded(spec, model, tokenizer, heads, "given" if heads is not None else "none", None, probed=False)


def load_base(spec: EngineSpec):
    """(model, tokenizer) of a concrete `spec` (backend and dtype named) on its backend (backends/registry.py)."""
    return REGISTRY[spec.backend].load(spec)


def _ready(spec: EngineSpec, model, tokenizer, probe: bool, budget_s: float | None) -> Loaded:
    """`Loaded` for a loaded model: the heads ready first (shipped.bind_heads), then the probes time them."""
    from ..shipped import default_heads_for, resolve_heads

    # unnamed heads: the shipped ones where they fit this model, else none (one line says so)
    heads_spec = spec.heads if spec.heads is not None else default_heads_for(model, spec.model, say)
    # bound, packed, int8 for drafting where asked: heads made for another model fail here
    heads = resolve_heads(heads_spec, model, int8=spec.draft_int8)
    kwargs = {} if budget_s is None else {"budget_s": budget_s}
    sampling = Sampling(spec.temperature, spec.acceptance)  # steps priced under the rule they will run
    if probe:
        what = f"{name_of(spec)}'s step costs" + (" with its heads" if heads is not None else "")
        costs = costs_for(model, heads, graphs=spec.graphs, sampling=sampling, what=what, **kwargs)
    else:  # nothing measured: this machine's curve if it was measured before
        costs = cached_curve(model, heads, graphs=spec.graphs, sampling=sampling)
    return Loaded(spec, model, tokenizer, heads, heads_spec, costs, None, probe)


def _with_surface(loaded: Loaded, max_batch: int) -> Loaded:
    """`loaded` with the cost surface of batches up to `max_batch` rows, measured on the same heads (or none:
    nothing probed, or a backend that steps no batch)."""
    spec = loaded.spec
    if not loaded.probed or not REGISTRY[spec.backend].batchable(spec, loaded.model):
        return loaded
    sampling = Sampling(spec.temperature, spec.acceptance)
    return replace(
        loaded, surface=surface_for(loaded.model, loaded.heads, max_batch=max_batch, sampling=sampling)
    )
