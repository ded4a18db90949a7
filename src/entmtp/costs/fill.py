"""The sizes a probe did not measure in its time: filled in from the ones it did, pessimistically."""

from __future__ import annotations

from collections.abc import Sequence


def extrapolate(row: dict[int, float], sizes: Sequence[int]) -> list[float]:
    """Step times for every size: measured, or linear in nodes from the two largest measured (never less)."""
    known = sorted(row)
    out = []
    for n in sizes:
        if n in row:
            out.append(row[n])
        elif len(known) >= 2:
            a, b = known[-2], known[-1]
            # pessimistic past the measurements: the steeper of the last segment and the mean slope so far
            slope = max(
                (row[b] - row[a]) / max(1, b - a), (row[b] - row[known[0]]) / max(1, b - known[0]), 0.0
            )
            out.append(row[b] + slope * (n - b))
        else:
            out.append(row[known[-1]] * max(1.0, n))  # one point: assume a node costs a plain step
    return out


def like(row: dict[int, float], reference: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """A later context's step times for every size: measured, else the reference row's shape scaled to the
    largest size measured in both."""
    ref = dict(zip(sizes, reference, strict=True))
    top = max(row)
    return [row[n] if n in row else ref[n] * row[top] / ref[top] for n in sizes]


def monotone(ms: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators). A step of more nodes never
    costs less; a timing outlier is averaged with its neighbours instead of raising every larger size, as a
    running maximum would."""
    blocks: list[list[float]] = []  # [sum, count]
    for m in ms:
        blocks.append([m, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def complete(measured: dict[int, dict[int, float]], batches: Sequence[int], sizes: Sequence[int]):
    """Every (batch, size) of a surface: measured; a batch's larger sizes linear from its two largest measured
    (`extrapolate`), or, with only its plain step measured, the previous batch's shape scaled to it; a batch
    not measured at all linear in rows from the two largest measured batches."""
    rows: dict[int, list[float]] = {}
    for b in batches:
        got = measured.get(b, {})
        if len(got) >= 2 or (got and not rows):
            rows[b] = extrapolate(got, sizes)
        elif got:
            prev = rows[max(rows)]
            rows[b] = [got.get(n, prev[j] * got[sizes[0]] / prev[0]) for j, n in enumerate(sizes)]
    done = sorted(rows)
    for b in batches:
        if b not in rows:
            lo, hi = (done[-2], done[-1]) if len(done) > 1 else (done[-1], done[-1])
            step = [(y - x) / max(1, hi - lo) for x, y in zip(rows[lo], rows[hi], strict=True)]
            rows[b] = [
                y + s * (b - hi) if hi > lo else y * b / hi for y, s in zip(rows[hi], step, strict=True)
            ]
    return rows
