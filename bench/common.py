"""Shared helpers of the benchmarks: statistics, the report, CPU accounting, one
embedded Ray, models, fleets and the loops that drive them."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import datetime as _dt
import math
import os
import platform
import queue
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import onnxruntime as ort
import psutil
import ray

from actors.engine import open_session
from cluster.client import FleetClient, FleetStatus
from cluster.deploy import init_loopback_ray
from cluster.traffic import Answer, Counts, OpenLoop
from edgefleet.config import FleetConfig, parse_config
from edgefleet.messages import Reply
from edgefleet.modelgen import calibrate_slow, median_call_s
from sim.report import md_table as md_table  # one table writer: benchmarks and simulator
from sim.workload import Arrival

DISTURBED_CORES = 0.15  # other processes using more than this means noisy figures
CALM_CORES = 0.2  # a measurement disturbed more than this is taken again (bounded)
GET_TIMEOUT_S = 30.0  # no single reply may take longer than this; a hang is a failure
T = TypeVar("T")
Feed = dict[str, np.ndarray]
_T0 = time.perf_counter()


def log(message: str) -> None:
    """A progress line on stderr, stamped with seconds since the benchmarks started."""
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(0, *(math.nan,) * 5)
        p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
        return cls(len(values), sum(values) / len(values), p50, p90, p99, max(values))


def fmt(value: float, digits: int = 1, *, signed: bool = False) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def columns(header: str) -> list[str]:
    """A table's column names from its Markdown header: ``"a | b"`` -> ``["a", "b"]``."""
    return header.split(" | ")


