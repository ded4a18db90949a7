"""Atomic file writes (a temp file beside the target, then one rename, so no reader ever sees half a file), a cache
file of verdicts read as nothing where it cannot be read, and paths as records name them (`portable`: never one
machine's absolute path)."""

from __future__ import annotations

import json
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


def read_json_or_empty(path: Path) -> dict:
    """The JSON object in a cache file of verdicts (keyed by what they were measured on), or {} where the file is
    missing or unreadable: every verdict is then measured again and the file written afresh."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def save_tensors_atomic(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    tmp = tmp_name(path)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def portable(path) -> str:
    """`path` as a record, a report or a shipped file names it, the same on every machine: inside the installed
    package `entmtp/...`, inside the working directory relative to it, under the home directory `~/...`, else
    its last component alone (a temporary or another machine's directory says nothing to a reader)."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        return str(path)
    p = Path(os.path.normpath(p))
    package = Path(__file__).resolve().parent
    for root, prefix in ((package, "entmtp"), (Path.cwd().resolve(), ""), (Path.home().resolve(), "~")):
        try:
            rest = p.relative_to(root)
        except ValueError:
            continue
        return str(Path(prefix) / rest) if prefix else str(rest)
    return p.name
