"""The messages nodes, the router and callers exchange: replies, token chunks,
generation results and node status reports.

Plain frozen dataclasses with no dependency on Ray, ONNX Runtime or the node
runtime, so the router and clients import them without either.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from edgefleet.errors import EdgeFleetError
from edgefleet.providers import DeviceProviders, ProviderUse

# Seconds, for request latencies: 1 ms to 30 s.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Seconds, for the engine time that served each request, by model (a rollout's latency
# gates): 25 % apart from 0.25 ms to about a minute, so a quantile is within a few per
# cent of the true one wherever it falls.
SERVICE_BUCKETS = tuple(round(0.00025 * 1.25**i, 7) for i in range(56))


def bucket_quantile(q: float, bounds: tuple[float, ...], cumulative: tuple[int, ...]) -> float:
    """The ``q`` quantile from cumulative bucket counts, interpolated as Prometheus's
    ``histogram_quantile`` does (NaN without observations)."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return float("nan")
    rank = q * total
    i = next(i for i, c in enumerate(cumulative) if c >= rank)
    if i >= len(bounds):  # in the +Inf bucket: the highest finite bound
        return bounds[-1]
    lower = 0.0 if i == 0 else bounds[i - 1]
    below = 0 if i == 0 else cumulative[i - 1]
    count = cumulative[i] - below
    if count <= 0:
        return bounds[i]
    return lower + (bounds[i] - lower) * (rank - below) / count


@dataclass(frozen=True)
class MetricsSummary:
    """What a node reports about its metrics in its status: cumulative latency bucket
    counts of completed requests by priority class (the same buckets as the exported
    ``edgefleet_latency_seconds``, so the same quantiles come out), and failed records."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    latency: dict[str, tuple[int, ...]] = field(default_factory=dict)  # class -> le counts, +Inf
    errors: int = 0

    def completed(self, priority: str) -> int:
        counts = self.latency.get(priority)
        return counts[-1] if counts else 0


@dataclass(frozen=True)
class Reply:
    """The one answer to one request."""

    request_id: str
    node: str
    outputs: dict[str, np.ndarray] | None = None
    error: EdgeFleetError | None = None
    queue_s: float = 0.0  # arrival to engine start
    service_s: float = 0.0  # engine time of the call that served it
    batch_size: int = 0  # requests in that call
    # Rows in that call, on the batch axis: the call's size, which its engine time
    # follows (the record and the simulator price calls by it).
    call_rows: int = 0
    # the last part of queue_s: the engine ready for that call (the one before it ended,
    # or it was planned) to its start, the node's bookkeeping and thread hand-over
    handoff_s: float = 0.0
    # within queue_s too: how long the call aborted on that engine just before that call
    # (preempted, or cancelled) took to stop; 0 when the call before was not aborted
    abort_s: float = 0.0

    def unwrap(self) -> dict[str, np.ndarray]:
        if self.error is not None:
            raise self.error
        assert self.outputs is not None
        return self.outputs


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of a generation, in order (several when they came faster than sent)."""

    tokens: tuple[int, ...]


@dataclass(frozen=True)
class GenerationResult:
    """The end of one generation: why it ended (``stop``, ``length``, ``budget``,
    ``cancelled``) or the typed error that ended it, and what it cost."""

    request_id: str
    node: str
    tokens: tuple[int, ...] = ()  # every generated token
    finish_reason: str | None = None
    error: EdgeFleetError | None = None
    queue_s: float = 0.0  # arrival to first engine step
    first_token_s: float | None = None  # arrival to first token
    total_s: float = 0.0  # arrival to end
    engine_s: float = 0.0  # engine time, over every resumption
    engine_cpu_s: float = 0.0  # CPU time of the engine thread within engine_s
    pauses: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from a session or shared prefix
    fed_tokens: int = 0  # tokens run through the model, re-prefills included
    token_times: tuple[float, ...] = ()  # seconds from arrival until each token was made
    arrival: float = 0.0  # on the node's monotonic clock

    def unwrap(self) -> tuple[int, ...]:
        if self.error is not None:
            raise self.error
        return self.tokens


@dataclass(frozen=True)
class ModelStatus:
    name: str
    loaded: bool
    batchable: bool
    batch_limit: int
    cost_ms: dict[int, float]  # measured at warm-up: engine ms per call, by batch rows
    row_ms: float | None  # observed recently, per row
    loads: int
    kind: str = "tensor"
    load_ms: float | None = None  # measured at its last load
    # A dynamically quantized decoder: its output depends on how tokens are grouped into
    # engine calls, so it reuses no session or prefix KV and is never batch-decoded.
    exact_grouping: bool = False
    providers: ProviderUse = ProviderUse()  # what its session runs on, and any fallback
    version: str = ""  # of the files it loads (see edgefleet/artifacts.py); "" unpublished
    digest: str = ""  # the sha256 of its files' listing
    fetched_bytes: int = 0  # fetched from the fleet's store into this device's cache
    # What the node served of it: requests that failed, and the completed ones' cumulative
    # counts of the engine time that served them (SERVICE_BUCKETS, +Inf last): a
    # rollout's gates compare them between versions.
    failed: int = 0
    service: tuple[int, ...] = ()
    signature: str = ""  # its inputs and outputs on one line (a rollout compares them)
    moving: bool = False  # the node is moving it to another version: it takes none now


@dataclass(frozen=True)
class RunningStatus:
    model: str
    request_ids: tuple[str, ...]
    priority: int
    elapsed_s: float
    rows: int = 0


