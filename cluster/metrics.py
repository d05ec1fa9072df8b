"""Fleet-level metrics: the router's recorder, Prometheus discovery of Ray's metrics
agents, and the overview figures ``edgefleet status`` shares with the dashboard.

Metric definitions live in :mod:`actors.metrics`; the Grafana dashboard that reads
them is built in :mod:`cluster.dashboard`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from actors.metrics import (
    NODE_HEALTHY,
    NODE_RESTARTS,
    NODE_UNRESPONSIVE,
    NODES_LOST,
    POOL_CHANGES,
    POOL_DEVICES,
    ROUTER_LATENCY,
    ROUTER_REPLACED,
    ROUTER_REQUESTS,
    ROUTER_SHED,
    ROUTER_SPILLED,
    MetricDef,
    Recorder,
    Sink,
)
from edgefleet.clock import Clock
from edgefleet.messages import bucket_quantile
from edgefleet.priorities import DEFAULT_PRIORITIES
from edgefleet.request import GenerateRequest, InferRequest

if TYPE_CHECKING:
    from edgefleet.messages import FleetStatus

# Ray's name for it (ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE).
SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"
GAUGE_REFRESH_S = 5.0  # the router's occasional gauges are recorded again this often
OVERVIEW_WINDOW_S = 60.0  # the dashboard's default $window: 1m
OUTCOMES = (  # how a caller's request ended: completed, or its error's class
    "completed", "rejected", "evicted", "superseded", "deadlineexceeded", "cancelled",
    "invalidinput", "modelnotfound", "engineerror", "nodelost", "timedout",
)  # fmt: skip


class RouterMetrics(Recorder):
    """What the router records: answers by outcome, latency as callers see it,
    spills, re-placements, shedding and node health."""

    def __init__(
        self,
        fleet: str,
        priorities: Mapping[str, int] = DEFAULT_PRIORITIES,
        *,
        sink: Sink | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Recorded in batches in Ray (see :class:`~actors.metrics.Recorder`)."""
        super().__init__({"fleet": fleet}, priorities, sink, clock=clock)
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[MetricDef, float]] = {}
        self._refreshed_at = self._clock.now()

    def _set(self, metric: MetricDef, value: float, **labels: str) -> None:
        """Set a gauge the router changes only now and then, and keep its value for
        :meth:`refresh`."""
        self._gauges[(metric.name, tuple(sorted(labels.items())))] = (metric, value)
        self.emit(metric, value, **labels)

    def refresh(self) -> None:
        """Record every such gauge again, at most every GAUGE_REFRESH_S: Ray exports a
        gauge's value when it is recorded, so one recorded once (at the router's start,
        perhaps before Ray's metrics agent took records) would show no data."""
        now = self._clock.now()
        if now - self._refreshed_at < GAUGE_REFRESH_S:
            return
        self._refreshed_at = now
        for (_, labels), (metric, value) in list(self._gauges.items()):
            self.emit(metric, value, **dict(labels))

    def start(self) -> None:
        """A caller's counters start at zero for every priority class and outcome."""
        classes = self.classes
        self.zero(ROUTER_REQUESTS, priority=classes, outcome=OUTCOMES)
        self.zero(ROUTER_SPILLED, priority=classes)
        self.zero(ROUTER_SHED, priority=classes)
        self.zero(ROUTER_REPLACED, priority=classes, reason=("evicted", "node_lost"))

    def watching(self, nodes: Iterable[str]) -> None:
        """The router watches ``nodes``: their loss and restart counters start at zero,
        and none is unresponsive."""
        nodes = list(nodes)
        self.zero(NODES_LOST, node=nodes)
        self.zero(NODE_RESTARTS, node=nodes)
        for node in nodes:
            self.node_unresponsive(node, False)

    def answered(
        self, request: InferRequest | GenerateRequest, error: Exception | None, seconds: float
    ) -> None:
        """The router gave the caller its answer (a generation: its result) after
        ``seconds``."""
        outcome = "completed" if error is None else type(error).__name__.lower()
        priority = self.label(request.priority)
        self._count(ROUTER_REQUESTS, 1, priority=priority, outcome=outcome)
        if error is None:
            self._observe(ROUTER_LATENCY, seconds, priority, request.model)

    def spilled(self, priority: int) -> None:
        self._count(ROUTER_SPILLED, 1, priority=self.label(priority))

    def replaced(self, priority: int, reason: str) -> None:
        """``reason``: ``evicted`` or ``node_lost``."""
        self._count(ROUTER_REPLACED, 1, priority=self.label(priority), reason=reason)

    def shed(self, priority: int) -> None:
        self._count(ROUTER_SHED, 1, priority=self.label(priority))

    def node_health(self, node: str, healthy: bool) -> None:
        self.emit(NODE_HEALTHY, 1 if healthy else 0, node=node)

    def node_lost(self, node: str) -> None:
        self.emit(NODES_LOST, 1, node=node)
        self.node_health(node, False)

    def node_unresponsive(self, node: str, unresponsive: bool) -> None:
        self._set(NODE_UNRESPONSIVE, 1 if unresponsive else 0, node=node)

    def node_restarted(self, node: str) -> None:
        self.emit(NODE_RESTARTS, 1, node=node)

    def pool_devices(self, pool: str, state: str, devices: int) -> None:
        self._set(POOL_DEVICES, devices, pool=pool, state=state)

    def device_change(self, pool: str, change: str) -> None:
        """``change``: ``joined`` (a return included) or ``left``."""
        self.emit(POOL_CHANGES, 1, pool=pool, change=change)

    def watching_pools(self, pools: Iterable[str]) -> None:
        """The router watches ``pools``: their join and leave counters start at zero."""
        self.zero(POOL_CHANGES, pool=list(pools), change=("joined", "left"))


