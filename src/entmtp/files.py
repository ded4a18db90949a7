"""Atomic file writes: a temp file beside the target, then one rename, so no reader ever sees half a file."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_text_atomic(path: Path, text: str) -> None:
    tmp = tmp_name(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_tensors_atomic(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    tmp = tmp_name(path)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
