"""Admission to a bounded queue: admit, admit by evicting lower ranks, or refuse."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueLimits:
    capacity: int  # items
    max_bytes: int


@dataclass(frozen=True)
class QueueLoad:
    items: int
    nbytes: int


@dataclass(frozen=True)
class Candidate:
    """A queued request that could be evicted: its id, rank and size."""

    id: str
    rank: int
    nbytes: int


@dataclass(frozen=True)
class Admit:
    evict: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refuse:
    reason: str


def decide_admission(
    rank: int,
    nbytes: int,
    load: QueueLoad,
    limits: QueueLimits,
    victims: Iterable[Candidate],
) -> Admit | Refuse:
    """Decide whether an arrival of ``rank`` and ``nbytes`` enters the queue.

    ``victims`` MUST come lowest rank first and, within a rank, newest first (the
    request that has waited least loses). Only strictly lower ranks are evicted, and
    nothing is evicted unless the arrival then fits: a refusal leaves the queue as is.
    """
    if nbytes > limits.max_bytes:
        return Refuse(
            f"request of {nbytes} bytes exceeds the queue's byte limit {limits.max_bytes}"
        )
    items, used = load.items, load.nbytes
    evict: list[str] = []
    for victim in victims:
        if items + 1 <= limits.capacity and used + nbytes <= limits.max_bytes:
            break
        if victim.rank >= rank:
            break
        evict.append(victim.id)
        items -= 1
        used -= victim.nbytes
    if items + 1 <= limits.capacity and used + nbytes <= limits.max_bytes:
        return Admit(tuple(evict))
    what = "items" if items + 1 > limits.capacity else "bytes"
    return Refuse(f"queue full ({what}) with work of equal or higher priority")


def retry_after(ahead_rows: int, running_left_s: float, row_cost_s: float) -> float:
    """Seconds until the work ahead of a refused arrival should have drained."""
    return max(0.001, running_left_s + ahead_rows * row_cost_s)
