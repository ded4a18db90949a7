"""Scheduler profiles: one calibrated tree bank per (base model, heads, task), as typed data and as files.

What a profile holds splits by what it depends on. The task part (acceptance frontier with each tree's
simulated tokens per step, bank, master tree, acceptance model, signal statistics; the traces beside it) is
portable across machines. The machine part is not: `latency` (ms per step of each measured tree, on the
machine that calibrated) and, in each section, `measured_on` (what those latencies decided there: throughput
frontier, EntMTP*, tuned thresholds, replays, the recommended policy). `policy(name, latency=curve)` and
`best_tree(latency=...)` re-derive EntMTP* and build the cost-aware policies on another machine's curve
(costs/curves.py) in microseconds (scheduler/factory.py). Tuned binary/ladder thresholds stay those of the
calibration machine.

`entmtp calibrate` (entmtp.calibration) builds a `Profile`; everything else reads its attributes. Each part is
a frozen dataclass whose JSON form is entmtp.codec's (its fields, by their types): the file format below is
the dataclasses' fields.

THE FILE FORMAT (`"format": "entmtp-profile"`, `"version": 2`), one JSON object written with indent 1:

  format, version   "entmtp-profile", 2
  task              the task's name (a shipped task, or the prompt file's stem)
  created           when it was calibrated, "%Y-%m-%dT%H:%M:%S%z"
  model             the base model's fingerprint: name, hidden_size, vocab_size, num_hidden_layers,
                    embedding_sha256 (machine.model_fingerprint; `check` compares the last four)
  heads             name, kind (medusa | hydra), num_heads, checksum (machine.heads_checksum)
  hardware          device, name, cpu_count, threads, dtype, cpu_flags (optional: older files lack it)
  versions          entmtp, torch, transformers
  calibration       latency_prompt_ids (token ids of the prompts decoded to time trees), prompts (traced),
                    positions, max_new_tokens, latency_prompts, latency_tokens, latency_repeats,
                    trace_seconds (null when the traces were shared between profiles), seconds
  latency           nodes and ms_per_step (one per measured tree, in `trees` order), plain_ms_per_step, and
                    trees: name -> {nodes, ms_per_step, measured_tokens_per_second, measured_tokens_per_step,
                    timed_steps (optional; the decoded steps counted)}; "none" is plain decoding. ms_per_step:
                    the step as the probe prices it (costs.priced_ms; profiles made before 2026-12 took a
                    decode's whole step, which for a static tree differs by the choice's ~0.01 ms);
                    measured_tokens_per_second: measured_tokens_per_step at that ms
  modes             "greedy" and, optionally, the T > 0 sections by acceptance rule: "sample" (lossless
                    rejection sampling), "typical" (typical acceptance) and "gumbel" (lossless Gumbel-max
                    sampling, drafts under the same noise), each calibrated at T=0.7:
    growth                max depth ("1".."D") -> the greedy growth's rank paths, in the order they were added
    acceptance_frontier   [{name, nodes, depth, paths, mean_accepted_all_positions, tokens_per_step_simulated,
                          and, for trees measured here, measured: {as latency.trees}}], smallest first
    bank                  the tree names the policies switch between ("none" first), smallest first
    master                {name, paths}: the union tree the dynamic policy takes subtrees of
    acceptance_model      {edges, ctx_edges, rates, rank_rates, rule} (policies.AcceptanceModel)
    signals               name -> {mean, std, quantiles, corr_with_chain_accepted}
    positions             the calibration positions the section's numbers are over
    measured_on           what the calibration machine's latencies decided for this section:
      throughput_frontier   [{name, nodes, tokens_per_step_simulated, ms_per_step, tokens_per_second,
                            measured_tokens_per_second (null if not measured)}]
      best                  EntMTP*: the name of the fastest static tree on the calibration machine
      reference             name -> {nodes, tokens_per_step_simulated, ms_per_step, tokens_per_second}: the
                            published default tree, for comparison ({} when it was not measured)
      thresholds            binary: {small, large, signal, tau_off, tau_on, window}; ladder: {trees, signal,
                            thresholds, window} (each optional; window 8 when absent)
      replay                policy (and "oracle") -> {tokens_per_second, tokens_per_step, steps, usage}
      recommended_policy    the replayed policy of most tokens/s
      plain_tokens_per_second
    sampling              T > 0 sections only: {temperature, acceptance, typical_eps, typical_alpha}
    traces                T > 0 sections only: [{prompt_len, length}] of the section's traces in the sidecar
    acceptance_check      optional: [{depth, predicted, measured, positions}], the acceptance model against
                          held-out positions (calibration.calibrate.check_acceptance)
    trace_tree            typical only: {name, paths}, the union tree its traces verified at every root (a
                          typical section without it comes from an older entmtp: its traces are not read)
  traces            [{prompt_len, length}] of the greedy traces in the sidecar (absent until it is written)
  traces_sha256     the sidecar's sha256 (absent likewise)
  machine           optional (older files lack it: "machine unknown"): machine.record of the calibration
                    machine (CPU model, kernel flags, cores, threads; GPU and driver; library versions)

The traces themselves live in a sidecar `<profile>.traces.safetensors` (calibration.traces), written before
the JSON, each atomically, so `entmtp calibrate --latency-only` can re-measure the hardware side elsewhere and
`--retune` re-derive every section without decoding again.

THE VERSION RULE: a reader reads its own version and the versions it knows how to convert (version 1: each
section's machine fields sat beside the task fields, a measured frontier entry's fields beside its own, and the
acceptance model's rule was optional; `_from_version_1`), and refuses any other with "calibrate again". Change
`VERSION` (and convert the previous one) whenever a field is removed, renamed or changes meaning, or a new
field becomes required; a field that readers may do without (marked optional above) can be added within a
version, but a reader refuses a field it does not know, naming it. `Profile.from_json(p.to_json())` returns
`p`, and `to_json(from_json(d))` returns `d` for every file of this version (tests).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

from .. import metrics
from ..accept import SAMPLED, Rule, Sampling
from ..codec import NOT_WRITTEN, CodecError, JsonForm, from_json, to_json
from ..errors import EntMTPError
from ..files import write_text_atomic
from ..machine import describe_record, hardware, heads_checksum, model_fingerprint
from ..shipped import HEAD_KINDS
from ..tree import RankPath, Tree, TreeError
from .policies import AcceptanceModel, LatencyModel

FORMAT = "entmtp-profile"
VERSION = 2
CONVERTED = {1}  # older versions this reader converts (`_from_version_1`)
PROFILE_TASKS = ("humaneval", "sharegpt", "gsm8k", "writing", "mixed")
DEFAULT_WINDOW = 8  # a threshold policy's EMA window when its entry has none


class ProfileError(EntMTPError):
    """A scheduler profile is missing, corrupt, or made for another model or heads."""


# ---- the parts of a profile (each a dataclass: its JSON form is entmtp.codec's) -----------------------------


@dataclass(frozen=True)
class ModelInfo(JsonForm):
    name: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    embedding_sha256: str

    CHECKED = ("hidden_size", "vocab_size", "num_hidden_layers", "embedding_sha256")  # what must match


@dataclass(frozen=True)
class HeadsInfo(JsonForm):
    name: str
    kind: str
    num_heads: int
    checksum: str


def describe_machine(machine: Mapping | None, hw: Hardware) -> str:
    """A profile's calibration machine in one line: its machine record (machine.describe_record); an older
    profile without one is "machine unknown", with what its hardware section does say."""
    if machine is not None:
        return describe_record(dict(machine))
    flags = (
        "CPU flags not recorded" if hw.cpu_flags is None else "flags " + (", ".join(hw.cpu_flags) or "none")
    )
    return f"machine unknown (the profile records {hw.name!r}, {hw.cpu_count} cores, {flags})"


@dataclass(frozen=True)
class Hardware(JsonForm):
    device: str
    name: str
    cpu_count: int
    threads: int
    dtype: str
    cpu_flags: tuple[str, ...] | None = None  # None: a file from before CPU flags were recorded

    CHECKED = ("device", "name", "threads", "dtype", "cpu_flags")  # what a latency depends on

    def differences(self, here: Hardware) -> list[str]:
        """'key calibrated -> here' for every field that differs (CPU flags only when this profile has them)."""
        keys = [k for k in self.CHECKED if k != "cpu_flags" or self.cpu_flags is not None]
        return [
            f"{k} {getattr(self, k)!r} -> {getattr(here, k)!r}"
            for k in keys
            if getattr(self, k) != getattr(here, k)
        ]


@dataclass(frozen=True)
class Versions(JsonForm):
    entmtp: str
    torch: str
    transformers: str


@dataclass(frozen=True)
class CalibrationRun(JsonForm):
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
class MeasuredTree(JsonForm):
    """A tree's real decodes on the calibration machine (medians over interleaved rounds)."""

    nodes: int
    ms_per_step: float
    measured_tokens_per_second: float  # decode steps only
    measured_tokens_per_step: float
    timed_steps: int | None = None  # None: a file from before it was recorded


