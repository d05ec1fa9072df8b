"""Shared helpers of the benchmarks: statistics, Markdown, one embedded Ray, models, fleets.

Importing this module before Ray matters: see :func:`_pin_ray_to_loopback`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime as _dt
import math
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np
import onnxruntime as ort
import ray
from ray.actor import ActorHandle

from cluster.client import FleetClient, FleetStatus
from cluster.deploy import NAMESPACE, actor_name, init_loopback_ray
from edgefleet.config import FleetConfig, parse_config
from edgefleet.messages import Reply
from edgefleet.modelgen import calibrate_slow
from edgefleet.request import DEFAULT_PRIORITIES, InferRequest, new_request_id, resolve_priority
from sim.report import md_table as md_table  # one table writer: benchmarks and simulator

DISTURBED_CORES = 0.15  # other processes using more than this means noisy figures
CALM_CORES = 0.2  # a measurement disturbed more than this is taken again (bounded)
GET_TIMEOUT_S = 30.0  # no single reply may take longer than this; a hang is a failure

_T0 = time.perf_counter()


# ------------------------------------------------------------------------ progress


def log(message: str) -> None:
    """A progress line on stderr, stamped with seconds since the benchmarks started."""
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


@dataclass(frozen=True)
class Summary:
    """Distribution of a sample (same unit as the sample)."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            n=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )


# ------------------------------------------------------------------------ Markdown


def fmt(value: float, digits: int = 1, *, signed: bool = False) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


# ---------------------------------------------------------------- report sections


