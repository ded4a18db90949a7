"""What machine, model and heads a measurement belongs to: fingerprints that key caches and check profiles.

Two CPUs of one pool can both call themselves "AMD EPYC" and differ by 2x in what a tree costs (AVX-512 and
native bf16 on one, AVX2 only on the other), so a CPU is known by its model name *and* the instruction-set
flags that decide its kernels (`CPU_FLAGS`), its core count and the threads torch uses.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

# the flags that decide which matmul kernels run (fp32 FMA, AVX-512, native bf16 dot products, AMX tiles)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def cpu_info() -> dict:
    """{"name": model name, "flags": the CPU_FLAGS present, "cores": physical cores (None: not said)} from
    /proc/cpuinfo (elsewhere: platform's name, no flags)."""
    name, flags, cores, physical = "", set(), set(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            field, value = field.strip(), value.strip()
            if field == "model name" and not name:
                name = value
            elif field == "flags" and not flags:
                flags = set(value.split())
            elif field == "physical id":
                physical = value
            elif field == "core id":
                cores.add((physical, value))
    except OSError:
        pass
    return {
        "name": name or platform.processor() or platform.machine(),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "cores": len(cores) or None,
    }


def native_bf16(flags=None) -> bool:
    """Whether the CPU multiplies bf16 in hardware (avx512_bf16 dot products, AMX tiles). Elsewhere torch emulates
    bf16 matmuls: a batched teacher-forced pass ran 6.5x slower in bf16 than in float32 on the AVX2-only EPYC
    (docs/results/heads-v3-cpu/dtype-speed-avx2.txt). `flags`: CPU_FLAGS to judge instead of this CPU's."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["flags"] if flags is None else flags))


def auto_dtype(device: str | torch.device = "cpu") -> str:
    """What `auto` means where a dtype is chosen by the hardware alone (train-heads' base model and heads'
    matmuls, the heads beside llama.cpp): bfloat16 where it is multiplied natively (CUDA, a CPU with
    avx512_bf16 or AMX), float32 on a CPU that would emulate it."""
    return "bfloat16" if torch.device(device).type == "cuda" or native_bf16() else "float32"


LIBRARIES = ("entmtp", "torch", "transformers", "llama-cpp-python")  # what runs the model, versioned


def versions() -> dict:
    """The installed version of each of LIBRARIES (None: not installed)."""
    out = {}
    for dist in LIBRARIES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def record(device: str | torch.device = "cpu") -> dict:
    """The machine record every file holding a measured figure keeps (bench results, profiles, cost curves):
    the CPU's model, the flags that decide its kernels, physical cores, logical CPUs and torch's threads; on
    CUDA the GPU and its driver; the versions of the libraries that run the model."""
    cpu, dev = cpu_info(), torch.device(device)
    out = {
        "cpu": cpu["name"],
        "cpu_flags": cpu["flags"],
        "cores": cpu["cores"],
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    if dev.type == "cuda":
        out |= {
            "gpu": torch.cuda.get_device_name(dev),
            "gpu_driver": _gpu_driver(),
            "cuda": torch.version.cuda,
        }
    return out | {"versions": versions()}


def _gpu_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi's), None where it cannot be asked."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def describe_record(rec: dict | None) -> str:
    """One line naming a machine record: the GPU and its driver, or the CPU with its cores and kernel flags;
    "machine unknown" for a file written before records were kept."""
    if not rec:
        return "machine unknown (written before machine records were kept)"
    if rec.get("gpu"):
        return (
            f"{rec['gpu']} (driver {rec.get('gpu_driver') or 'unknown'}, CUDA {rec.get('cuda') or 'unknown'})"
        )
    if rec.get("cpu_flags") is None:  # a record made afterwards, from what its run kept: flags not read
        flags = "CPU flags not recorded"
    else:
        flags = ", ".join(rec["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS)
    cores = f"{rec.get('cores') or '?'} cores, {rec.get('logical_cpus') or '?'} CPUs, {rec.get('threads') or '?'} threads"
    return f"{rec['cpu']} ({cores}; {flags})"


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


def model_name(name: str) -> str:
    """A model's name as records keep it: a hub id as given, a local directory or file by its own name (not
    the converting machine's path: the embedded model is `smollm2-135m-instruct` wherever its cache is)."""
    return Path(name).resolve().name if os.path.isabs(name) or os.path.exists(name) else name


def model_fingerprint(model) -> dict:
    cfg = model.config
    emb = model.get_input_embeddings().weight
    digest = hashlib.sha256(emb[:64].detach().to(torch.bfloat16).float().cpu().numpy().tobytes()).hexdigest()
    return {
        "name": model_name(getattr(cfg, "_name_or_path", "") or type(model).__name__),
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
