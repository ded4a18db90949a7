"""`entmtp calibrate`: build a task's scheduler profile on this hardware.

1. traces     greedy generations of the task's calibration prompts, teacher-forced through the heads
              (traces.py): the rank vector of every position, the probe's probabilities, the raw signals
2. search     EntMTP's greedy growth per max depth 1..D up to 90 nodes, scored on every position at once;
              the acceptance frontier, each tree re-scored by simulating its own decodes (search.py)
3. latency    a grid of frontier trees priced by the one probe (costs/probe.py: the engine's own steps,
              as every cost curve is): median ms per step against nodes; and real decodes of each
              (interleaved, repeated, start dropped): its measured tokens/step, and tokens/s at its ms
4. frontier   tokens/s of each measured tree = simulated tokens/step over all calibration positions / its
              median step latency (the direct tokens/s of a few prompts is kept beside it: on a shared CPU it
              is far noisier); keep trees faster than every smaller one; the fastest is EntMTP*
5. tuning     the acceptance model behind `cost`/`dynamic`, thresholds of `binary`/`ladder` swept by replaying
              the traces (replay.py); every policy and the oracle replayed; the best recommended
Trade against the paper (union rollouts per growth round): one generation per prompt replaces ~90 rounds of
union-tree decodes, and greedy scores are exact own-tree numbers rather than union-biased ones. What it gives
up: typical acceptance at T > 0 (`add_sampled`) is traced on sampled generations whose off-trajectory paths
are known one level deep only, so its section is an approximation; the lossless rule's section is exact in
distribution (traces.py).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from rich.progress import Progress

from .. import __version__, metrics
from ..accept import Rule, Sampling
from ..build import fixed, given
from ..costs.curves import LatencyModel
from ..engine import Engine
from ..errors import EntMTPError
from ..machine import hardware, heads_checksum, model_fingerprint, record
from ..policy import StaticPolicy
from ..scheduler.policies import (
    AcceptanceModel,
    BinaryPolicy,
    CostPolicy,
    DynamicPolicy,
    ExpectedAccepted,
    LadderPolicy,
    PathProbabilities,
)
from ..scheduler.profiles import (
    BinaryThresholds,
    CalibrationRun,
    DepthCheck,
    FrontierEntry,
    Hardware,
    HeadsInfo,
    LadderThresholds,
    Latency,
    MachineSection,
    MeasuredTree,
    ModelInfo,
    ModeProfile,
    NamedPaths,
    Profile,
    ReferenceTree,
    ReplayResult,
    SignalStats,
    Thresholds,
    ThroughputEntry,
    Versions,
)
from ..scheduler.signals import SIGNALS
from ..settings import setting
from ..tree import Tree, load_tree, union_tree
from .replay import Replay, oracle, replay
from .search import FrontierTree, Scores, TraceAcceptance, acceptance_frontier, grow, reachable, simulate
from .traces import MISS, TOPK, Trace, generate_traces, load_traces, probe_depth

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 90)  # frontier sizes whose latency is measured
EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97, 1.0)  # probability bins
CTX_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.97, 1.0)  # bins of head 1's top-1 probability (step context)
SHRINK = 20.0  # pseudo-counts pulling a thin (context, bin) cell toward the rate over all contexts
MASTER_MAX = 64  # nodes of the dynamic policy's master tree
DEFAULT_TREE = "mc_sim_7b_63"  # Medusa's and Hydra's published default


@dataclass(frozen=True)
class CalibrationSettings:
    """How a calibration decodes and measures (`entmtp calibrate`'s flags: settings.py)."""

    # the paper: 256; halved for a 2-core CPU budget
    max_new_tokens: int = setting(128, help="new tokens per calibration prompt (default %(default)s)")
    latency_prompts: int = setting(2, help="prompts decoded per measured tree")
    latency_tokens: int = setting(48, help="new tokens per decode of a measured tree")
    # medians over all their steps
    latency_repeats: int = setting(2, help="interleaved rounds of latency measurement")
    tree_seconds: float = setting(  # then it stops early
        8.0,
        help="decoding time per measured tree, all rounds together, and the probe's time for all of them "
        "(default 8: caps a slow machine's run)",
    )
    window: int = 8  # EMA window of the signal policies


def measure_trees(
    model,
    tokenizer,
    heads,
    trees: Sequence[Tree],
    prompts: Sequence[list[int]],
    settings: CalibrationSettings,
    progress: Progress | None = None,
) -> dict[str, MeasuredTree]:
    """Per tree (and plain decoding, "none") the ms per step the one probe prices it at on this machine
    (`costs.measure_trees`: the engine's own steps, at the prompts' median length plus half a latency
    generation), and the tokens per step it takes decoding `prompts` (interleaved prompt by prompt, repeated;
    the first 2 steps of each generation dropped). Each tree's decoding is capped by time (`tree_seconds`,
    once it has `MIN_TIMED_STEPS` steps), and so is the probe's, so a machine where big trees cost seconds per
    step still finishes in minutes."""
    from ..costs.measured import PLAIN
    from ..costs.measured import measure_trees as probed

    context = int(statistics.median(len(p) for p in prompts)) + settings.latency_tokens // 2
    step_ms = probed(model, heads, trees, context=context, budget_s=settings.tree_seconds, progress=progress)
    loaded = given(model, tokenizer, heads)
    engines = {PLAIN: fixed(loaded)} | {t.name: fixed(loaded, t) for t in trees}
    tokens: dict[str, list[int]] = {n: [] for n in engines}
    spent: dict[str, float] = dict.fromkeys(engines, 0.0)
    job = (
        progress.add_task("tokens per step", total=settings.latency_repeats * len(prompts) * len(engines))
        if progress
        else None
    )
    for _ in range(settings.latency_repeats):
        for ids in prompts:
            for name, e in engines.items():
                if spent[name] < settings.tree_seconds or len(tokens[name]) < MIN_TIMED_STEPS:
                    spent[name] += _generation(e, ids, settings, tokens[name])
                if progress:
                    progress.advance(job)
    out = {}
    for name, e in engines.items():
        nodes = 0 if name == PLAIN else e.policy.trees[0].num_nodes
        tps = statistics.mean(tokens[name])
        out[name] = MeasuredTree(
            nodes=nodes,
            ms_per_step=step_ms[name],
            measured_tokens_per_second=metrics.replay_tokens_per_second(tps, step_ms[name]),  # decode steps
            measured_tokens_per_step=tps,
            timed_steps=len(tokens[name]),
        )
    return out


MIN_TIMED_STEPS = 4  # a tree's decoding stops at its time cap only once it has this many counted steps


def _generation(engine, ids, settings, tokens: list[int]) -> float:
    """Decode up to `latency_tokens` after `ids`, stopping at the tree's time cap; appends each counted step's
    tokens (the first 2 steps are dropped, as before: a generation's start) and returns the seconds spent."""
    t0 = time.perf_counter()
    steps = []
    for event in engine.stream(ids, max_new_tokens=settings.latency_tokens):
        if event.step is not None:
            steps.append(event.step)
        if (
            time.perf_counter() - t0 > settings.tree_seconds
            and len(tokens) + len(steps) - 2 >= MIN_TIMED_STEPS
        ):
            break
    counted = steps[2:] or steps  # a generation of 1-2 steps (a tree that accepts everything) still counts
    tokens += [s.tokens for s in counted]
    return time.perf_counter() - t0


def fit_acceptance(
    traces: Sequence[Trace], probe_depth: int, num_heads: int, rule: str = "greedy"
) -> AcceptanceModel:
    """P(node right | parent path right) per depth and step context (head 1's top-1 probability, binned at
    CTX_EDGES): by the head's probability of the node's token (binned at EDGES, made non-decreasing) where the
    probe covers the depth, by rank (made non-increasing) everywhere. Thin cells shrink toward the rate over
    all contexts. "Right" is the acceptance `rule`'s: the next token of the trajectory (greedy: the base
    argmax; sample: the sampled token), seen for every candidate below the trajectory's own prefix; or
    passing the typical test (typical), seen for every union-tree node whose parent was accepted."""
    if Rule(rule).exclusive != (traces[0].passes is None):
        raise EntMTPError(f"fit_acceptance({rule!r}) got traces of another rule (union passes are typical's)")
    probe = torch.cat([t.probe for t in traces])  # [P, Dp, K]
    ctx_all = torch.bucketize(probe[:, 0, 0].exp(), torch.tensor(CTX_EDGES[1:-1]))  # [P]
    n_ctx, nb = len(CTX_EDGES) - 1, len(EDGES) - 1
    centers = torch.tensor([(a + b) / 2 for a, b in zip(EDGES[:-1], EDGES[1:], strict=True)])
    rates, rank_rates = [], []
    for d, (right, rank, pos) in enumerate(_observations(traces, num_heads)):  # [n] each
        c = ctx_all[pos]
        count = torch.bincount(rank, minlength=TOPK).float()
        overall = (torch.bincount(rank, weights=right, minlength=TOPK) + 0.5) / (count + 1.0)  # [K]
        per_rank = []
        for k in range(n_ctx):
            sub = c == k
            hits = torch.bincount(rank[sub], weights=right[sub], minlength=TOPK)
            r = (hits + SHRINK * overall) / (torch.bincount(rank[sub], minlength=TOPK) + SHRINK)
            per_rank.append(tuple(float(x) for x in np.minimum.accumulate(r.numpy())))
        rank_rates.append(tuple(per_rank))
        if d < probe_depth:
            bins = torch.bucketize(probe[pos, d, rank].exp(), torch.tensor(EDGES[1:-1]))  # [n]
            hits_all = torch.bincount(bins, weights=right, minlength=nb)
            tot_all = torch.bincount(bins, minlength=nb).float()
            prior = (hits_all + 2 * centers) / (
                tot_all + 2
            )  # a weak prior at the bin's centre where data is thin
            per_q = []
            for k in range(n_ctx):
                b, w = bins[c == k], right[c == k]
                hits = torch.bincount(b, weights=w, minlength=nb)
                tot = torch.bincount(b, minlength=nb).float()
                rate = (hits + SHRINK * prior) / (tot + SHRINK)
                per_q.append(tuple(float(x) for x in np.maximum.accumulate(rate.numpy())))
            rates.append(tuple(per_q))
    return AcceptanceModel(EDGES, CTX_EDGES, tuple(rates), tuple(rank_rates), rule)


def _observations(traces: Sequence[Trace], num_heads: int) -> list[tuple[torch.Tensor, ...]]:
    """Per depth d + 1 = 1..num_heads, every node seen with its parent accepted: (right [n] float, its rank
    [n], the position [n] it was seen at, numbered over all traces)."""
    out = []
    if traces[0].passes is None:  # rank vectors: all K candidates below the trajectory's own prefix
        ranks = torch.cat([t.ranks for t in traces])  # [P, D]
        for d in range(num_heads):
            seen = ((ranks[:, :d] < MISS).all(dim=1)).nonzero().flatten()  # the parent path was right
            right = (ranks[seen, d, None] == torch.arange(TOPK)).flatten().float()  # [n * K]
            out.append((right, torch.arange(TOPK).repeat(len(seen)), seen.repeat_interleave(TOPK)))
        return out
    union = traces[0].union
    passes = torch.cat([t.passes for t in traces])  # [P, N]
    alive = torch.from_numpy(np.concatenate([reachable(t.passes, union) for t in traces]))  # [P, N]
    accepted = torch.cat([torch.ones(len(alive), 1, dtype=torch.bool), alive], dim=1)  # [P, N+1]: root first
    for d in range(num_heads):
        nodes = (union.depths[1:] == d + 1).nonzero().flatten()  # [n_d] node ids - 1
        pos, k = accepted[:, union.parents[1 + nodes]].nonzero(as_tuple=True)  # the parent was accepted
        node = nodes[k]
        out.append((passes[pos, node].float(), union.ranks[1 + node], pos))
    return out


def check_acceptance(traces: Sequence[Trace], heads, rule: str, master: Tree) -> tuple[DepthCheck, ...]:
    """The acceptance model against measured acceptance on held-out positions, per depth k: the mean of its
    predicted P(the master tree accepts >= k drafts) against the share of positions where it did. Two folds:
    fitted on the even-numbered traces and checked on the odd ones, and the reverse. Empty with one trace."""
    if len(traces) < 2:
        return ()
    depth, paths, whole = master.depth, master.path_set, torch.ones(1, master.size)
    predicted, measured, n = np.zeros(depth), np.zeros(depth), 0
    for fit_on, held in ((traces[0::2], traces[1::2]), (traces[1::2], traces[0::2])):
        model = fit_acceptance(fit_on, probe_depth(heads), heads.config.num_heads, rule)
        rates, expected = PathProbabilities(master, model), ExpectedAccepted(master, rule)
        for tr in held:
            accepted = TraceAcceptance(tr)
            for j in range(len(tr.ranks)):
                predicted += expected.reach(rates.rates(tr.probe[j]), whole)[0].numpy()
                measured[: accepted(j, paths)] += 1
                n += 1
    return tuple(DepthCheck(k + 1, predicted[k] / n, measured[k] / n, n) for k in range(depth))


def _signal_values(traces: Sequence[Trace]) -> dict[str, np.ndarray]:
    raw = torch.cat([t.raw for t in traces]).numpy()
    return {"entropy": -raw[:, 0], "path": np.maximum(raw[:, 1], raw[:, 3]), "chain": raw[:, 2]}


def signal_stats(traces: Sequence[Trace]) -> dict[str, SignalStats]:
    """Per signal: quantiles, and correlation with the next step's accepted drafts (greedy chain, all
    positions: the longest rank-0 prefix)."""
    ranks = torch.cat([t.ranks for t in traces])
    chain = (ranks == 0).int().cumprod(dim=1).sum(dim=1).float().numpy()
    out = {}
    for name, v in _signal_values(traces).items():
        corr = float(np.corrcoef(v, chain)[0, 1]) if v.std() > 0 and chain.std() > 0 else 0.0
        out[name] = SignalStats(
            mean=float(v.mean()),
            std=float(v.std()),
            quantiles=tuple(float(x) for x in np.quantile(v, [0.1, 0.25, 0.5, 0.75, 0.9])),
            corr_with_chain_accepted=corr,
        )
    return out


def tune(
    bank: Sequence[Tree],
    best: Tree,
    traces: Sequence[Trace],
    latency: LatencyModel,
    window: int,
    acceptance: AcceptanceModel,
    master: Tree,
) -> tuple[Thresholds, dict[str, ReplayResult]]:
    """Sweep binary and ladder thresholds by replay; replay every policy and the oracle.
    Returns (thresholds, replays)."""
    ms_of = latency.ms_of
    values = _signal_values(traces)
    qs = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    grids = {s: sorted({round(float(np.quantile(values[s], q)), 4) for q in qs}) for s in values}
    grids["accept"] = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0]
    replays = {"static": _replayed(replay(StaticPolicy(best), traces, ms_of))}
    binary = _tune_binary(bank, best, traces, ms_of, grids, window)
    ladder = _tune_ladder(bank, best, traces, ms_of, grids, window)
    for name, tuned in (("binary", binary), ("ladder", ladder)):
        if tuned is not None:
            replays[name] = tuned[1]
    replays["cost"] = _replayed(replay(CostPolicy(bank, acceptance, [ms_of(t) for t in bank]), traces, ms_of))
    replays["dynamic"] = _replayed(replay(DynamicPolicy(master, acceptance, latency), traces, ms_of))
    replays["oracle"] = _replayed(oracle(bank, traces, ms_of))
    thresholds = Thresholds(binary[0] if binary else None, ladder[0] if ladder else None)
    return thresholds, replays


