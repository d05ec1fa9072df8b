"""Metrics of a node (and the definitions the router's metrics share).

Every metric edgefleet exports is defined once in this module as a :class:`MetricDef`
(name, kind, labels, help, buckets). Recorders turn events into records on a
:class:`Sink`: in a Ray process that is Ray's metric API (``ray.util.metrics``), which
Ray's own metrics agent exports for Prometheus with the prefix ``ray_``; outside Ray
(a node run in-process in a test) nothing is recorded, unless a test passes a
:class:`MemorySink` to look at what would have been.

Recording never breaks a node: a record that fails is dropped and counted
(``NodeMetrics.errors``, reported in ``NodeStatus.metrics``).

A record through Ray's metric API costs a few microseconds, and a node makes several
per request: in Ray a node sums its counters and records the sums at most once a
second and at every status report (``NodeMetrics.flush``). Histograms record every
observation.

Priorities are labelled by their class name (``foreground``, ``inline``,
``background``, ``offline`` by default): a priority between two classes is labelled
with the class below it, so a label never has more values than there are classes.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from edgefleet.clock import Clock, MonotonicClock
from edgefleet.messages import (
    LATENCY_BUCKETS,
    SERVICE_BUCKETS,
    MetricsSummary,
    NodeState,
    NodeStatus,
)
from edgefleet.priorities import DEFAULT_PRIORITIES, PRIORITIES, class_name
from edgefleet.request import TERMINAL_STATES, RequestState
from policies.budget import LIFECYCLE_STATES

if TYPE_CHECKING:
    from actors.scheduler import Outcome, Plan

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]
EXPORT_PREFIX = "ray_"  # Ray's metrics agent puts this in front of every metric name

LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# In Ray, a recorder hands its counter sums and histogram observations to Ray's metric
# API at most this often: one record costs tens of microseconds there when the threads
# of a busy process contend for it, many from one thread at once much less.
COUNTER_FLUSH_S = 1.0

NODE_STATES = tuple(NodeState)


@dataclass(frozen=True)
class MetricDef:
    """One exported metric. ``labels`` are all its label names, ``fleet`` first."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name Prometheus sees."""
        return EXPORT_PREFIX + self.name


_NODE = ("fleet", "node")


def _counter(name: str, labels: tuple[str, ...], text: str) -> MetricDef:
    return MetricDef(name, "counter", labels, text)


def _gauge(name: str, labels: tuple[str, ...], text: str) -> MetricDef:
    return MetricDef(name, "gauge", labels, text)


def _histogram(
    name: str, labels: tuple[str, ...], text: str, buckets: tuple[float, ...]
) -> MetricDef:
    return MetricDef(name, "histogram", labels, text, buckets)


# --------------------------------------------------------------------- node metrics