def pairs_text(counts: Mapping[str, int]) -> str:
    """``a 1, b 2`` for the non-zero counts, sorted by name."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v)


def med(items: Sequence[T], pick: Callable[[T], float]) -> float:
    return median([pick(x) for x in items])


def each(items: Sequence[T], pick: Callable[[T], float], digits: int = 0) -> str:
    """``pick`` of every item, ``a / b / c``."""
    return " / ".join(fmt(pick(x), digits) for x in items)


# ---------------------------------------------------------------------- the report


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
        return (
            f"- **{'PASS' if self.passed else 'MISS'}** {self.label}: "
            f"{fmt(self.value, self.digits)} (target {self.op} {self.threshold:g})"
        )


@dataclass
class Section:
    """A scenario's part of the report (``level`` 2), or a titled part of one (3): what
    was measured, its tables, targets and notes, then its own parts."""

    title: str
    measured: str
    tables: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    cpu: CpuUse | None = None
    parts: list[Section] = field(default_factory=list)
    level: int = 2

    @property
    def all_targets(self) -> list[Target]:
        return [*self.targets, *(t for p in self.parts for t in p.all_targets)]

    @property
    def passed(self) -> bool:
        return self.error is None and all(t.passed for t in self.all_targets)

    def markdown(self) -> str:
        out = [f"{'#' * self.level} {self.title}", "", self.measured, ""]
        if self.error is not None:
            out += ["**FAILED** — the scenario did not complete:", "", "```", self.error, "```", ""]
        for block in self.tables:
            out += [block, ""]
        if self.targets:
            out += ["Targets:", "", *(t.markdown() for t in self.targets), ""]
        elif self.level > 2:
            out += ["No target: reported for information.", ""]
        for block in [*self.notes, *(p.markdown() for p in self.parts)]:
            out += [block, ""]
        footer = f"_{'Scenario' if self.level == 2 else 'Part'} time: {self.seconds:.0f} s"
        if self.cpu is not None:
            footer += f"; {self.cpu.describe()}"
            if self.cpu.foreign_cores > DISTURBED_CORES:
                footer += " (**disturbed**: treat these figures with caution)"
        return "\n".join([*out, footer + "._"])


@dataclass
class Part(Section):
    level: int = 3


REPORT_TITLE = "# edgefleet benchmark results"
_ROW = re.compile(r"^\| (?P<title>.+?) \| (?P<result>.+?) \| (?P<run>.+) \|$")


def verdict(section: Section) -> str:
    targets = section.all_targets
    missed = [t.label for t in targets if not t.passed]
    if section.error:
        return "did not run (error)"
    if not targets:
        return "no targets"
    if not missed:
        return f"PASS ({len(targets)}/{len(targets)} targets met)"
    return f"MISS ({len(targets) - len(missed)}/{len(targets)} met; missed: {'; '.join(missed)})"


REPORT_HEADER = (
    "- Reproduce: from the source checkout, with the project installed (`pip install "
    "-e .`), run `python -m bench.run --out bench/RESULTS.md`; add `--quick` for a smoke "
    "run, `--only NAME` for one scenario (its section is replaced, the others kept). "
    "Models are generated and calibrated to this machine at the start of each run; Ray "
    "runs embedded on 127.0.0.1.\n\nEvery figure is a ratio of measurements taken side by "
    "side in one run: the machine is small and shared, so absolute numbers drift between runs."
)


def write_report(path: Path, sections: Sequence[Section], run: str) -> str:
    """The report at ``path`` with ``sections`` written in: each replaces the section of
    its title (or comes after the others), its row of the scenario table saying its
    verdict and ``run``; other sections are kept. Returns the text."""
    rows: dict[str, tuple[str, str]] = {}
    kept: dict[str, str] = {}
    if path.is_file() and (text := path.read_text()).startswith(REPORT_TITLE):
        head, *parts = re.split(r"(?m)^(?=## )", text)
        for line in head.splitlines():
            if (m := _ROW.match(line)) and m["title"] not in ("scenario", "---"):
                rows[m["title"]] = (m["result"], m["run"])
        for part in parts:
            kept[part.splitlines()[0][3:].strip()] = part.rstrip("\n")
    for s in sections:
        rows[s.title] = (verdict(s), run)
        kept[s.title] = s.markdown().rstrip("\n")
    table = ["| scenario | result | run |", "| --- | --- | --- |"]
    table += [f"| {t} | {rows[t][0]} | {rows[t][1]} |" for t in kept if t in rows]
    head = [REPORT_TITLE, "", f"- Machine: {EnvFacts.collect().line()}", REPORT_HEADER, ""]
    text = "\n".join([*head, *table, ""]) + "\n" + "\n\n".join(kept.values()) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def timed(build: Callable[[], Section]) -> Section:
    """``build()``, stamped with its wall time and CPU use."""
    t0, cpu = time.perf_counter(), cpu_sample()
    section = build()
    section.seconds, section.cpu = time.perf_counter() - t0, cpu_since(cpu)
    return section


# ---------------------------------------------------------------- the environment


@dataclass(frozen=True)
class EnvFacts:
    cpus: int
    cpu_model: str
    versions: str
    load_avg: tuple[float, float, float]

    @classmethod
    def collect(cls) -> EnvFacts:
        model = platform.processor() or "unknown CPU"
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            names = (r.split(":", 1)[1].strip() for r in f if r.startswith("model name"))
            model = next(names, model)
        versions = (
            f"Python {platform.python_version()}, ray {ray.__version__}, "
            f"onnxruntime {ort.__version__}, numpy {np.__version__}"
        )
        return cls(cpu_count(), model, versions, os.getloadavg())

    def line(self) -> str:
        load = ", ".join(f"{x:.2f}" for x in self.load_avg)
        return f"{self.cpus} CPUs ({self.cpu_model}); {self.versions}; load average at start {load}"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------- CPU disturbance


@dataclass(frozen=True)
class CpuUse:
    """Machine-wide busy CPU seconds and this benchmark's (this process and its
    descendants: the embedded Ray's GCS, raylet, workers and nodes): at one instant
    (:func:`cpu_sample`, ``wall_s`` a clock reading) or over a span (:func:`cpu_since`)."""

    wall_s: float
    busy_s: float
    own_s: float

    @property
    def foreign_cores(self) -> float:
        """Average cores used by processes outside this benchmark (a disturbance)."""
        return max(0.0, self.busy_s - self.own_s) / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        return (
            f"this benchmark used {self.own_s / max(self.wall_s, 1e-9):.2f} cores on average; "
            f"other processes {self.foreign_cores:.2f} cores"
        )


def cpu_sample() -> CpuUse:
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + t.irq + t.softirq + t.steal
    return CpuUse(time.perf_counter(), busy, _TREE.seconds())


def cpu_since(start: CpuUse) -> CpuUse:
    end = cpu_sample()
    return CpuUse(end.wall_s - start.wall_s, end.busy_s - start.busy_s, end.own_s - start.own_s)


class _TreeAccountant:
    """CPU seconds used by this process and every descendant it ever had. A killed Ray
    worker's time never reaches its parent's, so the tree is sampled in the background
    and a process that ended keeps the last time seen for it (keyed by pid and start
    time: a reused pid is a new process)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def seconds(self) -> float:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="bench-cpu", daemon=True)
            self._thread.start()
        self._scan()
        with self._lock:
            return sum(self._seen.values())

    def _loop(self) -> None:
        while True:
            time.sleep(0.25)
            self._scan()

    def _scan(self) -> None:
        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # the process ended meanwhile
                key, used = (process.pid, process.create_time()), process.cpu_times()
                with self._lock:
                    self._seen[key] = max(used.user + used.system, self._seen.get(key, 0.0))


