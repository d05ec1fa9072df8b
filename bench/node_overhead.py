"""(b) Node overhead: a saturated node's throughput over raw ONNX Runtime's, same model.

Raw: one in-process ``InferenceSession`` (1 intra-op thread, 1 inter-op, sequential)
running batch-1 calls back to back. Node: one node actor, same model, threads 1; the
driver keeps ``K`` requests in flight straight to the node actor (``node_submit``:
``infer.remote`` on the actor, bypassing the fleet's router) and ``ray.wait``, and
counts completed replies. Raw and node alternate (raw, node, raw, node, ...) and the
median of the per-pair ratios is reported, so drift of the machine cancels.

For the unbatched rows a third measurement sits in each round: a *Ray floor*, the
smallest async Ray actor that does the same job (one session on one engine thread,
the same request and reply types, no scheduler). It splits the node's loss into what
any Ray actor costs on this machine and what edgefleet's node adds on top.

A last row prices the node per request: on the tiny classifier (a call of well under
a millisecond, so the per-request work of Ray and the node dominates) the Ray floor
and the node alternate, driven the same way, and each window's machine CPU (every
process on the machine: the driver, Ray's processes, the actor) is divided by the
replies completed in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ray
from ray.actor import ActorHandle

from bench.common import (
    GET_TIMEOUT_S,
    BenchModel,
    ModelEntry,
    RunContext,
    Section,
    Submit,
    Target,
    calm,
    closed_loop,
    deployed,
    fleet_config,
    fmt,
    log,
    md_table,
    median,
    node_costs_ms,
    node_submit,
    only_node,
    raw_session,
    slow_feed,
)
from cluster.client import FleetClient
from edgefleet.messages import Reply
from edgefleet.modelgen import make_classifier, random_inputs
from edgefleet.request import InferRequest

TITLE = "Node overhead at saturation (b)"
IN_FLIGHT = 32
FLOOR_MAX_CONCURRENCY = 1024  # like a node actor: many calls held open at once
TARGET_RATIO_5MS = 0.85
TARGET_FLOOR_RATIO_1MS = 0.9  # node / Ray floor throughput, 1 ms model, batching off
TARGET_EXTRA_CPU_MS = 0.3  # node - Ray floor machine CPU per request on the classifier
CPU_MODEL = "classifier"  # the per-request CPU row's model (fleet entry and builtin)


@dataclass(frozen=True)
class Params:
    duration_s: float  # per measurement
    rounds: int  # raw/node pairs per row
    warmup_s: float
    in_flight: int = IN_FLIGHT


@dataclass(frozen=True)
class Throughput:
    calls: int  # successful calls (raw) or completed replies (actor)
    seconds: float
    errors: int = 0
    engine_calls: float = 0.0  # actor only: distinct engine calls (sum of 1/batch_size)
    engine_s: float = 0.0  # actor only: engine time of those calls (each call once)
    busy_s: float = float("nan")  # actor only: machine CPU seconds within the window
    own_s: float = float("nan")  # ... of which this benchmark's processes (driver, Ray)

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else float("nan")

    @property
    def cpu_ms(self) -> float:
        """Actor: machine CPU (every process) per completed reply, in ms."""
        return 1000 * self.busy_s / self.calls if self.calls else float("nan")

    @property
    def own_cpu_ms(self) -> float:
        """Actor: CPU of this benchmark's processes (the driver and the Ray it started)
        per completed reply, in ms: the machine's figure without other processes."""
        return 1000 * self.own_s / self.calls if self.calls else float("nan")

    @property
    def mean_batch(self) -> float:
        return self.calls / self.engine_calls if self.engine_calls else float("nan")

    @property
    def ms_per_call(self) -> float:
        """Raw: wall ms per call. Actor: mean ``service_s`` of an engine call."""
        if self.engine_calls:
            return 1000 * self.engine_s / self.engine_calls
        return 1000 * self.seconds / self.calls if self.calls else float("nan")

    @property
    def engine_busy(self) -> float:
        """Actor: fraction of the window its engine was in a call (by ``service_s``)."""
        return self.engine_s / self.seconds if self.seconds > 0 else float("nan")