def _tune_binary(bank, best, traces, ms_of, grids, window) -> tuple[BinaryThresholds, ReplayResult] | None:
    """The binary policy of most replayed tokens/s: a small tree (EntMTP* or up to 3 smaller) and a larger one
    (up to 4 larger), every signal, every pair of grid thresholds at most 2 apart."""
    best_i = [t.name for t in bank].index(best.name)
    smalls = bank[max(0, best_i - 3) : best_i + 1]  # conservative trees: EntMTP* and up to 3 smaller
    larges = bank[best_i : best_i + 5]  # aggressive trees: EntMTP* and up to 4 larger
    top = None
    for small, large in itertools.product(smalls, larges):
        if small.num_nodes >= large.num_nodes:
            continue
        for signal in SIGNALS:
            grid = grids[signal]
            for i, lo in enumerate(grid):
                for hi in grid[i : i + 3]:
                    r = replay(BinaryPolicy(small, large, signal, lo, hi, window), traces, ms_of)
                    if top is None or r.tokens_per_second > top[0].tokens_per_second:
                        top = (r, BinaryThresholds(small.name, large.name, signal, lo, hi, window))
    return None if top is None else (top[1], _replayed(top[0]))


def _tune_ladder(bank, best, traces, ms_of, grids, window) -> tuple[LadderThresholds, ReplayResult] | None:
    """The ladder over the smallest bank tree, EntMTP* and two sizes up, of most replayed tokens/s."""
    best_i = [t.name for t in bank].index(best.name)
    trees = _unique([bank[0], best, bank[min(best_i + 2, len(bank) - 1)]])
    if len(trees) < 2:
        return None
    top = None
    for signal in SIGNALS:
        for th in itertools.combinations(grids[signal], len(trees) - 1):
            r = replay(LadderPolicy(trees, signal, th, window), traces, ms_of)
            if top is None or r.tokens_per_second > top[0].tokens_per_second:
                top = (r, LadderThresholds(tuple(t.name for t in trees), signal, th, window))
    return top[1], _replayed(top[0])