_TREE = _TreeAccountant()


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
    for tries in range(1, attempts + 1):
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
    return replace(best, attempts=tries)


def alternating(
    measures: Mapping[str, Callable[[], T]], rounds: int, label: str = ""
) -> dict[str, list[T]]:
    """``rounds`` rounds of every measurement in turn (drift hits them alike), each calm."""
    out: dict[str, list[T]] = {k: [] for k in measures}
    for _ in range(rounds):
        for k, measure in measures.items():
            out[k].append(calm(measure, f"{label}{k}").value)
    return out


def kept(c: Calm[Any]) -> Any:
    """A kept measurement (a dataclass) stamped with its disturbance."""
    return replace(c.value, foreign_cores=c.foreign_cores, attempts=c.attempts)


def rounds_note(runs: Sequence[Round]) -> str:
    """How many rounds were measured again, and the most disturbed one kept."""
    return (
        f"Rounds measured again because other processes used more than {CALM_CORES:g} cores "
        f"meanwhile: {sum(r.attempts - 1 for r in runs)}; most CPU other processes used during "
        f"a kept round: {max(r.foreign_cores for r in runs):.2f} cores."
    )


def disturbance(runs: Mapping[str, Any]) -> str:
    """``name 0.01 cores, 1; ...``: each kept measurement's disturbance and attempts."""
    return "; ".join(f"{k} {r.foreign_cores:.2f} cores, {r.attempts}" for k, r in runs.items())


# ---------------------------------------------------------------------- Ray, fleets


@contextlib.contextmanager
def embedded_ray(num_cpus: int = 2) -> Iterator[None]:
    """One embedded Ray bound to 127.0.0.1 for the whole run (reused if already up)."""
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
    """A model of a benchmark fleet; ``batching`` adds other keys of its ``batching:``."""

    name: str
    path: Path
    window_ms: float = 0.0
    max_batch_size: int = 1
    only_if_faster: bool = True
    threads: int = 1
    batching: Mapping[str, Any] = field(default_factory=dict)


def fleet_config(
    name: str,
    models: Sequence[ModelEntry],
    *,
    capacity: int = 64,
    order: Literal["priority", "fifo"] = "priority",
    nodes: int = 1,
    node_list: Sequence[Mapping[str, Any]] | None = None,
    router: Mapping[str, Any] | None = None,
    starvation: Mapping[str, Any] | None = None,
) -> FleetConfig:
    """A FleetConfig parsed as a YAML file's would be: ``nodes`` identical nodes unless
    ``node_list`` gives the ``nodes:`` entries; preemption on with gap 5. ``router`` is
    the ``router:`` section; by default router shedding is off (the node-level
    scenarios measure one node's scheduler)."""
    defaults: dict[str, Any] = {
        "queue": {"capacity": capacity},
        "preemption": {"enabled": True, "min_priority_gap": 5},
        "order": order,
    }
    if starvation is not None:
        defaults["starvation"] = dict(starvation)
    batching = ("window_ms", "max_batch_size", "only_if_faster")
    data: dict[str, Any] = {
        "fleet": {"name": name},
        "local": {"nodes": nodes},
        "models": {
            m.name: {
                "path": str(m.path),
                "threads": m.threads,
                "batching": {k: getattr(m, k) for k in batching} | dict(m.batching),
            }
            for m in models
        },
        "node_defaults": defaults,
        "router": dict({"placement": {"shed": {}}} if router is None else router),
    }
    if node_list is not None:
        data["nodes"] = [dict(n) for n in node_list]
    return parse_config(data, models[0].path.parent)


