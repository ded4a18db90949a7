"""Model shapes with random weights: measure a machine's cost curve without downloading a checkpoint.

A forward's cost depends on the architecture's shapes, not on the weights' values, so a random model of the
right shape times like the real one. `random_model("llama-7b")` builds Vicuna-7B's shape (what the EntMTP
paper and the published Medusa trees were measured on); `random_model("config.json")` any architecture
transformers knows. Weights are drawn on the target device, so a 7B model on a GPU takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .errors import EntMTPError

SHAPES = {
    "smollm2-135m": dict(  # SmolLM2-135M-Instruct, the embedded model
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-7b": dict(  # Llama-2-7B / Vicuna-7B
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def random_config(spec: str):
    """A config from a shape name or a config.json path; generation never stops at an EOS."""
    if spec in SHAPES:
        fields = dict(SHAPES[spec])
    else:
        path = Path(spec)
        if not path.is_file():
            raise EntMTPError(
                f"--random-model {spec!r} is neither a shape ({', '.join(SHAPES)}) nor a config.json file"
            )
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EntMTPError(f"--random-model {path}: not a JSON config ({e})") from e
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise EntMTPError(f'--random-model {path}: a model config needs a model_type (e.g. "llama")')
    model_type = fields.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        raise EntMTPError(f"--random-model {spec}: {e}") from e
    config.eos_token_id = None  # random logits: an EOS would end a timing run at a random step
    return config


def random_model(spec: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0):
    """(model, tokenizer) with random weights of the given shape; the tokenizer only names ids."""
    config = random_config(spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False), IdTokenizer(config.vocab_size)


class IdTokenizer:
    """A random model's tokenizer: no text, no chat template, no EOS; ids print as themselves."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise EntMTPError("a random model has no tokenizer: give token ids")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def weight_bytes(model) -> int:
    """Bytes of weights one forward reads (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def memory_bandwidth(device: str | torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a large copy moves (read + write counted), best of `repeats`."""
    import time

    dev = torch.device(device)
    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best