def _replayed(r: Replay) -> ReplayResult:
    return ReplayResult(r.tokens_per_second, r.tokens_per_step, r.steps, dict(r.usage))


def _unique(trees: Sequence[Tree]) -> list[Tree]:
    return list({t.name: t for t in trees}.values())


def _entry(ft: FrontierTree, measured: MeasuredTree | None) -> FrontierEntry:
    tree = ft.tree
    return FrontierEntry(
        tree.name, tree.num_nodes, tree.depth, tree.paths, ft.mean_accepted, ft.tokens_per_step, measured
    )


def search(traces: Sequence[Trace], num_heads: int):
    """Greedy growth per max depth 1..num_heads and the acceptance frontier, under the traces' acceptance rule."""
    scores = Scores.for_traces(traces)
    grown = [grow(scores, d) for d in range(1, num_heads + 1)]
    return scores, grown, acceptance_frontier(scores, traces, grown)


def _grid(frontier) -> list[int]:
    """The frontier sizes nearest to GRID: the trees whose latency is measured and which form the bank."""
    sizes = [ft.tree.num_nodes for ft in frontier]
    return sorted({min(sizes, key=lambda n: (abs(n - g), n)) for g in GRID})


def build_section(
    traces: Sequence[Trace],
    grown,
    frontier,
    measured: Mapping[str, MeasuredTree],
    heads,
    window: int,
    rule: str = "greedy",
) -> ModeProfile:
    """One acceptance rule's part of a profile: frontiers, bank, EntMTP*, acceptance model, tuned policies.
    `measured` holds the step latencies measured on this hardware (by tree name; others are interpolated)."""
    by_nodes = {ft.tree.num_nodes: ft for ft in frontier}
    grid = _grid(frontier)
    latency = Latency.of(measured).model()
    throughput = _throughput_frontier(by_nodes, grid, measured, latency)
    best = by_nodes[max(throughput, key=lambda e: e.tokens_per_second).nodes].tree
    # the bank: every measured frontier tree, and the root-only tree (plain decoding). The throughput frontier
    # says which static tree is best; a scheduler also needs the larger trees that only pay on confident steps.
    bank = [Tree.root_only()] + [by_nodes[n].tree for n in grid]  # root-only: do not draft when hopeless
    master_n = max(n for n in by_nodes if n <= MASTER_MAX)
    master = union_tree([*bank, by_nodes[master_n].tree], "master")
    acceptance = fit_acceptance(traces, probe_depth(heads), heads.config.num_heads, rule)
    thresholds, replays = tune(bank, best, traces, latency, window, acceptance, master)
    candidates = {k: r.tokens_per_second for k, r in replays.items() if k != "oracle"}
    measured_on = MachineSection(
        throughput_frontier=throughput,
        best=best.name,
        reference=_reference(traces, measured),
        thresholds=thresholds,
        replay=replays,
        recommended_policy=max(candidates, key=candidates.get),
        plain_tokens_per_second=metrics.replay_tokens_per_second(1, measured["none"].ms_per_step),
    )
    return ModeProfile(
        growth={g.max_depth: g.order for g in grown},
        acceptance_frontier=tuple(_entry(ft, measured.get(ft.tree.name)) for ft in frontier),
        bank=tuple(t.name for t in bank),
        master=NamedPaths(master.name, master.paths),
        acceptance_model=acceptance,
        signals=signal_stats(traces),
        positions=sum(len(t.ranks) for t in traces),
        measured_on=measured_on,
        acceptance_check=check_acceptance(traces, heads, rule, master),
    )


