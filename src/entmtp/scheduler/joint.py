"""A batch's joint choice: one node budget per row for the whole batched step.

One forward verifies every row's tree padded to the largest (cache.BaseModel.forward_batch), so a step costs
`latency(n)` ms for the largest tree's n drafted nodes (surface.py, at this batch size), whatever the other
rows verify. Each row's policy offers a `Menu` (policy.py): its expected tokens for every budget of at most n
nodes. The budget that maximizes the batch's expected tokens per ms of the whole step is

    argmax_n  sum_rows expected_row[min(n, top_row)] / latency(n)

and every row with a menu verifies its best tree within it: a row's tree shrinks when the batch is busy (a
larger budget costs every row) and grows for free up to what another row needs. Rows without a menu (static
and signal policies) keep their tree, which bounds the budget from below, and count one token each.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..costs import LatencyModel
from ..policy import Menu


def joint_budget(menus: Sequence[Menu | None], sizes: Sequence[int], latency: LatencyModel) -> int | None:
    """The node budget per row (see the module docstring); None when no row offers a menu. `sizes`: each
    row's chosen tree's drafted nodes."""
    offered = [m for m in menus if m is not None]
    if not offered:
        return None
    floor = max((n for m, n in zip(menus, sizes, strict=True) if m is None), default=0)
    top = max(floor, *(len(m.expected) - 1 for m in offered))
    budgets = np.arange(floor, top + 1)
    tokens = sum(m.expected[np.minimum(budgets, len(m.expected) - 1)] for m in offered)
    tokens = tokens + (len(menus) - len(offered))
    return int(budgets[int(np.argmax(tokens / latency(budgets)))])