@dataclass(frozen=True)
class Latency(JsonForm):
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
        return LatencyModel.from_measured({name: to_json(m) for name, m in self.trees.items()})


@dataclass(frozen=True)
class FrontierEntry(JsonForm):
    """A tree of the acceptance frontier: its search score, its own simulated decodes, and its real decodes
    when it was measured."""

    name: str
    nodes: int
    depth: int
    paths: tuple[RankPath, ...]
    mean_accepted_all_positions: float
    tokens_per_step_simulated: float
    measured: MeasuredTree | None = None

    def tree(self) -> Tree:
        return Tree(self.name, self.paths)


@dataclass(frozen=True)
class ThroughputEntry(JsonForm):
    """A tree of the throughput frontier: simulated tokens per step over its step latency."""

    name: str
    nodes: int
    tokens_per_step_simulated: float
    ms_per_step: float
    tokens_per_second: float
    measured_tokens_per_second: float | None  # None: its latency was interpolated, not measured


@dataclass(frozen=True)
class ReferenceTree(JsonForm):
    nodes: int
    tokens_per_step_simulated: float
    ms_per_step: float
    tokens_per_second: float


@dataclass(frozen=True)
class NamedPaths(JsonForm):
    name: str
    paths: tuple[RankPath, ...]

    def tree(self) -> Tree:
        return Tree(self.name, self.paths)


