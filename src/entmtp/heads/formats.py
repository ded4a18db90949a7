"""Heads on disk: our format (config.json + heads.safetensors [+ draft_vocab.safetensors]) and the official Medusa
and Hydra layouts, both ways. Writes are atomic (temp files renamed into place, config last); reads check
every key and shape against the config and name the fix; `.pt` files load with `weights_only=True`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import HeadsError
from .config import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    FORMAT,
    FORMAT_VERSION,
    HEAD_ARCHS,
    HEADS_FILES,
    HYDRA_PT,
    MEDUSA_PT,
    MEDUSA_SAFETENSORS,
    WEIGHTS_FILE,
    HeadsConfig,
    saved_norm,
)
from .drafting import Heads
from .hydra import heads_class


def _write_atomically(
    directory: str | os.PathLike[str], files: dict[str, Callable[[Path], None]], overwrite: bool
) -> None:
    """Write each ``name -> writer(path)`` into temp files, then rename them into place (weights first,
    ``config.json`` last). Other heads files left there by an earlier save are removed."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise HeadsError(f"{d} is a file, not a directory: give a directory to save the heads into")
    d.mkdir(parents=True, exist_ok=True)
    existing = [n for n in HEADS_FILES if (d / n).exists()]
    if existing and not overwrite:
        raise HeadsError(
            f"{d} already holds heads ({', '.join(existing)}): pass overwrite=True (--overwrite) to replace them"
        )
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temps = {name: d / f".{name}.tmp-{tag}" for name in files}
    try:
        for name, write in files.items():
            write(temps[name])
        for name in sorted(files, key=lambda n: n == CONFIG_FILE):
            os.replace(temps[name], d / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    for stale in set(existing) - set(files):
        (d / stale).unlink(missing_ok=True)


def _json_writer(obj: dict[str, Any]) -> Callable[[Path], None]:
    return lambda p: p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _tensor_writer(state: dict[str, torch.Tensor], safetensors: bool) -> Callable[[Path], None]:
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}

    def write(p: Path) -> None:
        if safetensors:
            from safetensors.torch import save_file

            save_file(state, str(p))
        else:
            torch.save(state, p)

    return write


def _check_complete(heads: Heads) -> None:
    if heads.config.head_arch == "prefix-mlp" and getattr(heads, "prefix", None) is None:
        raise HeadsError(
            "these prefix-mlp heads have no prefix layer yet (it takes its shape from the base model): "
            "call heads.bind(model) before saving"
        )


