"""Pickers: the order in which the router tries the surviving candidates."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from policies.placement.base import NodeView


def _cost_then_name(scored: tuple[NodeView, float]) -> tuple[float, str]:
    return scored[1], scored[0].name


def _by_cost(scored: Sequence[tuple[NodeView, float]]) -> list[NodeView]:
    return [n for n, _ in sorted(scored, key=_cost_then_name)]


class Best:
    """Lowest cost first; ties by node name, so the order is deterministic."""

    def order(
        self, scored: Sequence[tuple[NodeView, float]], rng: random.Random, crowd: float = 0.0
    ) -> list[NodeView]:
        return _by_cost(scored)


class PowerOfTwo:
    """Sample two candidates, try the cheaper first, then the other, then the rest by
    cost. Scoring two instead of all keeps large fleets cheap and avoids herding."""

    def order(
        self, scored: Sequence[tuple[NodeView, float]], rng: random.Random, crowd: float = 0.0
    ) -> list[NodeView]:
        if len(scored) <= 2:
            return _by_cost(scored)
        picked = rng.sample(range(len(scored)), 2)
        first = _by_cost([scored[i] for i in picked])
        rest = _by_cost([s for i, s in enumerate(scored) if i not in picked])
        return first + rest


class RoundRobin:
    """Baseline: candidates in turn, ignoring load and priority."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(
        self, scored: Sequence[tuple[NodeView, float]], rng: random.Random, crowd: float = 0.0
    ) -> list[NodeView]:
        nodes = sorted((n for n, _ in scored), key=lambda n: n.name)
        if not nodes:
            return []
        k = next(self._turn) % len(nodes)
        return nodes[k:] + nodes[:k]


class Uniform:
    """Baseline: a uniformly random order."""

    def order(
        self, scored: Sequence[tuple[NodeView, float]], rng: random.Random, crowd: float = 0.0
    ) -> list[NodeView]:
        nodes = [n for n, _ in scored]
        rng.shuffle(nodes)
        return nodes


class NearBest:
    """The best candidate, chosen at random among those within a tie band of the best
    (``tie_s`` seconds or ``tie_ratio`` of its cost, whichever is larger); the rest by
    cost. Callers that share a stale view then spread over the near-best nodes instead
    of all picking the same one.

    The band widens with the crowd: by ``crowd_ratio`` times the share of the competing
    placements (the request's priority or above) that the fleet's other callers made
    lately. A caller alone is narrow: a cost includes what the request does to the work
    it overtakes, and a band of 30 % sent urgent requests at random to nodes where they
    wait for a call they cannot preempt. Among many callers, each sees only its own
    sends since a report and all would pick the few nodes that looked best in it."""

    def __init__(
        self, tie_s: float = 0.001, tie_ratio: float = 0.05, crowd_ratio: float = 0.3
    ) -> None:
        self.tie_s = tie_s
        self.tie_ratio = tie_ratio
        self.crowd_ratio = crowd_ratio

    def order(
        self, scored: Sequence[tuple[NodeView, float]], rng: random.Random, crowd: float = 0.0
    ) -> list[NodeView]:
        if len(scored) <= 1:
            return [n for n, _ in scored]
        ranked = sorted(scored, key=_cost_then_name)
        best = ranked[0][1]
        band = best + max(self.tie_s, (self.tie_ratio + crowd * self.crowd_ratio) * best)
        near = 1
        while near < len(ranked) and ranked[near][1] <= band:
            near += 1
        first = ranked.pop(rng.randrange(near)) if near > 1 else ranked.pop(0)
        return [first[0], *[n for n, _ in ranked]]
