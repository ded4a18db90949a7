"""Shared by the scheduler's and the calibration's tests: synthetic traces with known path values, heads fitted
to one greedy sequence of a tiny model, a small acceptance model, and a profile calibrated on them."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import torch

from conftest import ByteTokenizer, tiny_model
from entmtp.calibration.calibrate import CalibrationSettings, build_profile
from entmtp.calibration.traces import MISS, TOPK, Trace, save_traces
from entmtp.engine import Engine
from entmtp.heads import HeadsConfig, random_heads
from entmtp.scheduler.policies import AcceptanceModel

# ---- synthetic traces: heads with known per-rank accuracies ------------------------------------------------

RANK_P = (0.5, 0.2, 0.1)  # P(the right token is at rank r) at every depth; 0.2 of the mass misses


def synthetic_traces(depth: int = 3, scale: int = 1000) -> list[Trace]:
    """Positions whose rank vectors occur exactly in proportion to the product of RANK_P (independent
    depths): every path's value is known in closed form."""
    rows = []
    options = [*range(len(RANK_P)), MISS]
    probs = [*RANK_P, 1 - sum(RANK_P)]
    for combo in itertools.product(range(len(options)), repeat=depth):
        p = math.prod(probs[i] for i in combo)
        rows += [[options[i] for i in combo]] * round(p * scale)
    ranks = torch.tensor(rows, dtype=torch.int64)
    n = len(rows)
    probe = torch.full((n, depth, TOPK), -20.0)
    raw = torch.zeros(n, 4)
    return [Trace(prompt_len=1, length=n + 1, ranks=ranks, probe=probe, raw=raw)]


def path_value(path) -> float:
    return math.prod(RANK_P[r] for r in path)


# ---- heads fitted to one greedy sequence -------------------------------------------------------------------


def fitted_heads(kind: str, model, tokens: list[int], steps: int = 300, config: HeadsConfig | None = None):
    """Random heads (`config`; default 4 for the tiny model) overfitted to one greedy sequence of the tiny
    model, so they accept often on it."""
    cfg = config or HeadsConfig(kind=kind, num_heads=4, hidden_size=64, vocab_size=256)
    heads = random_heads(cfg, seed=1, init="random").bind(model)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        feats = heads.features(hidden, ids)
        loss = 0.0
        for k, f in enumerate(feats, start=1):
            logits = heads.project(k - 1, f[0, : -k - 1])
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, k + 1 :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.requires_grad_(False)


def fitted_setup():
    """(model, prompt ids, its greedy output, {kind: heads fitted to it}): the shared fixture of the scheduler's
    tests."""
    model = tiny_model("llama", seed=11)
    ids = list(range(60, 76))
    ref = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=48).token_ids
    return model, ids, ref, {k: fitted_heads(k, model, ids + ref) for k in ("medusa", "hydra")}


# ---- a small acceptance model ------------------------------------------------------------------------------


def small_acceptance(depth: int = 4) -> AcceptanceModel:
    """Two step contexts (head 1 unsure / sure), three probability bins."""
    ranks = tuple(
        (tuple(0.3 / (r + 1) for r in range(TOPK)), tuple(0.7 / (r + 1) for r in range(TOPK)))
        for _ in range(depth)
    )
    rates = tuple(((0.02, 0.2, 0.6), (0.05, 0.3, 0.9)) for _ in range(depth))
    return AcceptanceModel((0.0, 0.1, 0.5, 1.0), (0.0, 0.5, 1.0), rates, ranks)


# ---- a calibrated profile and its files --------------------------------------------------------------------

TINY = CalibrationSettings(max_new_tokens=24, latency_prompts=1, latency_tokens=12, latency_repeats=1)


def tiny_profile_setup(fitted, folder: Path):
    """(model, heads, path, greedy traces) of a profile calibrated on the tiny model with the fitted Hydra heads,
    saved in `folder`."""
    model, ids, ref, heads = fitted
    prompts = [ids, list(range(30, 44)), list(range(90, 101))]
    profile, traces = build_profile(
        model,
        ByteTokenizer(),
        heads["hydra"],
        heads_name="tiny-hydra",
        task="tiny",
        prompts=prompts,
        settings=TINY,
        log=lambda *a: None,
    )
    path = folder / "tiny.json"
    save_traces(profile, path, traces).save(path)
    return model, heads, path, traces


def copy_profile(path, tmp_path, edit=None, text=None):
    out = tmp_path / "p.json"
    shutil.copy(path.with_name(path.stem + ".traces.safetensors"), tmp_path / "p.traces.safetensors")
    data = json.loads(path.read_text())
    if edit:
        edit(data)
    out.write_text(text if text is not None else json.dumps(data))
    return out