def _throughput_frontier(by_nodes, grid, measured, latency: LatencyModel) -> tuple[ThroughputEntry, ...]:
    """The grid trees faster than every smaller one: tokens/s = simulated tokens/step over all calibration
    positions / step latency (measured, else interpolated)."""
    out, top = [], 0.0
    for n in grid:
        ft = by_nodes[n]
        ms = latency.ms_of(ft.tree)
        speed = metrics.replay_tokens_per_second(ft.tokens_per_step, ms)
        if speed <= top:
            continue
        top = speed
        m = measured.get(ft.tree.name)
        m = m if m is not None and m.nodes == n else None
        tps = m.measured_tokens_per_second if m else None
        out.append(ThroughputEntry(ft.tree.name, n, ft.tokens_per_step, ms, speed, tps))
    return tuple(out)


def _reference(traces, measured: Mapping[str, MeasuredTree]) -> dict[str, ReferenceTree]:
    """The published default tree's simulated speed on the traces, when its latency was measured."""
    reference = load_tree(DEFAULT_TREE)
    if reference.name not in measured:
        return {}
    tps = simulate(reference, traces).tokens_per_step
    ms = measured[reference.name].ms_per_step
    return {
        reference.name: ReferenceTree(reference.num_nodes, tps, ms, metrics.replay_tokens_per_second(tps, ms))
    }


