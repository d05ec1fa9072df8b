"""Queue disciplines: which queued request runs next.

A discipline maps a request's priority to a *rank*. The node keeps one FIFO lane
per rank and serves the highest rank first, so FIFO within a rank always holds.
Admission (who may evict whom) and preemption (who may abort whom) compare ranks
too, so a FIFO node never evicts or preempts: it is the baseline the priority
discipline is measured against.
"""

from __future__ import annotations

from typing import Literal, Protocol


class QueueOrder(Protocol):
    name: str

    def rank(self, priority: int) -> int:
        """Higher rank runs first. MUST be a pure function of the priority."""
        ...


class PriorityOrder:
    """Highest priority first; FIFO within a priority."""

    name = "priority"

    def rank(self, priority: int) -> int:
        return priority


class FifoOrder:
    """Arrival order for everyone; priorities are ignored (the baseline)."""

    name = "fifo"

    def rank(self, priority: int) -> int:
        return 0


# The names a node's ``order:`` takes in YAML: those of QUEUE_ORDERS (a test checks).
QueueOrderName = Literal["priority", "fifo"]
QUEUE_ORDERS: dict[str, type[QueueOrder]] = {
    PriorityOrder.name: PriorityOrder,
    FifoOrder.name: FifoOrder,
}