@contextlib.contextmanager
def deployed(config: FleetConfig) -> Iterator[FleetClient]:
    """Deploy a fleet on the running Ray, yield its client, tear it down afterwards."""
    t0 = time.perf_counter()
    with FleetClient.local(config, progress=lambda msg: log(f"  {msg}")) as client:
        log(f"fleet {config.fleet.name} up in {time.perf_counter() - t0:.1f} s")
        yield client


def node_names(client: FleetClient) -> list[str]:
    return [spec.name for spec in client.config.node_specs()]


def node_submit(
    client: FleetClient, node: str, model: str, inputs: Mapping[str, np.ndarray], **kw: Any
) -> ray.ObjectRef:
    """One request as the client builds it, straight to a node actor (no placement):
    a reference to the node's Reply."""
    request, _ = client._request(model, inputs, **kw)
    return client._node(node).infer.remote(request)


@dataclass(frozen=True)
class NodeRoute:
    """Straight to one node actor (what the node-level scenarios measure); a
    ``cluster.traffic.Client``, as the fleet's client is."""

    client: FleetClient
    node: str

    def submit(self, model: str, inputs: Mapping[str, np.ndarray], **kw: Any) -> ray.ObjectRef:
        return node_submit(self.client, self.node, model, inputs, **kw)

    def cancel(self, request_id: str, timeout_s: float = GET_TIMEOUT_S) -> bool:
        ref = self.client._node(self.node).cancel.remote(request_id)
        return bool(ray.get(ref, timeout=timeout_s))


def only_node(client: FleetClient) -> NodeRoute:
    """A route to the first (in the node-level scenarios: the only) node of the fleet."""
    return NodeRoute(client, node_names(client)[0])


def node_costs_ms(status: FleetStatus, model: str) -> Mapping[int, float]:
    """The node's warm-up measurement of ``model``: engine ms per call, by batch rows."""
    for node in status.nodes:
        for m in node.models:
            if m.name == model and m.cost_ms:
                return dict(sorted(m.cost_ms.items()))
    return {}


def reply_of(pending: Any, timeout_s: float = GET_TIMEOUT_S) -> Reply:
    """The reply of a node reference or a client future."""
    if isinstance(pending, cf.Future):
        reply: Reply = pending.result(timeout_s)
        return reply
    return ray.get(pending, timeout=timeout_s)  # type: ignore[no-any-return]


def warm(submit: Callable[[], Any], calls: int) -> None:
    for _ in range(calls):
        reply_of(submit())


# ---------------------------------------------------------------------------- loops

Pending = Any  # a ray.ObjectRef (straight to a node) or a Future of FleetClient.submit
Submit = Callable[[], Pending]


class Inbox:
    """Replies as they become ready, of one kind: node references (``ray.wait``) or
    client futures (their completion callbacks fill a queue, so each reply costs the
    same however many are in flight)."""

    def __init__(self) -> None:
        self._done: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._refs: list[Pending] = []

    def add(self, item: Pending) -> Pending:
        if isinstance(item, cf.Future):
            item.add_done_callback(self._done.put)
        else:
            self._refs.append(item)
        return item

    def ready(self, timeout_s: float) -> list[tuple[Pending, Reply]]:
        """What is ready and its replies, waiting at most ``timeout_s`` for the first."""
        if self._refs:
            ready, rest = ray.wait(self._refs, num_returns=1, timeout=timeout_s)
            if ready and rest:  # everything else that is ready in the same sweep
                ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            done = set(ready)
            self._refs = [r for r in self._refs if r not in done]
            return list(zip(ready, ray.get(ready, timeout=GET_TIMEOUT_S), strict=True))
        out = []
        with contextlib.suppress(queue.Empty):
            out.append(self._done.get(timeout=max(0.0, timeout_s)))
            while True:
                out.append(self._done.get_nowait())
        return [(f, f.result()) for f in out]

    def drain(self) -> None:
        if self._refs:
            ray.wait(self._refs, num_returns=len(self._refs), timeout=GET_TIMEOUT_S)