@dataclass(frozen=True)
class Target:
    """A figure checked against a threshold; ``passed`` is honest, misses are misses."""

    label: str
    value: float
    op: Literal[">=", "<="]
    threshold: float
    digits: int = 2

    @property
    def passed(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.threshold if self.op == ">=" else self.value <= self.threshold

    def markdown(self) -> str:
        verdict = "PASS" if self.passed else "MISS"
        return (
            f"- **{verdict}** {self.label}: {fmt(self.value, self.digits)} "
            f"(target {self.op} {self.threshold:g})"
        )


def _footer(what: str, seconds: float, cpu: CpuUse | None) -> str:
    footer = f"_{what} time: {seconds:.0f} s"
    if cpu is not None:
        footer += f"; {cpu.describe()}"
        if cpu.foreign_cores > DISTURBED_CORES:
            footer += " (**disturbed**: treat these figures with caution)"
    return footer + "._"


@dataclass
class Part:
    """A titled part of a section, for a scenario that measures several things; each
    part has its own tables, targets and notes."""

    title: str
    measured: str
    tables: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cpu: CpuUse | None = None

    def markdown(self) -> str:
        parts = [f"### {self.title}", "", self.measured, ""]
        for table in self.tables:
            parts += [table, ""]
        if self.targets:
            parts += ["Targets:", "", *(t.markdown() for t in self.targets), ""]
        else:
            parts += ["No target: reported for information.", ""]
        for note in self.notes:
            parts += [note, ""]
        parts.append(_footer("Part", self.seconds, self.cpu))
        return "\n".join(parts)


@dataclass
class Section:
    """One scenario's part of the report."""

    title: str
    measured: str  # what was measured and how, one paragraph
    tables: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    cpu: CpuUse | None = None
    parts: list[Part] = field(default_factory=list)

    @property
    def all_targets(self) -> list[Target]:
        """The section's own targets, then those of its parts, in order."""
        return [*self.targets, *(t for p in self.parts for t in p.targets)]

    @property
    def passed(self) -> bool:
        return self.error is None and all(t.passed for t in self.all_targets)

    def markdown(self) -> str:
        parts = [f"## {self.title}", "", self.measured, ""]
        if self.error is not None:
            parts += [
                "**FAILED** — the scenario did not complete:",
                "",
                "```",
                self.error,
                "```",
                "",
            ]
        for part in self.parts:
            parts += [part.markdown(), ""]
        for table in self.tables:
            parts += [table, ""]
        if self.targets:
            parts += ["Targets:", "", *(t.markdown() for t in self.targets), ""]
        for note in self.notes:
            parts += [note, ""]
        parts.append(_footer("Scenario", self.seconds, self.cpu))
        return "\n".join(parts)


# ------------------------------------------------------------------- environment


@dataclass(frozen=True)
class EnvFacts:
    cpus: int
    cpu_model: str
    python: str
    ray: str
    onnxruntime: str
    numpy: str
    load_avg: tuple[float, float, float]

    @classmethod
    def collect(cls) -> EnvFacts:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return cls(
            cpus=cpus or 1,
            cpu_model=_cpu_model(),
            python=platform.python_version(),
            ray=ray.__version__,
            onnxruntime=ort.__version__,
            numpy=np.__version__,
            load_avg=os.getloadavg(),
        )

    def line(self) -> str:
        load = ", ".join(f"{x:.2f}" for x in self.load_avg)
        return (
            f"{self.cpus} CPUs ({self.cpu_model}); Python {self.python}, ray {self.ray}, "
            f"onnxruntime {self.onnxruntime}, numpy {self.numpy}; load average at start {load}"
        )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for row in f:
                if row.startswith("model name"):
                    return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------- CPU disturbance


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    """Machine-wide busy CPU seconds, and those of this process and its descendants
    (the embedded Ray: GCS, raylet, workers, node actors) at one instant."""

    wall: float
    busy_s: float
    own_s: float


@dataclass(frozen=True)
class CpuUse:
    """CPU used between two samples; ``foreign`` is what other processes took."""

    wall_s: float
    busy_s: float
    own_s: float

    @property
    def foreign_cores(self) -> float:
        """Average cores used by processes outside this benchmark (a disturbance)."""
        if self.wall_s <= 0:
            return 0.0
        return max(0.0, self.busy_s - self.own_s) / self.wall_s

    def describe(self) -> str:
        return (
            f"this benchmark used {self.own_s / max(self.wall_s, 1e-9):.2f} cores on average; "
            f"other processes {self.foreign_cores:.2f} cores"
        )


def cpu_sample() -> CpuSample:
    """Read /proc (Linux); elsewhere every figure is 0 and nothing is flagged."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return CpuSample(time.perf_counter(), 0.0, 0.0)
    # user nice system idle iowait irq softirq steal ...: busy excludes idle and iowait
    busy = sum(fields[:3]) + sum(fields[5:8])
    return CpuSample(time.perf_counter(), busy / _CLK_TCK, _TREE.ticks() / _CLK_TCK)


def cpu_since(start: CpuSample) -> CpuUse:
    end = cpu_sample()
    return CpuUse(end.wall - start.wall, end.busy_s - start.busy_s, end.own_s - start.own_s)


class _TreeAccountant:
    """CPU ticks used by this process and every descendant it ever had.

    A killed Ray worker vanishes from /proc without its time reaching any parent's
    ``cutime`` (Ray reaps its workers without accounting), so live processes are
    sampled in the background and a dead one keeps the last ticks seen for it.
    Processes are keyed by (pid, start time), so a reused pid is a new process.
    """

    PERIOD_S = 0.25

    def __init__(self) -> None:
        self._root = os.getpid()
        self._seen: dict[tuple[int, int], int] = {}  # in-tree process -> last ticks
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def ticks(self) -> int:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="bench-cpu", daemon=True)
            self._thread.start()
        self._scan()
        with self._lock:
            return sum(self._seen.values())

    def _loop(self) -> None:
        while True:
            time.sleep(self.PERIOD_S)
            self._scan()

    def _scan(self) -> None:
        parent: dict[int, int] = {}
        usage: dict[int, tuple[int, int]] = {}  # pid -> (start time, utime + stime)
        try:
            entries = os.listdir("/proc")
        except OSError:
            return
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    data = f.read()
            except OSError:  # the process ended meanwhile
                continue
            rest = data[data.rfind(")") + 2 :].split()
            pid = int(entry)
            parent[pid] = int(rest[1])
            usage[pid] = (int(rest[19]), int(rest[11]) + int(rest[12]))
        with self._lock:
            for pid, (start, used) in usage.items():
                if self._in_tree(pid, parent):
                    key = (pid, start)
                    self._seen[key] = max(used, self._seen.get(key, 0))

    def _in_tree(self, pid: int, parent: dict[int, int]) -> bool:
        for _ in range(64):  # bounded walk up the process tree
            if pid == self._root:
                return True
            pid = parent.get(pid, 0)
            if pid <= 1:
                return False
        return False


_TREE = _TreeAccountant()


T = TypeVar("T")


@dataclass(frozen=True)
class Calm(Generic[T]):
    """A measurement and how much other processes disturbed it."""

    value: T
    foreign_cores: float
    attempts: int


def calm(
    measure: Callable[[], T], label: str, *, attempts: int = 3, limit: float = CALM_CORES
) -> Calm[T]:
    """Run ``measure``; while other processes took more than ``limit`` cores meanwhile,
    run it again (at most ``attempts`` times) and keep the least disturbed result."""
    best: Calm[T] | None = None
    tries = 0
    for tries in range(1, attempts + 1):  # noqa: B007 - the count is reported
        start = cpu_sample()
        value = measure()
        foreign = cpu_since(start).foreign_cores
        if best is None or foreign < best.foreign_cores:
            best = Calm(value, foreign, tries)
        if foreign <= limit:
            break
        again = "measuring again" if tries < attempts else "keeping the least disturbed"
        log(f"  {label}: other processes used {foreign:.2f} cores meanwhile; {again}")
    assert best is not None
    return Calm(best.value, best.foreign_cores, tries)


# --------------------------------------------------------------------------- Ray


@contextlib.contextmanager
def embedded_ray(num_cpus: int = 2) -> Iterator[None]:
    """One embedded Ray bound to 127.0.0.1 for the whole run (reused if already up).

    Fleets are then deployed on it one after another with :func:`deployed`; each
    :class:`FleetClient` finds Ray running and leaves it up when it closes.
    """
    if ray.is_initialized():
        yield
        return
    log("starting an embedded Ray on 127.0.0.1")
    init_loopback_ray(num_cpus=num_cpus)
    try:
        yield
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class ModelEntry:
    """One model entry of a benchmark fleet (several entries may share a file).
    ``batching`` adds other keys of its ``batching:`` section (e.g. ``min_gain``)."""

    name: str
    path: Path
    window_ms: float = 0.0
    max_batch_size: int = 1
    only_if_faster: bool = True
    threads: int = 1
    batching: Mapping[str, Any] = field(default_factory=dict)


NO_SHED: Mapping[str, Any] = {"placement": {"shed": {}}}


def fleet_config(
    name: str,
    models: Sequence[ModelEntry],
    base_dir: Path,
    *,
    capacity: int = 64,
    order: Literal["priority", "fifo"] = "priority",
    preemption: bool = True,
    min_priority_gap: int = 5,
    nodes: int = 1,
    node_list: Sequence[Mapping[str, Any]] | None = None,
    router: Mapping[str, Any] | None = None,
    starvation: Mapping[str, Any] | None = None,
) -> FleetConfig:
    """Build a FleetConfig the way a YAML file would (through ``parse_config``).

    ``nodes`` identical nodes (``local.nodes``) unless ``node_list`` gives the
    ``nodes:`` entries. ``router`` is the ``router:`` section; by default router
    shedding is off (:data:`NO_SHED`): the node-level scenarios measure one node's
    scheduler, and the router must not shed background work before the node's own
    queue is full. ``starvation`` is ``node_defaults.starvation`` (default: none).
    """
    data: dict[str, Any] = {
        "fleet": {"name": name},
        "local": {"nodes": nodes},
        "models": {
            m.name: {
                "path": str(m.path),
                "threads": m.threads,
                "batching": {
                    "window_ms": m.window_ms,
                    "max_batch_size": m.max_batch_size,
                    "only_if_faster": m.only_if_faster,
                    **m.batching,
                },
            }
            for m in models
        },
        "node_defaults": {
            "queue": {"capacity": capacity},
            "preemption": {"enabled": preemption, "min_priority_gap": min_priority_gap},
            "order": order,
        },
        "router": dict(NO_SHED if router is None else router),
    }
    if starvation is not None:
        data["node_defaults"]["starvation"] = dict(starvation)
    if node_list is not None:
        data["nodes"] = [dict(n) for n in node_list]
    return parse_config(data, base_dir)


@contextlib.contextmanager
def deployed(config: FleetConfig) -> Iterator[FleetClient]:
    """Deploy a fleet on the running Ray, yield its client, tear it down afterwards."""
    t0 = time.perf_counter()
    client = FleetClient.local(config, progress=lambda msg: log(f"  {msg}"))
    log(f"fleet {config.fleet.name} up in {time.perf_counter() - t0:.1f} s")
    try:
        yield client
    finally:
        forget_nodes(config.fleet.name)
        client.close()


# ------------------------------------------------------- straight to a node actor

_NODE_ACTORS: dict[tuple[str, str], ActorHandle] = {}


def node_names(client: FleetClient) -> list[str]:
    """The fleet's node names, in config order (``edge-0``, ... for ``local.nodes``)."""
    return [spec.name for spec in client.config.node_specs()]


def node_actor(fleet: str, node: str) -> ActorHandle:
    """The node actor of ``fleet``'s ``node``, found by name once and then cached (the
    cache is dropped when :func:`deployed` tears the fleet down)."""
    key = (fleet, node)
    handle = _NODE_ACTORS.get(key)
    if handle is None:
        handle = ray.get_actor(actor_name(fleet, node), namespace=NAMESPACE)
        _NODE_ACTORS[key] = handle
    return handle


def forget_nodes(fleet: str) -> None:
    for key in [k for k in _NODE_ACTORS if k[0] == fleet]:
        del _NODE_ACTORS[key]


def _fleet_and_priorities(target: FleetClient | str) -> tuple[str, Mapping[str, int]]:
    if isinstance(target, FleetClient):
        return target.config.fleet.name, target.config.priorities
    return target, DEFAULT_PRIORITIES


def node_submit(
    target: FleetClient | str,
    node: str,
    model: str,
    inputs: Mapping[str, np.ndarray],
    priority: str | int = "foreground",
    request_id: str | None = None,
    deadline_s: float | None = None,
    key: str | None = None,
) -> ray.ObjectRef:
    """Send one request straight to a node actor, bypassing the fleet's router.

    ``target`` is the fleet's client (its priority classes are used) or the fleet's
    name (default classes). Returns a reference to the node's :class:`Reply`.
    """
    fleet, classes = _fleet_and_priorities(target)
    request = InferRequest(
        model=model,
        inputs=inputs,
        priority=resolve_priority(priority, classes),
        id=request_id or new_request_id(),
        deadline_unix=InferRequest.deadline_from_timeout(deadline_s),
        key=key,
    )
    return node_actor(fleet, node).infer.remote(request)


Pending = Any  # a ray.ObjectRef (straight to a node) or a Future of FleetClient.submit


class Inbox:
    """Replies as they become ready, of one kind: node references (``ray.wait``) or
    client futures (their completion callbacks fill a queue, so each reply costs the
    same however many are in flight, as in an asyncio service awaiting them)."""

    def __init__(self) -> None:
        self._done: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._refs: list[Pending] = []

    def add(self, item: Pending) -> Pending:
        if isinstance(item, cf.Future):
            item.add_done_callback(self._done.put)
        else:
            self._refs.append(item)
        return item

    def ready(self, timeout_s: float) -> list[Pending]:
        """What is ready, waiting at most ``timeout_s`` for the first."""
        if self._refs:
            ready = _ray_ready(self._refs, timeout_s)
            done = set(ready)
            self._refs = [r for r in self._refs if r not in done]
            return ready
        try:
            out = [self._done.get(timeout=max(0.0, timeout_s))]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out


def _ray_ready(pending: Sequence[Pending], timeout_s: float) -> list[Pending]:
    """The references in ``pending`` that are ready, waiting at most ``timeout_s`` for
    the first."""
    ready, rest = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
    if ready and rest:  # everything else that is ready in the same sweep
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        ready += more
    return ready


def replies_of(ready: Sequence[Pending], timeout_s: float = GET_TIMEOUT_S) -> list[Reply]:
    """The replies of node references or client futures (one kind), in order."""
    if not ready:
        return []
    if isinstance(ready[0], cf.Future):
        return FleetClient.gather(ready, timeout_s)
    replies: list[Reply] = ray.get(list(ready), timeout=timeout_s)
    return replies


def reply_of(pending: Pending, timeout_s: float = GET_TIMEOUT_S) -> Reply:
    (reply,) = replies_of([pending], timeout_s)
    return reply


def drain_pending(pending: Sequence[Pending], timeout_s: float = GET_TIMEOUT_S) -> None:
    """Wait (bounded) for what is still out, ignoring the answers."""
    if not pending:
        return
    if isinstance(pending[0], cf.Future):
        cf.wait(pending, timeout=timeout_s)
    else:
        ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)


