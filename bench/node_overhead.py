"""(b) Node overhead: a saturated node's throughput over raw ONNX Runtime's and over a
*Ray floor* (the smallest async Ray actor doing the same job), and the machine CPU per
request of node and Ray floor on the tiny classifier."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from actors.engine import open_session
from bench import common as bc
from bench.common import Feed, Loop, ModelEntry, Round, Section, Target, fmt, log, med
from edgefleet.messages import Reply
from edgefleet.modelgen import make_classifier, random_inputs
from edgefleet.request import InferRequest

TITLE = "Node overhead at saturation (b)"
IN_FLIGHT = 32
CPU_MODEL = "classifier"
ROWS = (  # label, model entry, with a Ray floor, node / raw target, node / floor target
    ("5 ms, batching off", "slow5", True, 0.85, None),
    ("1 ms, batching off", "slow1", True, None, 0.9),
    ("1 ms, batching on", "slow1_batched", False, None, None),
)
TARGET_EXTRA_CPU_MS = 0.3  # node - Ray floor machine CPU per request on the classifier


class RayFloor:
    """The smallest async Ray actor doing a node's job: one session on one engine
    thread, ``InferRequest`` in, ``Reply`` out; no admission, queue or batching."""

    def __init__(self, path: str) -> None:
        self._session = open_session("floor", Path(path), threads=1)
        self._names = [o.name for o in self._session.get_outputs()]
        self._executor = ThreadPoolExecutor(1)

    async def infer(self, request: InferRequest) -> Reply:
        t0, run = time.monotonic(), self._session.run
        loop = asyncio.get_running_loop()
        values = await loop.run_in_executor(self._executor, run, self._names, dict(request.inputs))
        outputs = dict(zip(self._names, values, strict=True))
        return Reply(request.id, "ray-floor", outputs=outputs, service_s=time.monotonic() - t0)

    def ready(self) -> bool:
        return True


def raw_loop(session: Any, feed: Feed, seconds: float) -> Loop:
    """Batch-1 calls back to back on an in-process session for ``seconds``."""
    calls, start = 0, time.perf_counter()
    while (now := time.perf_counter()) < start + seconds:
        session.run(None, feed)
        calls += 1
    return Loop(calls, now - start)


def _loops(client: Any, floor: Any, model: str, feed: Feed) -> dict[str, Any]:
    """Closed loops straight to the Ray floor and to the node (``IN_FLIGHT`` each)."""
    node, request = bc.only_node(client).node, InferRequest(model=model, inputs=feed)
    to_floor, to_node = floor.infer.remote, bc.node_submit
    return {
        "floor": lambda s: bc.closed_loop([lambda: to_floor(request)], IN_FLIGHT, s),
        "node": lambda s: bc.closed_loop(
            [lambda: to_node(client, node, model, feed)], IN_FLIGHT, s
        ),
    }


def run(ctx: bc.RunContext) -> Section:
    m5, m1 = ctx.models.calibrated(5.0), ctx.models.calibrated(1.0)
    classifier = make_classifier(m5.path.parent / f"{CPU_MODEL}.onnx")
    batched = ModelEntry("slow1_batched", m1.path, window_ms=2.0, max_batch_size=8)
    entries = [ModelEntry("slow5", m5.path), ModelEntry("slow1", m1.path), batched]
    entries.append(ModelEntry(CPU_MODEL, classifier))
    models = {"slow5": m5, "slow1": m1, "slow1_batched": m1}
    floor_cls = ray.remote(RayFloor).options(max_concurrency=1024, num_cpus=0)
    floors = {p: floor_cls.remote(str(p)) for p in (m5.path, m1.path, classifier)}
    timing = {"seconds": ctx.pick(2.0, 0.5), "count": ctx.count(5, 2), "warm_s": ctx.pick(0.5, 0.2)}
    results: dict[str, list[Round]] = {}
    try:
        ray.get([f.ready.remote() for f in floors.values()], timeout=bc.GET_TIMEOUT_S)
        with bc.deployed(bc.fleet_config("bench-overhead", entries)) as client:
            for label, model, with_floor, *_ in ROWS:
                log(f"node overhead: {label}")
                feed, path = bc.slow_feed(models[model].width), models[model].path
                session = bc.raw_session(path)
                loops = {"raw": lambda s, x=session, f=feed: raw_loop(x, f, s)}
                loops |= _loops(client, floors[path], model, feed)
                if not with_floor:
                    del loops["floor"]
                results[label] = bc.rounds(label, loops, **timing)
            log("node overhead: machine CPU per request, classifier")
            cpu_loops = _loops(client, floors[classifier], CPU_MODEL, random_inputs(CPU_MODEL))
            cpu = bc.rounds("CPU per request", cpu_loops, **timing)
            status = client.status(bc.GET_TIMEOUT_S)
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
        f"scheduler) and node side by side, {timing['count']} rounds of {timing['seconds']:g} "
        "s, the order rotating; ratios are medians of per-round ratios. Models: 5 ms = "
        f"{m5.describe()}; 1 ms = {m1.describe()}. The second table prices the node per "
        "request on the tiny classifier (`modelgen.make_classifier`): machine CPU (busy "
        "jiffies of /proc/stat) per completed reply, Ray floor and node side by side."
    )
    return _section(results, cpu, status, measured)


def _ratio(r: Round, over: str = "raw") -> float:
    return r["node"].rate / r[over].rate


def _extra(r: Round, own: bool = False) -> float:
    """CPU ms per request the node takes over the Ray floor: every process on the
    machine's, or (``own``) this benchmark's only."""
    if own:
        return r["node"].cpu_ms - r["floor"].cpu_ms
    return r["node"].machine_cpu_ms - r["floor"].machine_cpu_ms


def _overhead_table(results: dict[str, list[Round]]) -> str:
    rows = []
    for label, r in results.items():
        floor = "floor" in r[0].loops
        rows.append(
            [label, *(fmt(med(r, lambda x, k=k: x[k].rate), 0) for k in ("raw", "node"))]
            + [fmt(med(r, _ratio), 2), bc.each(r, _ratio, 2)]
            + [fmt(med(r, lambda x: x["floor"].rate / x["raw"].rate), 2) if floor else "-"]
            + [fmt(med(r, lambda x: _ratio(x, "floor")), 2) if floor else "-"]
            + [fmt(med(r, lambda x: x["node"].mean_batch), 2)]
            + [fmt(med(r, lambda x, k=k: x[k].engine_ms), 2) for k in ("raw", "node")]
            + [f"{med(r, lambda x: x['node'].engine_busy) * 100:.0f}%"]
        )
    header = "model / node config | raw calls/s | node calls/s | node / raw (median) | "
    header += "per-round ratios | Ray floor / raw | node / Ray floor | mean batch | "
    header += "raw ms / call | node engine ms / call | node engine busy"
    return bc.md_table(bc.columns(header), rows)


def _cpu_table(cpu: list[Round]) -> str:
    def line(name: str, get: Any) -> list[object]:
        cells = [fmt(get(lambda x, k=k: x[k].rate), 0) for k in ("floor", "node")]
        cells += [fmt(get(lambda x, k=k: x[k].machine_cpu_ms), 3) for k in ("floor", "node")]
        own = get(lambda x: _extra(x, own=True))
        return [name, *cells, fmt(get(_extra), 3, signed=True), fmt(own, 3, signed=True)]

    rows = [
        [*line(str(i + 1), lambda f, r=r: f(r)), fmt(r.foreign_cores, 2)] for i, r in enumerate(cpu)
    ]
    rows.append([*line("median", lambda f: med(cpu, f)), ""])
    header = "round | Ray floor calls/s | node calls/s | Ray floor CPU ms / request | node CPU ms "
    header += "/ request | node - Ray floor ms | same, own processes only | other processes, cores"
    return bc.md_table(bc.columns(header), rows)


def _section(
    results: dict[str, list[Round]], cpu: list[Round], status: Any, measured: str
) -> Section:
    targets = []
    for label, _, _, raw_target, floor_target in ROWS:
        if raw_target is not None:
            value = med(results[label], _ratio)
            targets.append(Target(f"node / raw throughput, {label}", value, ">=", raw_target))
        if floor_target is not None:
            value = med(results[label], lambda x: _ratio(x, "floor"))
            targets.append(
                Target(f"node / Ray floor throughput, {label}", value, ">=", floor_target)
            )
    label = "node - Ray floor machine CPU per request, classifier, ms"
    targets.append(Target(label, med(cpu, _extra), "<=", TARGET_EXTRA_CPU_MS, digits=3))
    every = [x for r in results.values() for x in r]
    limit = {m.name: m.batch_limit for n in status.nodes for m in n.models}.get("slow1_batched")
    cost = ", ".join(
        f"{label}: {fmt(bc.node_costs_ms(status, model).get(1, float('nan')), 2)} ms"
        for label, model, *_ in ROWS
    )
    notes = [
        "Node / Ray floor is what edgefleet's node (admission, queue, scheduler, settle) "
        "costs over any Ray actor; Ray floor / raw is what Ray itself costs on this machine. "
        "Node engine ms / call is the mean `Reply.service_s`; engine busy their sum over "
        "the window. The batched row divides the node's request rate by the raw batch-1 "
        "call rate: above 1 is what batching recovers. Batch limit the node chose for it: "
        f"{limit}.",
        f"The node's own warm-up cost of a batch-1 call: {cost}.",
        f"Failed replies during measurement: {sum(x['node'].errors for x in every)}. "
        + bc.rounds_note(every),
        "Machine CPU per request counts every process on the machine ('own processes only': "
        "this benchmark's process tree). Failed replies in that row: "
        f"{sum(x['node'].errors + x['floor'].errors for x in cpu)}; rounds measured again: "
        f"{sum(x.attempts - 1 for x in cpu)}.",
    ]
    cpu_part = "**Machine CPU per request, classifier: Ray floor vs node**\n\n" + _cpu_table(cpu)
    return Section(TITLE, measured, [_overhead_table(results), cpu_part], targets, notes)
