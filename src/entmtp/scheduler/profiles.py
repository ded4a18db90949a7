"""Scheduler profiles: one calibrated tree bank per (base model, heads, task), as typed data and as files.

What a profile holds splits by what it depends on. The task part (acceptance frontier with each tree's
simulated tokens per step, bank, master tree, acceptance model, signal statistics; the traces beside it) is
portable across machines. The machine part (`latency`: ms per step of each measured tree, on the machine that
calibrated) is not: `policy(name, latency=curve)` and `best_tree(latency=...)` re-derive EntMTP* and build the
cost-aware policies on another machine's curve (costs.py) in microseconds. Tuned binary/ladder thresholds and
the recommended policy stay those of the calibration machine.

`entmtp calibrate` (entmtp.calibration) builds a `Profile`; everything else reads its attributes.

THE FILE FORMAT (`"format": "entmtp-profile"`, `"version": 1`), one JSON object written with indent 1:

  format, version   "entmtp-profile", 1
  task              the task's name (a shipped task, or the prompt file's stem)
  created           when it was calibrated, "%Y-%m-%dT%H:%M:%S%z"
  model             the base model's fingerprint: name, hidden_size, vocab_size, num_hidden_layers,
                    embedding_sha256 (machine.model_fingerprint; `check` compares the last four)
  heads             name, kind (medusa | hydra), num_heads, checksum (machine.heads_checksum)
  hardware          device, name, cpu_flags (optional: older files lack it), cpu_count, threads, dtype
  versions          entmtp, torch, transformers
  machine           optional (older files lack it: "machine unknown"): machine.record of the calibration
                    machine (CPU model, kernel flags, cores, threads; GPU and driver; library versions)
  calibration       latency_prompt_ids (token ids of the prompts decoded to time trees), prompts (traced),
                    positions, max_new_tokens, latency_prompts, latency_tokens, latency_repeats,
                    trace_seconds (null when the traces were shared between profiles), seconds
  latency           nodes and ms_per_step (one per measured tree, in `trees` order), plain_ms_per_step, and
                    trees: name -> {nodes, ms_per_step, measured_tokens_per_second, measured_tokens_per_step,
                    timed_steps (optional)}; "none" is plain decoding
  modes             "greedy" and, optionally, the T > 0 sections by acceptance rule: "sample" (lossless
                    rejection sampling), "typical" (typical acceptance) and "gumbel" (lossless Gumbel-max
                    sampling, drafts under the same noise), each calibrated at T=0.7:
    growth                max depth ("1".."D") -> the greedy growth's rank paths, in the order they were added
    acceptance_frontier   [{name, nodes, depth, paths, mean_accepted_all_positions, tokens_per_step_simulated,
                          and, for trees measured here, ms_per_step, measured_tokens_per_second,
                          measured_tokens_per_step, timed_steps (optional)}], smallest first
    bank                  the tree names the policies switch between ("none" first), smallest first
    throughput_frontier   [{name, nodes, tokens_per_step_simulated, ms_per_step, tokens_per_second,
                          measured_tokens_per_second (null if not measured)}]
    best                  EntMTP*: the name of the fastest static tree on the calibration machine
    master                {name, paths}: the union tree the dynamic policy takes subtrees of
    reference             name -> {nodes, tokens_per_step_simulated, ms_per_step, tokens_per_second}: the
                          published default tree, for comparison ({} when it was not measured)
    acceptance_model      {edges, ctx_edges, rates, rank_rates, rule (optional: the section's rule when
                          absent)} (policies.AcceptanceModel)
    signals               name -> {mean, std, quantiles, corr_with_chain_accepted}
    thresholds            binary: {small, large, signal, tau_off, tau_on, window}; ladder: {trees, signal,
                          thresholds, window} (each optional; window 8 when absent)
    replay                policy (and "oracle") -> {tokens_per_second, tokens_per_step, steps, usage}
    recommended_policy    the replayed policy of most tokens/s ("static" when absent)
    plain_tokens_per_second, positions
    sampling              T > 0 sections only: {temperature, acceptance, typical_eps, typical_alpha}
    traces                T > 0 sections only: [{prompt_len, length}] of the section's traces in the sidecar
    acceptance_check      optional: [{depth, predicted, measured, positions}], the acceptance model against
                          held-out positions (calibration.calibrate.check_acceptance)
    trace_tree            typical only: {name, paths}, the union tree its traces verified at every root (a
                          typical section without it comes from an older entmtp: its traces are not read)
  traces            [{prompt_len, length}] of the greedy traces in the sidecar (absent until it is written)
  traces_sha256     the sidecar's sha256 (absent likewise)

The traces themselves live in a sidecar `<profile>.traces.safetensors` (calibration.traces), written before
the JSON, each atomically, so `entmtp calibrate --latency-only` can re-measure the hardware side elsewhere and
`--retune` re-derive every section without decoding again.

THE VERSION RULE: a reader reads its own version only, and refuses any other with "calibrate again". Change
`VERSION` whenever a field is removed, renamed or changes meaning, or a new field becomes required; a field
that readers may do without (marked optional above) can be added within a version. `Profile.from_json(
p.to_json())` returns `p`, and `to_json(from_json(d))` returns `d` for every file of this version (tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from .. import metrics
from ..accept import SAMPLED, Sampling
from ..errors import EntMTPError
from ..files import write_text_atomic
from ..machine import describe_record, hardware, heads_checksum, model_fingerprint
from ..shipped import HEAD_KINDS
from ..tree import RankPath, Tree, TreeError
from .policies import (
    POLICIES,
    AcceptanceModel,
    BinaryPolicy,
    CostPolicy,
    DynamicPolicy,
    LadderPolicy,
    LatencyModel,
)

FORMAT = "entmtp-profile"
VERSION = 1
PROFILE_TASKS = ("humaneval", "sharegpt", "gsm8k", "writing", "mixed")
DEFAULT_WINDOW = 8  # a threshold policy's EMA window when its entry has none


class ProfileError(EntMTPError):
    """A scheduler profile is missing, corrupt, or made for another model or heads."""


# ---- the parts of a profile, each with its JSON form --------------------------------------------------------


def _paths(rows) -> tuple[RankPath, ...]:
    return tuple(tuple(p) for p in rows)


def _paths_json(paths: tuple[RankPath, ...]) -> list[list[int]]:
    return [list(p) for p in paths]


class _Record:
    """A flat JSON object whose keys are the dataclass's fields, in order (tuples written as lists)."""

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: Mapping):
        return cls(**{f.name: _frozen(d[f.name]) for f in dataclasses.fields(cls)})


