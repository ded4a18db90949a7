"""Medusa and Hydra draft heads on top of a frozen Hugging Face causal LM.

Glossary (t is a committed position, x_t its token):

* ``hidden[t]``: the base model's last hidden state after x_t; the base output layer on it predicts x_{t+1}.
  Heads with ``hidden_state_offset`` k read an earlier layer's output instead (``heads_input``).
* root token: x_{t+1}, the base model's own next token (tree node 0).
* head k (k = 1..K, index k-1 in ``heads.heads``) at position t predicts x_{t+k+1}.
* feature: what the heads read at t. Medusa and Hydra-``mlp``: hidden[t]. Hydra++ ``prefix-mlp``: the output
  of one extra decoder layer run causally over the hidden states of all committed positions.

Architectures (parameter layouts match the official code so their checkpoints load):

* Medusa-1 (FasterDecoding/Medusa, ``medusa/model/medusa_model.py``): head k = ``num_layers`` blocks
  ``x + SiLU(Linear(x))`` then a vocab projection without bias. Every head reads the feature.
* Hydra (zankner/Hydra, ``hydra/model/hydra_heads/{mlp_head,prefix_mlp_head}.py``): with ``grounded``, head
  k's first block reads ``concat(feature, emb(x_{t+1}), ..., emb(x_{t+k}))`` [(k+1)H] and maps it back to H
  in both branches: ``res_connection(x) + SiLU(linear(x))``; later blocks are plain residual blocks; the
  official per-head projection has a bias. Without ``grounded`` Hydra heads are Medusa heads.
  ``prefix-mlp`` adds one Llama decoder layer (+ final RMSNorm, as the official code runs a 1-layer
  ``LlamaModel``) over the base hidden states; it keeps its own KV cache of committed positions only.

Drafting contract: ``drafter = heads.drafter()`` per generation (its own feature and prefix-layer cache);
``drafter.extend(hidden)`` with the hidden states of newly committed positions (the prompt, then each step's
accepted path); ``drafter.probe(master, root_token) -> Probe``; ``drafter.draft(tree, root_token) -> Draft``.
Training: ``features`` then ``project``.

Where things live: ``config.py`` (HeadsConfig, file names, what the heads read: ``heads_input``),
``modules.py`` (residual blocks, Hydra++'s prefix layer), ``drafting.py`` (the ``Heads`` base class, Medusa,
the draft vocabulary), ``hydra.py`` (Hydra's branch-by-branch drafting, fresh heads) and ``formats.py`` (save
and load: ours and the official layouts).
"""

from .config import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    FORMAT,
    FORMAT_VERSION,
    HEAD_ARCHS,
    HEADS_FILES,
    HYDRA_PT,
    KINDS,
    MEDUSA_PT,
    MEDUSA_SAFETENSORS,
    WEIGHTS_FILE,
    HeadsConfig,
    heads_input,
)
from .drafting import Draft, Drafter, Heads, LazyProbe, MedusaHeads, Probe, frequent_tokens, taken
from .formats import load_heads, save_heads, save_hydra_official, save_medusa_official
from .fresh import random_heads
from .hydra import HydraHeads

__all__ = [
    "CONFIG_FILE",
    "DRAFT_VOCAB_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "HEAD_ARCHS",
    "HEADS_FILES",
    "HYDRA_PT",
    "KINDS",
    "MEDUSA_PT",
    "MEDUSA_SAFETENSORS",
    "WEIGHTS_FILE",
    "Draft",
    "Drafter",
    "Heads",
    "HeadsConfig",
    "HydraHeads",
    "LazyProbe",
    "MedusaHeads",
    "Probe",
    "frequent_tokens",
    "heads_input",
    "load_heads",
    "random_heads",
    "save_heads",
    "save_hydra_official",
    "save_medusa_official",
    "taken",
]
