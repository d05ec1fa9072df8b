"""Placement scorers. Each estimates the seconds a node adds for a request."""

from __future__ import annotations

from policies.placement.base import NodeView, PlacementRequest, row_cost


class ExpectedCompletion:
    """When would *this* request finish here, at *its* priority?

    Only work of equal or higher priority is ahead of it (lower work waits behind it,
    or is preempted), each request priced at its own model's cost, plus what is left
    of the call in progress, plus its own rows.
    """

    def cost(self, node: NodeView, request: PlacementRequest) -> float:
        ahead = node.backlog_at_or_above(request.priority)
        return node.running_left_s + ahead + request.rows * row_cost(node, request.model)


class ModelLoad:
    """The time to load the model where it is not resident: the load time the node
    measured for it, or ``default_s`` before it has loaded it once."""

    def __init__(self, default_s: float = 1.0) -> None:
        self.default_s = default_s

    def cost(self, node: NodeView, request: PlacementRequest) -> float:
        if request.model in node.loaded:
            return 0.0
        return node.load_cost_s.get(request.model, self.default_s)


class SessionAffinity:
    """A session goes back to the node holding its state; elsewhere it costs
    ``penalty_s`` (rebuilding that state)."""

    def __init__(self, penalty_s: float = 0.5) -> None:
        self.penalty_s = penalty_s

    def cost(self, node: NodeView, request: PlacementRequest) -> float:
        # When no node holds the session every node pays the same: the order is unchanged.
        if request.session is None or request.session in node.sessions:
            return 0.0
        return self.penalty_s
