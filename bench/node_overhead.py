"""(b) Node overhead: a saturated node's throughput over raw ONNX Runtime's, same model,
in alternating rounds; in the unbatched rows a *Ray floor* (the smallest async Ray
actor doing the same job) in between, and the machine CPU per request of node and Ray
floor on the tiny classifier."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.engine import open_session
from bench.common import (
    GET_TIMEOUT_S,
    Feed,
    Loop,
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
TARGET_RATIO_5MS = 0.85
TARGET_FLOOR_RATIO_1MS = 0.9  # node / Ray floor throughput, 1 ms model, batching off
TARGET_EXTRA_CPU_MS = 0.3  # node - Ray floor machine CPU per request on the classifier
CPU_MODEL = "classifier"


@dataclass(frozen=True)
class Round:
    """Loops measured side by side (raw / floor / node), and how disturbed they were."""

    loops: dict[str, Loop]
    foreign_cores: float
    attempts: int

    @property
    def raw(self) -> Loop:
        return self.loops["raw"]

    @property
    def floor(self) -> Loop:
        return self.loops["floor"]

    @property
    def node(self) -> Loop:
        return self.loops["node"]

    @property
    def ratio(self) -> float:
        return self.node.rate / self.raw.rate

    @property
    def floor_ratio(self) -> float:
        return self.floor.rate / self.raw.rate if "floor" in self.loops else float("nan")

    @property
    def extra_ms(self) -> float:
        """Machine CPU per request the node takes over the Ray floor, in ms."""
        return self.node.machine_cpu_ms - self.floor.machine_cpu_ms

    @property
    def own_extra_ms(self) -> float:
        """The same counting only this benchmark's processes."""
        return self.node.cpu_ms - self.floor.cpu_ms


def med(rounds: list[Round], pick: Callable[[Round], float]) -> float:
    return median([pick(r) for r in rounds])


class RayFloor:
    """The smallest async Ray actor doing a node's job: one ONNX Runtime session on one
    engine thread, ``InferRequest`` in, ``Reply`` out; no admission, queue or batching."""

    def __init__(self, path: str) -> None:
        self._session = open_session("floor", Path(path), threads=1)
        self._names = [o.name for o in self._session.get_outputs()]
        self._executor = ThreadPoolExecutor(1)

    async def infer(self, request: InferRequest) -> Reply:
        t0 = time.monotonic()
        values = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._session.run, self._names, dict(request.inputs)
        )
        outputs = dict(zip(self._names, values, strict=True))
        return Reply(request.id, "ray-floor", outputs=outputs, service_s=time.monotonic() - t0)

    def ready(self) -> bool:
        return True


def raw_loop(session: Any, feed: Feed, seconds: float) -> Loop:
    """Batch-1 calls back to back on an in-process session for ``seconds``."""
    calls, start = 0, time.perf_counter()
    now = start
    while now < start + seconds:
        session.run(None, feed)
        calls += 1
        now = time.perf_counter()
    return Loop(calls, now - start)


def _rounds(
    label: str, loops: dict[str, Callable[[float], Loop]], seconds: float, rounds: int, warm: float
) -> list[Round]:
    """Every loop once to warm up, then ``rounds`` rounds of all of them in order."""
    for loop in loops.values():
        loop(warm)
    out = []
    for i in range(rounds):
        c = calm(lambda: {k: loop(seconds) for k, loop in loops.items()}, f"{label} round {i + 1}")
        out.append(Round(c.value, c.foreign_cores, c.attempts))
        log(
            f"  {label} round {i + 1}/{rounds}: "
            + ", ".join(f"{k} {x.rate:.0f}/s {x.machine_cpu_ms:.3f} ms" for k, x in c.value.items())
            + f" (other processes {c.foreign_cores:.2f} cores)"
        )
    return out


def _actor(submit: Submit) -> Callable[[float], Loop]:
    return lambda seconds: closed_loop([submit], IN_FLIGHT, seconds)


