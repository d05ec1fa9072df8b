"""Placement: which node should run this request. Filters, then weighted scorers, then a
picker that orders the survivors (the router tries them in that order, spilling on
refusal). Everything here is pure: views in, decisions out."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class NodeView:
    """What placement knows of one node: its latest report plus the router's own count
    of work it dispatched there and has not seen finish."""

    name: str
    models: frozenset[str]  # models the node serves
    loaded: frozenset[str] = frozenset()  # models resident now
    healthy: bool = True
    draining: bool = False
    capacity: int = 64  # queue capacity, requests
    work: Mapping[int, int] = field(default_factory=dict)  # unfinished requests by priority
    row_cost_s: Mapping[str, float] = field(default_factory=dict)  # engine seconds per row
    load_cost_s: Mapping[str, float] = field(default_factory=dict)  # seconds to load a model
    running_left_s: float = 0.0  # expected remaining time of the call in progress
    sessions: frozenset[str] = frozenset()  # sessions whose state the node holds

    def work_at_or_above(self, priority: int) -> int:
        return sum(n for p, n in self.work.items() if p >= priority)

    @property
    def occupancy(self) -> float:
        return sum(self.work.values()) / max(1, self.capacity)


@dataclass(frozen=True)
class PlacementRequest:
    model: str
    priority: int
    rows: int = 1
    session: str | None = None


DEFAULT_ROW_COST_S = 0.005  # a node that has not reported a cost for this model yet


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
    def order(self, scored: Sequence[tuple[NodeView, float]], rng: random.Random) -> list[NodeView]:
        """Order candidates for trying, best first. MUST return each candidate once."""
        ...


@dataclass(frozen=True)
class Placement:
    """A filter -> score -> pick pipeline."""

    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]  # (scorer, weight)
    picker: Picker

    def rank(
        self, nodes: Sequence[NodeView], request: PlacementRequest, rng: random.Random
    ) -> list[NodeView]:
        """Candidates for ``request`` in the order the router should try them."""
        alive = [n for n in nodes if all(f.keep(n, request) for f in self.filters)]
        scored = [(n, sum(w * s.cost(n, request) for s, w in self.scorers)) for n in alive]
        return self.picker.order(scored, rng)


def row_cost(node: NodeView, model: str) -> float:
    if model in node.row_cost_s:
        return node.row_cost_s[model]
    return (
        sum(node.row_cost_s.values()) / len(node.row_cost_s)
        if node.row_cost_s
        else DEFAULT_ROW_COST_S
    )
