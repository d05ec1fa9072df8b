"""Rollouts: which nodes move to a model's new version in which step, and whether the
new version may go on (its gates).

A rollout moves a model from one version to another node by node: a canary first, then
steps of a share of the nodes. After each step the nodes on the new version bake: the
gates compare what they served in that time (their error rate, and quantiles of the
engine time that served each request: queueing is left out, as placement sends less
work to a slow node and evens its queue out) with what the nodes still on the old
version served in the same time. A gate that fails rolls every node moved so far back.
Pure: the router (cluster/rollout.py) and the simulator (sim/rollout.py) drive the same
decisions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from edgefleet.messages import SERVICE_BUCKETS, bucket_quantile

GATE_METRICS = ("error_rate", "p50", "p90", "p99")
# Requests the new version serves in a bake before a gate may fail it before the bake
# ends (a p99 of fewer is about their maximum), and at its end.
EARLY_REQUESTS = 100
MIN_REQUESTS = 20
# A relative latency gate allows at least this over the old version's quantile: under a
# millisecond, a busy machine's scheduling moves a p99 by more than any ratio.
LATENCY_SLACK_S = 0.002
DEFAULT_GATES = "error_rate<=0.01,p99<=1.5x"

_GATE = re.compile(r"^\s*(?P<metric>[a-z_0-9]+)\s*<=\s*(?P<limit>[0-9.]+)\s*(?P<unit>x|ms|s)?\s*$")


@dataclass(frozen=True)
class Gate:
    """``metric <= limit``: an absolute limit (an error rate, or seconds), or ``limit``
    times the old version's value when ``relative``."""

    metric: str
    limit: float
    relative: bool = False

    def __str__(self) -> str:
        if self.relative:
            return f"{self.metric}<={self.limit:g}x"
        if self.metric == "error_rate":
            return f"{self.metric}<={self.limit:g}"
        return f"{self.metric}<={self.limit * 1000:g}ms"


def parse_gates(text: str) -> tuple[Gate, ...]:
    """``error_rate<=0.01,p99<=1.5x,p50<=200ms`` as gates; ValueError naming the part
    that is not one (an error rate is a fraction; a latency takes ``x``, ``ms`` or
    ``s``)."""
    gates = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _GATE.match(part)
        if m is None or m["metric"] not in GATE_METRICS:
            raise ValueError(
                f"gate {part!r}: expected METRIC<=LIMIT with METRIC one of "
                f"{', '.join(GATE_METRICS)}, e.g. {DEFAULT_GATES}"
            )
        metric, unit = m["metric"], m["unit"]
        try:
            limit = float(m["limit"])
        except ValueError:
            raise ValueError(f"gate {part!r}: {m['limit']!r} is not a number") from None
        if metric == "error_rate":
            if unit is not None or not 0 <= limit <= 1:
                raise ValueError(f"gate {part!r}: an error rate is a fraction from 0 to 1")
            gates.append(Gate(metric, limit))
        elif unit == "x":
            gates.append(Gate(metric, limit, relative=True))
        elif unit in ("ms", "s"):
            gates.append(Gate(metric, limit / 1000 if unit == "ms" else limit))
        else:
            raise ValueError(f"gate {part!r}: give the latency limit in x, ms or s")
    return tuple(gates)


@dataclass(frozen=True)
class Served:
    """What some nodes served of one model: requests that ended (completed or failed),
    those that failed, and the completed ones' cumulative counts of the engine time that
    served them (the node reports' buckets, ``+Inf`` last)."""

    failed: int = 0
    latency: tuple[int, ...] = ()
    bounds: tuple[float, ...] = SERVICE_BUCKETS

    @property
    def completed(self) -> int:
        return self.latency[-1] if self.latency else 0

    @property
    def requests(self) -> int:
        return self.completed + self.failed

    @property
    def error_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    def quantile(self, q: float) -> float:
        return bucket_quantile(q, self.bounds, self.latency)

    def __add__(self, other: Served) -> Served:
        return Served(self.failed + other.failed, _zip(self.latency, other.latency, 1), self.bounds)

    def __sub__(self, other: Served) -> Served:
        """Since ``other`` (an earlier reading of the same counters); a counter that went
        back (the node restarted) counts from zero."""
        went_back = any(a < b for a, b in zip(self.latency, other.latency, strict=False))
        if other.failed > self.failed or went_back:
            return self
        return Served(
            self.failed - other.failed, _zip(self.latency, other.latency, -1), self.bounds
        )


