"""What another draft vocabulary buys the default (#21: the Hydra probe is memory-bound on its [Vd, 576] draft
projection): the default engine's policy with the shipped heads' draft vocabulary and with the N most frequent
tokens only (counted as scripts/build_draft_vocab.py counts them: the training corpus, never the benchmark
sets), interleaved per prompt in one process.

No retraining is involved: the heads project through the base model's lm_head rows of the draft vocabulary, so
a smaller one only drops rare tokens from the drafts (a right token outside it is a missed draft), a larger
one adds them back. The policy and its cost curve are the default's as built (for the shipped vocabulary), so
this measures the per-step saving and the acceptance lost, not a recalibrated schedule. In float32 every
variant writes plain greedy decoding's text.

    .venv/bin/python docs/results/hardware-aware/draft_vocab_ab.py --sizes 8192,4096 --tasks specbench-translation,humaneval \
        --out docs/results/hardware-aware/draft-vocab.json

`--before REV` adds what a git revision shipped, whole: its Hydra draft vocabulary and its mixed profile's
policy (sized on this machine's cost curve for those heads, as the default is), against today's. With `--sizes
""` that is the before/after of a shipped vocabulary change with its recalibrated profiles. `--lookup-alone`
adds entmtp's prompt lookup without heads (the method the default is held to on copy-heavy text).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from entmtp.build import EngineSpec, build
from entmtp.costs import costs_for
from entmtp.engine import Engine
from entmtp.heads import DRAFT_VOCAB_FILE, frequent_tokens
from entmtp.lookup import Lookup
from entmtp.machine import describe, hardware
from entmtp.prompts import load_prompts
from entmtp.scheduler.factory import scheduled_policy
from entmtp.scheduler.hybrid import hybrid
from entmtp.scheduler.profiles import load_profile, shipped_profiles_dir
from entmtp.shipped import resolve_heads, shipped_heads_dir

ROOT = Path(__file__).resolve().parents[3]  # the checkout (this file: docs/results/hardware-aware/)
sys.path.insert(0, str(ROOT / "scripts"))  # build_draft_vocab.py, a maintained tool
from build_draft_vocab import corpus_counts, corpus_texts  # noqa: E402
from interleave import add_rates, finish, interleaved, lookup_alone, rate_cells  # noqa: E402  (beside this file)


def shipped_at(rev: str, default, folder: Path) -> Engine:
    """The default engine as revision `rev` shipped it: its Hydra draft vocabulary and its mixed profile (with
    traces) written to `folder`, the policy sized on this machine's curve for those heads."""
    from safetensors.torch import load

    def show(path: Path) -> bytes:
        rel = path.resolve().relative_to(ROOT)
        return subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, check=True
        ).stdout

    heads = resolve_heads("hydra", default.model)
    heads.set_draft_vocab(load(show(shipped_heads_dir("hydra") / DRAFT_VOCAB_FILE))["ids"])
    for name in ("mixed.json", "mixed.traces.safetensors"):
        (folder / name).write_bytes(show(shipped_profiles_dir("hydra") / name))
    profile = load_profile(folder / "mixed.json")
    profile.check(default.model, heads, warn_hardware=False)
    costs = costs_for(default.model, heads)
    policy, _, _ = scheduled_policy(profile, profile.mode_for_rule("greedy"), costs.latency())
    return Engine(
        default.model, default.tokenizer, heads=heads, policy=hybrid(policy, Lookup(), costs), costs=costs
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8192,4096")
    ap.add_argument("--tasks", default="specbench-translation,humaneval")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--before", default=None, help="a git revision: add the default as it shipped there")
    ap.add_argument("--lookup-alone", action="store_true", help="add entmtp's prompt lookup without heads")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    built = build(EngineSpec(lookup=Lookup(), dtype=args.dtype, threads=args.threads), log=lambda m: None)
    default = built.engine
    counts = corpus_counts(default.tokenizer, corpus_texts(args.data_dir))
    shipped = default.heads.draft_vocab.numel()
    engines = {f"{shipped} (shipped)": default}
    if args.before:
        with tempfile.TemporaryDirectory() as folder:
            old = shipped_at(args.before, default, Path(folder))
        engines[f"{old.heads.draft_vocab.numel()} ({args.before})"] = old
    if args.lookup_alone:
        engines["lookup alone"] = lookup_alone(default)
    for size in (int(s) for s in args.sizes.split(",") if s):
        heads = resolve_heads("hydra", default.model)
        heads.set_draft_vocab(frequent_tokens(counts, size, keep=default.tokenizer.all_special_ids))
        engines[str(size)] = Engine(  # the same policy: each generation runs its own policy.fresh()
            default.model, default.tokenizer, heads=heads, policy=default.policy, costs=default.costs
        )
    machine = describe(hardware(default.model))
    results: dict = {"machine": machine, "dtype": args.dtype, "tasks": {}}
    table = Table(
        title=f"{machine}, {args.dtype}, {args.num_prompts} prompts x 2, {args.max_new_tokens} new tokens"
    )
    for col in ("task", "draft vocabulary", "tokens/s", "vs shipped", "tokens/step", "ms/step", "probe ms"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for task in args.tasks.split(","):
        prompts = load_prompts(task, "test", args.num_prompts)
        tally, same = interleaved(engines, prompts, args.max_new_tokens)
        add_rates(tally, f"{shipped} (shipped)")
        for name, t in tally.items():
            table.add_row(task, name, *rate_cells(t), f"{1000 * t['probe'] / t['steps']:.2f}")
        table.add_row(task, "identical outputs" if same else "OUTPUTS DIFFER", end_section=True)
        results["tasks"][task] = {"identical_outputs": same, "methods": tally}
        print(f"{task}: done", flush=True)
    finish(table, results, args.out)


if __name__ == "__main__":
    main()