@dataclass(frozen=True)
class Round:
    """One side-by-side round: raw, then (optionally) the Ray floor, then the node."""

    raw: Throughput
    node: Throughput
    floor: Throughput | None
    foreign_cores: float  # CPU other processes used during the round
    attempts: int

    @property
    def ratio(self) -> float:
        return self.node.rate / self.raw.rate

    @property
    def floor_ratio(self) -> float:
        return self.floor.rate / self.raw.rate if self.floor else float("nan")


@dataclass(frozen=True)
class Row:
    """One model/config measured in alternating rounds."""

    label: str
    model: str  # the fleet's model entry
    bench_model: BenchModel
    with_floor: bool
    target: float | None  # ratio target, if this row has one
    floor_target: float | None = None  # node / Ray floor throughput target, if any


@dataclass(frozen=True)
class RowResult:
    row: Row
    rounds: tuple[Round, ...]
    cost_ms: float  # the node's warm-up cost of a batch-1 call

    @property
    def ratio(self) -> float:
        return median([r.ratio for r in self.rounds])

    def med(self, pick: Callable[[Round], float]) -> float:
        return median([pick(r) for r in self.rounds])


@dataclass(frozen=True)
class CpuRound:
    """One round of the per-request CPU row: the Ray floor, then the node."""

    floor: Throughput
    node: Throughput
    foreign_cores: float
    attempts: int

    @property
    def extra_ms(self) -> float:
        """Machine CPU per request the node takes over the Ray floor, in ms."""
        return self.node.cpu_ms - self.floor.cpu_ms

    @property
    def own_extra_ms(self) -> float:
        """The same counting only this benchmark's processes (robust to other load)."""
        return self.node.own_cpu_ms - self.floor.own_cpu_ms


@dataclass(frozen=True)
class CpuResult:
    rounds: tuple[CpuRound, ...]

    def med(self, pick: Callable[[CpuRound], float]) -> float:
        return median([pick(r) for r in self.rounds])


class RayFloor:
    """The smallest async Ray actor doing a node's job: one ONNX Runtime session on one
    engine thread, ``InferRequest`` in, ``Reply`` out; no admission, queue or batching."""

    def __init__(self, path: str) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self._names = [o.name for o in self._session.get_outputs()]
        self._executor = ThreadPoolExecutor(1)

    async def infer(self, request: InferRequest) -> Reply:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        values = await loop.run_in_executor(
            self._executor, self._session.run, self._names, dict(request.inputs)
        )
        return Reply(
            request.id,
            "ray-floor",
            outputs=dict(zip(self._names, values, strict=True)),
            service_s=time.monotonic() - t0,
            batch_size=1,
        )

    def ready(self) -> bool:
        return True


def raw_throughput(
    session: ort.InferenceSession, feed: dict[str, np.ndarray], seconds: float
) -> Throughput:
    """Batch-1 calls back to back on an in-process session for ``seconds``."""
    run = session.run
    calls = 0
    start = time.perf_counter()
    end = start + seconds
    now = start
    while now < end:
        run(None, feed)
        calls += 1
        now = time.perf_counter()
    return Throughput(calls, now - start)


def actor_throughput(submit: Submit, seconds: float, in_flight: int) -> Throughput:
    """Keep ``in_flight`` requests outstanding for ``seconds``; count completed replies
    (``closed_loop``)."""
    loop = closed_loop([submit], in_flight, seconds)
    return Throughput(
        loop.completed,
        loop.seconds,
        loop.errors,
        loop.engine_calls,
        loop.engine_s,
        loop.busy_s,
        loop.own_s,
    )


