"""What ships inside the package for the embedded model: trained heads (and, later, scheduler profiles)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import EntMTPError

HEAD_KINDS = ("medusa", "hydra")
# the embedded SmolLM2-135M-Instruct's token embeddings, as machine.model_fingerprint hashes them (rounded to
# bf16: the same in every dtype, on either backend, from any of its files): the model the shipped heads fit
EMBEDDED_SHAPE, EMBEDDED_EMBEDDING_SHA256 = (576, 49152), "7f1fa1ad1582c174"


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


def fits_shipped(model) -> bool:
    """Whether the shipped heads were trained for `model`: the embedded model, by its shape and its token
    embeddings' hash, whatever its path, dtype or backend."""
    from .machine import model_fingerprint

    config = model.config
    if (config.hidden_size, config.vocab_size) != EMBEDDED_SHAPE:
        return False
    return model_fingerprint(model)["embedding_sha256"] == EMBEDDED_EMBEDDING_SHA256


def default_heads_for(model, name: str | None, say) -> str:
    """The heads a model gets when none are named: the shipped ones where they were trained for it, else none
    (plain steps, prompt-lookup drafts and routing as for any model), with one line to `say` that says so and
    how to train heads for it. `name`: the model as the user gave it."""
    kind = default_heads()
    if kind == "none" or fits_shipped(model):
        return kind
    if name is None:  # the embedded model in a weight format entmtp wrote (its embeddings rounded otherwise)
        file = Path(str(getattr(model.config, "_name_or_path", "") or "its file")).name
        say(
            f"no heads for the embedded model as {file}: its token embeddings are not those the shipped {kind} "
            "heads were trained on, so it decodes without heads (prompt-lookup drafts still on)"
        )
        return "none"
    say(
        f"no heads for {name}: the shipped {kind} heads were trained for the embedded SmolLM2-135M-Instruct, "
        f"so it decodes without heads (prompt-lookup drafts still on); train heads for it with `entmtp "
        f"train-heads --model {name} --out DIR` and pass --heads DIR"
    )
    return "none"


def default_heads() -> str:
    for kind in ("hydra", "medusa"):
        if (shipped_heads_dir(kind) / "config.json").exists():
            return kind
    return "none"
