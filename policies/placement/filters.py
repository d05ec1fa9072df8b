"""Placement filters: nodes that cannot take a request at all."""

from __future__ import annotations

from collections.abc import Mapping

from edgefleet.priorities import PRIORITIES
from policies.placement.base import NodeView, PlacementRequest


class ServesModel:
    """The node is configured for the model."""

    def keep(self, node: NodeView, request: PlacementRequest) -> bool:
        return request.model in node.models


class Healthy:
    """The node reports, is not lost and is not draining."""

    def keep(self, node: NodeView, request: PlacementRequest) -> bool:
        return node.healthy and not node.draining


class ShedBelowPriority:
    """Keep headroom for urgent work: a request may only go to a node whose occupancy,
    with it added, stays within the limit for its priority.

    ``limits`` maps a priority to the largest occupancy (0-1] work of that priority or
    lower may fill; e.g. {3: 0.75, 0: 0.5}: background may fill three quarters of a
    queue and offline half, and foreground all of it.

    Occupancy counts what the other callers likely sent since the node's report
    (``NodeView.unseen``): each caller's view holds its own sends, and callers that
    each fill a queue to the limit on their own views fill it past the limit together.

    A class the node guarantees a share of engine time or a longest wait (starvation
    bounds) gets that only while some of its work is there: a request of such a class
    may always go to a node that holds none, past the limit. Otherwise a flood of higher
    work that keeps the queues above the class's limit would shed all of it at the
    callers, and the node's guarantee would never apply.
    """

    def __init__(self, limits: Mapping[int, float]) -> None:
        self.limits = dict(limits)
        self._by_priority = {
            q: min((v for p, v in self.limits.items() if p >= q), default=1.0) for q in PRIORITIES
        }

    def limit(self, priority: int) -> float:
        return self._by_priority.get(priority, 1.0)

    def keep(self, node: NodeView, request: PlacementRequest) -> bool:
        limit = self._by_priority.get(request.priority, 1.0)  # self.limit(), without the call
        if limit >= 1.0:  # no headroom to keep: the node itself decides on admission
            return True
        after = (sum(node.work.values()) + node.unseen + 1) / max(1, node.capacity)
        if after <= limit:
            return True
        return request.priority in node.guaranteed and not node.holds_class_of(request.priority)
