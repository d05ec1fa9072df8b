"""(b) Node overhead: a saturated node against raw ONNX Runtime and a *Ray floor*.

Throughput of one node actor (threads 1) at saturation over raw ONNX Runtime's on the
same model, in the same run. Raw: an in-process session opened as the node's engine
opens it, batch-1 calls back to back. Node: requests kept in flight straight to the node
actor (`infer.remote`, `ray.wait`), completed replies counted. Ray floor: the smallest
async Ray actor doing the same job (one session on one engine thread, no scheduler),
driven the same way. The three side by side in rounds, the order rotating; ratios are
medians of per-round ratios. The second table prices the node per request on the tiny
classifier (`modelgen.make_classifier`): machine CPU (busy jiffies of /proc/stat) per
completed reply, Ray floor and node side by side.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
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
HEADER = "model / node config | raw calls/s | node calls/s | node / raw (median) | per-round "
HEADER += "ratios | Ray floor / raw | node / Ray floor | mean batch | raw ms / call | node engine "
HEADER += "ms / call | node engine busy"
CPU_HEADER = "round | Ray floor calls/s | node calls/s | Ray floor CPU ms / request | node CPU "
CPU_HEADER += (
    "ms / request | node - Ray floor ms | same, own processes only | other processes, cores"
)


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


def run(ctx: bc.RunContext) -> Section:
    m5, m1 = ctx.models.calibrated(5.0), ctx.models.calibrated(1.0)
    classifier = make_classifier(m5.path.parent / f"{CPU_MODEL}.onnx")
    models = {"slow5": m5, "slow1": m1, "slow1_batched": m1}
    entries = [ModelEntry(k, m.path) for k, m in models.items()]
    entries[2] = ModelEntry("slow1_batched", m1.path, window_ms=2.0, max_batch_size=8)
    entries.append(ModelEntry(CPU_MODEL, classifier))
    floor_cls = ray.remote(RayFloor).options(max_concurrency=1024, num_cpus=0)
    floors = {p: floor_cls.remote(str(p)) for p in (m5.path, m1.path, classifier)}
    timing = {"seconds": ctx.pick(2.0, 0.5), "count": ctx.count(5, 2), "warm_s": ctx.pick(0.5, 0.2)}
    results: dict[str, list[Round]] = {}
    try:
        ray.get([f.ready.remote() for f in floors.values()], timeout=bc.GET_TIMEOUT_S)
        with bc.deployed(bc.fleet_config("bench-overhead", entries)) as client:
            node = bc.only_node(client)

            def loops(model: str, path: Path, feed: Feed, floor: bool = True) -> dict[str, Any]:
                """Closed loops straight to the Ray floor and to the node (``IN_FLIGHT`` each)."""
                request, floor_of = InferRequest(model=model, inputs=feed), floors[path].infer
                sends = {"floor": lambda: floor_of.remote(request)} if floor else {}
                sends["node"] = lambda: node.submit(model, feed)
                return {k: partial(bc.closed_loop, [send], IN_FLIGHT) for k, send in sends.items()}

            for label, model, with_floor, *_ in ROWS:
                log(f"node overhead: {label}")
                feed, path = bc.slow_feed(models[model].width), models[model].path
                session = bc.raw_session(path)
                raw = {"raw": lambda s, x=session, f=feed: raw_loop(x, f, s)}
                loop = raw | loops(model, path, feed, with_floor)
                results[label] = bc.rounds(label, loop, **timing)
            log("node overhead: machine CPU per request, classifier")
            cpu_loops = loops(CPU_MODEL, classifier, random_inputs(CPU_MODEL))
            cpu = bc.rounds("CPU per request", cpu_loops, **timing)
            status = client.status(bc.GET_TIMEOUT_S)
    finally:
        for handle in floors.values():
            ray.kill(handle)
    measured = " ".join(__doc__.split("\n\n", 1)[1].split())
    measured += f" {IN_FLIGHT} requests in flight; {timing['count']} rounds of "
    measured += f"{timing['seconds']:g} s. Models: 5 ms = {m5.describe()}; 1 ms = {m1.describe()}."
    return _section(results, cpu, status, measured)


def _ratio(r: Round, over: str = "raw") -> float:
    return r["node"].rate / r[over].rate


def _extra(r: Round, own: bool = False) -> float:
    """CPU ms per request the node takes over the Ray floor: every process on the
    machine's, or (``own``) this benchmark's only."""
    if own:
        return r["node"].cpu_ms - r["floor"].cpu_ms
    return r["node"].machine_cpu_ms - r["floor"].machine_cpu_ms


def _section(
    results: dict[str, list[Round]], cpu: list[Round], status: Any, measured: str
) -> Section:
    rows, targets = [], []
    for (label, _, floor, raw, over_floor), r in zip(ROWS, results.values(), strict=True):
        over = med(r, lambda x: _ratio(x, "floor")) if floor else float("nan")
        rows.append(
            [label, *(fmt(med(r, lambda x, k=k: x[k].rate), 0) for k in ("raw", "node"))]
            + [fmt(med(r, _ratio), 2), bc.each(r, _ratio, 2)]
            + [fmt(med(r, lambda x: x["floor"].rate / x["raw"].rate), 2) if floor else "-"]
            + [fmt(over, 2) if floor else "-", fmt(med(r, lambda x: x["node"].mean_batch), 2)]
            + [fmt(med(r, lambda x, k=k: x[k].engine_ms), 2) for k in ("raw", "node")]
            + [f"{med(r, lambda x: x['node'].engine_busy) * 100:.0f}%"]
        )
        for what, value, limit in (("raw", med(r, _ratio), raw), ("Ray floor", over, over_floor)):
            if limit is not None:
                targets.append(Target(f"node / {what} throughput, {label}", value, ">=", limit))
    label = "node - Ray floor machine CPU per request, classifier, ms"
    targets.append(Target(label, med(cpu, _extra), "<=", TARGET_EXTRA_CPU_MS, digits=3))

    def line(name: str, get: Any) -> list[object]:
        cells = [fmt(get(lambda x, k=k: x[k].rate), 0) for k in ("floor", "node")]
        cells += [fmt(get(lambda x, k=k: x[k].machine_cpu_ms), 3) for k in ("floor", "node")]
        own = get(lambda x: _extra(x, own=True))
        return [name, *cells, fmt(get(_extra), 3, signed=True), fmt(own, 3, signed=True)]

    cpu_rows = [
        [*line(str(i + 1), lambda f, r=r: f(r)), fmt(r.foreign_cores, 2)] for i, r in enumerate(cpu)
    ]
    cpu_rows.append([*line("median", lambda f: med(cpu, f)), ""])
    every = [x for r in results.values() for x in r]
    limit = {m.name: m.batch_limit for n in status.nodes for m in n.models}.get("slow1_batched")
    cost = ", ".join(
        f"{label}: {fmt(bc.node_costs_ms(status, model).get(1, float('nan')), 2)} ms"
        for label, model, *_ in ROWS
    )
    notes = [
        "Node / Ray floor is what the node (admission, queue, scheduler) costs over any Ray "
        "actor; Ray floor / raw what Ray costs here. Node engine ms / call: the mean "
        "`Reply.service_s`; engine busy: their sum over the window. The batched row's ratios "
        f"are over raw batch-1 calls; the batch limit the node chose for it: {limit}.",
        f"The node's own warm-up cost of a batch-1 call: {cost}.",
        f"Failed replies during measurement: {sum(x['node'].errors for x in every)}. "
        + bc.rounds_note(every),
        "Machine CPU per request counts every process on the machine ('own processes only': "
        "this benchmark's process tree). Failed replies in that row: "
        f"{sum(x['node'].errors + x['floor'].errors for x in cpu)}; rounds measured again: "
        f"{sum(x.attempts - 1 for x in cpu)}.",
    ]
    tables = [bc.md_table(bc.columns(HEADER), rows)]
    tables.append(
        "**Machine CPU per request, classifier: Ray floor vs node**\n\n"
        + bc.md_table(bc.columns(CPU_HEADER), cpu_rows)
    )
    return Section(TITLE, measured, tables, targets, notes)
