"""`entmtp doctor`: what this installation has and where it keeps things, for bug reports and setup checks."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch

from . import __version__
from .engine_args import setup_torch
from .machine import CPU_FLAGS, cpu_info, describe_record, record, versions
from .model import EMBEDDED, cache_dir
from .packing import bf16_supported
from .shipped import HEAD_KINDS, shipped_heads_dir

EXTRAS = {  # optional package -> what it enables
    "llama_cpp": "llama.cpp peer in `entmtp bench` (pip install llama-cpp-python; builds from source)",
    "fastapi": "the HTTP server (pip install fastapi uvicorn prometheus-client)",
    "uvicorn": "the HTTP server",
    "prometheus_client": "the HTTP server's /metrics",
    "openai": "the OpenAI client, to call the server",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def report() -> dict:
    """Everything `entmtp doctor` prints, as one JSON-able dict."""
    from .backends.llama_build import describe_build
    from .model import embedded_gguf
    from .scheduler.profiles import shipped_profiles_dir
    from .suffix import HINT as SUFFIX_HINT
    from .suffix import available as suffix_available

    try:
        gguf = str(embedded_gguf())
    except Exception as e:  # noqa: BLE001 - reported, not raised: the doctor must always answer
        gguf = f"missing ({e})"
    converted = cache_dir() / "models" / EMBEDDED
    cuda = torch.cuda.is_available()
    cpu = cpu_info()
    return {
        "entmtp": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device)",
        "machine": describe_record(record("cuda" if cuda else "cpu")),  # what measured files record
        "versions": {k: v or "not installed" for k, v in versions().items()},
        "llama_cpp_build": describe_build(),  # entmtp's AMX-patched build or pip's (backends/llama_build.py)
        "suffix_drafts": "available (arctic-inference)"
        if suffix_available()
        else f"not installed ({SUFFIX_HINT})",
        "cpu": cpu["name"],
        "cpu_flags": ", ".join(cpu["flags"]) or "none of " + ", ".join(CPU_FLAGS),
        "cpu_threads": torch.get_num_threads(),
        "cpu_bf16_packing": "available (load_model packs bf16 CPU models)"
        if bf16_supported()
        else "not available (no oneDNN bf16 kernels in this torch build): bf16 linears run unpacked",
        "model_cache": str(cache_dir()),
        "embedded_model": {
            "gguf": gguf,
            "converted": str(converted)
            if (converted / "config.json").exists()
            else "not yet (first run, ~15 s)",
        },
        "shipped_heads": [k for k in HEAD_KINDS if (shipped_heads_dir(k) / "config.json").exists()],
        "shipped_profiles": {
            k: sorted(p.stem for p in shipped_profiles_dir(k).glob("*.json")) for k in HEAD_KINDS
        },
        "shipped_profiles_machines": _profile_machines(shipped_profiles_dir),
        "step_costs": _cached_costs(),
        "extras": {
            name: ("installed" if importlib.util.find_spec(name) else f"missing: {what}")
            for name, what in EXTRAS.items()
        },
    }


def _cached_costs() -> dict:
    """The cost curves and batched cost surfaces (costs/) measured on this machine so far,
    one line each."""
    from .costs import CostsError, costs_dir

    out = {}
    for path in sorted(costs_dir().glob("*.json")) if costs_dir().is_dir() else []:
        if path.name == "dtype-choices.json":
            continue
        try:
            c, summary = _read_cached(path)
        except CostsError as e:
            out[path.name] = str(e)
            continue
        hw, heads = c.key.get("hardware", {}), c.key.get("heads") or {}
        what = f"{hw.get('dtype')}, {hw.get('threads')} threads, heads {heads.get('kind', 'none')}"
        machine = describe_record(c.machine)
        out[path.name] = f"{what}: {summary} ({c.source}, {c.seconds:.0f} s; {machine})"
    return out or {"none yet": "the first `entmtp generate` measures them (or `entmtp doctor --probe`)"}


def _profile_machines(profiles_dir) -> dict:
    """Each shipped profile's calibration machine (those written before machine records: "machine unknown"),
    read from its JSON alone (loading every profile whole takes seconds)."""
    from .scheduler.profiles import Hardware, describe_machine

    out = {}
    for kind in HEAD_KINDS:
        for path in sorted(profiles_dir(kind).glob("*.json")):
            try:
                d = json.loads(path.read_text(encoding="utf-8"))
                out[f"{kind}/{path.stem}"] = describe_machine(
                    d.get("machine"), Hardware.from_json(d["hardware"])
                )
            except (OSError, ValueError, KeyError, TypeError) as e:
                out[f"{kind}/{path.stem}"] = f"unreadable ({type(e).__name__}: {e})"
    return out


def _read_cached(path: Path):
    """(a cached cost curve, surface or policy's choice, its one-line summary); CostsError naming the file when
    unreadable."""
    from .costs import SURFACE_FORMAT, ChoiceCost, CostsError, CostSurface, load_curve
    from .costs.choice import FORMAT as CHOICE_FORMAT

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(d, dict) and d.get("format") == CHOICE_FORMAT:
            c = ChoiceCost.from_json(d)
            return c, f"{c.policy}'s choice: {c.ms_per_step:.3f} ms a step (median of {c.steps} engine steps)"
        if isinstance(d, dict) and d.get("format") == SURFACE_FORMAT:
            s = CostSurface.from_json(d)
            b, plain = s.batches, [row[0] for row in s.ms]
            return s, (
                f"batched steps of {b[0]}-{b[-1]} rows: plain {plain[0]:.1f} ms at {b[0]}, "
                f"{plain[-1] / b[-1]:.1f} ms a row at {b[-1]}"
            )
    except (OSError, ValueError, KeyError, TypeError, CostsError) as e:
        raise CostsError(
            f"cost cache file {path} is unreadable ({type(e).__name__}: {e}): delete it to measure again"
        ) from e
    curve = load_curve(path)
    return curve, curve.summary()


def probe_report() -> str:
    """What `entmtp generate` with no options builds here, and why (measures this machine's costs if needed)."""
    from .build import EngineSpec, build
    from .lookup import Lookup

    return build(EngineSpec(lookup=Lookup())).plan.describe()


def format_report(r: dict) -> str:
    lines = []
    for key, value in r.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {', '.join(v) if isinstance(v, list) else v}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {', '.join(value) if isinstance(value, list) else value}")
    return "\n".join(lines)


# ---- `entmtp doctor` ----------------------------------------------------------------------------------


def register(sub) -> None:
    """`doctor` on the subcommand parsers `sub`."""
    from .build import EngineSpec
    from .settings import add_arguments

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
    add_arguments(dr, EngineSpec, only=("threads",))
    dr.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    setup_torch(args)
    plan = probe_report() if args.probe else None  # first: its measurement then shows in step_costs
    r = report()
    if plan is not None:
        r["default_engine"] = plan
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0