def build_profile(
    model,
    tokenizer,
    heads,
    *,
    heads_name: str,
    task: str,
    prompts: Sequence[list[int]],
    settings: CalibrationSettings = CalibrationSettings(),
    progress: Progress | None = None,
    traces: list[Trace] | None = None,
    log=print,
) -> tuple[Profile, list[Trace]]:
    """The greedy calibration and the hardware side (see the module docstring). `traces` given: the
    hardware side only (`--latency-only`). `add_sampled` adds the T > 0 sections."""
    t0 = time.perf_counter()
    if traces is None:
        engine = generation_engine(model, tokenizer, heads)
        traces, _ = generate_traces(engine, heads, list(prompts), settings.max_new_tokens, progress)
    if not traces:
        raise EntMTPError("no calibration generation produced two or more tokens: use other prompts")
    t_traces = time.perf_counter() - t0
    scores, grown, frontier = search(traces, heads.config.num_heads)
    latency_prompts = list(prompts[: settings.latency_prompts])
    trees = _measured_trees(frontier, heads.config.num_heads)
    measured = measure_trees(model, tokenizer, heads, trees, latency_prompts, settings, progress)
    section = build_section(traces, grown, frontier, measured, heads, settings.window)
    run = CalibrationRun(
        latency_prompt_ids=tuple(tuple(map(int, ids)) for ids in latency_prompts),
        prompts=len(traces),
        positions=scores.positions,
        max_new_tokens=settings.max_new_tokens,
        latency_prompts=len(latency_prompts),
        latency_tokens=settings.latency_tokens,
        latency_repeats=settings.latency_repeats,
        trace_seconds=t_traces,
        seconds=time.perf_counter() - t0,
    )
    profile = _profile(model, heads, heads_name, task, run, Latency.of(measured), section)
    log(f"calibrated {heads_name}/{task} in {run.seconds:.0f} s: EntMTP* = {section.measured_on.best}")
    return profile, traces


