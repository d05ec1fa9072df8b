"""Placement scorers. Each estimates the seconds a node adds for a request."""

from __future__ import annotations

from policies.placement.base import NodeView, PlacementRequest, row_cost

BLOCKING_LEFT = 0.5  # of a call this request cannot preempt, on average half remains
MAX_OVERTAKEN = 0.9  # a node busier than this with higher work: a tenfold wait, not more


class ExpectedCompletion:
    """When would *this* request finish here, at *its* priority, and what does it cost
    the work it overtakes?

    Work of equal or higher priority is ahead of it, each request priced at its own
    model's cost, plus what is left of the call in progress unless this request
    preempts that call, plus its own rows. Lower work waits behind it, except a call it
    cannot preempt (a priority gap below the node's ``preempt_gap``): when the node is
    not known to be running a call and such work is queued, one of it may be running by
    now, and on average half of a call remains. ``lower_share`` of the lower work's
    time is added too: this request delays all of it by its own service time, and a
    placement that ignores that piles urgent work onto the nodes already holding
    background work, where the background work then waits longest.

    Work of higher priority that arrives later overtakes this request too: where such
    work keeps the engine busy a share ``rho`` of the time, the wait stretches by
    ``1 / (1 - rho)`` (as in a priority queue), so low-priority work avoids the nodes
    that urgent work favours.
    """

    def __init__(self, lower_share: float = 0.25) -> None:
        self.lower_share = lower_share

    def cost(self, node: NodeView, request: PlacementRequest) -> float:
        # Conditionals, not min() / max(): this runs for every candidate of every request.
        q = request.priority
        gap = node.preempt_gap
        ahead = lower = blocking = 0.0
        backlog = node.backlog_s
        if backlog:
            work = node.work
            for p, seconds in backlog.items():
                if p >= q:
                    ahead += seconds
                    continue
                lower += seconds
                count = work.get(p, 0)
                if count and (gap is None or q - p < gap):
                    share = seconds / count
                    if share > blocking:
                        blocking = share
        running = node.running_left_s
        if running > 0 and node.running_priority is not None:
            blocking = 0.0  # what runs is known: no guess at what may be running
            if gap is not None and q - node.running_priority >= gap:
                running = 0.0  # this request preempts it
        model = request.model
        # row_cost(), without the call for the usual case of a node that reported one
        per_row = node.row_cost_s.get(model)
        if per_row is None:
            per_row = row_cost(node, model)
        own = request.rows * per_row
        rho = 0.0
        for p, share in node.busy.items():
            if p > q:
                rho += share
        if rho > MAX_OVERTAKEN:
            rho = MAX_OVERTAKEN
        wait = (running + ahead + BLOCKING_LEFT * blocking + own) / (1.0 - rho)
        return wait + self.lower_share * lower


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
