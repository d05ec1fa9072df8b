"""Which cached KV to give up when a node's KV memory is over budget.

Paused generations will resume, so their caches are worth more than those kept for
sessions that may never come back. Order of sacrifice: idle cached entries (least
recently used first), then paused caches trimmed to their shared prefix (lowest
priority, then newest first), then paused caches dropped entirely in the same order.
Nothing is ever lost: a trimmed or dropped cache is rebuilt by prefill on resume.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class KVAction(enum.Enum):
    DROP = "drop"  # free the whole cache
    TRIM = "trim"  # keep only the shared prefix


@dataclass(frozen=True)
class CacheView:
    id: str
    nbytes: int
    keep_bytes: int = 0  # bytes of the shared prefix a trim keeps
    paused: bool = False  # a paused generation's cache (else an idle cached entry)
    priority: int = 0
    last_used: float = 0.0  # idle entries: least recently used go first
    seq: int = 0  # paused caches: arrival order; newest give way first


def plan_kv_release(caches: Iterable[CacheView], budget_bytes: int) -> list[tuple[str, KVAction]]:
    """The fewest actions, in order, that bring the total under ``budget_bytes``."""
    views = list(caches)
    total = sum(c.nbytes for c in views)
    actions: list[tuple[str, KVAction]] = []
    if total <= budget_bytes:
        return actions
    idle = sorted((c for c in views if not c.paused), key=lambda c: c.last_used)
    paused = sorted((c for c in views if c.paused), key=lambda c: (c.priority, -c.seq))
    for c in idle:
        actions.append((c.id, KVAction.DROP))
        total -= c.nbytes
        if total <= budget_bytes:
            return actions
    kept: dict[str, int] = {}
    for c in paused:
        if c.keep_bytes < c.nbytes:
            actions.append((c.id, KVAction.TRIM))
            total -= c.nbytes - c.keep_bytes
        kept[c.id] = min(c.keep_bytes, c.nbytes)
        if total <= budget_bytes:
            return actions
    for c in paused:
        if kept[c.id] > 0:
            actions.append((c.id, KVAction.DROP))
            total -= kept[c.id]
            if total <= budget_bytes:
                return actions
    return actions