def _per(x: float, n: float) -> float:
    return x / n if n else math.nan


@dataclass(frozen=True)
class Loop:
    """What a closed loop completed in its window (or raw calls back to back)."""

    completed: int
    seconds: float
    errors: int = 0
    by_node: Mapping[str, int] = field(default_factory=dict)
    engine_calls: float = 0.0  # distinct engine calls (sum of 1 / batch size per reply)
    engine_s: float = 0.0  # the engine time of those calls, each call once
    busy_s: float = math.nan  # machine CPU seconds in the window (every process)
    own_s: float = math.nan  # ... of which this benchmark's (the driver and its Ray)

    rate = property(lambda self: _per(self.completed, self.seconds))
    engine_busy = property(lambda self: _per(self.engine_s, self.seconds))
    mean_batch = property(lambda self: _per(self.completed, self.engine_calls))
    cores = property(lambda self: _per(self.own_s, self.seconds))  # this benchmark's
    cpu_ms = property(lambda self: _per(1000 * self.own_s, self.completed))  # ... per request
    machine_cpu_ms = property(lambda self: _per(1000 * self.busy_s, self.completed))

    @property
    def engine_ms(self) -> float:
        """Engine ms per call (raw calls: wall ms per call)."""
        if self.engine_calls:
            return 1000 * self.engine_s / self.engine_calls
        return _per(1000 * self.seconds, self.completed)


class _Tally:
    """A loop's replies (counted as the traffic drivers count them) by node, and its CPU
    over the window."""

    def __init__(self) -> None:
        self.counts, self.by_node = Counts(), Counter[str]()
        self.cpu0, self.start = cpu_sample(), time.perf_counter()

    def add(self, reply: Reply) -> None:
        self.counts.add(reply)
        if reply.error is None:
            self.by_node[reply.node] += 1

    def loop(self, end: float) -> Loop:
        """The loop so far; the CPU counted is the window's share when the last wait
        ran past ``end``."""
        used = cpu_since(self.cpu0)
        elapsed = min(time.perf_counter(), end) - self.start
        window = elapsed / max(elapsed, used.wall_s)
        c, cpu = self.counts, (used.busy_s * window, used.own_s * window)
        errors = c.rejected + c.evicted + c.other_errors
        return Loop(c.completed, elapsed, errors, dict(self.by_node), c.calls, c.engine_s, *cpu)


@dataclass(frozen=True)
class Round:
    """Loops measured side by side in one round, and how disturbed the round was."""

    loops: dict[str, Loop]
    foreign_cores: float = 0.0
    attempts: int = 1

    def __getitem__(self, name: str) -> Loop:
        return self.loops[name]


def rounds(
    label: str,
    loops: Mapping[str, Callable[[float], Loop]],
    seconds: float,
    count: int,
    *,
    warm_s: float,
    attempts: int = 3,
) -> list[Round]:
    """Every loop once for ``warm_s`` (warm-up), then ``count`` rounds of each loop for
    ``seconds``, the order rotating every round; a disturbed round is taken again."""
    for loop in loops.values():
        loop(warm_s)
    out = []
    for i in range(count):
        order = rotated(list(loops), i)
        measure = lambda o=order: {k: loops[k](seconds) for k in o}  # noqa: E731
        c = calm(measure, f"{label} round {i + 1}", attempts=attempts)
        out.append(Round(c.value, c.foreign_cores, c.attempts))
        rates = ", ".join(f"{k} {x.rate:.0f}/s {x.cpu_ms:.2f} ms CPU" for k, x in c.value.items())
        log(f"  {label} round {i + 1}/{count}: {rates}")
    return out


