"""The cost cache: what a measured curve or surface belongs to (`cost_key`), where it is kept, and reading and
writing it. Files live under `$ENTMTP_CACHE/costs/`, one per key digest, written atomically; a file whose key
is not the one asked for (another machine, model, heads, plan of sizes, acceptance rule or way of measuring)
is measured again, never used (measured.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from .. import __version__
from ..accept import Sampling
from ..backends import backend_of
from ..files import write_text_atomic
from ..machine import digest, hardware, heads_checksum, model_fingerprint
from ..packing import PackedLinear
from .curves import CostCurve, CostRecord, CostsError, CostSurface

# How the probe times a step, part of every key: a curve measured another way is measured again. 2: the
# engine's own prepare / forward / conclude under the generation's acceptance rule (1: the probe's own copy of
# the step, greedy acceptance whatever the rule). 3: a step without heads asks the backend for no hidden
# states (llama.cpp's embeddings off), as the engine's own lookup-only and plain steps now do.
PROBE = 3


def cost_key(model, heads, graphs: bool = False, sampling: Sampling | None = None, sizes=(), **plan) -> dict:
    """Everything that changes what a step costs: the machine, the model, its dtype and packing, the heads,
    CUDA graphs, the acceptance rule, and the plan of sizes measured (`sizes`, and `plan`'s other entries)."""
    key = {
        "graphs": graphs,
        "hardware": hardware(model),
        "model": model_fingerprint(model),
        "packed": any(isinstance(m, PackedLinear) for m in model.modules()),
        "heads": None
        if heads is None
        else {
            "kind": heads.config.kind,
            "num_heads": heads.config.num_heads,
            "checksum": heads_checksum(heads),
            **({"int8": True} if getattr(heads, "int8", False) else {}),  # drafting from int8 copies
        },
        "versions": {"entmtp": __version__, "torch": torch.__version__},
        "probe": PROBE,
        "acceptance": (sampling or Sampling()).rule,
        "probe_sizes": list(sizes),  # a curve cached under another plan of sizes is measured again
        **{k: list(v) for k, v in plan.items()},
    }
    key |= backend_of(model).cost_key(model)  # llama.cpp: its own kernels, build and weights format
    return key


def costs_dir() -> Path:
    from ..model import cache_dir

    return cache_dir() / "costs"


def cost_path(key: dict) -> Path:
    return costs_dir() / f"{digest(key)}.json"


def uses_graphs(model, graphs: bool = True) -> bool:
    """Whether an engine over `model` verifies with CUDA graphs (the engine's rule: on CUDA, with the
    preallocated cache)."""
    from ..cache import preallocation_blocker

    return graphs and model.device.type == "cuda" and preallocation_blocker(model) is None


def probing_disabled() -> bool:
    return os.environ.get("ENTMTP_NO_PROBE", "").strip() not in ("", "0", "false", "no")


def read_record(path: str | os.PathLike[str], cls: type[CostRecord]):
    """A cached record of type `cls` (a curve, surface, prefill or choice cost); a file that cannot be read, is
    not JSON, is JSON but not an object (`null`, `[]`), or is not that record raises CostsError naming the file
    (`cached` then measures it again)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise TypeError(f"it holds a JSON {type(data).__name__}, not an object")
        return cls.from_json(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # JSON and Unicode: ValueErrors
        raise CostsError(
            f"{cls.KIND} {p} is unreadable ({type(e).__name__}: {e}): delete it to measure again"
        ) from e


def load_curve(path: str | os.PathLike[str]) -> CostCurve:
    return read_record(path, CostCurve)


def save_record(record, path: Path) -> None:
    """Write a measured record (a curve, surface, prefill or choice cost: anything with `to_json`) to the
    cache, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record.to_json(), indent=1) + "\n")


save_curve = save_surface = save_record  # the names the callers of curves and surfaces use


def load_surface(path: Path) -> CostSurface:
    return read_record(path, CostSurface)


def cached(path: Path, key: dict, cls: type[CostRecord]):
    """The `cls` record at `path` if it exists and was measured for `key` (None: measure it); an unreadable
    file is named on stderr and measured again."""
    if not path.exists():
        return None
    try:
        found = read_record(path, cls)
    except CostsError as e:
        print(f"entmtp: {e}; measuring again", file=sys.stderr)
        return None
    return found if found.key == json.loads(json.dumps(key)) else None


def cached_or_measured(cls: type[CostRecord], path: Path, key: dict, measure, *, refresh: bool = False):
    """The `cls` record measured for `key` on this machine: the cached one at `path`, or `measure()` now,
    written there (`refresh`: measured again whatever the cache holds). Every cost record goes through here."""
    found = None if refresh else cached(path, key, cls)
    if found is None:
        found = measure()
        save_record(found, path)
    return found
