"""Online signals: how predictable the text is right now, read once per step before the tree is chosen.

Named signals (higher = more predictable, so one threshold rule serves all):

  entropy  minus the bias-corrected EMA of the base model's next-token entropy at the block start (nats):
           m_t = beta m_{t-1} + (1 - beta) H_t, estimate m_t / (1 - beta^t), beta = 1 - 1/W
  path     EntMTP's path value s = max(p0, g_1..g_D), g_d = p0 * prod_{i<=d} p_i: p0 the base top-1
           probability at the root, p_i head i's top-1 probability along the greedy chain. Since every g_d <= p0
           this is p0 itself, as in the published code; `chain` is the informative sum.
  chain    sum_d g_d: the expected number of accepted drafts on the greedy chain if the heads were calibrated
  accept   EMA (same bias correction) of the drafts accepted per step so far

The heads' probabilities come from the step's `Probe` (every depth for Medusa, depth 1 for Hydra, whose deeper
heads read the drafted branch). Everything stays on the device until `read()`: one host sync per step.
"""

from __future__ import annotations

import math

import torch

SIGNALS = ("entropy", "path", "chain", "accept")
DEFAULT_WINDOW = 8  # EMA window W in steps; the paper studied 4..64


def root_stats(root_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] base logits at the root -> [..., 2] (entropy in nats, top-1 probability), on their device."""
    p = torch.softmax(root_logits.float(), dim=-1)  # [..., V]
    # entr(p) = -p log p, 0 at p = 0: a grammar's mask (-inf logits) leaves tokens of probability 0
    return torch.stack([torch.special.entr(p).sum(-1), p.max(-1).values], dim=-1)


def chain_values(p0: torch.Tensor, probe_logprobs: torch.Tensor | None) -> torch.Tensor:
    """g_1..g_D of the greedy chain: p0 [...] and the probe's top-k log-probabilities [..., D, k] -> [..., D]."""
    if probe_logprobs is None or probe_logprobs.numel() == 0:
        return torch.zeros_like(p0)[..., None]
    return p0[..., None] * probe_logprobs[..., 0].cumsum(-1).exp()


def raw_signals(stats: torch.Tensor, probe_logprobs: torch.Tensor | None) -> torch.Tensor:
    """[..., 4] (entropy, p0, sum g_d, max g_d) of a step (stats [..., 2]), still on the device."""
    g = chain_values(stats[..., 1], probe_logprobs)  # [..., D]
    return torch.cat([stats, g.sum(-1, keepdim=True), g.max(-1, keepdim=True).values], dim=-1)


class EMA:
    """Bias-corrected exponential moving average with window W (beta = 1 - 1/W): m_t / (1 - beta^t)."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        if window < 1:
            raise ValueError(f"EMA window must be >= 1 step, got {window}")
        self.beta = 1.0 - 1.0 / window
        self.reset()

    def reset(self) -> None:
        self.m, self.t = 0.0, 0

    def update(self, x: float) -> float:
        self.t += 1
        self.m = self.beta * self.m + (1.0 - self.beta) * x
        return self.value

    @property
    def value(self) -> float:
        return self.m / (1.0 - self.beta**self.t) if self.t else math.nan


class SignalTracker:
    """Keeps the EMAs and turns one step's raw values into the named signals (one host sync)."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        self.entropy, self.accept = EMA(window), EMA(window)

    def reset(self) -> None:
        self.entropy.reset()
        self.accept.reset()

    def read(self, stats: torch.Tensor, probe_logprobs: torch.Tensor | None) -> dict[str, float]:
        """stats [2] = (entropy, p0) from `root_stats`; probe_logprobs [D, k] or None. One host sync."""
        return self.update(raw_signals(stats, probe_logprobs).tolist())

    def update(self, raw: list[float]) -> dict[str, float]:
        """raw = (entropy, p0, chain sum, max g_d) of this step (from `raw_signals`, or recorded offline)."""
        entropy, p0, chain, gmax = raw
        accept = self.accept.value
        return {
            "entropy": -self.entropy.update(entropy),
            "path": max(p0, gmax),
            "chain": chain,
            "accept": accept if accept == accept else 1.0,  # before the first step: a neutral 1 draft
        }

    def observe(self, accepted: int) -> None:
        self.accept.update(float(accepted))