def _measure(
    ctx: RunContext, client: FleetClient, floors: dict[Path, Any], models: dict[str, Any]
) -> tuple[dict[str, list[Round]], list[Round]]:
    seconds, rounds, warm = ctx.pick(2.0, 0.5), ctx.count(5, 2), ctx.pick(0.5, 0.2)
    node = only_node(client).node
    out: dict[str, list[Round]] = {}
    for label, model, with_floor in ROWS:
        log(f"node overhead: {label}")
        bench_model = models[model]
        feed = slow_feed(bench_model.width)
        session = raw_session(bench_model.path)
        floor = floors[bench_model.path]
        loops = {"raw": lambda s, session=session, feed=feed: raw_loop(session, feed, s)}
        if with_floor:
            request = InferRequest(model=model, inputs=feed)
            loops["floor"] = _actor(lambda f=floor, r=request: f.infer.remote(r))
        loops["node"] = _actor(lambda m=model, feed=feed: node_submit(client, node, m, feed))
        out[label] = _rounds(label, loops, seconds, rounds, warm)
    log("node overhead: machine CPU per request, classifier")
    feed = random_inputs(CPU_MODEL)
    request = InferRequest(model=CPU_MODEL, inputs=feed)
    floor = floors[models[CPU_MODEL]]
    cpu_loops = {
        "floor": _actor(lambda: floor.infer.remote(request)),
        "node": _actor(lambda: node_submit(client, node, CPU_MODEL, feed)),
    }
    return out, _rounds("CPU per request", cpu_loops, seconds, rounds, warm)


ROWS = (  # label, model entry, with a Ray floor
    ("5 ms, batching off", "slow5", True),
    ("1 ms, batching off", "slow1", True),
    ("1 ms, batching on", "slow1_batched", False),
)
TARGETS = {"5 ms, batching off": TARGET_RATIO_5MS}
FLOOR_TARGETS = {"1 ms, batching off": TARGET_FLOOR_RATIO_1MS}


def run(ctx: RunContext) -> Section:
    m5, m1 = ctx.models.calibrated(5.0), ctx.models.calibrated(1.0)
    classifier = make_classifier(m5.path.parent / f"{CPU_MODEL}.onnx")
    entries = [
        ModelEntry("slow5", m5.path),
        ModelEntry("slow1", m1.path),
        ModelEntry("slow1_batched", m1.path, window_ms=2.0, max_batch_size=8),
        ModelEntry(CPU_MODEL, classifier),
    ]
    models = {"slow5": m5, "slow1": m1, "slow1_batched": m1, CPU_MODEL: classifier}
    floor_cls = ray.remote(RayFloor).options(max_concurrency=1024, num_cpus=0)
    floors = {p: floor_cls.remote(str(p)) for p in (m5.path, m1.path, classifier)}
    try:
        ray.get([f.ready.remote() for f in floors.values()], timeout=GET_TIMEOUT_S)
        with deployed(fleet_config("bench-overhead", entries)) as client:
            status = client.status(GET_TIMEOUT_S)
            limits = {m.name: m.batch_limit for n in status.nodes for m in n.models}
            rows, cpu = _measure(ctx, client, floors, models)
            costs = {e.name: node_costs_ms(client.status(GET_TIMEOUT_S), e.name) for e in entries}
    finally:
        for handle in floors.values():
            ray.kill(handle)
    measured = (
        "Throughput of one node actor at saturation over raw ONNX Runtime throughput on the "
        "same model, in the same run. Raw: an in-process session opened as the node's engine "
        "opens it (`actors.engine.open_session`), batch-1 calls back to back. Node: one node "
        f"actor (threads 1), {IN_FLIGHT} requests in flight straight to it (`infer.remote`, "
        "bypassing placement; `ray.wait`), completed replies counted. Raw, Ray floor (the "
        "smallest async Ray actor doing the same job: one session on one engine thread, no "
        f"scheduler) and node alternate, {ctx.count(5, 2)} rounds of {ctx.pick(2.0, 0.5):g} s; "
        f"ratios are medians of per-round ratios. Models: 5 ms = {m5.describe()}; 1 ms = "
        f"{m1.describe()}. The second table prices the node per request on the tiny "
        "classifier (`modelgen.make_classifier`): machine CPU (busy jiffies of /proc/stat) "
        "per completed reply, Ray floor and node alternating."
    )
    return _section(rows, cpu, limits, costs, measured)


