"""Where trees pay on CPUs for the models CPU users run: llama.cpp's cost curve of a 1B-class and a 7B-class
Llama (random Q4_0 weights written with the `gguf` package: nothing is downloaded; a step's cost does not
depend on the weights' values), and which trees EntMTP* and the default schedule choose on them, replayed on
the shipped profiles' calibration traces (the acceptance side stays SmolLM2's heads': the cost side is what
this measures).

    python docs/results/llama-cpp/cpu_curves.py --out docs/results/llama-cpp/cpu-curves.json

Shapes: 1B as Llama-3.2-1B (hidden 2048, 16 layers, FFN 8192, 32 heads, 8 KV heads), 7B as Llama-2-7B
(hidden 4096, 32 layers, FFN 11008, 32 heads, 32 KV heads); the tokenizer is SmolLM2's (vocabulary 49152, so
the output layer is smaller than Llama-3.2's 128256 and larger than Llama-2's 32000). The files go to
$ENTMTP_CACHE/models (1B ~0.8 GB, 7B ~3.9 GB), written once. The curve is the engine's step with no heads
(the base model's verification, llama.cpp's kernels) measured by `costs.measure` at 2 threads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = {
    "llama-1b": dict(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8),
    "llama-7b": dict(hidden=4096, layers=32, ffn=11008, heads=32, kv_heads=32),
}
Q4_0_BLOCK = 32  # values per Q4_0 block: an f16 scale and 16 bytes of 4-bit values


def random_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 data [rows, cols / 32 * 18] bytes: small scales, random nibbles (valid weights)."""
    blocks = rows * cols // Q4_0_BLOCK
    data = np.empty((blocks, 18), dtype=np.uint8)
    data[:, :2] = np.frombuffer(np.full(blocks, 0.02, dtype=np.float16).tobytes(), dtype=np.uint8).reshape(
        -1, 2
    )
    data[:, 2:] = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
    return data.reshape(rows, cols // Q4_0_BLOCK * 18)


def write_random_gguf(name: str, path: Path) -> Path:
    """A Llama of shape SHAPES[name] with random Q4_0 weights and SmolLM2's tokenizer, at `path`."""
    import gguf

    from entmtp.model import embedded_gguf

    s = SHAPES[name]
    src = gguf.GGUFReader(str(embedded_gguf()))
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    for key, f in src.fields.items():
        if key.startswith(("tokenizer.", "general.quantization_version")):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    vocab, h = len(src.fields["tokenizer.ggml.tokens"].contents()), s["hidden"]
    w.add_name(f"random {name}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(h // s["heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    q4 = gguf.GGMLQuantizationType.Q4_0
    kv = h // s["heads"] * s["kv_heads"]

    def q(tname: str, rows: int, cols: int) -> None:
        w.add_tensor(tname, random_q4_0(rows, cols, rng), raw_dtype=q4)  # byte shape [rows, cols / 32 * 18]

    q("token_embd.weight", vocab, h)
    q("output.weight", vocab, h)
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        q(b + "attn_q.weight", h, h)
        q(b + "attn_k.weight", kv, h)
        q(b + "attn_v.weight", kv, h)
        q(b + "attn_output.weight", h, h)
        q(b + "ffn_gate.weight", s["ffn"], h)
        q(b + "ffn_up.weight", s["ffn"], h)
        q(b + "ffn_down.weight", h, s["ffn"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def measure_curve(path: Path, budget_s: float):
    from entmtp.backends.llama_cpp import load_gguf
    from entmtp.costs import measure

    model, _ = load_gguf(path, dtype=torch.bfloat16, threads=2, n_ctx=4096, tokenizer_dir=None)
    return measure(model, None, budget_s=budget_s)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from entmtp.calibration.replay import replay, step_ms
    from entmtp.calibration.traces import load_traces
    from entmtp.machine import cpu_info
    from entmtp.model import cache_dir
    from entmtp.policy import StaticPolicy
    from entmtp.scheduler.factory import scheduled_policy
    from entmtp.scheduler.profiles import PROFILE_TASKS, resolve_profile
    from entmtp.tree import Tree

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of probing per model")
    ap.add_argument("--models", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(2)
    console = Console()
    result: dict = {"machine": cpu_info(), "models": {}}
    for name in args.models.split(","):
        path = cache_dir() / "models" / f"random-{name}-q4_0.gguf"
        if not path.is_file():
            console.print(f"writing {path}")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_random_gguf(name, path)
        curve = measure_curve(path, args.budget)
        lat = curve.latency()
        plain = float(lat(0))
        entry = {"curve": {"nodes": list(curve.nodes), "ms": [float(x) for x in curve.step_ms]}, "tasks": {}}
        table = Table(title=f"{name} (llama.cpp Q4_0, plain step {plain:.1f} ms)")
        for col in ("profile", "EntMTP*", "nodes", "EntMTP* / plain", "default / plain", "default"):
            table.add_column(col)
        for task in PROFILE_TASKS:
            profile = resolve_profile(task, "hydra")
            traces = load_traces(profile)
            ms_of = step_ms(lat)
            chosen, why, _ = scheduled_policy(profile, "greedy", lat)
            policy = StaticPolicy(chosen) if isinstance(chosen, Tree) else chosen
            best = profile.best_tree("greedy", lat)
            default = replay(policy, traces, ms_of).tokens_per_second * plain / 1000
            star = replay(StaticPolicy(best), traces, ms_of).tokens_per_second * plain / 1000
            entry["tasks"][task] = dict(
                entmtp_star=best.name, nodes=best.num_nodes, star_over_plain=star, default_over_plain=default,
                default=why,
            )  # fmt: skip
            table.add_row(task, best.name, str(best.num_nodes), f"{star:.2f}x", f"{default:.2f}x", why[:60])
        console.print(table)
        result["models"][name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
