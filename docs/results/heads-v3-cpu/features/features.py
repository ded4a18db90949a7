"""Issue 42's feature question: do heads that read several of the base model's layers (EAGLE-3's fused low,
middle and high features), or one layer below the last, draft better than heads that read only its last
hidden state, at equal data?

Every lever tried so far (more data, learning rates, a second block, own projections) moved head 1's top-1
by thousandths. They all changed what the heads do with the final hidden state. This experiment changes what
they read. It is a probe, outside the library: nothing here ships, and it times nothing.

    # 1. the hidden states of the chosen layers at every stored position (resumable; both cores, ~45 min here)
    python docs/results/heads-v3-cpu/features/features.py extract --distill D1,D2 --out heads-v3/features
    # 2. one Hydra head per arm (--head k, default 1), same data, steps and seed; then the table
    python docs/results/heads-v3-cpu/features/features.py train --distill D1,D2 --features heads-v3/features \
        --results docs/results/heads-v3-cpu/features

`extract` runs the teacher-forced pass again over the sequences of the distillation shards (float32) and
keeps, per position, the base model's final RMSNorm applied to the output of each layer in ``LAYERS`` (the
last is the heads' usual input, and is checked against the shards' stored ``hidden``). Chunks of
``CHUNK`` sequences are written atomically, so an interrupted run resumes where it stopped.

`train` trains Hydra's head k (the token k+1 ahead, from the features at t and the embeddings of tokens
t+1..t+k: a ``ResBlock`` as the library's, onto the shared output layer's draft-vocabulary rows, loss ``kl``
against the stored top-k) once per arm. Arms differ only in which layers are concatenated into the input
and where they start (``ARMS``). Arms already in --results with the same data and settings are kept. It writes
features.json (per arm: validation top-1 and loss at every evaluation), features.png and the table
(features.md) to --results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from entmtp.files import save_tensors_atomic, write_text_atomic
from entmtp.heads.modules import ResBlock
from entmtp.model import load_model
from entmtp.train.shards import DistillData, load_split
from entmtp.train.trainer import distill_loss

LAYERS = (2, 8, 15, 22, 27, 30)  # outputs of these decoder layers (of 30); 30 is the heads' usual input
CHUNK = 64  # sequences per written chunk: the unit of resumption
# arm name -> the layers its head reads, and where it starts: "scratch" (the library's Medusa init) or
# "shipped" (the shipped Hydra's head 1; with several layers, behind a fusing Linear(nl*H -> H) that starts
# by picking the last layer, so the arm starts as exactly the shipped head: the form the library could ship)
ARMS = {
    "final": ((30,), "scratch"),  # as shipped: the last hidden state
    "l27": ((27,), "scratch"),  # one layer lower (the library's hidden_state_offset 3, normed here)
    "l22": ((22,), "scratch"),  # hidden_state_offset 8
    "l15": ((15,), "scratch"),  # the middle layer alone
    "fuse3": ((2, 15, 27), "scratch"),  # EAGLE-3's choice for a 32-layer Llama: low, middle, high
    "fuse4": ((2, 15, 27, 30), "scratch"),  # EAGLE-3's three and the last
    "fuse6": (LAYERS, "scratch"),
    "shipped": ((30,), "shipped"),  # the shipped head 1 continued: the control of the next arm
    "shipped+fuse4": ((2, 15, 27, 30), "shipped"),
}


def _bar(total: int, what: str, quiet: bool):
    """A rich bar on a terminal; otherwise a plain line every twentieth of the way."""
    if quiet or not sys.stderr.isatty():

        class Line:
            def __init__(self) -> None:
                self.done, self.t0 = 0, time.time()

            def advance(self, n: int = 1) -> None:
                self.done += n
                if self.done != total and self.done % max(1, total // 20):
                    return
                print(
                    f"{what}: {self.done}/{total} ({time.time() - self.t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

        return Line()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class Bar:
        def __enter__(self):
            self.p = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.p.__enter__()
            self.task = self.p.add_task(what, total=total)
            return self

        def advance(self, n: int = 1) -> None:
            self.p.advance(self.task, n)

        def __exit__(self, *exc) -> None:
            self.p.__exit__(*exc)

    return Bar()


# ---- 1. extract ---------------------------------------------------------------------------------------


@torch.inference_mode()
def extract(args) -> None:
    data_dirs = DistillData.read(args.distill)
    model, _ = load_model(None, dtype="float32", pack=False)
    decoder = model.get_decoder()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"layers": list(LAYERS), "distill": args.distill, "splits": {}}
    for split in ("val", "train"):
        data = load_split(data_dirs, split)
        s_total = data.num_sequences
        chunks = range(0, s_total, CHUNK)
        t0, cpu0, positions, worst = time.time(), time.process_time(), 0, 0.0
        with _bar(len(chunks), f"extract {split}", args.no_progress) as bar:
            for c in chunks:
                path = out / f"{split}-{c // CHUNK:05d}.safetensors"
                if path.exists():
                    bar.advance()
                    continue
                seqs = range(c, min(c + CHUNK, s_total))
                g0, g1 = int(data.offsets[seqs[0]]), int(data.offsets[seqs[-1] + 1])
                feats = torch.empty(g1 - g0, len(LAYERS), data.hidden.shape[1], dtype=torch.bfloat16)
                order = sorted(seqs, key=lambda s: int(data.offsets[s + 1] - data.offsets[s]))
                for b in range(0, len(order), args.batch_size):
                    batch = order[b : b + args.batch_size]
                    lens = [int(data.offsets[s + 1] - data.offsets[s]) for s in batch]
                    ids = torch.zeros(len(batch), max(lens), dtype=torch.long)  # right padded
                    mask = torch.zeros_like(ids)
                    for row, s in enumerate(batch):
                        ids[row, : lens[row]] = data.tokens[data.offsets[s] : data.offsets[s + 1]]
                        mask[row, : lens[row]] = 1
                    hs = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
                    # hidden_states[-1] is the last layer's output after the final norm already
                    normed = [hs[i] if i == len(hs) - 1 else decoder.norm(hs[i]) for i in LAYERS]
                    layers = torch.stack(normed, dim=2)  # [B, L, nl, H]
                    for row, s in enumerate(batch):
                        a = int(data.offsets[s]) - g0
                        feats[a : a + lens[row]] = layers[row, : lens[row]].to(torch.bfloat16)
                        stored = data.hidden[data.offsets[s] : data.offsets[s + 1]].float()
                        worst = max(worst, float((layers[row, : lens[row], -1] - stored).abs().max()))
                positions += g1 - g0
                save_tensors_atomic(path, {"features": feats})
                bar.advance()
        record["splits"][split] = {
            "sequences": s_total,
            "positions_extracted": positions,
            "seconds": round(time.time() - t0, 1),
            "cpu_seconds": round(time.process_time() - cpu0, 1),
            # the last layer against the shards' stored hidden state (bf16): alignment and dtype check
            "max_abs_diff_last_layer_vs_stored": worst,
        }
        if positions:
            print(
                f"{split}: {positions} positions in {time.time() - t0:.0f} s, last layer vs stored {worst:.4f}"
            )
        if worst > 0.5:
            raise SystemExit(
                f"the last layer differs from the stored hidden state by {worst}: not the same data"
            )
    old = json.loads((out / "extract.json").read_text()) if (out / "extract.json").exists() else {"runs": []}
    old["runs"].append(record)
    write_text_atomic(out / "extract.json", json.dumps(old, indent=1) + "\n")


def load_features(directory: Path, split: str, data) -> torch.Tensor:
    """[N, len(LAYERS), H] bf16 for ``split``, in the order of ``load_split``."""
    n = -(-data.num_sequences // CHUNK)
    parts = []
    for i in range(n):
        path = directory / f"{split}-{i:05d}.safetensors"
        if not path.exists():
            raise SystemExit(f"{path} is missing: finish `extract` first")
        parts.append(load_file(path)["features"])
    feats = torch.cat(parts)
    if feats.shape[0] != data.hidden.shape[0]:
        raise SystemExit(
            f"{directory} holds {feats.shape[0]} {split} positions, the data {data.hidden.shape[0]}"
        )
    return feats


# ---- 2. train -----------------------------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[4] / "src/entmtp/assets/heads/hydra"


class Split:
    """One split's examples for Hydra's head k: anchor g (a response position whose position g+k is stored)
    reads the features at g and the embeddings of tokens g+1..g+k, and learns the base model's top-k at g+k
    (the token k+1 ahead)."""

    def __init__(self, data, feats: torch.Tensor, vocab_index: torch.Tensor, head: int = 1) -> None:
        anchors = []
        for s in range(data.num_sequences):
            g0, n = int(data.offsets[s]), int(data.offsets[s + 1] - data.offsets[s])
            first = max(0, int(data.prompt_lens[s]) - 1)
            anchors.append(torch.arange(g0 + first, g0 + n - head))  # as the trainer's make_windows masks
        self.anchors = torch.cat(anchors)  # [M]
        self.feats = feats  # [N, nl, H] bf16
        ahead = self.anchors[:, None] + torch.arange(1, head + 1)  # [M, k]
        self.next_tokens = data.tokens[ahead]  # [M, k]: the tokens on the branch before head k's
        self.target_ids = vocab_index[
            data.topk_ids[self.anchors + head]
        ]  # [M, K] indices into the draft vocab
        self.target_logp = data.topk_logp[self.anchors + head]  # [M, K]

    def __len__(self) -> int:
        return self.anchors.numel()

    def inputs(self, rows: torch.Tensor, layers: list[int], embed) -> torch.Tensor:
        """[B, (len(layers) + k) H] float32: the chosen layers at the anchors, then emb(tokens g+1..g+k)."""
        f = self.feats[self.anchors[rows]][:, layers].float().flatten(1)  # [B, nl*H]
        return torch.cat([f, embed(self.next_tokens[rows]).flatten(1)], dim=-1)


class Head(torch.nn.Module):
    """A Hydra head (the library's ResBlock, Medusa init) onto the shared output layer's draft rows.
    ``fuse_layers`` > 1: a Linear(nl*H -> H) first fuses the layers into one feature, starting as the pick
    of the last one."""

    def __init__(self, in_features: int, proj: torch.Tensor, fuse_layers: int = 0) -> None:
        super().__init__()
        h = proj.shape[1]
        self.fuse = None
        if fuse_layers > 1:
            self.fuse = torch.nn.Linear(fuse_layers * h, h, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -h:] = torch.eye(h)
        self.block = ResBlock(in_features, h)
        torch.nn.init.zeros_(self.block.linear.weight)  # random_heads(init="medusa")
        self.register_buffer("proj", proj)  # [Vd, H], frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, in] -> [B, Vd]
        if self.fuse is not None:
            h = self.proj.shape[1]
            x = torch.cat([self.fuse(x[:, :-h]), x[:, -h:]], dim=-1)
        return self.block(x) @ self.proj.T


@torch.no_grad()
def evaluate(head: Head, split: Split, layers: list[int], embed, batch: int = 4096) -> tuple[float, float]:
    """Validation top-1 against the base model's argmax (a miss when it is outside the draft vocabulary,
    as the trainer counts it) and mean kl loss."""
    hits, loss = 0, 0.0
    for b in range(0, len(split), batch):
        rows = torch.arange(b, min(b + batch, len(split)))
        logits = head(split.inputs(rows, layers, embed))
        ids = split.target_ids[rows]
        loss += float(distill_loss(logits, ids, split.target_logp[rows], "kl").sum())
        hits += int((logits.argmax(-1) == ids[:, 0]).sum())
    return hits / len(split), loss / len(split)


def shipped_head(proj: torch.Tensor, h: int, fuse_layers: int = 0, k: int = 1) -> Head:
    """The shipped Hydra's head k (trained on a GPU over 540k positions): the reference row, and the start
    of the "shipped" arms."""
    if fuse_layers > 1 and k != 1:
        raise SystemExit("the fusing arms are head 1's only: train them with --head 1")
    prefix = f"heads.{k - 1}.blocks.0."
    weights = load_file(SHIPPED / "heads.safetensors")
    head = Head((k + 1) * h, proj, fuse_layers)
    head.block.load_state_dict(
        {n.removeprefix(prefix): w.float() for n, w in weights.items() if n.startswith(prefix)}
    )
    return head


def train_arm(arm: str, tr: Split, va: Split, embed, proj: torch.Tensor, args) -> dict:
    """One arm: its head, the trainer's schedule (linear warm-up over 5%, cosine to 0.1 of the peak), the
    same example order for every arm, validation every ``eval_every`` steps."""
    chosen, init = ARMS[arm]
    layers = [LAYERS.index(x) for x in chosen]
    torch.manual_seed(args.seed)
    h = proj.shape[1]
    k = args.head
    if init == "shipped":
        head = shipped_head(proj, h, len(layers), k)
    else:
        head = Head((len(layers) + k) * h, proj)
    lr = args.lr if init == "scratch" else args.lr_shipped
    params = [p for p in head.parameters() if p.requires_grad]
    # a fusing layer is new even on the shipped head: it learns at the rate of new parameters
    fuse = list(head.fuse.parameters()) if head.fuse is not None else []
    groups = [{"params": [p for p in params if all(p is not q for q in fuse)], "lr": lr}]
    groups += [{"params": fuse, "lr": args.lr}] if fuse else []
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    steps = math.ceil(args.epochs * len(tr) / args.batch_size)
    warmup = max(1, int(0.05 * steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.cat([torch.randperm(len(tr), generator=gen) for _ in range(math.ceil(args.epochs) + 1)])
    t0 = time.time()
    top1, loss = evaluate(head, va, layers, embed)
    curve = [{"step": 0, "val_top1": top1, "val_loss": loss}]
    with _bar(steps, f"train {arm}", args.no_progress) as bar:
        for step in range(1, steps + 1):
            rows = order[(step - 1) * args.batch_size : step * args.batch_size]
            with torch.no_grad():
                x = tr.inputs(rows, layers, embed)
            batch_loss = distill_loss(head(x), tr.target_ids[rows], tr.target_logp[rows], "kl").mean()
            opt.zero_grad(set_to_none=True)
            batch_loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % args.eval_every == 0 or step == steps:
                top1, loss = evaluate(head, va, layers, embed)
                curve.append({"step": step, "val_top1": top1, "val_loss": loss})
                if args.no_progress:
                    print(f"{arm} step {step}: val top-1 {top1:.4f} loss {loss:.4f}", flush=True)
            bar.advance()
    print(f"{arm}: val top-1 {top1:.4f} ({time.time() - t0:.0f} s)")
    return {
        "layers": list(chosen),
        "init": init,
        "peak_lr": lr,
        "peak_lr_fuse": args.lr if fuse else None,
        "steps": steps,
        "parameters": sum(p.numel() for p in params),
        "curve": curve,
        "val_top1": top1,
        "val_loss": loss,
        "seconds": round(time.time() - t0, 1),
    }


def train(args) -> None:
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}: use some of {', '.join(ARMS)}")
    shipped_heads = json.loads((SHIPPED / "config.json").read_text())["num_heads"]
    if not 1 <= args.head <= shipped_heads:
        raise SystemExit(
            f"--head {args.head}: the shipped Hydra has heads 1 to {shipped_heads}; pick one of them"
        )
    model, _ = load_model(None, dtype="float32", pack=False)
    embed, lm = model.get_input_embeddings(), model.get_output_embeddings().weight.detach()
    draft = load_file(SHIPPED / "draft_vocab.safetensors")["ids"]  # the shipped heads' draft vocabulary
    vocab_index = torch.full((lm.shape[0],), -1, dtype=torch.long)
    vocab_index[draft] = torch.arange(draft.numel())
    proj = lm[draft].float()  # [Vd, H]
    data_dirs, fdir = DistillData.read(args.distill), Path(args.features)
    splits = {}
    for name in ("train", "val"):
        data = load_split(data_dirs, name)
        splits[name] = Split(data, load_features(fdir, name, data), vocab_index, args.head)
    tr, va = splits["train"], splits["val"]
    print(
        f"{len(tr)} training anchors, {len(va)} validation anchors, {args.epochs} epochs of {args.batch_size}"
    )
    out = Path(args.results)
    path = out / "features.json"
    # arms already in the results (same data and settings) are kept: a rerun adds the missing ones
    results = json.loads(path.read_text()) if path.exists() else {}
    settings = {
        "train_anchors": len(tr),
        "val_anchors": len(va),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "draft_vocab": int(draft.numel()),
        "layers_stored": list(LAYERS),
        "seed": args.seed,
        "head": args.head,
    }
    if results.get("settings") != settings:
        results = {"settings": settings, "arms": {}}
    with torch.no_grad():
        ref = evaluate(shipped_head(proj, lm.shape[1], k=args.head), va, [LAYERS.index(30)], embed)
    results["shipped_head"] = {"val_top1": ref[0], "val_loss": ref[1]}
    print(f"shipped head {args.head} (540k positions, GPU): val top-1 {ref[0]:.4f}")
    for arm in arms:
        results["arms"][arm] = {"command": " ".join(sys.argv), **train_arm(arm, tr, va, embed, proj, args)}
        report(results, out)


def report(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "features.json", json.dumps(results, indent=1) + "\n")
    arms = results["arms"]
    st = results["settings"]
    lines = [
        f"Hydra head {st['head']} (token t+{st['head'] + 1}): {st['train_anchors']:,} training anchors, {st['epochs']} epochs in batches of "
        f"{st['batch_size']}; validation top-1 on {st['val_anchors']:,} anchors (one standard error ~0.002).",
        "",
        "| arm | starts from | layers read | trained parameters | peak lr | val top-1 | vs its control | val loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, a in arms.items():
        control = arms.get("final" if a["init"] == "scratch" else "shipped")
        gain = f"{a['val_top1'] - control['val_top1']:+.4f}" if control and control is not a else "-"
        fuse_lr = f" (fusing layer {a['peak_lr_fuse']:g})" if a.get("peak_lr_fuse") else ""
        lines.append(
            f"| {name} | {a['init']} | {', '.join(map(str, a['layers']))} | {a['parameters'] / 1e6:.2f}M "
            f"| {a['peak_lr']:g}{fuse_lr} | {a['val_top1']:.4f} | {gain} | {a['val_loss']:.4f} |"
        )
    ref = results["shipped_head"]
    lines.append(
        f"| shipped head {st['head']} as shipped (GPU, 540k positions) | - | 30 | - | - | {ref['val_top1']:.4f} | "
        f"| {ref['val_loss']:.4f} |"
    )
    write_text_atomic(out / "features.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, a in arms.items():
        ax.plot([c["step"] for c in a["curve"]], [c["val_top1"] for c in a["curve"]], label=name)
    ax.axhline(ref["val_top1"], color="grey", linestyle="--", label=f"shipped head {st['head']}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"validation top-1, head {st['head']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "features.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("extract", help="the chosen layers' hidden states at every stored position")
    e.add_argument("--distill", required=True, help="distillation directories, comma-separated")
    e.add_argument("--out", required=True)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--threads", type=int, default=os.cpu_count())
    e.add_argument("--no-progress", action="store_true")
    t = sub.add_parser("train", help="one head per arm; the table, JSON and plot")
    t.add_argument("--distill", required=True)
    t.add_argument("--features", required=True)
    t.add_argument("--results", required=True)
    t.add_argument("--arms", default=",".join(ARMS))
    t.add_argument("--head", type=int, default=1, help="which Hydra head: k predicts the token k+1 ahead")
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--batch-size", type=int, default=512)
    t.add_argument("--lr", type=float, default=1e-3, help="peak lr of the arms from scratch (Medusa's)")
    t.add_argument(
        "--lr-shipped",
        type=float,
        default=5e-5,
        help="peak lr of the arms from the shipped head (13th session)",
    )
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=os.cpu_count())
    t.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    extract(args) if args.command == "extract" else train(args)


if __name__ == "__main__":
    main()