def _zip(a: tuple[int, ...], b: tuple[int, ...], sign: int) -> tuple[int, ...]:
    if not a:
        return tuple(sign * x for x in b)
    if not b:
        return a
    return tuple(x + sign * y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Verdict:
    """``passed``: True (the gates hold), False (one failed: roll back), None (too
    early to tell). ``why`` says what was measured."""

    passed: bool | None
    why: str


def judge(
    new: Served,
    old: Served,
    gates: Sequence[Gate],
    *,
    final: bool,
    min_requests: int = MIN_REQUESTS,
    early_requests: int = EARLY_REQUESTS,
) -> Verdict:
    """The gates on what the new version (``new``) and the old one (``old``, on the
    nodes not moved yet) served during a bake. Before the bake ends (``final`` False) a
    gate fails only once the new version has served ``early_requests``; at the end a gate
    needs ``min_requests``, and without them passes, saying so. A quantile is judged
    only on enough requests to have one above it (a p99 on 100), and a relative latency
    limit is at least ``LATENCY_SLACK_S`` above the old version's (below that, a busy
    machine's scheduling decides). A relative gate with no old requests to compare to
    passes, as do the gates left unjudged: the verdict says which."""
    parts = [f"new: {_describe(new)}", f"old: {_describe(old)}"]
    if not final and new.requests < early_requests:
        return Verdict(None, "; ".join(parts))
    if new.requests < min_requests:
        return Verdict(True, f"too few requests to judge ({new.requests}); " + "; ".join(parts))
    unjudged = []
    for gate in gates:
        if gate.metric == "error_rate":
            value, base = new.error_rate, old.error_rate
        else:
            q = _q(gate.metric)
            if new.requests < math.ceil(1 / (1 - q)):
                unjudged.append(f"{gate.metric} (on {new.requests} requests)")
                continue
            value, base = new.quantile(q), old.quantile(q)
        limit = gate.limit
        if gate.relative:
            if old.requests < min_requests or math.isnan(base):
                unjudged.append(f"{gate} (nothing to compare to)")
                continue
            limit = gate.limit * base
            if gate.metric != "error_rate":
                limit = max(limit, base + LATENCY_SLACK_S)
        if value > limit:
            shown = f"{value:.3f}" if gate.metric == "error_rate" else f"{value * 1000:.1f} ms"
            bound = f"{limit:.3f}" if gate.metric == "error_rate" else f"{limit * 1000:.1f} ms"
            return Verdict(False, f"{gate} failed: {shown} > {bound}; " + "; ".join(parts))
    if unjudged:
        parts.append("not judged: " + ", ".join(unjudged))
    return Verdict(True if final else None, "; ".join(parts))


def _q(metric: str) -> float:
    return int(metric[1:]) / 100


def _describe(s: Served) -> str:
    if not s.requests:
        return "no requests"
    p99 = s.quantile(0.99)
    p99_text = "" if math.isnan(p99) else f", engine p99 {p99 * 1000:.1f} ms"
    return f"{s.requests} requests, {s.error_rate:.1%} failed{p99_text}"


def parse_share(text: str | int | float, what: str) -> float | int:
    """``"2"`` (nodes) or ``"25%"`` (a share of the nodes, as a fraction); ValueError
    naming ``what`` otherwise."""
    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            share = float(raw[:-1]) / 100
            if not 0 < share <= 1:
                raise ValueError
            return share
        count = int(raw)
        if count < 1:
            raise ValueError
        return count
    except ValueError:
        raise ValueError(f"{what} {raw!r}: give a number of nodes (2) or a share (25%)") from None


def _count(share: float | int, total: int) -> int:
    if isinstance(share, float):
        return max(1, math.ceil(share * total))
    return min(share, total)


def plan_steps(
    nodes: Sequence[str], canary: float | int, step: float | int
) -> tuple[tuple[str, ...], ...]:
    """``nodes`` in the order they move, grouped into steps: ``canary`` nodes first, then
    ``step`` (nodes, or a share of all the nodes) at a time."""
    if not nodes:
        return ()
    first = _count(canary, len(nodes))
    size = _count(step, len(nodes))
    steps = [tuple(nodes[:first])]
    for i in range(first, len(nodes), size):
        steps.append(tuple(nodes[i : i + size]))
    return tuple(steps)