def _measure_row(
    client: FleetClient,
    row: Row,
    session: ort.InferenceSession,
    floor: ActorHandle | None,
    params: Params,
) -> RowResult:
    feed = slow_feed(row.bench_model.width)
    node = only_node(client).node

    def to_node() -> ray.ObjectRef:  # straight to the node actor, not through the router
        return node_submit(client, node, row.model, feed, priority="foreground")

    def floor_submit() -> ray.ObjectRef:
        assert floor is not None
        return floor.infer.remote(InferRequest(model=row.model, inputs=feed))

    def one_round() -> tuple[Throughput, Throughput | None, Throughput]:
        raw = raw_throughput(session, feed, params.duration_s)
        base = None
        if floor is not None:
            base = actor_throughput(floor_submit, params.duration_s, params.in_flight)
        node = actor_throughput(to_node, params.duration_s, params.in_flight)
        return raw, base, node

    raw_throughput(session, feed, params.warmup_s)
    if floor is not None:
        actor_throughput(floor_submit, params.warmup_s, params.in_flight)
    actor_throughput(to_node, params.warmup_s, params.in_flight)
    rounds: list[Round] = []
    for i in range(params.rounds):
        c = calm(one_round, f"{row.label} round {i + 1}")
        raw, base, node_tp = c.value
        r = Round(raw, node_tp, base, c.foreign_cores, c.attempts)
        rounds.append(r)
        floor_text = f", Ray floor {base.rate:.0f}/s" if base else ""
        log(
            f"  {row.label} round {i + 1}/{params.rounds}: raw {raw.rate:.0f}/s{floor_text}, "
            f"node {node_tp.rate:.0f}/s (ratio {r.ratio:.2f}, "
            f"mean batch {node_tp.mean_batch:.2f}, "
            f"engine busy {node_tp.engine_busy * 100:.0f}%, errors {node_tp.errors}, "
            f"other processes {c.foreign_cores:.2f} cores)"
        )
    costs = node_costs_ms(client.status(GET_TIMEOUT_S), row.model)
    return RowResult(row, tuple(rounds), costs.get(1, float("nan")))


def _measure_cpu(client: FleetClient, floor: ActorHandle, params: Params) -> CpuResult:
    """Machine CPU per request, node vs Ray floor, on the classifier (interleaved)."""
    feed = random_inputs(CPU_MODEL)
    node = only_node(client).node

    def to_node() -> ray.ObjectRef:
        return node_submit(client, node, CPU_MODEL, feed, priority="foreground")

    def floor_submit() -> ray.ObjectRef:
        return floor.infer.remote(InferRequest(model=CPU_MODEL, inputs=feed))

    def one_round() -> tuple[Throughput, Throughput]:
        base = actor_throughput(floor_submit, params.duration_s, params.in_flight)
        return base, actor_throughput(to_node, params.duration_s, params.in_flight)

    actor_throughput(floor_submit, params.warmup_s, params.in_flight)
    actor_throughput(to_node, params.warmup_s, params.in_flight)
    rounds: list[CpuRound] = []
    for i in range(params.rounds):
        c = calm(one_round, f"CPU per request round {i + 1}")
        base, node_tp = c.value
        r = CpuRound(base, node_tp, c.foreign_cores, c.attempts)
        rounds.append(r)
        log(
            f"  CPU per request round {i + 1}/{params.rounds}: Ray floor {base.rate:.0f}/s "
            f"{base.cpu_ms:.3f} ms, node {node_tp.rate:.0f}/s {node_tp.cpu_ms:.3f} ms "
            f"({r.extra_ms:+.3f} ms; own processes {r.own_extra_ms:+.3f} ms; "
            f"errors {node_tp.errors}, "
            f"other processes {c.foreign_cores:.2f} cores)"
        )
    return CpuResult(tuple(rounds))


