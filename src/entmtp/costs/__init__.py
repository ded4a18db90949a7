"""The machine part of a schedule: what a verification step costs here, measured, cached and corrected.

A profile (scheduler/profiles.py) holds what belongs to the task: traces, the acceptance model, the candidate
trees and how many tokens each accepts per step. What a tree *costs* belongs to the machine (CPU model and
flags, GPU, threads, dtype, packing, model and heads), and differs a lot across machines: a 4-node tree costs
1.1 plain steps on a 2-core CPU with native bf16 and 2.8 on one with AVX2 only. So policies and the lookup
hybrid are built on this machine's measured curve (scheduler/factory.py: `profile_policy(profile, ...,
latency=curve.latency())`), and the same shipped profile gives small trees on a small CPU and big ones on a GPU.

The rooms:
  curves.py     the types the policies read (`LatencyModel`, `CostCurve`, `CostSurface`) and the fallback
                costs of another machine (`CPU_COST`, `HEADS_DRAFT_COST`); a leaf
  probe.py      the probe: times the engine's own steps (prepare / forward / conclude) on synthetic trees
  measured.py   the plans and the measurements: `costs_for` / `measure` (a curve), `surface_for` /
                `measure_surface` (a batched surface), measured once, then read from the cache
  cache.py      the cost cache: keys (`cost_key`), paths, reading and writing
  choice.py     what a policy's choice costs per step here (`choice_for`), measured in the engine's steps and
                cached beside the curve: the replays charge it (calibration/replay.py)
  corrector.py  `CostCorrector`: rewrites a cached curve's point when generations' steps disagree with it
  fill.py       the sizes a probe had no time for, filled in from the ones it measured
  prefill.py    `PrefillCost`: a prompt's prefill by its length (`prefill_for`), what routing.py reads
"""

from .cache import (
    cost_key,
    cost_path,
    costs_dir,
    load_curve,
    load_surface,
    probing_disabled,
    save_curve,
    save_surface,
    uses_graphs,
)
from .choice import ChoiceCost, cached_choice, choice_for, measure_choice
from .corrector import CostCorrector
from .curves import (
    CPU_COST,
    FORMAT,
    HEADS_DRAFT_COST,
    SURFACE_FORMAT,
    CostCurve,
    CostsError,
    CostSurface,
    LatencyModel,
    priced_ms,
    relative_cost,
)
from .measured import BATCHES, SIZES, cached_curve, costs_for, measure, measure_surface, surface_for
from .prefill import PrefillCost, measure_prefill, prefill_for
from .probe import Probe, synthetic_tree

__all__ = [
    "BATCHES",
    "CPU_COST",
    "FORMAT",
    "HEADS_DRAFT_COST",
    "SIZES",
    "SURFACE_FORMAT",
    "ChoiceCost",
    "CostCorrector",
    "CostCurve",
    "CostSurface",
    "CostsError",
    "LatencyModel",
    "PrefillCost",
    "Probe",
    "cached_choice",
    "cached_curve",
    "choice_for",
    "cost_key",
    "cost_path",
    "costs_dir",
    "costs_for",
    "load_curve",
    "load_surface",
    "measure",
    "measure_choice",
    "measure_prefill",
    "measure_surface",
    "prefill_for",
    "priced_ms",
    "relative_cost",
    "probing_disabled",
    "save_curve",
    "save_surface",
    "surface_for",
    "synthetic_tree",
    "uses_graphs",
]