@dataclass(frozen=True)
class BinaryThresholds(JsonForm):
    small: str
    large: str
    signal: str
    tau_off: float
    tau_on: float
    window: int = DEFAULT_WINDOW


@dataclass(frozen=True)
class LadderThresholds(JsonForm):
    trees: tuple[str, ...]
    signal: str
    thresholds: tuple[float, ...]
    window: int = DEFAULT_WINDOW


@dataclass(frozen=True)
class Thresholds(JsonForm):
    """The tuned threshold policies (None: not tuned, e.g. a bank too small for a ladder)."""

    binary: BinaryThresholds | None = None
    ladder: LadderThresholds | None = None


@dataclass(frozen=True)
class SignalStats(JsonForm):
    mean: float
    std: float
    quantiles: tuple[float, ...]  # at 0.1, 0.25, 0.5, 0.75, 0.9
    corr_with_chain_accepted: float


@dataclass(frozen=True)
class ReplayResult(JsonForm):
    """A policy replayed on the calibration traces with the measured latencies (decode steps only)."""

    tokens_per_second: float
    tokens_per_step: float
    steps: int
    usage: Mapping[str, int]  # tree name -> steps


@dataclass(frozen=True)
class DepthCheck(JsonForm):
    """The acceptance model against held-out calibration positions at one depth: the mean predicted and the
    measured share of positions where the master tree accepts at least `depth` drafts (two folds: fitted on
    half the traces, checked on the other half, and the reverse)."""

    depth: int
    predicted: float
    measured: float
    positions: int


