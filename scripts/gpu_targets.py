"""The #8 GPU targets, read from two `entmtp step-costs --kv dynamic,kv,graphs` JSON files (scripts/gpu_check.sh).

Prints a Markdown table: each target, the measured ratio, and whether it holds.
Usage: python scripts/gpu_targets.py PROFILE_SMOLLM2.json PROFILE_LLAMA7B.json
"""

import argparse
import json


def rows(path):
    data = json.load(open(path))
    return data["meta"], data["rows"]


def main(small_path, big_path):
    small_meta, small = rows(small_path)
    big_meta, big = rows(big_path)
    checks = [
        (
            "SmolLM2-135M plain step: eager (DynamicCache) / graphs >= 4x",
            small["plain@dynamic"]["total"] / small["plain@graphs"]["total"],
            lambda r: r >= 4,
        ),
        (
            "SmolLM2-135M verify mc_sim_7b_63 / verify plain (graphs) <= 1.3x",
            small["mc_sim_7b_63@graphs"]["verify"] / small["plain@graphs"]["verify"],
            lambda r: r <= 1.3,
        ),
        (
            "Llama-7B plain step (graphs) / weight-streaming time <= 2x",
            big["plain@graphs"]["total"] / big_meta["floor_ms"],
            lambda r: r <= 2,
        ),
        (
            "Llama-7B verify mc_sim_7b_63 / verify plain (graphs)",
            big["mc_sim_7b_63@graphs"]["verify"] / big["plain@graphs"]["verify"],
            lambda r: True,
        ),
    ]
    print(
        f"device: {small_meta['device']}; torch {small_meta['versions']['torch']}, "
        f"transformers {small_meta['versions']['transformers']}\n"
    )
    print("| target | measured | holds |\n| --- | --- | --- |")
    for name, ratio, ok in checks:
        print(f"| {name} | {ratio:.2f}x | {'yes' if ok(ratio) else 'NO'} |")
    print("\n| shape | run | kv | draft | verify | total ms |\n| --- | --- | --- | --- | --- | --- |")
    for label, rs in (("smollm2-135m", small), ("llama-7b", big)):
        for r in rs.values():
            print(
                f"| {label} | {r['tree']} | {r['mode']} | {r['draft']:.2f} | {r['verify']:.2f} | {r['total']:.2f} |"
            )
    print(
        f"\nweight-streaming floor: smollm2-135m {small_meta['floor_ms']:.2f} ms, llama-7b {big_meta['floor_ms']:.2f} ms "
        f"({big_meta['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s measured copy bandwidth)"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("smollm2", help="step-costs JSON of the smollm2-135m shape (profile-smollm2-135m.json)")
    ap.add_argument("llama7b", help="step-costs JSON of the llama-7b shape (profile-llama-7b.json)")
    args = ap.parse_args()
    main(args.smollm2, args.llama7b)