QUEUE_DEPTH = _gauge(
    "edgefleet_queue_depth", (*_NODE, "priority"), "Requests queued on the node, by priority class"
)
RUNNING = _gauge(
    "edgefleet_running",
    (*_NODE, "priority"),
    "Requests in the engine call in progress, by priority class",
)
PAUSED = _gauge(
    "edgefleet_paused", (*_NODE, "priority"), "Paused generations kept on the node, by priority"
)
NODE_STATE = _gauge(
    "edgefleet_node_state",
    (*_NODE, "state"),
    "1 for the node's current service state (starting, serving, draining, drained, stuck, "
    "failed, stopped)",
)
NODE_LIFECYCLE = _gauge(
    "edgefleet_node_lifecycle",
    (*_NODE, "lifecycle"),
    "1 for the node's current lifecycle state (foreground, background)",
)
MODEL_RESIDENT = _gauge(
    "edgefleet_model_resident", (*_NODE, "model"), "1 while the model is loaded on the node"
)
MODEL_PROVIDER = _gauge(
    "edgefleet_model_provider",
    (*_NODE, "model", "provider", "fallback"),
    "1 for the execution provider the model's session runs on first (cpu, openvino, cuda, "
    "...); fallback=yes when it is not the model's first choice, or part of its graph runs "
    "on the CPU",
)
MODEL_VERSION = _gauge(
    "edgefleet_model_version",
    (*_NODE, "model", "version", "digest"),
    "1 for the version of the model's files the node serves (its YAML `version:`, else "
    "its digest), with the first 12 hex digits of their sha256",
)
NODE_ONNXRUNTIME = _gauge(
    "edgefleet_node_onnxruntime",
    (*_NODE, "build", "version"),
    "1 for the ONNX Runtime build (onnxruntime, onnxruntime-gpu, onnxruntime-openvino, ...) "
    "and version of the node's device",
)
RSS_BYTES = _gauge("edgefleet_node_rss_bytes", _NODE, "Resident memory of the node's process")
KV_BYTES = _gauge(
    "edgefleet_kv_cache_bytes",
    (*_NODE, "kind"),
    "KV cache bytes held: kind=running (generations decoding now), kind=paused (paused "
    "generations), kind=cached (sessions and shared prefixes)",
)
ADMITTED = _counter(
    "edgefleet_admitted_total",
    (*_NODE, "priority", "model"),
    "Requests the node admitted into its queue",
)
REQUESTS = _counter(
    "edgefleet_requests_total",
    (*_NODE, "priority", "model", "state"),
    "Requests that reached a terminal state on the node (completed, failed, rejected, "
    "evicted, superseded, expired, cancelled)",
)
PREEMPTED = _counter(
    "edgefleet_preempted_total",
    (*_NODE, "priority", "model"),
    "Requests sent back to their queue because a more urgent arrival aborted their call",
)
ENGINE_CALLS = _counter(
    "edgefleet_engine_calls_total", (*_NODE, "model"), "Engine calls (batches) the node ran"
)
BATCHED = _counter(
    "edgefleet_batched_requests_total",
    (*_NODE, "model"),
    "Requests in those engine calls; divided by engine calls: the mean batch size",
)
ENGINE_BUSY = _counter(
    "edgefleet_engine_busy_seconds_total",
    (*_NODE, "model"),
    "Seconds the engine spent in calls; its rate is the engine's utilisation",
)
MODEL_LOADS = _counter(
    "edgefleet_model_loads_total", (*_NODE, "model"), "Models loaded on demand (switches)"
)
TOKENS = _counter(
    "edgefleet_tokens_total",
    (*_NODE, "priority", "model"),
    "Tokens generated; its rate is tokens per second",
)
PAUSES = _counter(
    "edgefleet_generations_paused_total",
    (*_NODE, "priority"),
    "Generations paused for more urgent work",
)
RESUMES = _counter(
    "edgefleet_generations_resumed_total", (*_NODE, "priority"), "Paused generations resumed"
)
BUDGET_CUTS = _counter(
    "edgefleet_budget_cuts_total",
    (*_NODE, "priority"),
    "Generations ended by their token budget",
)
QUEUE_WAIT = _histogram(
    "edgefleet_queue_wait_seconds",
    (*_NODE, "priority", "model"),
    "Arrival on the node to the start of the engine call that ran the request",
    LATENCY_BUCKETS,
)
SERVICE = _histogram(
    "edgefleet_service_seconds",
    (*_NODE, "priority", "model"),
    "Engine time of the call that completed the request",
    LATENCY_BUCKETS,
)
LATENCY = _histogram(
    "edgefleet_latency_seconds",
    (*_NODE, "priority", "model"),
    "Arrival on the node to the answer, for completed requests (end to end on the node)",
    LATENCY_BUCKETS,
)
BATCH_SIZE = _histogram(
    "edgefleet_batch_size",
    (*_NODE, "model"),
    "Requests per engine call",
    BATCH_BUCKETS,
)
MODEL_LOAD_SECONDS = _histogram(
    "edgefleet_model_load_seconds",
    (*_NODE, "model"),
    "Time to make a model resident on demand (the switch time)",
    LOAD_BUCKETS,
)

# ------------------------------------------------------------------- router metrics