def rotated(items: Sequence[T], i: int) -> list[T]:
    """``items`` starting at ``i`` (modulo its length): the order of round ``i``."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


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
    end, last = tally.start + seconds, tally.start
    while (now := time.perf_counter()) < end:
        if now - last > GET_TIMEOUT_S:
            raise TimeoutError(f"no reply for {GET_TIMEOUT_S:.0f} s")
        ready = inbox.ready(min(end - now, 1.0))
        if not ready:
            continue
        last = time.perf_counter()
        if last > end:  # the wait ran past the window: these do not count
            break
        for ref, reply in ready:
            tally.add(reply)
            who = pending.pop(ref)
            pending[inbox.add(submitters[who]())] = who
    out = tally.loop(end)
    inbox.drain()
    cf.wait([p for p in pending if isinstance(p, cf.Future)], timeout=GET_TIMEOUT_S)
    return out


def pipelined_loop(
    client: FleetClient, model: str, feed: Feed, in_flight: int, seconds: float
) -> Loop:
    """:func:`closed_loop` through ``FleetClient.map_unordered``; the window opens once
    the first ``in_flight`` are sent, answers after it are read but not counted."""
    opened: list[_Tally] = []

    def feeds() -> Iterator[Feed]:
        for _ in range(in_flight):
            yield feed
        opened.append(_Tally())  # drawn once the first answers make room
        while time.perf_counter() < opened[0].start + seconds:
            yield feed

    out: Loop | None = None
    for _, reply in client.map_unordered(model, feeds(), in_flight=in_flight):
        if not opened or out is not None:
            continue
        if time.perf_counter() <= opened[0].start + seconds:
            opened[0].add(reply)
        else:
            out = opened[0].loop(opened[0].start + seconds)
    if out is None:
        tally = opened[0] if opened else _Tally()
        out = tally.loop(tally.start + seconds)
    return out


@dataclass(frozen=True)
class OpenRun:
    """An open-loop run of a workload's arrivals: every answer (``cluster.traffic``)."""

    answers: tuple[Answer, ...]
    max_lag_s: float  # worst delay of a submit behind its arrival time
    lost: int  # sent and never answered
    seconds: float
    foreign_cores: float = 0.0  # CPU other processes used meanwhile
    attempts: int = 1

    @classmethod
    def pooled(cls, runs: Sequence[OpenRun], **more: Any) -> Any:
        """``runs`` as one: every answer, the worst lag and disturbance."""
        lag, lost = max(r.max_lag_s for r in runs), sum(r.lost for r in runs)
        noise = (max(r.foreign_cores for r in runs), max(r.attempts for r in runs))
        answers = tuple(a for r in runs for a in r.answers)
        return cls(answers, lag, lost, sum(r.seconds for r in runs), *noise, **more)

    def ok(self, priorities: Sequence[int] | None = None) -> list[Answer]:
        """The completed answers (of arrivals of ``priorities``)."""
        ok = [a for a in self.answers if a.reply.error is None]
        if priorities is None:
            return ok
        return [a for a in ok if a.arrival is not None and a.arrival.priority in priorities]

    def latency_ms(self, priorities: Sequence[int] | None = None) -> Summary:
        return Summary.of([a.latency_s * 1000 for a in self.ok(priorities)])

    def count(self, error: str | None) -> int:
        return sum(1 for a in self.answers if error_name(a.reply) == error)


def error_name(reply: Reply) -> str | None:
    return None if reply.error is None else type(reply.error).__name__


def open_loop(client: Any, arrivals: Sequence[Arrival], feeds: Mapping[str, Feed]) -> OpenRun:
    """Send ``arrivals`` at their times (``cluster.traffic.OpenLoop``) and wait for
    every answer (each bounded by ``GET_TIMEOUT_S``)."""
    answers: list[Answer] = []
    driver = OpenLoop(
        client, arrivals, feeds, on_answer=answers.append, reply_timeout_s=GET_TIMEOUT_S
    )
    t0 = time.perf_counter()
    asyncio.run(driver.run())
    lost = driver.counts.submitted - len(answers)
    return OpenRun(tuple(answers), driver.max_lag_s, lost, time.perf_counter() - t0)


