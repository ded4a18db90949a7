"""Policies from a profile: the one place that turns a profile section and a machine's costs into a policy.

  profile_policy    a named policy (static, binary, ladder, cost, dynamic) of a section, on a latency curve
                    (this machine's, `CostCurve.latency()`; None: the calibration machine's stored latencies)
  scheduled_policy  what to run on a machine's curve when no policy is named: plain steps where no bank tree
                    is expected to beat a plain step there, else the section's recommended policy (`dynamic`
                    in place of binary and ladder, whose thresholds only hold on the calibration machine)
  section_policy    `scheduled_policy`, or the stored latencies' policy when nothing was measured (build/)

Expected tokens/s of a bank tree: its simulated tokens per step on the calibration positions over its step
cost on the curve (`Profile.static_speeds`).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import metrics
from ..costs.curves import CostCurve, LatencyModel
from ..policy import StaticPolicy
from ..tree import Tree
from .policies import POLICIES, BinaryPolicy, CostPolicy, DynamicPolicy, LadderPolicy
from .profiles import Profile, ProfileError, Thresholds

THRESHOLD_POLICIES = ("binary", "ladder")  # tuned on the calibration machine's latencies


def profile_policy(
    profile: Profile,
    name: str,
    mode: str = "greedy",
    require_contiguous: bool = True,
    online: bool = True,
    latency: LatencyModel | None = None,
):
    """A policy object for the engine, built from `profile`'s task part and `latency` (this machine's cost
    curve, `CostCurve.latency()`; None: the latencies stored at calibration). `online`: `cost` and `dynamic`
    recalibrate their acceptance model on the text at hand (policies.OnlineCalibration)."""
    m = profile.mode(mode)
    stored = latency is None
    latency = profile.latency.model() if stored else latency
    if name == "static":
        return StaticPolicy(profile.best_tree(mode, None if stored else latency))
    trees = m.trees()
    if name in THRESHOLD_POLICIES:
        return _threshold_policy(profile, name, m.measured_on.thresholds, trees)
    if name == "cost":
        bank = profile.bank(mode)
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


def _threshold_policy(profile: Profile, name: str, thresholds: Thresholds, trees: dict[str, Tree]):
    th = getattr(thresholds, name)
    if th is None:
        raise ProfileError(f"profile {profile.where} has no tuned {name} thresholds: calibrate again")
    if name == "binary":
        return BinaryPolicy(
            trees[th.small], trees[th.large], th.signal, th.tau_off, th.tau_on, window=th.window
        )
    return LadderPolicy([trees[n] for n in th.trees], th.signal, th.thresholds, window=th.window)


def scheduled_policy(
    profile: Profile,
    mode: str,
    latency: LatencyModel,
    name: str | None = None,
    heads_less: Callable[[], CostCurve | None] | None = None,
):
    """(policy or the root-only tree, why, expected tokens/s) of a profile on a machine's `latency` curve:
    the policy `name`, or by default plain steps when no bank tree is expected to beat a plain step here, else
    the profile's recommended policy (`dynamic` in place of binary and ladder, whose thresholds were tuned
    on the calibration machine's latencies). `heads_less`: the machine's curve without heads (measured when
    first called): the heads' trees must also beat a plain step of an engine without heads, whose steps are
    cheaper (on llama.cpp the heads keep the embeddings on: every token an output row with its hidden state;
    on the AMX Xeon the shipped Q4_1 model's best tree 116.8 tokens/s against 112.6 plain with heads, 118.9
    without)."""
    speeds = profile.static_speeds(mode, latency)
    best = max(speeds, key=speeds.get)
    if best == "none" and name is None:
        why = f"no tree of the {profile.task} profile beats a plain step on this machine's costs"
        return Tree.root_only(), why, speeds[best]
    if name is None and heads_less is not None and (plain := heads_less()) is not None:
        without = metrics.replay_tokens_per_second(1, plain.plain_ms)
        if without >= speeds[best]:
            why = (
                f"no tree of the {profile.task} profile beats a plain step without heads on this machine's "
                f"costs ({best} {speeds[best]:.1f} tokens/s, plain without heads {without:.1f})"
            )
            return Tree.root_only(), why, without
    if name is None:
        name = profile.recommended_policy(mode)
        if name in THRESHOLD_POLICIES:  # tuned on the calibration machine's latencies: they do not transfer
            name = "dynamic"
    why = f"{profile.task} profile, {name}; EntMTP* here: {best} ({speeds[best]:.1f} tokens/s expected)"
    return profile_policy(profile, name, mode, latency=latency), why, speeds[best]


def section_policy(
    profile: Profile,
    mode: str,
    costs: CostCurve | None,
    name: str | None = None,
    heads_less: Callable[[], CostCurve | None] | None = None,
):
    """(policy, its name, why, expected tokens/s) from `profile`'s section `mode`: the policy `name` (None:
    the machine's choice, `scheduled_policy`, against `heads_less`'s plain step too) on the curve `costs`;
    None: the profile's stored latencies."""
    name_or_recommended = name or profile.recommended_policy(mode)
    if costs is None:
        policy = profile_policy(profile, name_or_recommended, mode)
        return policy, name_or_recommended, "the profile's stored latencies (no probe)", 0.0
    policy, reason, expected = scheduled_policy(profile, mode, costs.latency(), name, heads_less)
    return policy, ("plain" if isinstance(policy, Tree) else name_or_recommended), reason, expected