ROUTER_REQUESTS = _counter(
    "edgefleet_router_requests_total",
    ("fleet", "priority", "outcome"),
    "Answers callers got, by outcome (completed, or the error: rejected, evicted, nodelost, "
    "deadlineexceeded, invalidinput, ...)",
)
ROUTER_LATENCY = _histogram(
    "edgefleet_router_latency_seconds",
    ("fleet", "priority", "model"),
    "Placement to answer of completed requests, in the caller, spills included",
    LATENCY_BUCKETS,
)
ROUTER_SPILLED = _counter(
    "edgefleet_router_spilled_total",
    ("fleet", "priority"),
    "Node refusals after which the caller tried another node",
)
ROUTER_REPLACED = _counter(
    "edgefleet_router_replaced_total",
    ("fleet", "priority", "reason"),
    "Requests placed again: reason=evicted (pushed out of a full node) or node_lost",
)
ROUTER_SHED = _counter(
    "edgefleet_router_shed_total",
    ("fleet", "priority"),
    "Low-priority requests refused to keep headroom for urgent work",
)
NODE_HEALTHY = _gauge(
    "edgefleet_node_healthy",
    _NODE,
    "1 while the router hears from the node, 0 once it is lost or unresponsive",
)
NODES_LOST = _counter("edgefleet_nodes_lost_total", _NODE, "Times the router declared a node lost")
NODE_UNRESPONSIVE = _gauge(
    "edgefleet_node_unresponsive",
    _NODE,
    "1 while the node's actor is alive but does not answer the router, or its engine is stuck",
)
NODE_RESTARTS = _counter(
    "edgefleet_node_restarts_total",
    _NODE,
    "Times the router killed an unresponsive or stuck node for Ray to start it again",
)

POOL_DEVICES = _gauge(
    "edgefleet_pool_devices",
    ("fleet", "pool", "state"),
    "Devices of a pool by state (starting, serving, failed, left)",
)
POOL_CHANGES = _counter(
    "edgefleet_pool_changes_total",
    ("fleet", "pool", "change"),
    "Devices that joined a pool (change=joined, returns included) or left it (change=left)",
)

NODE_METRICS = (
    QUEUE_DEPTH,
    RUNNING,
    PAUSED,
    NODE_STATE,
    NODE_LIFECYCLE,
    MODEL_RESIDENT,
    MODEL_PROVIDER,
    MODEL_VERSION,
    NODE_ONNXRUNTIME,
    RSS_BYTES,
    KV_BYTES,
    ADMITTED,
    REQUESTS,
    PREEMPTED,
    ENGINE_CALLS,
    BATCHED,
    ENGINE_BUSY,
    MODEL_LOADS,
    TOKENS,
    PAUSES,
    RESUMES,
    BUDGET_CUTS,
    QUEUE_WAIT,
    SERVICE,
    LATENCY,
    BATCH_SIZE,
    MODEL_LOAD_SECONDS,
)
ROUTER_METRICS = (
    ROUTER_REQUESTS,
    ROUTER_LATENCY,
    ROUTER_SPILLED,
    ROUTER_REPLACED,
    ROUTER_SHED,
    NODE_HEALTHY,
    NODES_LOST,
    NODE_UNRESPONSIVE,
    NODE_RESTARTS,
    POOL_DEVICES,
    POOL_CHANGES,
)
CATALOGUE: tuple[MetricDef, ...] = NODE_METRICS + ROUTER_METRICS
_BY_NAME = {d.name: d for d in CATALOGUE}


# ------------------------------------------------------------------------- sinks


class Sink(Protocol):
    def record(self, metric: MetricDef, value: float, tags: Mapping[str, str]) -> None:
        """Counters add ``value``, gauges take it, histograms observe it. MAY raise;
        recorders catch and count."""
        ...


class NullSink:
    """Records nothing (a node outside Ray)."""

    def record(self, metric: MetricDef, value: float, tags: Mapping[str, str]) -> None:
        pass


_RAY_METRICS: dict[str, Any] = {}  # one Ray metric object per name and process


class RaySink:
    """Ray's metric API; Ray's metrics agent exports what this records."""

    def record(self, metric: MetricDef, value: float, tags: Mapping[str, str]) -> None:
        m = _RAY_METRICS.get(metric.name)
        if m is None:
            m = _RAY_METRICS[metric.name] = _make_ray_metric(metric)
        if metric.kind == "counter":
            if value > 0:
                m.inc(value, tags=dict(tags))
            elif value == 0:  # a series at zero (see Recorder.zero); inc() refuses 0
                m._record(0.0, tags=dict(tags))
        elif metric.kind == "gauge":
            m.set(value, tags=dict(tags))
        else:
            m.observe(value, tags=dict(tags))


def _make_ray_metric(metric: MetricDef) -> Any:
    from ray.util import metrics

    if metric.kind == "counter":
        return metrics.Counter(metric.name, metric.help, tag_keys=metric.labels)
    if metric.kind == "gauge":
        return metrics.Gauge(metric.name, metric.help, tag_keys=metric.labels)
    return metrics.Histogram(
        metric.name, metric.help, boundaries=list(metric.buckets), tag_keys=metric.labels
    )