@dataclass(frozen=True)
class TraceMeta(JsonForm):
    """One calibration trace in the sidecar: its prompt length and its whole length (prompt + output)."""

    prompt_len: int
    length: int


@dataclass(frozen=True)
class MachineSection(JsonForm):
    """What the calibration machine's latencies decided for one section: these numbers hold there only (on
    another machine, scheduler/factory.py re-derives the choice from that machine's cost curve)."""

    throughput_frontier: tuple[ThroughputEntry, ...]
    best: str  # EntMTP* on the calibration machine
    reference: Mapping[str, ReferenceTree]
    thresholds: Thresholds
    replay: Mapping[str, ReplayResult]
    recommended_policy: str
    plain_tokens_per_second: float


@dataclass(frozen=True)
class ModeProfile(JsonForm):
    """One acceptance rule's section: what the search found, the bank, the acceptance model, and (under
    `measured_on`) what the calibration machine's latencies decided."""

    growth: Mapping[int, tuple[RankPath, ...]]  # max depth -> rank paths in the order they were grown
    acceptance_frontier: tuple[FrontierEntry, ...]
    bank: tuple[str, ...]
    master: NamedPaths
    acceptance_model: AcceptanceModel
    signals: Mapping[str, SignalStats]
    positions: int
    measured_on: MachineSection
    sampling: Sampling | None = None  # T > 0 sections only
    traces: tuple[TraceMeta, ...] | None = None  # T > 0 sections only: this section's traces in the sidecar
    acceptance_check: tuple[DepthCheck, ...] = ()  # the acceptance model on held-out positions, per depth
    trace_tree: NamedPaths | None = None  # typical only: the union tree its traces verified at every root

    def trees(self) -> dict[str, Tree]:
        """Every tree the section names (acceptance frontier, plain decoding, master), by name."""
        return dict(self._trees)

    @functools.cached_property  # ~40 ms for a shipped section's 92 trees; a first run composes ~100 times
    def _trees(self) -> dict[str, Tree]:
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
    path: Path | None = field(default=None, compare=False, metadata=NOT_WRITTEN)  # the file read or saved

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **to_json(self)}

    @classmethod
    def from_json(cls, d: Mapping, path: Path | None = None) -> Profile:
        """The profile of a JSON document of this format version or one it converts (`codec.CodecError`, a
        ValueError naming the place, or KeyError when it is malformed: `load_profile` names the file)."""
        if d.get("version") in CONVERTED:
            d = _from_version_1(d)
        body = {k: v for k, v in d.items() if k not in ("format", "version")}
        return replace(from_json(cls, body), path=path)

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
            return self.trees(mode)[self.mode(mode).measured_on.best]
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
        rule = Rule(rule)
        for mode in (rule, *(m for m in SAMPLED if m != rule and rule.sampled)):
            if mode in self.modes:
                return mode
        return Rule.GREEDY

    def recommended_policy(self, mode: str = "greedy") -> str:
        return self.mode(mode).measured_on.recommended_policy

    def trace_metas(self, mode: str = "greedy") -> tuple[TraceMeta, ...]:
        """The mode's traces in the sidecar (none recorded: empty)."""
        metas = self.mode(mode).traces if Rule(mode).sampled else self.traces
        return metas or ()

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
                "default; --no-probe turns it off; in Python `scheduler.factory.profile_policy(profile, name, "
                f"latency=costs_for(model, heads).latency())`), or re-measure with `entmtp calibrate --latency-only --profile "
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


