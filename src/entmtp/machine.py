"""What machine, model and heads a measurement belongs to: fingerprints that key caches and check profiles.

Two CPUs of one pool can both call themselves "AMD EPYC" and differ by 2x in what a tree costs (AVX-512 and
native bf16 on one, AVX2 only on the other), so a CPU is known by its model name *and* the instruction-set
flags that decide its kernels (`CPU_FLAGS`), its core count and the threads torch uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

# the flags that decide which matmul kernels run (fp32 FMA, AVX-512, native bf16 dot products, AMX tiles)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def cpu_info() -> dict:
    """{"name": model name, "flags": the CPU_FLAGS present} from /proc/cpuinfo (elsewhere: platform's)."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "name": name or platform.processor() or platform.machine(),
        "flags": [f for f in CPU_FLAGS if f in flags],
    }


def hardware(model) -> dict:
    """The device a model runs on: type, name (CPU model or GPU), CPU flags, cores, torch threads, dtype."""
    dev = model.device if hasattr(model, "device") else torch.device("cpu")
    cpu = cpu_info()
    return {
        "device": dev.type,
        "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu["name"],
        "cpu_flags": cpu["flags"],
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
    }


def describe(hw: dict) -> str:
    """One line naming a `hardware` record for reports: the GPU, or the CPU model with its cores and the
    flags that decide its kernels (two CPUs of one name can differ by 2x)."""
    if hw["device"] == "cuda":
        return hw["name"]
    flags = ", ".join(hw["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS)
    return f"{hw['name']} ({hw['cpu_count']} cores; {flags})"


def model_fingerprint(model) -> dict:
    cfg = model.config
    emb = model.get_input_embeddings().weight
    digest = hashlib.sha256(emb[:64].detach().to(torch.bfloat16).float().cpu().numpy().tobytes()).hexdigest()
    return {
        "name": getattr(cfg, "_name_or_path", "") or type(model).__name__,
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(emb.shape[0]),
        "num_hidden_layers": int(getattr(cfg, "num_hidden_layers", 0)),
        "embedding_sha256": digest[:16],
    }


def heads_checksum(heads) -> str:
    """sha256 of the heads' weights (rounded to bf16, so a float32 load of bf16 weights matches) and draft
    vocabulary; the same heads loaded on any device or dtype give the same checksum."""
    h = hashlib.sha256()
    for name, t in sorted(heads.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.bfloat16).float().cpu().numpy().tobytes())
    if heads.draft_vocab is not None:
        h.update(heads.draft_vocab.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def digest(document: dict) -> str:
    """A short stable key for a JSON-able fingerprint."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]