def run(ctx: RunContext) -> Section:
    params = Params(
        duration_s=ctx.pick(2.0, 0.5),
        rounds=ctx.count(5, 2),
        warmup_s=ctx.pick(0.5, 0.2),
    )
    m5 = ctx.models.calibrated(5.0)
    m1 = ctx.models.calibrated(1.0)
    rows = [
        Row("5 ms, batching off", "slow5", m5, True, TARGET_RATIO_5MS),
        Row("1 ms, batching off", "slow1", m1, True, None, TARGET_FLOOR_RATIO_1MS),
        Row("1 ms, batching on", "slow1_batched", m1, False, None),
    ]
    entries = [
        ModelEntry("slow5", m5.path),
        ModelEntry("slow1", m1.path),
        ModelEntry("slow1_batched", m1.path, window_ms=2.0, max_batch_size=8),
        ModelEntry(CPU_MODEL, make_classifier(m5.path.parent / f"{CPU_MODEL}.onnx")),
    ]
    config = fleet_config("bench-overhead", entries, m5.path.parent)
    sessions = {p: raw_session(p) for p in {m5.path, m1.path}}
    floor_cls = ray.remote(RayFloor).options(max_concurrency=FLOOR_MAX_CONCURRENCY, num_cpus=0)
    floors: dict[Path, ActorHandle] = {}
    results: list[RowResult] = []
    try:
        for path in [*sessions, entries[-1].path]:
            floors[path] = floor_cls.remote(str(path))
            ray.get(floors[path].ready.remote(), timeout=GET_TIMEOUT_S)
        with deployed(config) as client:
            limits = {
                m.name: m.batch_limit for n in client.status(GET_TIMEOUT_S).nodes for m in n.models
            }
            for row in rows:
                log(f"node overhead: {row.label}")
                floor = floors[row.bench_model.path] if row.with_floor else None
                session = sessions[row.bench_model.path]
                results.append(_measure_row(client, row, session, floor, params))
            log("node overhead: machine CPU per request, classifier")
            cpu = _measure_cpu(client, floors[entries[-1].path], params)
    finally:
        for handle in floors.values():
            ray.kill(handle)
    return _section(results, cpu, params, limits, m5, m1)