def _overhead_table(rows: dict[str, list[Round]]) -> str:
    def floor(r: list[Round], pick: Callable[[Round], float]) -> str:
        return fmt(med(r, pick), 2) if "floor" in r[0].loops else "-"

    return md_table(
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
                label,
                fmt(med(r, lambda x: x.raw.rate), 0),
                fmt(med(r, lambda x: x.node.rate), 0),
                fmt(med(r, lambda x: x.ratio), 2),
                " / ".join(fmt(x.ratio, 2) for x in r),
                floor(r, lambda x: x.floor_ratio),
                floor(r, lambda x: x.ratio / x.floor_ratio),
                fmt(med(r, lambda x: x.node.mean_batch), 2),
                fmt(med(r, lambda x: x.raw.engine_ms), 2),
                fmt(med(r, lambda x: x.node.engine_ms), 2),
                f"{med(r, lambda x: x.node.engine_busy) * 100:.0f}%",
            ]
            for label, r in rows.items()
        ],
    )


def _cpu_table(cpu: list[Round]) -> str:
    def line(name: str, pick: Callable[[Callable[[Round], float]], float]) -> list[object]:
        return [
            name,
            fmt(pick(lambda x: x.floor.rate), 0),
            fmt(pick(lambda x: x.node.rate), 0),
            fmt(pick(lambda x: x.floor.machine_cpu_ms), 3),
            fmt(pick(lambda x: x.node.machine_cpu_ms), 3),
            fmt(pick(lambda x: x.extra_ms), 3, signed=True),
            fmt(pick(lambda x: x.own_extra_ms), 3, signed=True),
        ]

    rows = [
        [*line(str(i + 1), lambda f, r=r: f(r)), fmt(r.foreign_cores, 2)] for i, r in enumerate(cpu)
    ]
    rows.append([*line("median", lambda f: med(cpu, f)), ""])
    headers = ["round", "Ray floor calls/s", "node calls/s", "Ray floor CPU ms / request"]
    headers += ["node CPU ms / request", "node - Ray floor ms", "same, own processes only"]
    return md_table([*headers, "other processes, cores"], rows)


def _section(
    rows: dict[str, list[Round]],
    cpu: list[Round],
    limits: dict[str, int],
    costs: dict[str, Any],
    measured: str,
) -> Section:
    targets = [
        Target(f"node / raw throughput, {label}", med(rows[label], lambda x: x.ratio), ">=", t)
        for label, t in TARGETS.items()
    ]
    targets += [
        Target(
            f"node / Ray floor throughput, {label}",
            med(rows[label], lambda x: x.ratio / x.floor_ratio),
            ">=",
            t,
        )
        for label, t in FLOOR_TARGETS.items()
    ]
    targets.append(
        Target(
            "node - Ray floor machine CPU per request, classifier, ms",
            med(cpu, lambda x: x.extra_ms),
            "<=",
            TARGET_EXTRA_CPU_MS,
            digits=3,
        )
    )
    every = [x for r in rows.values() for x in r]
    cost = ", ".join(
        f"{label}: {fmt(costs[model].get(1, float('nan')), 2)} ms" for label, model, _ in ROWS
    )
    notes = [
        "Node / Ray floor is what edgefleet's node (admission, queue, scheduler, settle) "
        "costs over any Ray actor; Ray floor / raw is what Ray itself costs on this machine. "
        "Node engine ms / call is the mean `Reply.service_s`; engine busy their sum over "
        "the window. The batched row divides the node's request rate by the raw batch-1 "
        "call rate: above 1 is what batching recovers. Batch limit the node chose for it: "
        f"{limits.get('slow1_batched', 'n/a')}.",
        f"The node's own warm-up cost of a batch-1 call: {cost}.",
        f"Failed replies during measurement: {sum(x.node.errors for x in every)}. Rounds "
        f"measured again because other processes used more than 0.2 cores meanwhile: "
        f"{sum(x.attempts - 1 for x in every)}; most CPU other processes used during a kept "
        f"round: {max(x.foreign_cores for x in every):.2f} cores.",
        "Machine CPU per request counts every process on the machine ('own processes only': "
        "this benchmark's process tree). Failed replies in that row: "
        f"{sum(x.node.errors + x.floor.errors for x in cpu)}; rounds measured again: "
        f"{sum(x.attempts - 1 for x in cpu)}.",
    ]
    cpu_part = "**Machine CPU per request, classifier: Ray floor vs node**\n\n" + _cpu_table(cpu)
    return Section(TITLE, measured, [_overhead_table(rows), cpu_part], targets, notes)
