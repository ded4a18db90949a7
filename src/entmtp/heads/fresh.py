"""Fresh heads of either kind, before any training: what `train-heads` starts from and what tests and the
step-cost timings of random models draft with."""

from __future__ import annotations

import torch

from ..errors import HeadsError
from .config import HeadsConfig
from .drafting import Heads
from .hydra import heads_class
from .modules import ResBlock, randomize_norms


def random_heads(
    config: HeadsConfig, seed: int = 0, dtype: torch.dtype = torch.float32, init: str = "medusa"
) -> Heads:
    """Fresh heads. ``init="medusa"``: residual blocks start as the identity (zero ``linear`` weights), as
    Medusa and Hydra do; ``init="random"``: every weight nonzero, for tests that must see each parameter."""
    if init not in ("medusa", "random"):
        raise HeadsError(f"init {init!r} is unknown: use 'medusa' or 'random'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = heads_class(config)(config)
        with torch.no_grad():
            for module in heads.modules():
                if init == "medusa" and isinstance(module, ResBlock):
                    module.linear.weight.zero_()
            if init == "random":
                randomize_norms(heads)
    heads._prefix_init = (seed, init)
    return heads.to(dtype)
