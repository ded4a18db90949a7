"""What ships inside the package for the embedded model: trained heads (and, later, scheduler profiles)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import EntMTPError

HEAD_KINDS = ("medusa", "hydra")


def shipped_heads_dir(kind: str) -> Path:
    return Path(str(resources.files("entmtp") / "assets" / "heads" / kind))


def heads_path(spec: str | Path) -> Path:
    """The directory of heads named by `spec`: medusa | hydra (the shipped ones) or a heads directory."""
    if str(spec) not in HEAD_KINDS:
        return Path(spec)
    path = shipped_heads_dir(str(spec))
    if not (path / "config.json").exists():
        raise EntMTPError(
            f"no trained {spec} heads ship with this version: train some with `entmtp train-heads --kind {spec}` "
            "and pass their directory to --heads"
        )
    return path


def resolve_heads(spec: str | None, model, *, int8: bool = False):
    """`spec`: medusa | hydra (shipped heads for the embedded model) | none | a heads directory. The heads
    come ready for `model` (`bind_heads`: heads made for another model fail here, before anything else uses
    them); `int8`: `bind_heads`'."""
    from .heads import load_heads

    if spec in (None, "none"):
        return None
    heads = load_heads(heads_path(spec), dtype=model.dtype, device=model.device)
    return bind_heads(heads, model, int8=int8)


def bind_heads(heads, model, *, int8: bool = False):
    """`heads` ready to draft for `model`, in place (the one place heads are bound): bound to it, on its device
    in its dtype, and their linears packed when the model's are (packing.py: the same drafts, faster), so a
    cost probe times the heads the engine runs. `int8`: on a CPU in bfloat16, they draft from int8 copies of
    their weights (heads/int8.py: the same outputs, cheaper drafts; the engine's default, `EngineSpec`'s
    `draft_int8`). Idempotent (heads quantized already stay so); returns `heads`."""
    from .packing import PackedLinear, pack_linears

    if not heads.is_bound_to(model):
        heads.bind(model)
    heads.to(device=model.device, dtype=model.dtype)
    if int8 and heads.quantize_int8():
        return heads  # the int8 copies stand in for packed ones
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        pack_linears(heads)  # the heads follow the model; layers packed already stay as they are
    return heads


def default_heads() -> str:
    for kind in ("hydra", "medusa"):
        if (shipped_heads_dir(kind) / "config.json").exists():
            return kind
    return "none"
