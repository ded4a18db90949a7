"""Compose: one policy per acceptance rule on a loaded model, and the engine that runs them."""

from __future__ import annotations

from dataclasses import dataclass

from .. import metrics
from ..accept import ACCEPTANCE, Sampling
from ..console import say
from ..costs import CostCorrector, CostCurve
from ..engine import Engine
from ..errors import EntMTPError
from ..policy import TreePolicy, static
from ..scheduler.factory import section_policy
from ..scheduler.hybrid import hybrid
from ..shipped import HEAD_KINDS
from ..tree import Tree
from .loaded import Loaded
from .spec import EngineSpec


@dataclass
class Composed:
    """The policies an engine runs, one per acceptance rule, and why (what `Plan` reports)."""

    policies: dict[str, TreePolicy]  # every rule of accept.ACCEPTANCE -> the policy its generations run
    rule: str  # the spec's own rule (its temperature and acceptance)
    name: str  # the rule's policy: a policy name, "tree <name>", "plain" or "lookup"
    reason: str
    expected: float  # tokens/s expected of the rule's policy on the loaded costs (0: not measured)
    others: dict[str, str]  # rules with a policy from their own profile section -> its name
    lookup_rules: tuple[str, ...]  # rules whose trees get prompt-lookup drafts
    uses_heads: bool  # whether any policy drafts with the heads (else the engine runs without them)
    observers: tuple = ()  # told each generation's steps: the cost curve's corrector (costs.CostCorrector)
    # the curve the spec's rule's policy was sized on, the engine's own: `loaded.costs`, or the curve without heads
    # where that policy drafts with none (`Loaded.curve_without_heads`; each rule's lookup branch is sized so)
    costs: CostCurve | None = None

    @property
    def policy(self) -> TreePolicy:
        return self.policies[self.rule]


def compose(loaded: Loaded, spec: EngineSpec = EngineSpec(), *, profile=None, log=None) -> Composed:
    """One policy per acceptance rule on `loaded` (the module docstring's `policy`): each rule's own from its
    profile section (a tree is the same for all), made a policy once (`_as_policy`), and the prompt-lookup
    branch wrapped around it once where `spec.lookup` asks for it under that rule (scheduler.hybrid, sized on
    `loaded.costs`). `profile`: one resolved for `spec.profile` and checked against `loaded` already (the bench
    reads each once); None: resolved and checked here. The cost curve's corrector observes the generations."""
    inner, name, reason, expected, others = _policy(spec, loaded, profile, log or say)
    main = _as_policy(inner)
    inners = {r: _as_policy(others[r][0]) if r in others else main for r in ACCEPTANCE}
    uses_heads = loaded.heads is not None and any(_drafts(p) for p in inners.values())
    lookup = spec.lookup

    def priced(policy: TreePolicy) -> CostCurve | None:
        """The curve a rule's lookup branch is sized on: as its generations run, without heads where its policy
        drafts with none (the engine builds no drafter for them: engine.py), even where another rule's does."""
        if lookup is not None and loaded.heads is not None and not _drafts(policy):
            return loaded.curve_without_heads() or loaded.costs
        return loaded.costs

    # typical acceptance gets lookup drafts only when asked (Lookup.typical) or without heads
    rules = tuple(
        r for r in ACCEPTANCE if lookup is not None and (r.exclusive or not uses_heads or lookup.typical)
    )
    wrapped: dict[int, TreePolicy] = {}  # id(inner) -> its wrap: rules that share a policy share its wrap
    for r in rules:
        if id(inners[r]) not in wrapped:
            wrapped[id(inners[r])] = hybrid(inners[r], lookup, priced(inners[r]))
    policies = {r: wrapped[id(inners[r])] if r in rules else inners[r] for r in ACCEPTANCE}
    rule = Sampling(spec.temperature, spec.acceptance).rule
    costs = priced(inners[rule])  # the engine's curve (forced chains, the corrector): the spec's rule's
    names = {r: n for r, (_, n) in others.items()}
    corrector = CostCorrector.for_curve(costs) if costs is not None and loaded.probed else None
    observers = (corrector,) if corrector is not None else ()
    return Composed(policies, rule, name, reason, expected, names, rules, uses_heads, observers, costs)


def assemble(loaded: Loaded, composed: Composed, spec: EngineSpec = EngineSpec()) -> Engine:
    """The engine running `composed`'s policies on `loaded`'s model: with its heads when a policy drafts with
    them, and the curve the policies were sized on (steps that disagree with it correct that cached curve)."""
    return Engine(
        loaded.model,
        loaded.tokenizer,
        heads=loaded.heads if composed.uses_heads else None,
        policy=composed.policy,
        policies=composed.policies,
        kv=spec.kv,
        graphs=spec.graphs,
        costs=composed.costs,
        observers=composed.observers,
        suffix=_suffix_cache(spec),
    )