# path -> (the file's sha256, the profile read from it): a process reads and validates each file once (a first
# run composes ~10 candidates on the shipped profile, ~0.3 s a read); a file written again is read again, and
# replaces what was kept for its path
_READ: dict[str, tuple[str, Profile]] = {}


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file; clear errors for missing, truncated or foreign files."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ProfileError(
            f"profile {p} {what}: give a profile JSON written by `entmtp calibrate`, or a task name "
            f"({', '.join(PROFILE_TASKS)}) for a shipped one"
        )
    raw = p.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    kept = _READ.get(str(p))
    if kept is None or kept[0] != digest:
        kept = _READ[str(p)] = (digest, _validated(p, raw))
    return kept[1]


def _validated(p: Path, raw: bytes) -> Profile:
    data = _read_document(p, raw)
    try:
        profile = Profile.from_json(data, p)
        for mode in profile.modes:
            profile.trees(mode)  # the trees are valid
        profile.latency.model()
    except CodecError as e:
        raise ProfileError(
            f"profile {p} is malformed at {e.where or 'the top'}: {e.problem}: calibrate again (a field this "
            "entmtp does not know comes from a newer entmtp, or from an edit by hand)"
        ) from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProfileError(f"profile {p} is malformed ({type(e).__name__}: {e}): calibrate again") from e
    return profile


def _read_document(p: Path, raw: bytes) -> dict:
    """The JSON object of a profile file's bytes, of this format and a version this entmtp reads, with every
    top-level section."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(
            f"profile {p} is corrupt or truncated ({e}): calibrate again with `entmtp calibrate`"
        ) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(
            f'{p} is not an entmtp scheduler profile (no "format": "{FORMAT}"): '
            "give a file written by `entmtp calibrate`"
        )
    if data.get("version") != VERSION and data.get("version") not in CONVERTED:
        versions = ", ".join(map(str, sorted({*CONVERTED, VERSION})))
        raise ProfileError(
            f"profile {p} has format version {data.get('version')}, this entmtp reads {versions}: calibrate again"
        )
    missing = [k for k in ("task", "model", "heads", "hardware", "latency", "modes") if k not in data]
    if missing:
        raise ProfileError(
            f"profile {p} lacks {', '.join(missing)} (truncated or hand-edited): calibrate again"
        )
    return data


MACHINE_FIELDS = tuple(f.name for f in fields(MachineSection))  # a version-1 section held them beside its own
MEASURED_FIELDS = tuple(f.name for f in fields(MeasuredTree) if f.name != "nodes")  # ... and a frontier entry


def _from_version_1(d: Mapping) -> dict:
    """A version-1 document as version 2: each section's machine fields under `measured_on` (a missing
    `reference` was {} and a missing `recommended_policy` "static"), a measured frontier entry's fields under
    `measured`, and the acceptance model's rule written out (absent, it was the section's)."""
    modes = {}
    for name, old in d["modes"].items():
        section = {k: v for k, v in old.items() if k not in MACHINE_FIELDS}
        machine = {"reference": {}, "recommended_policy": "static"}
        machine |= {k: old[k] for k in MACHINE_FIELDS if k in old}
        section["measured_on"] = {k: machine[k] for k in MACHINE_FIELDS if k in machine}
        section["acceptance_frontier"] = [_frontier_entry_v1(e) for e in old["acceptance_frontier"]]
        rule = Sampling(**old["sampling"]).rule if "sampling" in old else "greedy"
        section["acceptance_model"] = {"rule": rule, **old["acceptance_model"]}
        modes[name] = section
    return {**d, "version": VERSION, "modes": modes}


def _frontier_entry_v1(e: Mapping) -> dict:
    if "ms_per_step" not in e:
        return dict(e)
    own = {k: v for k, v in e.items() if k not in MEASURED_FIELDS}
    return {**own, "measured": {"nodes": e["nodes"], **{k: e[k] for k in MEASURED_FIELDS if k in e}}}


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
