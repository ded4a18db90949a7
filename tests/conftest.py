"""Shared fixtures: tiny random base models (Llama, Qwen2), an oracle drafter, a policy that reads the heads'
probe, the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from entmtp.heads import Draft
from entmtp.policy import Choice

VOCAB = 256

# Engines built by the CLI and `build` use the profiles' stored latencies in tests, as on every machine alike:
# a measured cost curve would make what they decode depend on the machine CI runs on. The tests of the
# measurement itself (test_costs.py) lift this.
os.environ["ENTMTP_NO_PROBE"] = "1"


class ByteTokenizer:
    """Enough of a tokenizer for the engine on tiny models: ids are bytes, no chat template."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    @property
    def byte_tokens(self) -> list[bytes]:
        """Each id's bytes: what a grammar's matcher reads of a tokenizer (constraints.grammar_tokenizer)."""
        return [bytes([i]) for i in range(256)]


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, **overrides):
    """A frozen random base model: Llama or Qwen2, 2 layers, hidden 64. `overrides` change its config
    (e.g. eos_token_id, pad_token_id), and the generation config follows them."""
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.eos_token_id = common["eos_token_id"]
    model.generation_config.pad_token_id = common["pad_token_id"] if common["pad_token_id"] is not None else 0
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class OracleConfig:
    num_heads: int
    kind: str = "medusa"
    hidden_state_offset: int = 0


class OracleHeads(torch.nn.Module):
    """A drafter that knows the base model's greedy continuation `reference` (prompt + output) and puts the
    right token at rank `(pos * 7 + depth) % rank_mod` of each head, filling the other ranks with wrong
    tokens. Rank 0 is not always right, so accepted paths go through side branches and the KV commit must
    move entries; `wrong_every` makes some depths miss entirely."""

    def __init__(self, reference: list[int], num_heads: int = 5, rank_mod: int = 2, wrong_every: int = 0):
        super().__init__()
        self.config = OracleConfig(num_heads)
        self.reference, self.rank_mod, self.wrong_every = reference, rank_mod, wrong_every

    def bind(self, model):
        self.model, self.vocab = model, model.config.vocab_size
        return self

    def is_bound_to(self, model) -> bool:
        return getattr(self, "model", None) is model

    def drafter(self, noise=None, temperature: float = 1.0) -> OracleDrafter:
        return OracleDrafter(self)  # drafts the reference whatever the noise


class OracleDrafter:
    """One generation's position in the oracle's reference (what `Heads.drafter()` gives real heads)."""

    def __init__(self, heads: OracleHeads):
        self.heads, self.pos = heads, 0

    def extend(self, hidden):
        self.pos += hidden.shape[0]

    def draft(self, tree, root_token, probe=None) -> Draft:
        h, tokens = self.heads, []
        for node in range(1, tree.size):
            depth, rank = int(tree.depths[node]), int(tree.ranks[node])
            # truth after the committed prefix: reference[pos] is the root, reference[pos + d] at depth d
            idx = self.pos + depth
            truth = h.reference[idx] if idx < len(h.reference) else 0
            right_rank = (self.pos * 7 + depth) % h.rank_mod
            miss = h.wrong_every and (self.pos + depth) % h.wrong_every == 0
            tokens.append(truth if rank == right_rank and not miss else (truth + 1 + rank) % h.vocab)
        t = torch.tensor(tokens, dtype=torch.long, device=root_token.device)
        return Draft(tokens=t, logprobs=torch.zeros(len(tokens)))


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """scripts/`name` run with `args` in a fresh interpreter (its refusals are tested by their messages)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / name
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)


def script_module(name: str):
    """scripts/`name` imported as a module (its functions tested without running its command line); scripts/
    is on the path while it loads, as when it runs (a script may import another)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


class ProbeReadingPolicy:
    """An inner policy with a master tree that reads the heads' probe before choosing it, as the calibrated ones
    (cost, dynamic) do: the hybrid's tests use it to see when the engine's lazy probe is computed."""

    lookup = None

    def __init__(self, tree):
        self.master, self.trees = tree, [tree]

    def fresh(self):
        return self

    def choose(self, ctx):
        ctx.probe.tokens  # noqa: B018 - reading it is the point
        return Choice(self.master, {})

    def observe(self, step):
        pass


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct in float32 (exact-equality tests need fp32)."""
    from entmtp.model import load_model

    torch.set_num_threads(int(os.environ.get("ENTMTP_TEST_THREADS", "2")))
    return load_model(dtype="float32")


def save_tiny_model(path):
    """Save a 2-layer random Llama at `path` with the embedded model's tokenizer (real prompts and chat
    template, the full 49152-token vocabulary), for commands that load a model by path; returns the model."""
    from transformers import AutoTokenizer

    from entmtp.model import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = tiny_model(
        "llama", vocab=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True, **ids
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