def _measured_trees(frontier, num_heads: int) -> list[Tree]:
    """The frontier trees nearest the GRID sizes, and the published default tree when the heads reach it."""
    by_nodes = {ft.tree.num_nodes: ft for ft in frontier}
    trees = [by_nodes[n].tree for n in _grid(frontier)]
    reference = load_tree(DEFAULT_TREE)  # the published default, for comparison
    return trees + [reference] if reference.depth <= num_heads else trees


def _profile(model, heads, heads_name, task, run, latency, section) -> Profile:
    """A greedy-only profile of this model, heads and machine, made now."""
    return Profile(
        task=task,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        model=ModelInfo.from_json(model_fingerprint(model)),
        heads=HeadsInfo(heads_name, heads.config.kind, heads.config.num_heads, heads_checksum(heads)),
        hardware=Hardware.from_json(hardware(model)),
        versions=Versions(__version__, torch.__version__, _transformers_version()),
        calibration=run,
        latency=latency,
        modes={"greedy": section},
        machine=record(model.device),
    )


def generation_engine(model, tokenizer, heads) -> Engine:
    """The engine calibration generations are made with (any tree gives the same greedy output; a small one
    is fast on every device)."""
    tree = "tree_8" if heads.config.num_heads >= 3 else "chain_1"
    return fixed(given(model, tokenizer, heads), tree)