def _section(
    results: list[RowResult],
    cpu: CpuResult,
    params: Params,
    limits: dict[str, int],
    m5: BenchModel,
    m1: BenchModel,
) -> Section:
    table = md_table(
        [
            "model / node config",
            "raw calls/s",
            "node calls/s",
            "node / raw (median)",
            "per-round ratios",
            "Ray floor / raw",
            "node / Ray floor",
            "mean batch",
            "raw ms / call",
            "node engine ms / call",
            "node engine busy",
        ],
        [
            [
                r.row.label,
                fmt(r.med(lambda x: x.raw.rate), 0),
                fmt(r.med(lambda x: x.node.rate), 0),
                fmt(r.ratio, 2),
                " / ".join(fmt(x.ratio, 2) for x in r.rounds),
                fmt(r.med(lambda x: x.floor_ratio), 2) if r.row.with_floor else "-",
                fmt(r.med(lambda x: x.ratio / x.floor_ratio), 2) if r.row.with_floor else "-",
                fmt(r.med(lambda x: x.node.mean_batch), 2),
                fmt(r.med(lambda x: x.raw.ms_per_call), 2),
                fmt(r.med(lambda x: x.node.ms_per_call), 2),
                f"{r.med(lambda x: x.node.engine_busy) * 100:.0f}%",
            ]
            for r in results
        ],
    )
    targets = [
        Target(f"node / raw throughput, {r.row.label}", r.ratio, ">=", target)
        for r in results
        if (target := r.row.target) is not None
    ]
    targets += [
        Target(
            f"node / Ray floor throughput, {r.row.label}",
            r.med(lambda x: x.ratio / x.floor_ratio),
            ">=",
            target,
        )
        for r in results
        if (target := r.row.floor_target) is not None
    ]
    extra = cpu.med(lambda x: x.extra_ms)
    targets.append(
        Target(
            "node - Ray floor machine CPU per request, classifier, ms",
            extra,
            "<=",
            TARGET_EXTRA_CPU_MS,
            digits=3,
        )
    )
    cpu_table = md_table(
        [
            "round",
            "Ray floor calls/s",
            "node calls/s",
            "Ray floor CPU ms / request",
            "node CPU ms / request",
            "node - Ray floor ms",
            "same, own processes only",
            "other processes, cores",
        ],
        [
            [
                str(i + 1),
                fmt(r.floor.rate, 0),
                fmt(r.node.rate, 0),
                fmt(r.floor.cpu_ms, 3),
                fmt(r.node.cpu_ms, 3),
                fmt(r.extra_ms, 3, signed=True),
                fmt(r.own_extra_ms, 3, signed=True),
                fmt(r.foreign_cores, 2),
            ]
            for i, r in enumerate(cpu.rounds)
        ]
        + [
            [
                "median",
                fmt(cpu.med(lambda x: x.floor.rate), 0),
                fmt(cpu.med(lambda x: x.node.rate), 0),
                fmt(cpu.med(lambda x: x.floor.cpu_ms), 3),
                fmt(cpu.med(lambda x: x.node.cpu_ms), 3),
                fmt(extra, 3, signed=True),
                fmt(cpu.med(lambda x: x.own_extra_ms), 3, signed=True),
                "",
            ]
        ],
    )
    errors = sum(x.node.errors for r in results for x in r.rounds)
    foreign = max(x.foreign_cores for r in results for x in r.rounds)
    repeats = sum(x.attempts - 1 for r in results for x in r.rounds)
    costs = ", ".join(f"{r.row.label}: {fmt(r.cost_ms, 2)} ms" for r in results)
    measured = (
        "Throughput of one node actor at saturation divided by raw ONNX Runtime throughput "
        "on the same model in the same run. Raw: one in-process `InferenceSession` "
        "(intra-op 1, inter-op 1, sequential) calling batch-1 back to back. Node: one node "
        f"actor (threads 1); the driver keeps {params.in_flight} requests in flight "
        "straight to the node actor (`infer.remote` on it, bypassing the fleet's router; "
        "`ray.wait`) and counts completed replies. Measurements "
        f"alternate raw, node, raw, node ... ({params.rounds} rounds of {params.duration_s:g} s "
        f"per measurement and row, after a {params.warmup_s:g} s warm-up); the ratio is the "
        "median of the per-round ratios. In the unbatched rows each round also measures a "
        "*Ray floor* between raw and node (raw, floor, node, raw, floor, node ...): the "
        "smallest async Ray actor doing the same job "
        "(one session on one engine thread, the same request and reply types, no "
        "scheduler), driven the same way. Models: "
        f"5 ms = {m5.describe()}; 1 ms = {m1.describe()}. The second table prices the "
        "node per request: on the tiny classifier (`modelgen.make_classifier`, batching "
        "off) the Ray floor and the node alternate (floor, node, floor, node ...; same "
        "rounds, durations and requests in flight), and the CPU every process on the "
        "machine used within each window (busy jiffies of /proc/stat: the driver, Ray's "
        "processes, the actor) is divided by the replies completed in it."
    )
    notes = [
        "Node / Ray floor is what edgefleet's node (admission, queue, scheduler, settle) "
        "costs over any Ray actor; Ray floor / raw is what Ray itself costs on this 2-core "
        "machine, where the driver, the actor's event loop and Ray's own threads compete "
        "with the engine thread for the second core.",
        "Node engine ms / call is the mean `Reply.service_s` of the node's engine calls "
        "(from the moment the node starts a call to the moment its loop has the result); "
        "engine busy is their sum over the window. A busy engine with a longer call than "
        "raw means the loss is inside the call window (thread hand-off, the engine thread "
        "sharing the CPUs), not idle gaps the scheduler leaves between calls.",
        "The batched row divides the node's request rate (each request is one batch-1 "
        "input) by the raw batch-1 call rate, so a ratio above 1 is what batching "
        "recovers. Batch limit the node chose for it (only_if_faster on): "
        f"{limits.get('slow1_batched', 'n/a')}.",
        f"The node's own warm-up cost of a batch-1 call: {costs}.",
        f"Failed replies during measurement: {errors}. Rounds measured again because "
        f"other processes used more than 0.2 cores meanwhile: {repeats}; most CPU other "
        f"processes used during a kept round: {foreign:.2f} cores.",
    ]
    cpu_errors = sum(x.node.errors + x.floor.errors for x in cpu.rounds)
    notes.append(
        "Machine CPU per request counts every process on the machine, so the driver's "
        "own work (submitting, `ray.wait`, receiving replies) is in both columns; their "
        "difference is what the node costs per request over any Ray actor serving the "
        "same session. 'Own processes only' counts the CPU of this benchmark's process "
        "tree (the driver and the Ray it started) instead of the whole machine: the same "
        "difference without whatever else ran meanwhile. "
        f"Failed replies in that row: {cpu_errors}; rounds measured again: "
        f"{sum(x.attempts - 1 for x in cpu.rounds)}."
    )
    cpu_part = "**Machine CPU per request, classifier: Ray floor vs node**\n\n" + cpu_table
    return Section(TITLE, measured, [table, cpu_part], targets, notes)


__all__ = ["RayFloor", "Throughput", "actor_throughput", "raw_throughput", "run"]
