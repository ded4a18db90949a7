"""What ships inside the package for the embedded model: trained heads (and, later, scheduler profiles)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import EntMTPError

HEAD_KINDS = ("medusa", "hydra")


def shipped_heads_dir(kind: str) -> Path:
    return Path(str(resources.files("entmtp") / "assets" / "heads" / kind))


def resolve_heads(spec: str | None, model):
    """`spec`: medusa | hydra (shipped heads for the embedded model) | none | a heads directory."""
    from .heads import load_heads

    if spec in (None, "none"):
        return None
    path = shipped_heads_dir(spec) if spec in HEAD_KINDS else Path(spec)
    if spec in HEAD_KINDS and not (path / "config.json").exists():
        raise EntMTPError(
            f"no trained {spec} heads ship with this version: train some with `entmtp train-heads --kind {spec}` "
            "and pass their directory to --heads"
        )
    return load_heads(path, dtype=model.dtype, device=model.device)


def default_heads() -> str:
    for kind in ("hydra", "medusa"):
        if (shipped_heads_dir(kind) / "config.json").exists():
            return kind
    return "none"