# ----------------------------------------------------------- Prometheus discovery


def default_temp_dir() -> Path:
    """Ray's default temporary folder (``ray start`` / ``ray.init`` without --temp-dir)."""
    return Path(tempfile.gettempdir()) / "ray"


def write_service_discovery(temp_dir: Path | None = None) -> Path:
    """Write Ray's Prometheus service-discovery file for the cluster this process
    started or joined, where and as Ray's dashboard writes it: in the session folder,
    linked from ``temp_dir`` (default: the session's own), listing each live node's
    metrics-agent address. Ray writes it itself only when its dashboard runs, which
    the embedded default and ``up --detach`` leave off. Returns the linked path.
    """
    import ray

    node = ray._private.worker._global_node
    session = Path(node.get_session_dir_path())
    temp = Path(temp_dir) if temp_dir is not None else Path(node.get_temp_dir_path())
    targets = [
        f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]
    ]
    content = json.dumps([{"labels": {"job": "ray"}, "targets": targets}])
    target = session / SERVICE_DISCOVERY_FILE
    _atomic_write(target, content)
    link = temp / SERVICE_DISCOVERY_FILE
    if link != target:
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)  # atomic: Prometheus never reads half a file
    return link


def _atomic_write(path: Path, content: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(content)
    os.replace(tmp, path)


def prometheus_config(sd_file: Path, *, scrape_interval: str = "5s") -> str:
    """A Prometheus configuration that scrapes every Ray metrics agent listed in
    ``sd_file`` (Ray's service-discovery file; Prometheus re-reads it as it changes)."""
    return (
        "# Prometheus configuration for an edgefleet fleet on Ray\n"
        "# (written by `edgefleet dashboard prometheus-config`). Ray lists the addresses of\n"
        "# its metrics agents in the service-discovery file below; Prometheus follows it.\n"
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        "    file_sd_configs:\n"
        "      - files:\n"
        f"          - {json.dumps(str(sd_file))}\n"
    )


# ------------------------------------------------------------------------ overview


@dataclass(frozen=True)
class Overview:
    """The dashboard's fleet overview as figures: completed requests per second and
    latency p50/p99 by priority class, caller rejections and node evictions per second.

    Rates cover ``seconds`` (up to the dashboard's one-minute window); with a single
    snapshot there are no rates (``seconds`` 0) and latency covers the nodes' lifetime.
    """

    seconds: float
    classes: tuple[str, ...]
    throughput: dict[str, float] = field(default_factory=dict)  # class -> completed/s
    p50: dict[str, float] = field(default_factory=dict)  # class -> seconds (NaN: none)
    p99: dict[str, float] = field(default_factory=dict)
    rejected_per_s: float | None = None
    evicted_per_s: float | None = None
    rejected: int = 0  # since the router started
    evicted: int = 0  # since the nodes started

    @property
    def total_throughput(self) -> float:
        return sum(self.throughput.values())


@dataclass(frozen=True)
class _Sample:
    at: float
    latency: dict[str, dict[str, tuple[int, ...]]]  # node -> class -> cumulative buckets
    evicted: dict[str, int]  # node -> evictions
    rejected: int
    bounds: tuple[float, ...]


class OverviewWindow:
    """Snapshots of a fleet over the last ``window_s`` seconds, turned into the same
    figures as the dashboard's overview (counter resets are handled as Prometheus does)."""

    def __init__(
        self, window_s: float = OVERVIEW_WINDOW_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._history: deque[_Sample] = deque()

    def add(self, status: FleetStatus) -> Overview:
        now = self._clock()
        bounds = next((n.metrics.bounds for n in status.nodes), ())
        sample = _Sample(
            now,
            {n.name: dict(n.metrics.latency) for n in status.nodes},
            {n.name: n.counters.get("evicted", 0) for n in status.nodes},
            status.router.get("rejected", 0),
            bounds,
        )
        self._history.append(sample)
        while len(self._history) > 1 and now - self._history[0].at > self.window_s:
            self._history.popleft()
        return overview(sample, self._history[0] if len(self._history) > 1 else None)


def overview(new: _Sample, old: _Sample | None) -> Overview:
    classes: list[str] = []
    for per_class in new.latency.values():
        classes += [c for c in per_class if c not in classes]
    buckets: dict[str, list[int]] = {}
    for node, per_class in new.latency.items():
        before = old.latency.get(node, {}) if old is not None else {}
        for c, counts in per_class.items():
            if old is None:
                delta = list(counts)
            elif node not in old.latency:
                delta = [0] * len(counts)  # first seen in the window: no increase known yet
            else:
                delta = _increase(counts, before.get(c, (0,) * len(counts)))
            acc = buckets.setdefault(c, [0] * len(counts))
            for i, d in enumerate(delta):
                acc[i] += d
    p50 = {c: bucket_quantile(0.5, new.bounds, tuple(b)) for c, b in buckets.items()}
    p99 = {c: bucket_quantile(0.99, new.bounds, tuple(b)) for c, b in buckets.items()}
    rejected, evicted = new.rejected, sum(new.evicted.values())
    if old is None or new.at <= old.at:
        return Overview(0.0, tuple(classes), {}, p50, p99, None, None, rejected, evicted)
    seconds = new.at - old.at
    throughput = {c: b[-1] / seconds for c, b in buckets.items()}
    evicted_delta = sum(
        _increase((n,), (old.evicted[node],))[0] if node in old.evicted else 0
        for node, n in new.evicted.items()
    )
    rejected_delta = _increase((new.rejected,), (old.rejected,))[0]
    return Overview(
        seconds,
        tuple(classes),
        throughput,
        p50,
        p99,
        rejected_delta / seconds,
        evicted_delta / seconds,
        rejected,
        evicted,
    )


def _increase(new: tuple[int, ...], old: tuple[int, ...]) -> list[int]:
    """Per-element increase of cumulative counts; a counter that went down restarted
    from zero (its process restarted), so all of its new value is increase."""
    if len(new) != len(old) or any(n < o for n, o in zip(new, old, strict=True)):
        return list(new)
    return [n - o for n, o in zip(new, old, strict=True)]
