"""Which waiting inputs share the next forward: length-bucketed, oldest first.

Inputs of every request the engine holds wait in arrival order. The next forward
always takes the oldest waiting input (so every request progresses), and around it the
inputs closest to it in length among the next few waiting, so that padding stays
small: a short input is never padded to a long one's width while inputs of its own
length wait. A forward holds at most ``max_rows`` rows and ``max_tokens`` padded tokens
(rows times the longest row).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

#: how far past the oldest waiting input the planner looks, in forwards' worth of rows
LOOKAHEAD_FORWARDS = 4


@dataclass(frozen=True)
class Waiting:
    """One input waiting for a forward."""

    key: Hashable
    length: int


def plan_forward(waiting: Iterable[Waiting], *, max_tokens: int, max_rows: int) -> list[Waiting]:
    """The inputs of the next forward, shortest first (empty when none wait); ``waiting``
    is in arrival order."""
    ahead = list(itertools.islice(waiting, max(1, max_rows) * LOOKAHEAD_FORWARDS))
    if not ahead:
        return []
    window = sorted(ahead, key=lambda item: item.length)
    oldest = window.index(ahead[0])
    low = high = oldest
    while high - low + 1 < max_rows:
        rows = high - low + 2
        # A shorter neighbour keeps the width; a longer one sets it.
        if low > 0 and rows * window[high].length <= max_tokens:
            low -= 1
        elif high + 1 < len(window) and rows * window[high + 1].length <= max_tokens:
            high += 1
        else:
            break
    return window[low:high + 1]


def padded_tokens(rows: Sequence[Waiting]) -> int:
    """Tokens a forward of ``rows`` computes, padding included."""
    return len(rows) * max((row.length for row in rows), default=0)


__all__ = ["LOOKAHEAD_FORWARDS", "Waiting", "plan_forward", "padded_tokens"]
