"""python compare.py A B: per task, tok/step and curve tok/s of chain-A.json and chain-B.json, and on the prompts\nwhose greedy texts are the same in both (bf16: different trees may round to different tokens)."""

import collections
import json
import sys
from pathlib import Path

A, B = sys.argv[1], sys.argv[2]
d = {v: json.load(open(Path(__file__).parent / f"chain-{v}.json")) for v in (A, B)}
tasks = collections.OrderedDict()
for k in d[A]:
    tasks.setdefault(k.split("/")[0], []).append(k)
print(
    f"{'task':26s} {'prompts same text':>18s} | {A}: tok/step, curve tok/s | {B}: tok/step, curve tok/s | same-text prompts only: {A} -> {B} curve tok/s"
)
for t, ks in tasks.items():
    same = [k for k in ks if d[A][k]["ids"] == d[B][k]["ids"]]

    def agg(v, kk):
        tok = sum(d[v][k]["tokens"] for k in kk)
        st = sum(d[v][k]["steps"] for k in kk)
        ms = sum(d[v][k]["est_ms"] for k in kk)
        return tok / st, 1000 * tok / ms

    a, b = agg(A, ks), agg(B, ks)
    sa, sb = agg(A, same), agg(B, same) if same else ((0, 0), (0, 0))
    print(
        f"{t:26s} {len(same):>8d}/{len(ks):<9d} | {a[0]:5.2f} {a[1]:6.1f} | {b[0]:5.2f} {b[1]:6.1f} | {sa[1]:6.1f} -> {sb[1]:6.1f} ({sb[1] / sa[1]:.3f}x)"
    )