Submit = Callable[[], Pending]


@dataclass(frozen=True)
class Loop:
    """What a closed loop completed in its window."""

    completed: int
    seconds: float
    errors: int = 0
    by_node: Mapping[str, int] = field(default_factory=dict)
    engine_calls: float = 0.0  # distinct engine calls (sum of 1 / batch size per reply)
    engine_s: float = 0.0  # the engine time of those calls, each call once
    busy_s: float = math.nan  # machine CPU seconds in the window (every process)
    own_s: float = math.nan  # ... of which this benchmark's (the driver and its Ray)

    @property
    def rate(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else math.nan

    @property
    def engine_ms(self) -> float:
        """Engine milliseconds per call."""
        return 1000 * self.engine_s / self.engine_calls if self.engine_calls else math.nan

    @property
    def cores(self) -> float:
        """Cores this benchmark's processes used on average."""
        return self.own_s / self.seconds if self.seconds > 0 else math.nan

    @property
    def cpu_ms(self) -> float:
        """CPU milliseconds this benchmark's processes spent per completed request."""
        return 1000 * self.own_s / self.completed if self.completed else math.nan


class _Tally:
    """What a loop counts of its replies, and its CPU over the window."""

    def __init__(self) -> None:
        self.completed = self.errors = 0
        self.engine_calls = self.engine_s = 0.0
        self.by_node: dict[str, int] = {}
        self.cpu0 = cpu_sample()
        self.start = time.perf_counter()

    def add(self, reply: Reply) -> None:
        if reply.error is None:
            self.completed += 1
            share = 1.0 / max(1, reply.batch_size)
            self.engine_calls += share
            self.engine_s += reply.service_s * share
            self.by_node[reply.node] = self.by_node.get(reply.node, 0) + 1
        else:
            self.errors += 1

    def loop(self, end: float) -> Loop:
        """The loop so far; the CPU counted is the window's share when the last wait
        ran past ``end``."""
        used = cpu_since(self.cpu0)
        elapsed = min(time.perf_counter(), end) - self.start
        window = elapsed / max(elapsed, used.wall_s)
        return Loop(
            self.completed,
            elapsed,
            self.errors,
            self.by_node,
            self.engine_calls,
            self.engine_s,
            used.busy_s * window,
            used.own_s * window,
        )


def closed_loop(submitters: Sequence[Submit], in_flight_each: int, seconds: float) -> Loop:
    """Keep ``in_flight_each`` requests outstanding per submitter for ``seconds``; each
    reply is replaced by a new request from the submitter that sent it. Replies after
    the window are drained (bounded) but not counted."""
    pending: dict[Pending, int] = {}
    inbox = Inbox()
    for i, submit in enumerate(submitters):
        for _ in range(in_flight_each):
            pending[inbox.add(submit())] = i
    tally = _Tally()
    end = tally.start + seconds
    last_progress = tally.start
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if now - last_progress > GET_TIMEOUT_S:
            raise TimeoutError(f"no reply for {GET_TIMEOUT_S:.0f} s")
        ready = inbox.ready(min(end - now, 1.0))
        if not ready:
            continue
        last_progress = time.perf_counter()
        if last_progress > end:  # the wait ran past the window: these do not count
            break
        for ref, reply in zip(ready, replies_of(ready), strict=True):
            tally.add(reply)
            who = pending.pop(ref)
            pending[inbox.add(submitters[who]())] = who
    out = tally.loop(end)
    drain_pending(list(pending))
    return out


def pipelined_loop(
    client: FleetClient, model: str, feed: dict[str, np.ndarray], in_flight: int, seconds: float
) -> Loop:
    """:func:`closed_loop` through ``FleetClient.map_unordered``: ``in_flight`` requests
    outstanding for ``seconds``, the answers read on this thread. As in
    :func:`closed_loop`, the window opens once the first ``in_flight`` are sent; answers
    after it are read (the loop sends no more) but not counted."""
    opened: list[_Tally] = []

    def feeds() -> Iterator[dict[str, np.ndarray]]:
        for _ in range(in_flight):
            yield feed
        opened.append(_Tally())  # drawn once the first answers make room
        end = opened[0].start + seconds
        while time.perf_counter() < end:
            yield feed

    out: Loop | None = None
    for _, reply in client.map_unordered(model, feeds(), in_flight=in_flight):
        if not opened or out is not None:
            continue
        tally = opened[0]
        if time.perf_counter() <= tally.start + seconds:
            tally.add(reply)
        else:
            out = tally.loop(tally.start + seconds)
    if out is None:
        tally = opened[0] if opened else _Tally()
        out = tally.loop(tally.start + seconds)
    return out


def node_cancel(
    target: FleetClient | str, node: str, request_id: str, timeout_s: float = GET_TIMEOUT_S
) -> bool:
    """Cancel a request on one node actor directly; True if the node had it."""
    fleet, _ = _fleet_and_priorities(target)
    return bool(ray.get(node_actor(fleet, node).cancel.remote(request_id), timeout=timeout_s))


class Route(Protocol):
    """Where a scenario sends its requests: one node actor, or the fleet's router. A
    route is a ``cluster.traffic.Client``: the traffic drivers send through it."""

    @property
    def label(self) -> str: ...

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> Pending: ...

    def cancel(self, request_id: str, timeout_s: float = GET_TIMEOUT_S) -> bool: ...


@dataclass(frozen=True)
class NodeRoute:
    """Straight to one node actor (what the node-level scenarios measure)."""

    client: FleetClient
    node: str

    @property
    def label(self) -> str:
        return f"node {self.node}"

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> Pending:
        return node_submit(
            self.client, self.node, model, inputs, priority, request_id, deadline_s, key
        )

    def cancel(self, request_id: str, timeout_s: float = GET_TIMEOUT_S) -> bool:
        return node_cancel(self.client, self.node, request_id, timeout_s)


@dataclass(frozen=True)
class RouterRoute:
    """Placed by the fleet's client (``FleetClient.submit``): the fleet's placement."""

    client: FleetClient

    @property
    def label(self) -> str:
        return "fleet"

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> Pending:
        return self.client.submit(
            model, inputs, priority=priority, deadline_s=deadline_s, key=key, request_id=request_id
        )

    def cancel(self, request_id: str, timeout_s: float = GET_TIMEOUT_S) -> bool:
        return self.client.cancel(request_id, timeout_s)


def only_node(client: FleetClient) -> NodeRoute:
    """A route to the first (in the node-level scenarios: the only) node of the fleet."""
    return NodeRoute(client, node_names(client)[0])


# ------------------------------------------------------------------------ models


@dataclass(frozen=True)
class BenchModel:
    """A generated model file and how it was made."""

    path: Path
    width: int
    layers: int
    target_ms: float  # the batch-1 cost it was calibrated to
    linear: bool = False  # a :func:`make_linear` model (cost proportional to rows)

    def describe(self) -> str:
        if self.linear:
            return (
                f"model whose cost grows with its rows (`bench.common.make_linear`: input "
                f"[N, {self.width}] tiled to [N, {self.width * LINEAR_TILE}], {self.layers} "
                f"Tanh layers), calibrated to ~{self.target_ms:g} ms per batch-1 call"
            )
        return (
            f"slow MLP (`modelgen.calibrate_slow`), width {self.width}, {self.layers} layers, "
            f"calibrated to ~{self.target_ms:g} ms per batch-1 call"
        )


LINEAR_TILE = 64  # a make_linear model works on rows this many times its input width


def make_linear(path: Path, layers: int, width: int) -> Path:
    """Write a model whose call costs nearly in proportion to its rows.

    ``x`` float32 ``[N, width]`` is tiled to ``[N, width * LINEAR_TILE]``, goes through
    ``layers`` element-wise Tanh ops and is sliced back to ``[N, width]``. Nothing is
    shared between rows (unlike a matrix product, whose weights are read once per call),
    so batch 4 costs about 4x batch 1, while requests and replies stay small.
    """
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Tile", ["x", "repeats"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("Slice", [f"h{layers}", "starts", "ends", "axes"], ["y"]))
    ints = {"repeats": [1, LINEAR_TILE], "starts": [0], "ends": [width], "axes": [1]}
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor(k, TensorProto.INT64, [len(v)], v) for k, v in ints.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return path


def median_call_ms(session: Any, feed: dict[str, np.ndarray], repeats: int = 9) -> float:
    """Median ms of ``repeats`` back-to-back calls of ``session``, after 3 warm-ups."""
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return 1000 * median(times)


def linear_call_ms(path: Path, width: int, rows: int = 1, repeats: int = 9) -> float:
    """Median ms of back-to-back calls of a :func:`make_linear` model, in-process."""
    return median_call_ms(raw_session(path), slow_feed(width, rows=rows), repeats)


def calibrate_linear(path: Path, target_ms: float, width: int) -> tuple[Path, int]:
    """A :func:`make_linear` model whose batch-1 call takes about ``target_ms`` here: two
    probe depths give the cost per layer apart from the fixed cost of a call."""
    shallow, deep = 50, 200
    t_shallow = linear_call_ms(make_linear(path, shallow, width), width)
    t_deep = linear_call_ms(make_linear(path, deep, width), width)
    per_layer = max(1e-6, (t_deep - t_shallow) / (deep - shallow))
    fixed = max(0.0, t_shallow - shallow * per_layer)
    layers = max(1, round((target_ms - fixed) / per_layer))
    return make_linear(path, layers, width), layers


class ModelFactory:
    """Writes benchmark models into one temporary folder, each at most once per run."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._made: dict[tuple[str, int, float], BenchModel] = {}

    def calibrated(self, target_ms: float, *, width: int = 256) -> BenchModel:
        """A slow model whose batch-1 call takes about ``target_ms`` on this machine."""
        key = ("cal", width, target_ms)
        if key not in self._made:
            t0 = time.perf_counter()
            path, layers = calibrate_slow(
                self.directory / f"slow_w{width}_{target_ms:g}ms.onnx", target_ms, width=width
            )
            self._made[key] = BenchModel(path, width, layers, target_ms)
            log(
                f"calibrated width-{width} model to {target_ms:g} ms: {layers} layers "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        return self._made[key]

    def linear(self, target_ms: float, *, width: int = 256) -> BenchModel:
        """A :func:`make_linear` model whose batch-1 call takes about ``target_ms``."""
        key = ("lin", width, target_ms)
        if key not in self._made:
            t0 = time.perf_counter()
            path, layers = calibrate_linear(
                self.directory / f"linear_w{width}_{target_ms:g}ms.onnx", target_ms, width
            )
            self._made[key] = BenchModel(path, width, layers, target_ms, linear=True)
            log(
                f"calibrated a linear model to {target_ms:g} ms: {layers} layers "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        return self._made[key]


@contextlib.contextmanager
def model_dir() -> Iterator[ModelFactory]:
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-") as tmp:
        yield ModelFactory(Path(tmp))


def slow_feed(width: int, *, rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """A valid input for a slow model of ``width`` (float32 ``[rows, width]``)."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, width)).astype(np.float32)}


def raw_session(path: Path, threads: int = 1) -> ort.InferenceSession:
    """An in-process session configured like a node's engine (sequential, 1 inter-op)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def node_costs_ms(status: FleetStatus, model: str) -> Mapping[int, float]:
    """The node's warm-up measurement of ``model``: engine ms per call, by batch rows."""
    for node in status.nodes:
        for m in node.models:
            if m.name == model and m.cost_ms:
                return dict(sorted(m.cost_ms.items()))
    return {}


# ------------------------------------------------------------------ run context


@dataclass(frozen=True)
class RunContext:
    """What every scenario gets: the mode and the shared model folder."""

    quick: bool
    models: ModelFactory

    def pick(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def count(self, full: int, quick: int) -> int:
        return quick if self.quick else full
