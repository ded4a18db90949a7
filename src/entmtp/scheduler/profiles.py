"""Scheduler profiles: one calibrated tree bank per (base model, heads, task), as files.

What a profile holds splits by what it depends on. The task part (traces, acceptance frontier with each tree's
simulated tokens per step, bank, master tree, acceptance model, signal statistics) is portable across
machines. The machine part (the `latency` section: ms per step of each measured tree, from the machine that
calibrated) is not: `policy(name, costs=curve)` and `best_tree(latency=...)` re-derive EntMTP* and build the
cost-aware policies on another machine's curve (costs.py) in microseconds. Tuned binary/ladder thresholds and
the recommended policy stay those of the calibration machine.

A profile is a JSON file (the bank, both frontiers, the latency profile, the acceptance model, the signal
statistics, the tuned thresholds, the replayed policies, and what it was made from) with a sidecar
`*.traces.safetensors` holding the calibration traces, so `entmtp calibrate --latency-only` can re-measure
the hardware side on another machine and re-tune without decoding again. Both are written atomically
(sidecar first, JSON last, each by rename), and the JSON records the sidecar's sha256.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import EntMTPError
from ..files import write_text_atomic
from ..machine import hardware, heads_checksum, model_fingerprint
from ..shipped import HEAD_KINDS
from ..tree import Tree, TreeError
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

POLICY_NAMES = POLICIES  # what Profile.policy builds


class ProfileError(EntMTPError):
    """A scheduler profile is missing, corrupt, or made for another model or heads."""


# ---- the profile -----------------------------------------------------------------------------------------


@dataclass
class Profile:
    data: dict  # the JSON document
    path: Path | None = None

    # -- reading --
    @property
    def task(self) -> str:
        return self.data["task"]

    def mode(self, mode: str = "greedy") -> dict:
        modes = self.data["modes"]
        if mode not in modes:
            raise ProfileError(f"profile {self.where} has no {mode!r} section (it holds {', '.join(modes)})")
        return modes[mode]

    def trees(self, mode: str = "greedy") -> dict[str, Tree]:
        """Every tree the profile names (acceptance frontier, master), by name."""
        m = self.mode(mode)
        out = {}
        for entry in m["acceptance_frontier"]:
            out[entry["name"]] = Tree(entry["name"], tuple(tuple(p) for p in entry["paths"]))
        out["none"] = Tree.root_only()  # plain decoding: in every bank
        master = m["master"]
        out[master["name"]] = Tree(master["name"], tuple(tuple(p) for p in master["paths"]))
        return out

    def bank(self, mode: str = "greedy") -> list[Tree]:
        """The trees the policies switch between, smallest first: every frontier tree whose latency was
        measured (the throughput frontier, EntMTP* included, and the larger trees that pay on confident steps)."""
        trees = self.trees(mode)
        return [trees[name] for name in self.mode(mode)["bank"]]

    def best_tree(self, mode: str = "greedy", latency: LatencyModel | None = None) -> Tree:
        """EntMTP*: the fastest static tree of the task, plain decoding included; on the calibration hardware
        (stored), or re-derived under `latency` (another machine's curve)."""
        if latency is None:
            return self.trees(mode)[self.mode(mode)["best"]]
        speed = self.static_speeds(mode, latency)
        return self.trees(mode)[max(speed, key=speed.get)]

    def static_speeds(self, mode: str, latency: LatencyModel) -> dict[str, float]:
        """Expected tokens/s of every bank tree (the root-only tree: plain decoding) under `latency`:
        simulated tokens per step on the calibration positions / the curve's ms per step."""
        tps = {e["name"]: e["tokens_per_step_simulated"] for e in self.mode(mode)["acceptance_frontier"]}
        tps["none"] = 1.0
        return {t.name: 1000.0 * tps[t.name] / latency.ms_of(t) for t in self.bank(mode)}

    def acceptance(self, mode: str = "greedy") -> AcceptanceModel:
        return AcceptanceModel.from_json(self.mode(mode)["acceptance_model"])

    def latency(self) -> LatencyModel:
        """The step latencies measured at calibration (`ms_of(tree)`: a tree's own, else interpolated)."""
        return LatencyModel.from_measured(self.data["latency"]["trees"])

    def mode_for(self, temperature: float) -> str:
        """The section a run uses: `typical` (calibrated at T=0.7) for any T > 0 when the profile has it."""
        return "typical" if temperature > 0 and "typical" in self.data["modes"] else "greedy"

    def recommended_policy(self, mode: str = "greedy") -> str:
        return self.mode(mode).get("recommended_policy", "static")

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
        latency = self.latency() if stored else latency
        if name == "static":
            return StaticPolicy(self.best_tree(mode, None if stored else latency))
        trees = self.trees(mode)
        if name in ("binary", "ladder"):
            return self._threshold_policy(name, m, trees)
        if name == "cost":
            bank = self.bank(mode)
            return CostPolicy(bank, self.acceptance(mode), [latency.ms_of(t) for t in bank], online=online)
        if name == "dynamic":
            return DynamicPolicy(
                trees[m["master"]["name"]],
                self.acceptance(mode),
                latency,
                require_contiguous=require_contiguous,
                online=online,
            )
        raise ProfileError(f"unknown policy {name!r}: use {', '.join(POLICY_NAMES)}")

    def _threshold_policy(self, name: str, m: dict, trees: dict[str, Tree]):
        th = m["thresholds"].get(name)
        if th is None:
            raise ProfileError(f"profile {self.where} has no tuned {name} thresholds: calibrate again")
        if name == "binary":
            return BinaryPolicy(
                trees[th["small"]],
                trees[th["large"]],
                th["signal"],
                th["tau_off"],
                th["tau_on"],
                window=th.get("window", 8),
            )
        return LadderPolicy(
            [trees[n] for n in th["trees"]], th["signal"], th["thresholds"], window=th.get("window", 8)
        )

    @property
    def where(self) -> str:
        """The profile's file, or its task when it has none yet (for messages)."""
        return str(self.path) if self.path else f"<{self.data.get('task', '?')}>"

    # -- checks --
    def check(self, model, heads, *, warn_hardware: bool = True) -> None:
        """Raise ProfileError if made for another base model or heads, or its trees do not fit the heads;
        warn if made on other hardware (latencies and so the bank may not hold here)."""
        fix = "calibrate for this model and heads with `entmtp calibrate`, or pass the right --profile"
        got = model_fingerprint(model)
        want = self.data["model"]
        for key in ("hidden_size", "vocab_size", "num_hidden_layers", "embedding_sha256"):
            if want.get(key) != got[key]:
                raise ProfileError(
                    f"profile {self.where} was made for base model {want.get('name')!r} ({key} {want.get(key)}), "
                    f"not this one ({got['name']!r}, {key} {got[key]}): {fix}"
                )
        checksum = heads_checksum(heads)
        if self.data["heads"]["checksum"] != checksum:
            raise ProfileError(
                f"profile {self.where} was made for other heads ({self.data['heads']['name']}, checksum "
                f"{self.data['heads']['checksum']}), not these (checksum {checksum}): {fix}"
            )
        contiguous = heads.config.kind == "hydra"
        for tree in (t for mode in self.data["modes"] for t in self.trees(mode).values()):
            try:
                tree.check_fits(heads.config.num_heads, require_contiguous=contiguous)
            except TreeError as e:
                raise ProfileError(f"profile {self.where}: {e}") from None
        if warn_hardware:
            here, there = hardware(model), self.data["hardware"]
            keys = ("device", "name", "threads", "dtype") + (("cpu_flags",) if "cpu_flags" in there else ())
            if any(here[k] != there.get(k) for k in keys):
                diff = ", ".join(
                    f"{k} {there.get(k)!r} -> {here[k]!r}" for k in keys if here[k] != there.get(k)
                )
                warnings.warn(
                    f"profile {self.where} was calibrated on other hardware ({diff}): its stored latencies "
                    "may not hold here; build policies on this machine's measured step costs instead (the "
                    "default; --no-probe turns it off; in Python `profile.policy(name, latency=costs_for(model, "
                    f"heads).latency())`), or re-measure with `entmtp calibrate --latency-only --profile "
                    f"{self.where}` (minutes)",
                    stacklevel=2,
                )

    # -- writing --
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON atomically (by rename); the traces sidecar, when there is one, is written before it
        (calibration.traces.save_traces)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        write_text_atomic(path, json.dumps(self.data, indent=1) + "\n")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file; clear errors for missing, truncated or foreign files."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ProfileError(
            f"profile {p} {what}: give a profile JSON written by `entmtp calibrate`, or a task name "
            f"({', '.join(PROFILE_TASKS)}) for a shipped one"
        )
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
            f"profile {p} has format version {data.get('version')}, this entmtp reads {VERSION}: "
            "calibrate again"
        )
    missing = [k for k in ("task", "model", "heads", "hardware", "latency", "modes") if k not in data]
    if missing:
        raise ProfileError(
            f"profile {p} lacks {', '.join(missing)} (truncated or hand-edited): calibrate again"
        )
    profile = Profile(data, p)
    try:
        for mode in data["modes"]:
            profile.trees(mode)
            profile.acceptance(mode)
        profile.latency()
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"profile {p} is malformed ({type(e).__name__}: {e}): calibrate again") from e
    return profile


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