# --------------------------------------------------------------------------- models

LINEAR_TILE = 64  # a make_linear model works on rows this many times its input width


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


def make_linear(path: Path, layers: int, width: int) -> Path:
    """A model whose call costs nearly in proportion to its rows: ``x`` float32
    ``[N, width]`` tiled to ``[N, width * LINEAR_TILE]``, ``layers`` element-wise Tanh
    ops, sliced back to ``[N, width]`` (nothing shared between rows)."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Tile", ["x", "repeats"], ["h0"])]
    nodes += [helper.make_node("Tanh", [f"h{i}"], [f"h{i + 1}"]) for i in range(layers)]
    nodes.append(helper.make_node("Slice", [f"h{layers}", "starts", "ends", "axes"], ["y"]))
    ints = {"repeats": [1, LINEAR_TILE], "starts": [0], "ends": [width], "axes": [1]}
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", width]) for n in "xy"]
    consts = [helper.make_tensor(k, TensorProto.INT64, [len(v)], v) for k, v in ints.items()]
    graph = helper.make_graph(nodes, "linear", io[:1], io[1:], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return path


def raw_session(path: Path) -> ort.InferenceSession:
    """An in-process session as a node's engine opens it."""
    return open_session(path.stem, path, threads=1)


def median_call_ms(session: Any, feed: Feed, repeats: int = 9) -> float:
    """Median ms of ``repeats`` back-to-back calls of ``session``, after 3 warm-ups."""
    return 1000 * median_call_s(session, feed, runs=repeats)


def linear_call_ms(path: Path, width: int, rows: int = 1, repeats: int = 9) -> float:
    return median_call_ms(raw_session(path), slow_feed(width, rows=rows), repeats)


class ModelFactory:
    """Writes benchmark models into one temporary folder, each at most once per run."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._made: dict[tuple[bool, int, float], BenchModel] = {}

    def calibrated(self, target_ms: float, *, width: int = 256) -> BenchModel:
        """A slow model whose batch-1 call takes about ``target_ms`` on this machine."""
        return self._make(False, target_ms, width)

    def linear(self, target_ms: float, *, width: int = 256) -> BenchModel:
        """A :func:`make_linear` model whose batch-1 call takes about ``target_ms``."""
        return self._make(True, target_ms, width)

    def _make(self, linear: bool, target_ms: float, width: int) -> BenchModel:
        key = (linear, width, target_ms)
        if key in self._made:
            return self._made[key]
        t0, kind = time.perf_counter(), "linear" if linear else "slow"
        path = self.directory / f"{kind}_w{width}_{target_ms:g}ms.onnx"
        if linear:  # two probe depths: the cost per layer apart from a call's fixed cost
            t50 = linear_call_ms(make_linear(path, 50, width), width)
            t200 = linear_call_ms(make_linear(path, 200, width), width)
            per_layer = max(1e-6, (t200 - t50) / 150)
            layers = max(1, round((target_ms - max(0.0, t50 - 50 * per_layer)) / per_layer))
            make_linear(path, layers, width)
        else:
            path, layers = calibrate_slow(path, target_ms, width=width)
        self._made[key] = BenchModel(path, width, layers, target_ms, linear)
        took = f"{layers} layers ({time.perf_counter() - t0:.1f} s)"
        log(f"calibrated a width-{width} {kind} model to {target_ms:g} ms: {took}")
        return self._made[key]


@contextlib.contextmanager
def model_dir() -> Iterator[ModelFactory]:
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-") as tmp:
        yield ModelFactory(Path(tmp))


def slow_feed(width: int, *, rows: int = 1, seed: int = 0) -> Feed:
    """A valid input for a slow model of ``width`` (float32 ``[rows, width]``)."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, width)).astype(np.float32)}


@dataclass(frozen=True)
class RunContext:
    """What every scenario gets: the mode and the shared model folder."""

    quick: bool
    models: ModelFactory

    def pick(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def count(self, full: int, quick: int) -> int:
        return quick if self.quick else full
