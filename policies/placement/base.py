"""Placement: which node should run this request. Filters, then weighted scorers, then a
picker that orders the survivors (the caller tries them in that order, spilling on
refusal). Everything here is pure: views in, decisions out."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from policies.costs import UNTIMED_ROW_COST


@dataclass(slots=True, eq=False)
class NodeView:
    """What placement knows of one node: its latest report, aged to now, plus the work
    this caller sent there since that report.

    ``work`` counts unfinished requests by priority (for occupancy and shedding);
    ``backlog_s`` is the engine time that work needs, by priority, priced at the cost
    of each request's own model.

    Read-only by contract, not frozen: a caller builds one per candidate node for
    every request it places, and a frozen dataclass takes six times as long to build.
    """

    name: str
    models: frozenset[str]  # models the node serves
    loaded: frozenset[str] = frozenset()  # models resident now
    healthy: bool = True
    draining: bool = False
    capacity: int = 64  # queue capacity, requests
    work: Mapping[int, int] = field(default_factory=dict)  # unfinished requests by priority
    backlog_s: Mapping[int, float] = field(default_factory=dict)  # their engine seconds
    row_cost_s: Mapping[str, float] = field(default_factory=dict)  # engine seconds per row
    load_cost_s: Mapping[str, float] = field(default_factory=dict)  # seconds to load a model
    running_left_s: float = 0.0  # expected remaining time of the call in progress
    running_priority: int | None = None  # that call's priority (None: not known)
    sessions: frozenset[str] = frozenset()  # sessions whose state the node holds
    preempt_gap: int | None = 5  # priority gap that preempts a running call; None: never
    busy: Mapping[int, float] = field(default_factory=dict)  # share of engine time by priority
    # requests the fleet's other callers likely sent here since the report (an estimate
    # from their recent placements): shedding counts them, no scorer does
    unseen: float = 0.0
    # priority -> its class, for the classes the node guarantees a share of engine time
    # or a longest wait (starvation bounds)
    guaranteed: Mapping[int, int] = field(default_factory=dict)

    def work_at_or_above(self, priority: int) -> int:
        return sum(n for p, n in self.work.items() if p >= priority)

    def holds_class_of(self, priority: int) -> bool:
        """The node holds work of ``priority``'s guaranteed class (queued or running)."""
        guaranteed = self.guaranteed
        cls = guaranteed[priority]
        return any(n > 0 and guaranteed.get(p) == cls for p, n in self.work.items())

    def backlog_at_or_above(self, priority: int) -> float:
        return sum(s for p, s in self.backlog_s.items() if p >= priority)

    @property
    def occupancy(self) -> float:
        return sum(self.work.values()) / max(1, self.capacity)


@dataclass(frozen=True)
class PlacementRequest:
    model: str
    priority: int
    rows: int = 1
    session: str | None = None
    version: str | None = None  # only nodes serving this version of the model


class Filter(Protocol):
    def keep(self, node: NodeView, request: PlacementRequest) -> bool:
        """True when ``node`` may take ``request``. MUST NOT depend on other nodes."""
        ...


class Scorer(Protocol):
    def cost(self, node: NodeView, request: PlacementRequest) -> float:
        """Expected seconds this node adds for the request (lower is better). Costs of
        every scorer are in seconds, so weighted sums need no normalisation."""
        ...


class Picker(Protocol):
    def order(
        self, scored: Sequence[tuple[NodeView, float]], rng: random.Random, crowd: float = 0.0
    ) -> list[NodeView]:
        """Order candidates for trying, best first. MUST return each candidate once.
        ``crowd``: the share (0-1) of the recent placements competing with this request
        (its priority or above) made by the fleet's other callers."""
        ...


@dataclass(frozen=True)
class Placement:
    """A filter -> score -> pick pipeline."""

    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]  # (scorer, weight)
    picker: Picker

    def rank(
        self,
        nodes: Sequence[NodeView],
        request: PlacementRequest,
        rng: random.Random,
        crowd: float = 0.0,
    ) -> list[NodeView]:
        """Candidates for ``request`` in the order they should be tried (``crowd``: see
        :meth:`Picker.order`)."""
        # Plain loops, no generators: this runs for every request a caller places. The
        # plugins' methods are looked up once per request, not once per candidate.
        scored: list[tuple[NodeView, float]] = []
        keeps = [f.keep for f in self.filters]
        costs = [(scorer.cost, weight) for scorer, weight in self.scorers]
        for node in nodes:
            for keep in keeps:
                if not keep(node, request):
                    break
            else:
                cost = 0.0
                for scorer_cost, weight in costs:
                    cost += weight * scorer_cost(node, request)
                scored.append((node, cost))
        return self.picker.order(scored, rng, crowd)


def row_cost(node: NodeView, model: str) -> float:
    """Engine seconds per row of ``model`` on ``node``: as the node reported it, else
    the mean of its other models', else the untimed default."""
    if model in node.row_cost_s:
        return node.row_cost_s[model]
    return (
        sum(node.row_cost_s.values()) / len(node.row_cost_s)
        if node.row_cost_s
        else UNTIMED_ROW_COST.caller_s
    )


def drain(
    work: Mapping[int, int], backlog_s: Mapping[int, float], running_left_s: float, elapsed_s: float
) -> tuple[dict[int, int], dict[int, float], float]:
    """What is left of a node's reported work ``elapsed_s`` after the report.

    The node works the call in progress first, then its queue from the highest
    priority down, so the time elapsed comes off in that order; a priority drained
    part way keeps the matching share of its requests. Arrivals since the report are
    not known here: callers add what they sent themselves.
    """
    left = max(0.0, elapsed_s)
    running = max(0.0, running_left_s - left)
    left = max(0.0, left - running_left_s)
    counts: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for p in sorted(backlog_s, reverse=True):
        s = backlog_s[p]
        n = work.get(p, 0)
        if left >= s:
            left -= s
            continue
        remaining = s - left
        counts[p] = max(1, round(n * remaining / s)) if s > 0 and n else n
        seconds[p] = remaining
        left = 0.0
    for p, n in work.items():  # work without a known cost cannot be drained by time
        if p not in backlog_s:
            counts[p] = n
    return counts, seconds, running