def fixed(loaded: Loaded, policy: str | Tree | TreePolicy | None = None) -> Engine:
    """The engine of one policy under every acceptance rule on `loaded`: a tree (or its name), a policy, or
    None (plain decoding), with no lookup drafts and no cost observer, assembled as `build`'s are. What the
    offline commands decode with (calibrate's latency decodes and traces, eval-heads' runs), on a `Loaded` of
    their own (`loaded.given`)."""
    main = _as_policy(policy)
    uses_heads = loaded.heads is not None and _drafts(main)
    name = "plain" if policy is None else getattr(main, "name", type(main).__name__)
    composed = Composed(
        {r: main for r in ACCEPTANCE},
        Sampling().rule,
        name,
        "given",
        0.0,
        {},
        (),
        uses_heads,
        (),
        loaded.costs,
    )
    return assemble(loaded, composed, loaded.spec)


def _suffix_cache(spec: EngineSpec):
    if not spec.suffix_cache:
        return None
    from ..suffix import SuffixCache

    return SuffixCache(max_bytes=spec.suffix_cache * 2**20)


def _as_policy(inner: str | TreePolicy | None) -> TreePolicy:
    """The one place a name from the user becomes a policy: a spec's tree name (`--tree`) or a tree (a profile
    section's when no bank tree beats a plain step here: the root alone) the static policy of that tree, None
    (no heads, no tree) plain decoding, a profile section's policy itself."""
    if inner is None:
        return static(Tree.root_only())
    return static(inner) if isinstance(inner, (str, Tree)) else inner


def _drafts(policy: TreePolicy) -> bool:
    """Whether any tree `policy` may verify (its master included) has head nodes."""
    master = [policy.master] if policy.master is not None else []
    return any(t.heads_tree.num_nodes for t in (*policy.trees, *master))


def _policy(spec: EngineSpec, loaded: Loaded, profile, log):
    """(tree or policy, its name, why, expected tokens/s, {other acceptance rule: (policy, name)}) on `loaded`.
    A policy from a profile has one per rule, each from the profile's section for it (a server's requests
    differ in temperature); a tree is the same under every rule. `profile`: see `compose`."""
    heads_spec, model, heads, costs = loaded.heads_spec, loaded.model, loaded.heads, loaded.costs
    plain_speed = metrics.replay_tokens_per_second(1, costs.plain_ms) if costs is not None else 0.0
    if heads is None:
        name = (
            "lookup" if spec.lookup is not None else ("plain" if spec.tree is None else f"tree {spec.tree}")
        )
        return spec.tree, name, "no heads", plain_speed, {}
    if spec.tree is not None and spec.policy in (None, "static"):
        return spec.tree, f"tree {spec.tree}", "as asked", _tree_speed(spec.tree, costs), {}
    from ..scheduler.profiles import ProfileError, resolve_profile, shipped_profiles_dir

    if profile is None:
        if spec.profile is None and heads_spec not in HEAD_KINDS:
            if spec.policy is not None:
                raise EntMTPError(
                    f"--policy {spec.policy} needs a profile for these heads: make one with `entmtp calibrate "
                    f"--heads {heads_spec} --task TASK --out P.json` and pass --profile P.json"
                )
            log("no --profile for these heads: using the static tree tree_8")
            return "tree_8", "tree tree_8", "no profile for these heads", _tree_speed("tree_8", costs), {}
        if spec.profile is None and not (shipped_profiles_dir(heads_spec) / "mixed.json").exists():
            log(f"no shipped scheduler profile for {heads_spec} heads: using the static tree tree_8")
            return "tree_8", "tree tree_8", "no shipped profile", _tree_speed("tree_8", costs), {}
        profile = resolve_profile(spec.profile, heads_spec)
        profile.check(model, heads, warn_hardware=costs is None)
    rule = Sampling(spec.temperature, spec.acceptance).rule
    mode = profile.mode_for_rule(rule)
    # the heads' trees against a plain step without them too (its curve measured only where a tree wins)
    heads_less = loaded.curve_without_heads
    policy, name, reason, expected = section_policy(profile, mode, costs, spec.policy, heads_less)
    others, built = {}, {}  # rules that share a section (gumbel runs sample's) share its policy
    for other in ACCEPTANCE:
        other_mode = profile.mode_for_rule(other)
        if other == rule or other_mode == mode:
            continue
        if other_mode not in built:
            try:
                built[other_mode] = section_policy(profile, other_mode, costs, spec.policy, heads_less)[:2]
            except ProfileError as e:  # a forced --policy this section cannot build: the rule runs `policy`
                log(f"{other} acceptance runs the {rule} policy: {e}")
                continue
        others[other] = built[other_mode]
    return policy, name, reason, expected, others


def _tree_speed(tree: str, costs: CostCurve | None) -> float:
    """A forced tree accepts the same under any dtype: its speed ranks dtypes by its step cost alone."""
    if costs is None:
        return 0.0
    from ..tree import load_tree

    return metrics.replay_tokens_per_second(1, float(costs.latency()(load_tree(tree).num_nodes)))