@dataclass
class MemorySink:
    """Keeps what was recorded, for tests: counter sums, last gauge values and every
    histogram observation, keyed by metric name and labels."""

    values: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    observations: dict[tuple[str, frozenset[tuple[str, str]]], list[float]] = field(
        default_factory=dict
    )

    def record(self, metric: MetricDef, value: float, tags: Mapping[str, str]) -> None:
        missing = set(metric.labels) - set(tags)
        if missing or set(tags) - set(metric.labels):
            raise ValueError(f"{metric.name}: labels {sorted(tags)}, defined {metric.labels}")
        key = (metric.name, frozenset(tags.items()))
        if metric.kind == "counter":
            self.values[key] = self.values.get(key, 0.0) + value
        elif metric.kind == "gauge":
            self.values[key] = value
        else:
            self.observations.setdefault(key, []).append(value)

    def value(self, metric: MetricDef, **labels: str) -> float:
        """Counters and gauges: the sum over the series whose labels include ``labels``."""
        want = set(labels.items())
        return sum(
            v for (name, tags), v in self.values.items() if name == metric.name and want <= tags
        )

    def observed(self, metric: MetricDef, **labels: str) -> list[float]:
        want = set(labels.items())
        return [
            v
            for (name, tags), vs in self.observations.items()
            if name == metric.name and want <= tags
            for v in vs
        ]


def default_sink() -> Sink:
    """Ray's metric API inside a Ray process, nothing elsewhere."""
    try:
        import ray

        if ray.is_initialized():
            return RaySink()
    except Exception:  # a broken Ray install must not stop a node from serving
        log.warning("Ray metrics unavailable; recording nothing", exc_info=True)
    return NullSink()


# --------------------------------------------------------------------- recorders