NODE_COUNTERS = (
    # requests, by how they ended (RequestState values of the terminal states)
    "received", "invalid", "admitted", "completed", "failed", "rejected", "evicted",
    "superseded", "expired", "cancelled",
    # the engine and the scheduler
    "engine_calls", "batched_requests", "preemptions", "preempted", "model_loads",
    # generation
    "tokens", "paused", "resumed", "finish_stop", "finish_length", "finish_budget",
    "finish_cancelled", "kv_trimmed", "kv_dropped", "lifecycle_changes",
)  # fmt: skip
"""Every counter a node reports, present from the start (at zero until it happens)."""


class NodeState(enum.StrEnum):
    """A node's service state. A str: it compares equal to (and prints, and goes into
    JSON as) its value, as the bare strings it replaced did."""

    STARTING = "starting"  # loading, warming up and measuring its models
    SERVING = "serving"
    DRAINING = "draining"  # refuses new work, finishes what it holds
    DRAINED = "drained"  # ... and has finished it
    # An engine call ran past its max_call_s and did not stop when terminated: refuses
    # new work and has answered what it held; serves again if the call ever returns.
    STUCK = "stuck"
    FAILED = "failed"  # out of service for good: its start failed, or its serve loop died
    STOPPED = "stopped"


N = NodeState
NODE_MOVES: Mapping[NodeState, frozenset[NodeState]] = {
    N.STARTING: frozenset({N.SERVING, N.FAILED, N.STOPPED}),
    N.SERVING: frozenset({N.DRAINING, N.STUCK, N.FAILED, N.STOPPED}),
    N.DRAINING: frozenset({N.DRAINED, N.STUCK, N.FAILED, N.STOPPED}),
    N.DRAINED: frozenset({N.FAILED, N.STOPPED}),
    # The call came back: serving again (drained, when a drain had begun).
    N.STUCK: frozenset({N.SERVING, N.DRAINED, N.FAILED, N.STOPPED}),
    N.FAILED: frozenset({N.STOPPED}),
    N.STOPPED: frozenset(),
}
"""The moves a node's service state may make, written down once."""
del N


@dataclass(frozen=True)
class NodeStatus:
    name: str
    state: NodeState
    queued: dict[int, int]  # priority -> requests
    queued_bytes: int
    running: RunningStatus | None
    models: tuple[ModelStatus, ...]
    counters: dict[str, int] = field(default_factory=dict)
    switching: str | None = None
    rss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    pid: int = 0  # the node's process
    paused: dict[int, int] = field(default_factory=dict)  # priority -> paused generations
    lifecycle: str = "foreground"
    kv_bytes: dict[str, int] = field(default_factory=dict)  # paused / cached -> bytes
    sessions: tuple[str, ...] = ()  # chat sessions whose KV the node holds
    metrics: MetricsSummary = field(default_factory=MetricsSummary)  # latency by priority
    # priority -> model -> rows queued
    queued_rows: dict[int, dict[str, int]] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)  # priority -> share of engine time
    at: float = 0.0  # when the node made this report, on its own clock (orders its reports)
    failure: str = ""  # why a failed or stuck node is out of service
    device: DeviceProviders = DeviceProviders()  # the device's ONNX Runtime build

    @property
    def queue_length(self) -> int:
        return sum(self.queued.values())


MAX_REPORTED_SESSIONS = 256  # sessions a node names in its status (most recent first)


@dataclass(frozen=True)
class DeviceStatus:
    """One device of a pool: its node (``POOL/DEVICE``), its state (``starting``,
    ``serving``, ``failed``, ``left``), its Ray node, how long ago it first joined
    (``age_s``) and its current (or last) Ray node started (``joined_s``), the joins
    the router saw, why it failed, and how long ago it left."""

    node: str
    device: str
    state: str
    ray_node: str
    age_s: float
    joined_s: float
    joins: int = 0
    reason: str = ""
    left_s: float | None = None


@dataclass(frozen=True)
class PoolStatus:
    """A pool, its selector and its devices (those that left included)."""

    name: str
    selector: str
    devices: tuple[DeviceStatus, ...] = ()

    def count(self, state: str) -> int:
        return sum(1 for d in self.devices if d.state == state)


@dataclass(frozen=True)
class FleetStatus:
    """A snapshot of every node, which are healthy, and the fleet-wide counters of the
    callers that place requests (received, completed, spilled, replaced, shed, ...) and
    of the router (nodes_lost, joined, rejoined): what the router answers a status call
    with, and what ``FleetClient.status()`` returns."""

    fleet: str
    nodes: tuple[NodeStatus, ...]
    healthy: dict[str, bool] = field(default_factory=dict)
    router: dict[str, int] = field(default_factory=dict)
    callers: int = 0  # processes placing requests lately
    placement: str = ""  # the placement pipeline
    # nodes alive but not answering the router, or stuck: seconds they have been so
    unresponsive: dict[str, float] = field(default_factory=dict)
    pools: tuple[PoolStatus, ...] = ()  # with their devices
    rollouts: tuple[str, ...] = ()  # the rollouts running, one line each

    def pool(self, name: str) -> PoolStatus:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def totals(self) -> dict[str, int]:
        """Node counters added up over the fleet."""
        out: dict[str, int] = {}
        for node in self.nodes:
            for k, v in node.counters.items():
                out[k] = out.get(k, 0) + v
        return out

    def node(self, name: str) -> NodeStatus:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