def typical_union(profile: Profile, heads) -> Tree:
    """The tree typical traces verify at every root: the greedy section's master (the trees that pay here)
    and the published default, as deep as the heads reach. The typical search grows subtrees of it."""
    trees = [profile.mode("greedy").master.tree()]
    reference = load_tree(DEFAULT_TREE)
    if reference.depth <= heads.config.num_heads:
        trees.append(reference)
    return union_tree(trees, "typical-union")


def add_sampled(
    profile: Profile,
    heads,
    traces: list[Trace],
    sampling: Sampling,
    settings: CalibrationSettings = CalibrationSettings(),
    log=print,
) -> Profile:
    """`profile` with the T > 0 section of `sampling`'s rule (sample, typical or gumbel) from `traces` made by
    `generate_traces(..., sampling=sampling)`; step latencies come from the profile's greedy-side measurements
    (a tree's step costs the same whatever the acceptance rule), so nothing is timed again."""
    rule = sampling.rule
    if not rule.sampled:
        raise EntMTPError(
            "add_sampled needs a sampling rule (sample, typical, gumbel); greedy is the main section"
        )
    if not traces or any((t.passes is None) != rule.exclusive for t in traces):
        raise EntMTPError(
            f"add_sampled({rule!r}) needs traces of {rule}-acceptance generations "
            f"(generate_traces(..., sampling=...) with that rule){'' if rule.exclusive else ', verified on a union tree'}"
        )
    _, grown, frontier = search(traces, heads.config.num_heads)
    section = build_section(traces, grown, frontier, profile.latency.trees, heads, settings.window, rule)
    union = traces[0].union
    trace_tree = None if union is None else NamedPaths(union.name, union.paths)
    section = replace(section, sampling=sampling, trace_tree=trace_tree)
    where = f"{profile.heads.name}/{profile.task}"
    log(f"{rule} section (T={sampling.temperature}) for {where}: EntMTP* = {section.measured_on.best}")
    return replace(profile, modes={**profile.modes, rule: section})