class Recorder:
    """Shared plumbing: fixed labels, priority labels, records that cannot fail, and
    counters and histograms kept back and recorded in batches.

    ``flush_s``: counter sums and histogram observations are recorded at most this
    often (at the first record after it passed, and at every :meth:`flush`); 0 records
    each at once. By default they go to Ray's metric API every ``COUNTER_FLUSH_S``,
    and any other sink sees every record at once. Gauges are always recorded at once.
    Thread-safe.
    """

    def __init__(
        self,
        base: Mapping[str, str],
        priorities: Mapping[str, int],
        sink: Sink | None,
        *,
        flush_s: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._base = dict(base)
        self._classes = dict(priorities) or dict(DEFAULT_PRIORITIES)
        self._labels = {p: class_name(p, self._classes) for p in PRIORITIES}
        self._sink = sink if sink is not None else default_sink()
        self.errors = 0  # records that failed and were dropped
        if flush_s is None:
            flush_s = COUNTER_FLUSH_S if isinstance(self._sink, RaySink) else 0.0
        self._flush_s = flush_s
        self._clock = clock or MonotonicClock()
        self._flushed_at = self._clock.now()
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._observed: list[tuple[MetricDef, float, Mapping[str, str]]] = []
        self._tags: dict[tuple[str, str], dict[str, str]] = {}  # (priority label, model)

    @property
    def classes(self) -> tuple[str, ...]:
        """Priority class names, most urgent first."""
        return tuple(sorted(self._classes, key=lambda n: -self._classes[n]))

    def label(self, priority: int) -> str:
        return self._labels.get(priority) or class_name(priority, self._classes)

    def zero(self, metric: MetricDef, **choices: Iterable[str]) -> None:
        """Record ``metric`` at zero for every combination of the label values in
        ``choices``: its series exist from the start, so a fresh fleet's dashboard
        shows 0 rather than "no data" until the first event."""
        names = list(choices)
        for values in itertools.product(*(tuple(v) for v in choices.values())):
            self.emit(metric, 0, **dict(zip(names, values, strict=True)))

    def emit(self, metric: MetricDef, value: float, **labels: str) -> None:
        self._record(metric, float(value), {**self._base, **labels})

    def _record(self, metric: MetricDef, value: float, tags: Mapping[str, str]) -> None:
        try:
            self._sink.record(metric, value, tags)
        except Exception:
            self.errors += 1
            if self.errors == 1:  # once: a broken metric must not flood the log either
                log.warning("dropping a record of %s", metric.name, exc_info=True)

    def _count(self, metric: MetricDef, value: float, **labels: str) -> None:
        """Add ``value`` to a counter: at once, or to its sum until the next flush."""
        if not self._flush_s:
            self.emit(metric, value, **labels)
            return
        key = (metric.name, tuple(labels.items()))
        with self._lock:
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._flush_when_due()

    def _observe(self, metric: MetricDef, value: float, priority: str, model: str) -> None:
        """One histogram observation labelled by priority class and model: at once, or
        at the next flush."""
        tags = self._tags.get((priority, model))
        if tags is None:
            tags = self._tags[(priority, model)] = {
                **self._base,
                "priority": priority,
                "model": model,
            }
        if not self._flush_s:
            self._record(metric, value, tags)
            return
        with self._lock:
            self._observed.append((metric, value, tags))
        self._flush_when_due()

    def _flush_when_due(self) -> None:
        if self._clock.now() - self._flushed_at >= self._flush_s:
            self.flush()

    def flush(self) -> None:
        """Record the counter sums and histogram observations kept since the last flush."""
        with self._lock:
            self._flushed_at = self._clock.now()
            sums, self._sums = self._sums, {}
            observed, self._observed = self._observed, []
        for (name, labels), value in sums.items():
            self.emit(_BY_NAME[name], value, **dict(labels))
        for metric, value, tags in observed:
            self._record(metric, value, tags)


class NodeMetrics(Recorder):
    """Everything one node records. The node calls one method per event."""

    def __init__(
        self,
        fleet: str,
        node: str,
        priorities: Mapping[str, int] = DEFAULT_PRIORITIES,
        *,
        sink: Sink | None = None,
        flush_s: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``flush_s``, ``clock``: see :class:`Recorder`."""
        super().__init__(
            {"fleet": fleet, "node": node}, priorities, sink, flush_s=flush_s, clock=clock
        )
        self._latency = {name: [0] * (len(LATENCY_BUCKETS) + 1) for name in self.classes}
        self._model_service: dict[str, list[int]] = {}  # model -> SERVICE_BUCKETS counts
        self._model_failed: Counter[str] = Counter()

    def start(self, models: Iterable[str], decoders: Iterable[str]) -> None:
        """The node serves ``models`` (``decoders`` among them): its counters start at
        zero for every priority class and model."""
        classes, models, decoders = self.classes, tuple(models), tuple(decoders)
        states = [s.value for s in TERMINAL_STATES]
        self.zero(REQUESTS, priority=classes, model=models, state=states)
        for metric in (ADMITTED, PREEMPTED):
            self.zero(metric, priority=classes, model=models)
        for metric in (ENGINE_CALLS, BATCHED, ENGINE_BUSY, MODEL_LOADS):
            self.zero(metric, model=models)
        self.zero(TOKENS, priority=classes, model=decoders)
        for metric in (PAUSES, RESUMES, BUDGET_CUTS):
            self.zero(metric, priority=classes)

    # ------------------------------------------------------------------- requests

    def admitted(self, priority: int, model: str) -> None:
        self._count(ADMITTED, 1, priority=self.label(priority), model=model)

    def settled(self, outcome: Outcome, now: float, service_s: float) -> None:
        """A request reached a terminal state at ``now`` (the node's clock);
        ``service_s`` is the engine time of the call that ended it, if one did."""
        r = outcome.request
        label = self.label(r.priority)
        self._count(REQUESTS, 1, priority=label, model=r.model, state=outcome.state.value)
        if r.started is not None:
            self._observe(QUEUE_WAIT, max(0.0, r.started - r.arrival), label, r.model)
        if outcome.state is RequestState.COMPLETED:
            latency = max(0.0, now - r.arrival)
            self._observe(LATENCY, latency, label, r.model)
            self._observe(SERVICE, service_s, label, r.model)
            bucket = bisect.bisect_left(LATENCY_BUCKETS, latency)
            self._latency.setdefault(label, [0] * (len(LATENCY_BUCKETS) + 1))[bucket] += 1
            served = self._model_service.setdefault(r.model, [0] * (len(SERVICE_BUCKETS) + 1))
            served[bisect.bisect_left(SERVICE_BUCKETS, service_s)] += 1
        elif outcome.state is RequestState.FAILED:
            self._model_failed[r.model] += 1

    def preempted(self, plan: Plan) -> None:
        """The call ``plan`` was aborted for more urgent work; its requests requeue."""
        for r in plan.requests:
            if not r.cancel_requested:
                self._count(PREEMPTED, 1, priority=self.label(r.priority), model=r.model)

    # --------------------------------------------------------------------- engine

    def engine_call(self, plan: Plan, service_s: float) -> None:
        model = plan.model
        self._count(ENGINE_CALLS, 1, model=model)
        self._count(BATCHED, len(plan.requests), model=model)
        self.emit(BATCH_SIZE, len(plan.requests), model=model)
        self._count(ENGINE_BUSY, service_s, model=model)

    def model_loaded(self, model: str, seconds: float) -> None:
        self._count(MODEL_LOADS, 1, model=model)
        self.emit(MODEL_LOAD_SECONDS, seconds, model=model)

    # ----------------------------------------------------------------- generation

    def tokens(self, model: str, priority: int, n: int) -> None:
        """``n`` tokens were generated for a request of ``priority``."""
        if n > 0:
            self._count(TOKENS, n, priority=self.label(priority), model=model)

    def paused(self, priority: int) -> None:
        """A generation was paused (its KV cache kept)."""
        self._count(PAUSES, 1, priority=self.label(priority))

    def resumed(self, priority: int) -> None:
        """A paused generation runs again."""
        self._count(RESUMES, 1, priority=self.label(priority))

    def budget_cut(self, priority: int) -> None:
        """A generation ended because it reached its token budget."""
        self._count(BUDGET_CUTS, 1, priority=self.label(priority))

    # --------------------------------------------------------------------- status

    def observe(self, status: NodeStatus) -> None:
        """Set the gauges from a status snapshot (the router asks for one every
        ``router.report_interval_s``): Ray's metrics agent drops a gauge that is not
        set again for two report intervals (20 s by default). Counter sums kept
        since the last flush are recorded too."""
        self.flush()
        queued = dict.fromkeys(self.classes, 0)
        for p, n in status.queued.items():
            label = self.label(p)
            queued[label] = queued.get(label, 0) + n
        running = dict.fromkeys(self.classes, 0)
        if status.running is not None:
            label = self.label(status.running.priority)
            running[label] = running.get(label, 0) + len(status.running.request_ids)
        for label, n in queued.items():
            self.emit(QUEUE_DEPTH, n, priority=label)
        for label, n in running.items():
            self.emit(RUNNING, n, priority=label)
        paused = dict.fromkeys(self.classes, 0)
        for p, n in status.paused.items():
            label = self.label(p)
            paused[label] = paused.get(label, 0) + n
        for label, n in paused.items():
            self.emit(PAUSED, n, priority=label)
        for s in {*LIFECYCLE_STATES, status.lifecycle}:
            self.emit(NODE_LIFECYCLE, 1 if s == status.lifecycle else 0, lifecycle=s)
        for kind, n in status.kv_bytes.items():
            self.emit(KV_BYTES, n, kind=kind)
        for s in {*NODE_STATES, status.state}:
            self.emit(NODE_STATE, 1 if s == status.state else 0, state=str(s))
        for m in status.models:
            self.emit(MODEL_RESIDENT, 1 if m.loaded else 0, model=m.name)
            fallback = "yes" if m.providers.fallback else "no"
            self.emit(
                MODEL_PROVIDER, 1, model=m.name, provider=m.providers.runs_on, fallback=fallback
            )
            if m.version:
                self.emit(MODEL_VERSION, 1, model=m.name, version=m.version, digest=m.digest[:12])
        device = status.device
        self.emit(NODE_ONNXRUNTIME, 1, build=device.build or "unknown", version=device.version)
        self.emit(RSS_BYTES, status.rss_mb * 1024 * 1024)

    def served(self, model: str) -> tuple[int, tuple[int, ...]]:
        """What the node served of ``model``: the requests that failed, and the completed
        ones' cumulative counts of the engine time that served them (``+Inf`` last)."""
        counts = self._model_service.get(model, [])
        return self._model_failed[model], tuple(itertools.accumulate(counts))

    def summary(self) -> MetricsSummary:
        latency = {}
        for name, counts in self._latency.items():
            total, cumulative = 0, []
            for c in counts:
                total += c
                cumulative.append(total)
            latency[name] = tuple(cumulative)
        return MetricsSummary(LATENCY_BUCKETS, latency, self.errors)
