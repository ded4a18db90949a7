"""The base model's answers to the training prompts, kept apart from the distillation shards so that they can
outlive the machine that made them.

Generating the answers is the costly half of the self-distillation data on a CPU (~160 tokens per CPU second
against ~330 positions per CPU second for the teacher-forced pass, on the 2-core AMD EPYC), and the shards
are large (~1.9 kB per trained position: the features). The answers are small (2 bytes a token), so a
long job can keep them where they survive (a directory in git), and a later run on a fresh machine redoes
only the teacher-forced pass from them, token for token the same data.

One file per distillation shard, ``<shard>.answers.safetensors`` (``train-00003.answers.safetensors``):

* ``responses`` [T] uint16 (int32 when the vocabulary has more than 65,536 tokens): the shard's responses,
  concatenated in the shard's sequence order;
* ``lengths``   [S] int32: each sequence's response length;
* metadata: what the answers depend on (``IDENTITY``), so answers made for other prompts or settings are
  refused instead of silently mixed in.

Written atomically (a temp file, then a rename): a killed run leaves no half-written answers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import DataError
from ..files import save_tensors_atomic

SUFFIX = ".answers.safetensors"
# the settings the answers depend on (the teacher-forced pass's own settings, top_k and the stored
# features' dtype and layer, are not among them: the same answers serve any of those)
IDENTITY = ("base_model", "prompts_sha", "shard_size", "max_new_tokens", "temperature", "seed")


class AnswerStore:
    """A directory of answer files, one per distillation shard (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], identity: dict):
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise DataError(f"answers directory {self.dir} is a file: give a directory")
        missing = [k for k in IDENTITY if k not in identity]
        if missing:
            raise ValueError(f"answer identity lacks {missing}")
        self.identity = {k: json.dumps(identity[k]) for k in IDENTITY}  # safetensors metadata is str -> str

    def path(self, shard_file: str) -> Path:
        return self.dir / (shard_file.removesuffix(".safetensors") + SUFFIX)

    def read(self, shard_file: str, sequences: int) -> list[list[int]] | None:
        """The responses stored for ``shard_file`` (``sequences`` of them), or None when none are stored."""
        path = self.path(shard_file)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                responses, lengths = f.get_tensor("responses"), f.get_tensor("lengths")
        except (OSError, SafetensorError) as e:
            raise DataError(
                f"cannot read answers {path} ({e}): delete the file to generate them again"
            ) from e
        diff = [k for k in IDENTITY if meta.get(k) != self.identity[k]]
        if diff:
            said = ", ".join(f"{k}: {meta.get(k)} there, {self.identity[k]} now" for k in diff)
            raise DataError(
                f"answers {path} were made for other data ({said}): give another --answers-dir, or delete "
                f"the directory's answers to generate them again"
            )
        if lengths.numel() != sequences or int(lengths.sum()) != responses.numel():
            raise DataError(
                f"answers {path} hold {lengths.numel()} responses of {int(lengths.sum())} tokens in all, "
                f"not {sequences} responses of {responses.numel()} tokens: delete the file to generate "
                f"them again"
            )
        return [r.tolist() for r in responses.to(torch.int64).split(lengths.tolist())]

    def write(self, shard_file: str, responses: list[list[int]], vocab_size: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        dtype = torch.uint16 if vocab_size <= 2**16 else torch.int32
        flat = [t for r in responses for t in r]
        tensors = {
            "responses": torch.tensor(flat, dtype=torch.int64).to(dtype),
            "lengths": torch.tensor([len(r) for r in responses], dtype=torch.int32),
        }
        save_tensors_atomic(self.path(shard_file), tensors, metadata=self.identity)

    def stored(self) -> list[str]:
        """The shard files whose answers are stored, sorted."""
        if not self.dir.is_dir():
            return []
        return sorted(p.name.removesuffix(SUFFIX) + ".safetensors" for p in self.dir.glob("*" + SUFFIX))
