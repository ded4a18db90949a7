"""Issue 42, layer 27 through the library: distillation shards whose stored state is one layer's, made from
the feature probe's extraction instead of a second teacher-forced pass.

The feature probe (../features/) found that Hydra's head 1 reads layer 27 better than the last layer (+1.5
points of validation top-1 at equal data). The library now reads any layer through the final norm
(``--hidden-state-offset``; ``entmtp.heads.heads_input``), so heads trained by ``entmtp train-heads`` on layer
27 can be decoded and measured in tokens per step. Data for them needs the layer's state at every stored
position. The probe's ``extract`` already computed it (float32, through the final norm, bf16) for the same
sequences, so this script writes it into copies of the shards, and its manifest says so (offset, norm):

    python docs/results/heads-v3-cpu/layer27/convert.py write --layer 27 \
        --distill heads-v3/distill,heads-v3/gsm8k/distill --features heads-v3/features \
        --out heads-v3/l27/distill,heads-v3/l27/gsm8k/distill
    # that the copies hold what the library's own teacher-forced pass stores (base_targets, float32)
    python docs/results/heads-v3-cpu/layer27/convert.py check --distill heads-v3/l27/distill

Every tensor but ``hidden`` is the original shard's. Writing layer 30 the same way gives the control arm data
that differs from layer 27's in the layer alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from entmtp.files import save_tensors_atomic
from entmtp.model import load_model
from entmtp.train.shards import (
    MANIFEST,
    PROMPTS,
    DistillData,
    Manifest,
    _read_shard,
    base_targets,
    load_split,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "features"))
from features import LAYERS, load_features  # noqa: E402  (the probe's extraction, beside its results)

LAST = LAYERS[-1]  # the decoder's layer count: offset = LAST - layer


def write(args) -> None:
    if args.layer not in LAYERS:
        raise SystemExit(f"--layer {args.layer}: the extraction holds layers {LAYERS} only")
    column = LAYERS.index(args.layer)
    data = DistillData.read(args.distill)
    outs = [Path(p) for p in args.out.split(",")]
    if len(outs) != len(data.parts):
        raise SystemExit(f"--out names {len(outs)} directories for {len(data.parts)} in --distill: one each")
    for split in ("val", "train"):
        feats = load_features(Path(args.features), split, load_split(data, split))  # [N, layers, H]
        g, worst = 0, 0.0
        for (d, m), out in zip(data.parts, outs, strict=True):
            out.mkdir(parents=True, exist_ok=True)
            for file in m.shard_files(split):
                shard = _read_shard(d, file)
                n = shard["hidden"].shape[0]
                # alignment: the extraction's last layer is the stored state, to bf16 rounding
                worst = max(
                    worst, float((feats[g : g + n, -1].float() - shard["hidden"].float()).abs().max())
                )
                shard["hidden"] = feats[g : g + n, column].clone()
                save_tensors_atomic(out / file, shard)
                g += n
        if g != feats.shape[0] or worst > 0.5:
            raise SystemExit(f"{split}: {g} positions written of {feats.shape[0]}, last layer off by {worst}")
        print(f"{split}: {g} positions, layer {args.layer}; extraction's last layer vs stored: {worst:.4f}")
    for (d, m), out in zip(data.parts, outs, strict=True):
        settings = {**m.settings, "hidden_state_offset": LAST - args.layer, "hidden_state_norm": True}
        shutil.copyfile(d / PROMPTS, out / PROMPTS)
        Manifest(**{**vars(m), "settings": settings}).write(out)  # last: the data is complete
        print(f"{out}: {MANIFEST} with hidden_state_offset {LAST - args.layer}")


@torch.inference_mode()
def check(args) -> None:
    """The first validation sequences' stored states against the library's teacher-forced pass at the
    data's offset, in float32."""
    data = DistillData.read(args.distill)
    split = load_split(data, "val")
    model, _ = load_model(None, dtype="float32", pack=False)
    worst = 0.0
    for s in range(args.sequences):
        a, b = int(split.offsets[s]), int(split.offsets[s + 1])
        seq = split.tokens[a:b].tolist() + [0]  # base_targets keeps positions 0..L-2
        row = base_targets(
            model, [seq], top_k=1, hidden_state_offset=data.hidden_state_offset, hidden_state_norm=True
        )[0]
        worst = max(worst, float((row["hidden"].float() - split.hidden[a:b].float()).abs().max()))
    scale = float(split.hidden[: int(split.offsets[args.sequences])].float().abs().max())
    print(
        json.dumps(
            {
                "offset": data.hidden_state_offset,
                "sequences": args.sequences,
                "max_abs_diff": worst,
                "max_abs_value": scale,
            }
        )
    )
    if worst > 0.01 * scale:
        raise SystemExit("the stored states are not the library's: do not train on them")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--layer", type=int, required=True)
    w.add_argument("--distill", required=True)
    w.add_argument("--features", required=True)
    w.add_argument("--out", required=True, help="one directory per --distill directory, comma-separated")
    c = sub.add_parser("check")
    c.add_argument("--distill", required=True)
    c.add_argument("--sequences", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    {"write": write, "check": check}[args.cmd](args)


if __name__ == "__main__":
    main()