def save_heads(heads: Heads, directory: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Save in our format: ``config.json`` (format, version, HeadsConfig) + ``heads.safetensors``."""
    _check_complete(heads)
    config = {"format": FORMAT, "version": FORMAT_VERSION, **dataclasses.asdict(heads.config)}
    files = {WEIGHTS_FILE: _tensor_writer(heads.state_dict(), safetensors=True)}
    if heads.draft_vocab is not None:
        files[DRAFT_VOCAB_FILE] = _tensor_writer({"ids": heads.draft_vocab.cpu()}, safetensors=True)
    files[CONFIG_FILE] = _json_writer(config)
    _write_atomically(directory, files, overwrite)


# Our parameter name -> official name. Official checkpoints hold per-head projections.
def _medusa_name(name: str, config: HeadsConfig) -> str:
    name = re.sub(r"^heads\.(\d+)\.blocks\.(\d+)\.", r"\1.\2.", name)
    return re.sub(r"^heads\.(\d+)\.proj\.", rf"\1.{config.num_layers}.", name)


def _hydra_name(name: str, config: HeadsConfig) -> str:
    if config.head_arch == "mlp":
        name = re.sub(r"^heads\.(\d+)\.blocks\.(\d+)\.", r"hydra_mlp.\1.\2.", name)
        return re.sub(r"^heads\.(\d+)\.proj\.", r"hydra_lm_head.\1.", name)
    # prefix-mlp interleaves Dropout modules: blocks sit at odd indices, the projection at index 1.
    name = re.sub(r"^heads\.(\d+)\.blocks\.(\d+)\.", lambda m: f"hydra_mlp.{m[1]}.{2 * int(m[2]) + 1}.", name)
    name = re.sub(r"^heads\.(\d+)\.proj\.", r"hydra_lm_head.\1.1.", name)
    if name == "prefix.norm.weight":
        return "prefix_embeding_layer.norm.weight"
    return re.sub(r"^prefix\.", "prefix_embeding_layer.layers.0.", name)


def _official_state(heads: Heads, rename: Callable[[str, HeadsConfig], str]) -> dict[str, torch.Tensor]:
    """The heads' weights under official names, with a projection per head (copied from the base when shared)."""
    _check_complete(heads)
    cfg = heads.config
    state = dict(heads.state_dict())
    if cfg.share_lm_head:
        lm_weight = heads._require_base().lm_head.weight.detach()
        for i in range(cfg.num_heads):
            state[f"heads.{i}.proj.weight"] = lm_weight.to(heads.dtype)
            if heads.proj_bias:
                state[f"heads.{i}.proj.bias"] = torch.zeros(cfg.vocab_size, dtype=heads.dtype)
    return {rename(k, dataclasses.replace(cfg, share_lm_head=False)): v for k, v in state.items()}


def save_medusa_official(
    heads: Heads,
    directory: str | os.PathLike[str],
    *,
    config_heads: int | None = None,
    safetensors: bool = False,
    overwrite: bool = False,
) -> None:
    """Write the official Medusa-1 layout: ``config.json`` + ``medusa_lm_head.pt`` (or ``.safetensors``).

    ``config_heads`` overrides ``medusa_num_heads`` in the config, to reproduce published checkpoints whose
    config disagrees with their weights. Shared projections need the heads bound (the base layer is copied).
    """
    cfg = heads.config
    if cfg.kind != "medusa":
        raise HeadsError(f"save_medusa_official needs Medusa heads, got kind {cfg.kind!r}")
    config = {
        "medusa_num_heads": cfg.num_heads if config_heads is None else config_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": cfg.base_model,
    }
    if cfg.hidden_state_offset:  # not an official field: heads that read an earlier layer must say so
        config.update(hidden_state_offset=cfg.hidden_state_offset, hidden_state_norm=cfg.hidden_state_norm)
    name = MEDUSA_SAFETENSORS if safetensors else MEDUSA_PT
    files = {
        name: _tensor_writer(_official_state(heads, _medusa_name), safetensors),
        CONFIG_FILE: _json_writer(config),
    }
    _write_atomically(directory, files, overwrite)


def save_hydra_official(
    heads: Heads,
    directory: str | os.PathLike[str],
    config_heads: int | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Write the official Hydra layout: ``config.json`` (HydraConfig fields) + ``hydra_lm_head.pt`` (the
    state dict of the official ``hydra_head`` module, minus its unused embedding tables)."""
    cfg = heads.config
    if cfg.kind != "hydra":
        raise HeadsError(f"save_hydra_official needs Hydra heads, got kind {cfg.kind!r}")
    config: dict[str, Any] = {
        "hydra_num_heads": cfg.num_heads if config_heads is None else config_heads,
        "hydra_num_layers": cfg.num_layers,
        "hydra_head_arch": cfg.head_arch,
        "base_model_name_or_path": cfg.base_model,
        "grounded_heads": cfg.grounded,
        "hidden_state_offset": cfg.hidden_state_offset,
        "hidden_state_norm": cfg.hidden_state_norm,  # entmtp's: official Hydra code ignores it
    }
    if cfg.head_arch == "prefix-mlp":  # not in official configs; recorded so the split needs no guess
        config.update(
            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads
        )
    files = {
        HYDRA_PT: _tensor_writer(_official_state(heads, _hydra_name), False),
        CONFIG_FILE: _json_writer(config),
    }
    _write_atomically(directory, files, overwrite)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsError(f"cannot read heads config {path} ({e}): fix the JSON or download it again") from e
    if not isinstance(data, dict):
        raise HeadsError(f"heads config {path} is not a JSON object: download or save the heads again")
    return data


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip all raise their own types
        raise HeadsError(
            f"cannot read heads weights {path}: the file is corrupt or truncated "
            f"({type(e).__name__}: {e}); download or save the heads again"
        ) from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HeadsError(
            f"heads weights {path} are not a state dict of tensors: download or save the heads again"
        )
    return state


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _build(
    config: HeadsConfig,
    state: dict[str, torch.Tensor],
    path: Path,
    rename: Callable[[str, HeadsConfig], str] | None = None,
) -> Heads:
    """Heads for ``config`` holding ``state`` (official names when ``rename`` maps ours to them)."""
    with torch.device("meta"):
        heads = heads_class(config)(config)
    expected = heads.state_dict()
    to_ours = {(rename(k, config) if rename else k): k for k in expected}
    missing = sorted(set(to_ours) - set(state))
    unexpected = sorted(set(state) - set(to_ours))
    if missing or unexpected:
        parts = [
            f"missing keys {_few(missing)}" if missing else "",
            f"unexpected keys {_few(unexpected)}" if unexpected else "",
        ]
        raise HeadsError(
            f"heads weights {path} do not match their config ({config.kind}, {config.num_heads} heads, "
            f"{config.num_layers} layers): {'; '.join(p for p in parts if p)}; the file is incomplete or "
            f"belongs to other heads: download or save them again"
        )
    ours, seen = {}, set()
    for name, ours_name in to_ours.items():
        tensor = state[name]
        if tensor.shape != expected[ours_name].shape:
            raise HeadsError(
                f"heads weights {path}: {name} has shape {tuple(tensor.shape)} but hidden size "
                f"{config.hidden_size} / vocab size {config.vocab_size} need {tuple(expected[ours_name].shape)}; "
                f"the shapes are inconsistent: the file is corrupt or mixes two checkpoints"
            )
        # Official checkpoints may store one tensor under several names (a reused module): untie them.
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        ours[ours_name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    heads.load_state_dict(ours, assign=True)
    return heads


def _ints_after(prefix: str, keys: list[str]) -> list[int]:
    """Sorted distinct integers ``n`` in keys that start with ``prefix`` + ``n.``."""
    found = {int(m[1]) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return sorted(found)


def _load_medusa(directory: Path, cfg: dict[str, Any]) -> Heads:
    path = directory / MEDUSA_SAFETENSORS
    if not path.exists():
        path = directory / MEDUSA_PT
    state = _read_weights(path)
    if state and all(k.startswith("medusa_head.") for k in state):
        state = {k[len("medusa_head.") :]: v for k, v in state.items()}
    keys = list(state)
    heads_ids = _ints_after("", keys)
    layers = _ints_after("0.", [k for k in keys if k.endswith(".linear.weight")])
    if not heads_ids or not layers:
        raise HeadsError(
            f"no Medusa heads in {path} (expected keys like 0.0.linear.weight, found {_few(keys)}): "
            f"download the heads again"
        )
    num_layers = len(layers)
    hidden = state["0.0.linear.weight"].shape[1]
    proj = state.get(f"0.{num_layers}.weight")
    if proj is None:
        raise HeadsError(
            f"Medusa weights {path} lack the projection 0.{num_layers}.weight: download them again"
        )
    config = HeadsConfig(
        kind="medusa",
        num_heads=len(heads_ids),  # from the weights: published configs under-report (2 vs 5)
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=proj.shape[0],
        share_lm_head=False,
        hidden_state_offset=int(cfg.get("hidden_state_offset", 0)),  # entmtp's: official configs lack it
        hidden_state_norm=saved_norm(cfg),
        base_model=str(cfg.get("base_model_name_or_path", "")),
    )
    return _build(config, state, path, _medusa_name)


def _load_hydra(directory: Path, cfg: dict[str, Any]) -> Heads:
    path = directory / HYDRA_PT
    if not path.exists():
        raise HeadsError(f"Hydra config in {directory} but no {HYDRA_PT} beside it: download the weights too")
    arch = cfg.get("hydra_head_arch", "mlp")
    if arch not in HEAD_ARCHS:
        raise HeadsError(
            f"{directory}: hydra_head_arch {arch!r} is not supported: use {', '.join(HEAD_ARCHS)} heads"
        )
    raw = _read_weights(path)
    # The official module also registers the base embedding (input_embed_fn) and an unused one in the prefix
    # LlamaModel; old transformers saved rotary inv_freq buffers. None of these are head weights.
    ignored = ("input_embed_fn.", "prefix_embeding_layer.embed_tokens.")
    state = {
        k: v for k, v in raw.items() if not k.startswith(ignored) and not k.endswith("rotary_emb.inv_freq")
    }
    keys = list(state)
    heads_ids = _ints_after("hydra_mlp.", keys)
    first = 1 if arch == "prefix-mlp" else 0
    blocks = _ints_after("hydra_mlp.0.", [k for k in keys if k.endswith(".linear.weight")])
    proj_key = "hydra_lm_head.0.1.weight" if arch == "prefix-mlp" else "hydra_lm_head.0.weight"
    if not heads_ids or not blocks or proj_key not in state:
        raise HeadsError(
            f"no {arch} Hydra heads in {path} (expected keys like hydra_mlp.0.{first}.linear.weight and "
            f"{proj_key}, found {_few(keys)}): check hydra_head_arch in config.json or download the heads again"
        )
    hidden = state[f"hydra_mlp.0.{first}.linear.weight"].shape[0]
    fields = _prefix_layer_fields(state, cfg, path) if arch == "prefix-mlp" else {}
    config = HeadsConfig(
        kind="hydra",
        num_heads=len(heads_ids),
        num_layers=len(blocks),
        hidden_size=hidden,
        vocab_size=state[proj_key].shape[0],
        share_lm_head=False,
        head_arch=arch,
        grounded=f"hydra_mlp.0.{first}.res_connection.weight" in state,
        hidden_state_offset=int(cfg.get("hidden_state_offset", 0)),
        hidden_state_norm=saved_norm(cfg),
        base_model=str(cfg.get("base_model_name_or_path", "")),
        **fields,
    )
    if "grounded_heads" in cfg and bool(cfg["grounded_heads"]) != config.grounded:
        raise HeadsError(
            f"{directory}: config.json says grounded_heads={cfg['grounded_heads']} but the weights in {path} "
            f"are {'' if config.grounded else 'un'}grounded: fix config.json or download the heads again"
        )
    return _build(config, state, path, _hydra_name)


def _prefix_layer_fields(state: dict, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The `HeadsConfig` fields of Hydra++'s prefix decoder layer: its attention head split and MLP size."""
    q = state.get("prefix_embeding_layer.layers.0.self_attn.q_proj.weight")
    k = state.get("prefix_embeding_layer.layers.0.self_attn.k_proj.weight")
    gate = state.get("prefix_embeding_layer.layers.0.mlp.gate_proj.weight")
    if q is None or k is None or gate is None:
        raise HeadsError(
            f"prefix-mlp Hydra weights {path} lack the prefix decoder layer: download them again"
        )
    # Official configs do not record the head split; bind() takes it from the base model. Until then
    # guess Llama's head size 128 (or the largest divisor of both sizes below it) unless config.json
    # names the head count. Only the split is guessed: parameter shapes come from the weights.
    nh = cfg.get("num_attention_heads")
    head_dim = q.shape[0] // nh if nh else math.gcd(q.shape[0], k.shape[0], 128)
    return {
        "num_attention_heads": q.shape[0] // head_dim,
        "num_key_value_heads": k.shape[0] // head_dim,
        "head_dim": head_dim,
        "intermediate_size": gate.shape[0],
    }


def _load_ours(directory: Path, cfg: dict[str, Any]) -> Heads:
    path = directory / WEIGHTS_FILE
    if cfg.get("version") != FORMAT_VERSION:
        raise HeadsError(
            f"{directory / CONFIG_FILE} has format version {cfg.get('version')!r}; this entmtp reads "
            f"version {FORMAT_VERSION}: upgrade entmtp or save the heads again"
        )
    if not path.exists():
        raise HeadsError(f"{directory} has a heads config but no {WEIGHTS_FILE}: save the heads again")
    fields = {k: v for k, v in cfg.items() if k not in ("format", "version")}
    fields["hidden_state_norm"] = saved_norm(cfg)
    known = {f.name for f in dataclasses.fields(HeadsConfig)}
    if set(fields) - known:
        raise HeadsError(
            f"{directory / CONFIG_FILE} has unknown fields {sorted(set(fields) - known)}: "
            f"it was written by a newer entmtp; upgrade entmtp"
        )
    try:
        config = HeadsConfig(**fields)
    except TypeError as e:
        raise HeadsError(f"{directory / CONFIG_FILE} is incomplete ({e}): save the heads again") from e
    heads = _build(config, _read_weights(path), path)
    vocab_path = directory / DRAFT_VOCAB_FILE
    if vocab_path.exists():
        heads.set_draft_vocab(_read_weights(vocab_path)["ids"])
    return heads


def load_heads(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Heads:
    """Load heads from a directory in our format, the official Medusa layout or the official Hydra layout.

    The number of heads (and layers, hidden and vocab sizes) is read from the weights, never from an
    official config. Weights keep their stored dtype unless ``dtype`` is given.
    """
    directory = Path(path)
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise HeadsError(
            f"heads directory {directory} {what}: give the directory holding config.json and the weights"
        )
    cfg_path = directory / CONFIG_FILE
    cfg = _read_json(cfg_path) if cfg_path.exists() else {}
    if cfg.get("format") == FORMAT:
        heads = _load_ours(directory, cfg)
    elif "hydra_num_heads" in cfg or (not cfg and (directory / HYDRA_PT).exists()):
        heads = _load_hydra(directory, cfg)
    elif (directory / MEDUSA_SAFETENSORS).exists() or (directory / MEDUSA_PT).exists():
        heads = _load_medusa(directory, cfg)
    else:
        raise HeadsError(
            f"no heads found in {directory}: expected config.json + {WEIGHTS_FILE} (entmtp), "
            f"{MEDUSA_PT} or {MEDUSA_SAFETENSORS} (Medusa), or config.json + {HYDRA_PT} (Hydra)"
        )
    if dtype is not None or device is not None:
        heads = heads.to(device=device, dtype=dtype)
    return heads