def _plain(x):
    return [_plain(v) for v in x] if isinstance(x, tuple) else x


def _frozen(x):
    return tuple(_frozen(v) for v in x) if isinstance(x, list) else x


@dataclass(frozen=True)
class ModelInfo(_Record):
    name: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    embedding_sha256: str

    CHECKED = ("hidden_size", "vocab_size", "num_hidden_layers", "embedding_sha256")  # what must match


@dataclass(frozen=True)
class HeadsInfo(_Record):
    name: str
    kind: str
    num_heads: int
    checksum: str


def describe_machine(machine: Mapping | None, hw: Hardware) -> str:
    """A profile's calibration machine in one line: its machine record (machine.describe_record); an older
    profile without one is "machine unknown", with what its hardware section does say."""
    if machine is not None:
        return describe_record(dict(machine))
    flags = "no CPU flags" if hw.cpu_flags is None else "flags " + (", ".join(hw.cpu_flags) or "none")
    return f"machine unknown (the profile records {hw.name!r}, {hw.cpu_count} cores, {flags})"


@dataclass(frozen=True)
class Hardware:
    device: str
    name: str
    cpu_count: int
    threads: int
    dtype: str
    cpu_flags: tuple[str, ...] | None = None  # None: a file from before CPU flags were recorded

    CHECKED = ("device", "name", "threads", "dtype", "cpu_flags")  # what a latency depends on

    def to_json(self) -> dict:
        flags = {} if self.cpu_flags is None else {"cpu_flags": list(self.cpu_flags)}
        return {
            "device": self.device,
            "name": self.name,
            **flags,
            "cpu_count": self.cpu_count,
            "threads": self.threads,
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Hardware:
        flags = d.get("cpu_flags")
        return cls(
            d["device"],
            d["name"],
            d["cpu_count"],
            d["threads"],
            d["dtype"],
            None if flags is None else tuple(flags),
        )

    def differences(self, here: Hardware) -> list[str]:
        """'key calibrated -> here' for every field that differs (CPU flags only when this profile has them)."""
        keys = [k for k in self.CHECKED if k != "cpu_flags" or self.cpu_flags is not None]
        return [
            f"{k} {getattr(self, k)!r} -> {getattr(here, k)!r}"
            for k in keys
            if getattr(self, k) != getattr(here, k)
        ]


@dataclass(frozen=True)
class Versions(_Record):
    entmtp: str
    torch: str
    transformers: str


@dataclass(frozen=True)
class CalibrationRun(_Record):
    """What the profile was made from, and how long it took."""

    latency_prompt_ids: tuple[tuple[int, ...], ...]  # the prompts decoded to time trees (token ids)
    prompts: int  # traced calibration prompts
    positions: int
    max_new_tokens: int
    latency_prompts: int
    latency_tokens: int
    latency_repeats: int
    trace_seconds: float | None  # None: the traces were shared between profiles
    seconds: float


@dataclass(frozen=True)
class MeasuredTree:
    """A tree's real decodes on the calibration machine (medians over interleaved rounds)."""

    nodes: int
    ms_per_step: float
    measured_tokens_per_second: float  # decode steps only
    measured_tokens_per_step: float
    timed_steps: int | None = None  # None: a file from before it was recorded

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return d if self.timed_steps is not None else {k: v for k, v in d.items() if k != "timed_steps"}

    @classmethod
    def from_json(cls, d: Mapping) -> MeasuredTree:
        return cls(
            d["nodes"],
            d["ms_per_step"],
            d["measured_tokens_per_second"],
            d["measured_tokens_per_step"],
            d.get("timed_steps"),
        )


@dataclass(frozen=True)
class Latency:
    """The machine part measured at calibration."""

    nodes: tuple[int, ...]  # one per measured tree, in `trees` order
    ms_per_step: tuple[float, ...]
    plain_ms_per_step: float
    trees: Mapping[str, MeasuredTree]  # by tree name; "none" is plain decoding

    @classmethod
    def of(cls, trees: Mapping[str, MeasuredTree]) -> Latency:
        ms = tuple(m.ms_per_step for m in trees.values())
        return cls(tuple(m.nodes for m in trees.values()), ms, trees["none"].ms_per_step, dict(trees))

    def model(self) -> LatencyModel:
        """`ms_of(tree)`: a tree's own measured latency, else interpolated by its node count."""
        return LatencyModel.from_measured({name: m.to_json() for name, m in self.trees.items()})

    def to_json(self) -> dict:
        return {
            "nodes": list(self.nodes),
            "ms_per_step": list(self.ms_per_step),
            "plain_ms_per_step": self.plain_ms_per_step,
            "trees": {name: m.to_json() for name, m in self.trees.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Latency:
        trees = {name: MeasuredTree.from_json(m) for name, m in d["trees"].items()}
        return cls(tuple(d["nodes"]), tuple(d["ms_per_step"]), d["plain_ms_per_step"], trees)


@dataclass(frozen=True)
class FrontierEntry:
    """A tree of the acceptance frontier: its search score, its own simulated decodes, and its real decodes
    when it was measured (the JSON object holds the measurement's fields beside its own)."""

    name: str
    nodes: int
    depth: int
    paths: tuple[RankPath, ...]
    mean_accepted_all_positions: float
    tokens_per_step_simulated: float
    measured: MeasuredTree | None = None

    def tree(self) -> Tree:
        return Tree(self.name, self.paths)

    def to_json(self) -> dict:
        own = {
            "name": self.name,
            "nodes": self.nodes,
            "depth": self.depth,
            "paths": _paths_json(self.paths),
            "mean_accepted_all_positions": self.mean_accepted_all_positions,
            "tokens_per_step_simulated": self.tokens_per_step_simulated,
        }
        return own if self.measured is None else {**own, **self.measured.to_json()}

    @classmethod
    def from_json(cls, d: Mapping) -> FrontierEntry:
        measured = MeasuredTree.from_json(d) if "ms_per_step" in d else None
        return cls(
            d["name"],
            d["nodes"],
            d["depth"],
            _paths(d["paths"]),
            d["mean_accepted_all_positions"],
            d["tokens_per_step_simulated"],
            measured,
        )


@dataclass(frozen=True)
class ThroughputEntry(_Record):
    """A tree of the throughput frontier: simulated tokens per step over its step latency."""

    name: str
    nodes: int
    tokens_per_step_simulated: float
    ms_per_step: float
    tokens_per_second: float
    measured_tokens_per_second: float | None  # None: its latency was interpolated, not measured


@dataclass(frozen=True)
class ReferenceTree(_Record):
    nodes: int
    tokens_per_step_simulated: float
    ms_per_step: float
    tokens_per_second: float


@dataclass(frozen=True)
class NamedPaths:
    name: str
    paths: tuple[RankPath, ...]

    def tree(self) -> Tree:
        return Tree(self.name, self.paths)

    def to_json(self) -> dict:
        return {"name": self.name, "paths": _paths_json(self.paths)}

    @classmethod
    def from_json(cls, d: Mapping) -> NamedPaths:
        return cls(d["name"], _paths(d["paths"]))


@dataclass(frozen=True)
class BinaryThresholds(_Record):
    small: str
    large: str
    signal: str
    tau_off: float
    tau_on: float
    window: int = DEFAULT_WINDOW

    @classmethod
    def from_json(cls, d: Mapping) -> BinaryThresholds:
        return super().from_json({"window": DEFAULT_WINDOW, **d})


@dataclass(frozen=True)
class LadderThresholds(_Record):
    trees: tuple[str, ...]
    signal: str
    thresholds: tuple[float, ...]
    window: int = DEFAULT_WINDOW

    @classmethod
    def from_json(cls, d: Mapping) -> LadderThresholds:
        return super().from_json({"window": DEFAULT_WINDOW, **d})


@dataclass(frozen=True)
class Thresholds:
    """The tuned threshold policies (None: not tuned, e.g. a bank too small for a ladder)."""

    binary: BinaryThresholds | None = None
    ladder: LadderThresholds | None = None

    def to_json(self) -> dict:
        return {
            k: v.to_json() for k, v in (("binary", self.binary), ("ladder", self.ladder)) if v is not None
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Thresholds:
        binary, ladder = d.get("binary"), d.get("ladder")
        return cls(
            None if binary is None else BinaryThresholds.from_json(binary),
            None if ladder is None else LadderThresholds.from_json(ladder),
        )


@dataclass(frozen=True)
class SignalStats(_Record):
    mean: float
    std: float
    quantiles: tuple[float, ...]  # at 0.1, 0.25, 0.5, 0.75, 0.9
    corr_with_chain_accepted: float


@dataclass(frozen=True)
class ReplayResult:
    """A policy replayed on the calibration traces with the measured latencies (decode steps only)."""

    tokens_per_second: float
    tokens_per_step: float
    steps: int
    usage: Mapping[str, int]  # tree name -> steps

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "usage": dict(self.usage)}

    @classmethod
    def from_json(cls, d: Mapping) -> ReplayResult:
        return cls(d["tokens_per_second"], d["tokens_per_step"], d["steps"], dict(d["usage"]))


@dataclass(frozen=True)
class DepthCheck(_Record):
    """The acceptance model against held-out calibration positions at one depth: the mean predicted and the
    measured share of positions where the master tree accepts at least `depth` drafts (two folds: fitted on
    half the traces, checked on the other half, and the reverse)."""

    depth: int
    predicted: float
    measured: float
    positions: int


@dataclass(frozen=True)
class TraceMeta(_Record):
    """One calibration trace in the sidecar: its prompt length and its whole length (prompt + output)."""

    prompt_len: int
    length: int


def _trace_metas(rows) -> tuple[TraceMeta, ...] | None:
    return None if rows is None else tuple(TraceMeta.from_json(r) for r in rows)


@dataclass(frozen=True)
class ModeProfile:
    """One acceptance rule's section: what the search found, the bank, and the policies tuned on it."""

    growth: Mapping[int, tuple[RankPath, ...]]  # max depth -> rank paths in the order they were grown
    acceptance_frontier: tuple[FrontierEntry, ...]
    bank: tuple[str, ...]
    throughput_frontier: tuple[ThroughputEntry, ...]
    best: str  # EntMTP* on the calibration machine
    master: NamedPaths
    reference: Mapping[str, ReferenceTree]
    acceptance_model: AcceptanceModel
    signals: Mapping[str, SignalStats]
    thresholds: Thresholds
    replay: Mapping[str, ReplayResult]
    recommended_policy: str
    plain_tokens_per_second: float
    positions: int
    sampling: Sampling | None = None  # T > 0 sections only
    traces: tuple[TraceMeta, ...] | None = None  # T > 0 sections only: this section's traces in the sidecar
    acceptance_check: tuple[DepthCheck, ...] = ()  # the acceptance model on held-out positions, per depth
    trace_tree: NamedPaths | None = None  # typical only: the union tree its traces verified at every root

    def to_json(self) -> dict:
        out = {
            "growth": {str(d): _paths_json(order) for d, order in self.growth.items()},
            "acceptance_frontier": [e.to_json() for e in self.acceptance_frontier],
            "bank": list(self.bank),
            "throughput_frontier": [e.to_json() for e in self.throughput_frontier],
            "best": self.best,
            "master": self.master.to_json(),
            "reference": {name: r.to_json() for name, r in self.reference.items()},
            "acceptance_model": self.acceptance_model.to_json(),
            "signals": {name: s.to_json() for name, s in self.signals.items()},
            "thresholds": self.thresholds.to_json(),
            "replay": {name: r.to_json() for name, r in self.replay.items()},
            "recommended_policy": self.recommended_policy,
            "plain_tokens_per_second": self.plain_tokens_per_second,
            "positions": self.positions,
        }
        if self.sampling is not None:
            out["sampling"] = dataclasses.asdict(self.sampling)
        if self.traces is not None:
            out["traces"] = [t.to_json() for t in self.traces]
        if self.acceptance_check:
            out["acceptance_check"] = [c.to_json() for c in self.acceptance_check]
        if self.trace_tree is not None:
            out["trace_tree"] = self.trace_tree.to_json()
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> ModeProfile:
        sampling = Sampling(**d["sampling"]) if "sampling" in d else None
        rule = "greedy" if sampling is None else sampling.rule
        return cls(
            growth={int(k): _paths(order) for k, order in d["growth"].items()},
            acceptance_frontier=tuple(FrontierEntry.from_json(e) for e in d["acceptance_frontier"]),
            bank=tuple(d["bank"]),
            throughput_frontier=tuple(ThroughputEntry.from_json(e) for e in d["throughput_frontier"]),
            best=d["best"],
            master=NamedPaths.from_json(d["master"]),
            reference={name: ReferenceTree.from_json(r) for name, r in d.get("reference", {}).items()},
            acceptance_model=AcceptanceModel.from_json({"rule": rule, **d["acceptance_model"]}),
            signals={name: SignalStats.from_json(s) for name, s in d["signals"].items()},
            thresholds=Thresholds.from_json(d["thresholds"]),
            replay={name: ReplayResult.from_json(r) for name, r in d["replay"].items()},
            recommended_policy=d.get("recommended_policy", "static"),
            plain_tokens_per_second=d["plain_tokens_per_second"],
            positions=d["positions"],
            sampling=sampling,
            traces=_trace_metas(d.get("traces")),
            acceptance_check=tuple(DepthCheck.from_json(c) for c in d.get("acceptance_check", ())),
            trace_tree=NamedPaths.from_json(d["trace_tree"]) if "trace_tree" in d else None,
        )

    def trees(self) -> dict[str, Tree]:
        """Every tree the section names (acceptance frontier, plain decoding, master), by name."""
        out = {e.name: e.tree() for e in self.acceptance_frontier}
        out["none"] = Tree.root_only()  # plain decoding: in every bank
        out[self.master.name] = self.master.tree()
        return out


# ---- the profile ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    task: str
    created: str
    model: ModelInfo
    heads: HeadsInfo
    hardware: Hardware
    versions: Versions
    calibration: CalibrationRun
    latency: Latency
    modes: Mapping[str, ModeProfile]  # "greedy", and "sample" / "typical" / "gumbel" when calibrated at T > 0
    traces: tuple[TraceMeta, ...] | None = None  # the greedy traces in the sidecar (None: not written yet)
    traces_sha256: str | None = None
    machine: Mapping | None = None  # machine.record of the calibration machine (None: an older file)
    path: Path | None = field(default=None, compare=False)  # the file it was read from or saved to

    def to_json(self) -> dict:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "task": self.task,
            "created": self.created,
            "model": self.model.to_json(),
            "heads": self.heads.to_json(),
            "hardware": self.hardware.to_json(),
            "versions": self.versions.to_json(),
            "calibration": self.calibration.to_json(),
            "latency": self.latency.to_json(),
            "modes": {name: m.to_json() for name, m in self.modes.items()},
        }
        if self.traces is not None:
            out["traces"] = [t.to_json() for t in self.traces]
        if self.traces_sha256 is not None:
            out["traces_sha256"] = self.traces_sha256
        if self.machine is not None:
            out["machine"] = dict(self.machine)
        return out

    @classmethod
    def from_json(cls, d: Mapping, path: Path | None = None) -> Profile:
        """The profile of a JSON document of this format version (KeyError, TypeError or ValueError when it
        is malformed: `load_profile` names them)."""
        return cls(
            task=d["task"],
            created=d["created"],
            model=ModelInfo.from_json(d["model"]),
            heads=HeadsInfo.from_json(d["heads"]),
            hardware=Hardware.from_json(d["hardware"]),
            versions=Versions.from_json(d["versions"]),
            calibration=CalibrationRun.from_json(d["calibration"]),
            latency=Latency.from_json(d["latency"]),
            modes={name: ModeProfile.from_json(m) for name, m in d["modes"].items()},
            traces=_trace_metas(d.get("traces")),
            traces_sha256=d.get("traces_sha256"),
            machine=d.get("machine"),
            path=path,
        )

    # -- reading --
    @property
    def machine_description(self) -> str:
        """The calibration machine in one line (`describe_machine`)."""
        return describe_machine(self.machine, self.hardware)

    def mode(self, mode: str = "greedy") -> ModeProfile:
        if mode not in self.modes:
            raise ProfileError(
                f"profile {self.where} has no {mode!r} section (it holds {', '.join(self.modes)})"
            )
        return self.modes[mode]

    def trees(self, mode: str = "greedy") -> dict[str, Tree]:
        """Every tree the profile names (acceptance frontier, master), by name."""
        return self.mode(mode).trees()

    def bank(self, mode: str = "greedy") -> list[Tree]:
        """The trees the policies switch between, smallest first: every frontier tree whose latency was
        measured (the throughput frontier, EntMTP* included, and the larger trees that pay on confident steps)."""
        trees = self.trees(mode)
        return [trees[name] for name in self.mode(mode).bank]

    def best_tree(self, mode: str = "greedy", latency: LatencyModel | None = None) -> Tree:
        """EntMTP*: the fastest static tree of the task, plain decoding included; on the calibration hardware
        (stored), or re-derived under `latency` (another machine's curve)."""
        if latency is None:
            return self.trees(mode)[self.mode(mode).best]
        speed = self.static_speeds(mode, latency)
        return self.trees(mode)[max(speed, key=speed.get)]

    def static_speeds(self, mode: str, latency: LatencyModel) -> dict[str, float]:
        """Expected tokens/s of every bank tree (the root-only tree: plain decoding) under `latency`:
        simulated tokens per step on the calibration positions / the curve's ms per step."""
        tps = {e.name: e.tokens_per_step_simulated for e in self.mode(mode).acceptance_frontier}
        tps["none"] = 1.0
        return {
            t.name: metrics.replay_tokens_per_second(tps[t.name], latency.ms_of(t)) for t in self.bank(mode)
        }

    def acceptance(self, mode: str = "greedy") -> AcceptanceModel:
        return self.mode(mode).acceptance_model

    def mode_for(self, temperature: float, acceptance: str = "auto") -> str:
        """The section a run at `temperature` with `acceptance` (accept.Sampling) uses: its rule's (the T > 0
        sections were calibrated at T=0.7); a profile without it (older files hold "typical" only) lends the
        other T > 0 section, else the greedy one."""
        return self.mode_for_rule(Sampling(temperature, acceptance).rule)

    def mode_for_rule(self, rule: str) -> str:
        """The section an acceptance `rule` (accept.ACCEPTANCE) uses (see `mode_for`)."""
        for mode in (rule, *(m for m in SAMPLED if m != rule and rule != "greedy")):
            if mode in self.modes:
                return mode
        return "greedy"

    def recommended_policy(self, mode: str = "greedy") -> str:
        return self.mode(mode).recommended_policy

    def trace_metas(self, mode: str = "greedy") -> tuple[TraceMeta, ...]:
        """The mode's traces in the sidecar (none recorded: empty)."""
        metas = self.traces if mode == "greedy" else self.mode(mode).traces
        return metas or ()

    def policy(
        self,
        name: str,
        mode: str = "greedy",
        require_contiguous: bool = True,
        online: bool = True,
        latency: LatencyModel | None = None,
    ):
        """A policy object for the engine, built from this profile's task part and `latency` (this machine's
        cost curve, `CostCurve.latency()`; None: the latencies stored at calibration). `online`: `cost` and
        `dynamic` recalibrate their acceptance model on the text at hand (policies.OnlineCalibration)."""
        from ..policy import StaticPolicy

        m = self.mode(mode)
        stored = latency is None
        latency = self.latency.model() if stored else latency
        if name == "static":
            return StaticPolicy(self.best_tree(mode, None if stored else latency))
        trees = m.trees()
        if name in ("binary", "ladder"):
            return self._threshold_policy(name, m.thresholds, trees)
        if name == "cost":
            bank = self.bank(mode)
            return CostPolicy(bank, m.acceptance_model, [latency.ms_of(t) for t in bank], online=online)
        if name == "dynamic":
            return DynamicPolicy(
                trees[m.master.name],
                m.acceptance_model,
                latency,
                require_contiguous=require_contiguous,
                online=online,
            )
        raise ProfileError(f"unknown policy {name!r}: use {', '.join(POLICIES)}")

    def _threshold_policy(self, name: str, thresholds: Thresholds, trees: dict[str, Tree]):
        th = getattr(thresholds, name)
        if th is None:
            raise ProfileError(f"profile {self.where} has no tuned {name} thresholds: calibrate again")
        if name == "binary":
            return BinaryPolicy(
                trees[th.small], trees[th.large], th.signal, th.tau_off, th.tau_on, window=th.window
            )
        return LadderPolicy([trees[n] for n in th.trees], th.signal, th.thresholds, window=th.window)

    @property
    def where(self) -> str:
        """The profile's file, or its task when it has none yet (for messages)."""
        return str(self.path) if self.path else f"<{self.task}>"

    # -- checks --
    def check(self, model, heads, *, warn_hardware: bool = True) -> None:
        """Raise ProfileError if made for another base model or heads, or its trees do not fit the heads;
        warn if made on other hardware (latencies and so the bank may not hold here)."""
        fix = "calibrate for this model and heads with `entmtp calibrate`, or pass the right --profile"
        self.check_model(model)
        checksum = heads_checksum(heads)
        if self.heads.checksum != checksum:
            raise ProfileError(
                f"profile {self.where} was made for other heads ({self.heads.name}, checksum "
                f"{self.heads.checksum}), not these (checksum {checksum}): {fix}; if only the heads' draft "
                f"vocabulary or weights changed, `entmtp calibrate --retrace --profile {self.where}` re-derives "
                "it from its stored generations"
            )
        contiguous = heads.config.kind == "hydra"
        for tree in (t for mode in self.modes for t in self.trees(mode).values()):
            try:
                tree.check_fits(heads.config.num_heads, require_contiguous=contiguous)
            except TreeError as e:
                raise ProfileError(f"profile {self.where}: {e}") from None
        diff = self.hardware.differences(Hardware.from_json(hardware(model))) if warn_hardware else []
        if diff:
            warnings.warn(
                f"profile {self.where} was calibrated on other hardware ({', '.join(diff)}): its stored "
                "latencies may not hold here; build policies on this machine's measured step costs instead (the "
                "default; --no-probe turns it off; in Python `profile.policy(name, latency=costs_for(model, "
                f"heads).latency())`), or re-measure with `entmtp calibrate --latency-only --profile "
                f"{self.where}` (minutes)",
                stacklevel=2,
            )

    def check_model(self, model) -> None:
        """Raise ProfileError if made for another base model."""
        got, want = ModelInfo.from_json(model_fingerprint(model)), self.model
        for key in ModelInfo.CHECKED:
            if getattr(want, key) != getattr(got, key):
                raise ProfileError(
                    f"profile {self.where} was made for base model {want.name!r} ({key} {getattr(want, key)}), "
                    f"not this one ({got.name!r}, {key} {getattr(got, key)}): calibrate for this model and "
                    "heads with `entmtp calibrate`, or pass the right --profile"
                )

    # -- writing --
    def save(self, path: str | os.PathLike[str]) -> Profile:
        """Write the JSON atomically (by rename) and return the profile saved there; the traces sidecar, when
        there is one, is written before it (calibration.traces.save_traces)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")
        return replace(self, path=path)


# ---- files -------------------------------------------------------------------------------------------------------


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file; clear errors for missing, truncated or foreign files."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ProfileError(
            f"profile {p} {what}: give a profile JSON written by `entmtp calibrate`, or a task name "
            f"({', '.join(PROFILE_TASKS)}) for a shipped one"
        )
    data = _read_document(p)
    try:
        profile = Profile.from_json(data, p)
        for mode in profile.modes:
            profile.trees(mode)  # the trees are valid
        profile.latency.model()
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProfileError(f"profile {p} is malformed ({type(e).__name__}: {e}): calibrate again") from e
    return profile


def _read_document(p: Path) -> dict:
    """The JSON object of a profile file of this format and version, with every top-level section."""
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(
            f"profile {p} is corrupt or truncated ({e}): calibrate again with `entmtp calibrate`"
        ) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(
            f'{p} is not an entmtp scheduler profile (no "format": "{FORMAT}"): '
            "give a file written by `entmtp calibrate`"
        )
    if data.get("version") != VERSION:
        raise ProfileError(
            f"profile {p} has format version {data.get('version')}, this entmtp reads {VERSION}: calibrate again"
        )
    missing = [k for k in ("task", "model", "heads", "hardware", "latency", "modes") if k not in data]
    if missing:
        raise ProfileError(
            f"profile {p} lacks {', '.join(missing)} (truncated or hand-edited): calibrate again"
        )
    return data


def shipped_profiles_dir(heads_kind: str) -> Path:
    return Path(str(resources.files("entmtp") / "assets" / "profiles" / heads_kind))


def resolve_profile(spec: str | os.PathLike[str] | None, heads_spec: str | None) -> Profile:
    """`spec`: a task name (the shipped profile for the shipped heads `heads_spec`) or a profile file;
    None = the shipped `mixed` profile."""
    spec = "mixed" if spec is None else str(spec)
    if spec in PROFILE_TASKS:
        if heads_spec not in HEAD_KINDS:
            raise ProfileError(
                f"shipped profiles exist only for the shipped heads (medusa, hydra), not {heads_spec!r}: "
                f"calibrate yours with `entmtp calibrate --heads {heads_spec} --task {spec} --out P.json` "
                "and pass --profile P.json"
            )
        path = shipped_profiles_dir(heads_spec) / f"{spec}.json"
        if not path.exists():
            raise ProfileError(
                f"no shipped {spec!r} profile for {heads_spec} heads in this version: make one with "
                f"`entmtp calibrate --heads {heads_spec} --task {spec}`"
            )
        return load_profile(path)
    return load_profile(spec)