def retune(
    profile: Profile, heads, settings: CalibrationSettings = CalibrationSettings(), log=print
) -> Profile:
    """`profile` with every section re-derived from its stored traces and measured latencies: the search, the
    frontiers, the acceptance model and the tuned thresholds (seconds; nothing is decoded or timed)."""
    modes = {}
    for mode, old in profile.modes.items():
        traces = load_traces(profile, mode)
        _, grown, frontier = search(traces, heads.config.num_heads)
        section = build_section(traces, grown, frontier, profile.latency.trees, heads, settings.window, mode)
        modes[mode] = replace(section, sampling=old.sampling, traces=old.traces, trace_tree=old.trace_tree)
        log(f"retuned {profile.heads.name}/{profile.task} ({mode}): EntMTP* = {section.measured_on.best}")
    return replace(profile, modes=modes)


def retrace(
    profile: Profile,
    model,
    tokenizer,
    heads,
    prompts: Sequence[Sequence[int]] | None = None,
    progress: Progress | None = None,
) -> tuple[Profile, list[Trace], dict[str, list[Trace]]]:
    """(profile, greedy traces, {rule: sampled traces}): every section's traces made again from its
    generations, teacher-forced through `heads` (the same kind and depth, changed since: another draft
    vocabulary, retrained weights), and the profile recording these heads. The generations are the ones the
    sidecar stores; greedy traces of an older entmtp hold none, and are then decoded again from `prompts`
    (the calibration prompts' token ids, checked against the traces' prompt lengths; greedy output does not
    depend on the heads). Nothing is timed: the latencies and the typical section's union tree stay. Save the
    traces, then `retune` (what `entmtp calibrate --retrace` does)."""
    from ..backends.transformers import BaseModel
    from .traces import trace_generation

    old = profile.heads
    if (heads.config.kind, heads.config.num_heads) != (old.kind, old.num_heads):
        raise EntMTPError(
            f"profile {profile.where} was made for {old.kind} heads of depth {old.num_heads}, not "
            f"{heads.config.kind} heads of depth {heads.config.num_heads}: a retrace keeps the profile's trees, "
            "so calibrate these heads from scratch (`entmtp calibrate --heads ...`)"
        )
    modes = {mode: load_traces(profile, mode) for mode in profile.modes}
    generations = {
        mode: [None if tr.tokens is None else tr.tokens.tolist() for tr in trs] for mode, trs in modes.items()
    }
    greedy = modes["greedy"]
    if any(g is None for g in generations["greedy"]):
        lengths = [tr.prompt_len for tr in greedy]
        if prompts is None or [len(p) for p in prompts] != lengths:
            raise EntMTPError(
                f"profile {profile.where}'s greedy traces do not hold their generations (an older entmtp made "
                "them) and the prompts to decode them again from are not the ones they were made from: "
                "calibrate again from scratch"
            )
        engine = generation_engine(model, tokenizer, heads)
        task = progress.add_task("greedy generations", total=len(prompts)) if progress else None
        generations["greedy"] = []
        for ids in prompts:
            out = engine.generate(list(ids), max_new_tokens=profile.calibration.max_new_tokens).token_ids
            generations["greedy"].append(list(ids) + out)
            if progress:
                progress.advance(task)
    base = BaseModel(model, hidden_state_offset=heads.config.hidden_state_offset)
    task = progress.add_task("retrace", total=sum(map(len, modes.values()))) if progress else None
    new: dict[str, list[Trace]] = {}
    for mode, traces in modes.items():
        sampling = profile.mode(mode).sampling
        new[mode] = []
        for tr, tokens in zip(traces, generations[mode], strict=True):
            new[mode].append(
                trace_generation(base, heads, tokens, tr.prompt_len, sampling, tr.union, seed=tr.seed)
            )
            if progress:
                progress.advance(task)
    renamed = replace(profile, heads=replace(old, checksum=heads_checksum(heads)))
    return renamed, new.pop("greedy"), new


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
