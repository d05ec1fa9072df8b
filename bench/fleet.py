"""The fleet with placement in the caller, measured side by side on one embedded Ray:
(a) throughput at saturation over the sum of its nodes', (b) the latency placement
adds, (c) foreground p99 under a background flood, (d) the placement policies on one
seeded trace (``sim.workload``), (e) what placement costs per request."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import ray

from bench import common as bc
from bench import priority_latency as pl
from bench.common import GET_TIMEOUT_S, BenchModel, Feed, Part, Round, Target, each, fmt, log, med
from cluster.client import FleetClient
from cluster.traffic import ClosedLoop, Counts
from edgefleet.config import FleetConfig
from edgefleet.messages import Reply
from edgefleet.modelgen import make_classifier, random_inputs
from policies.placement import placement_policies
from sim.workload import Arrival, Workload, parse_workload

POLICIES = placement_policies()  # the default first
DEFAULT_POLICY = POLICIES[0]
TITLE = "The fleet: placement in the caller (fleet)"
# (a) scaling and (b) added latency: one 3-node fleet serving both models
FLEET_NODES = 3
SAT_MODEL, SAT_COST_MS = "slow5", 5.0
LAT_MODEL, LAT_COST_MS = "slow1", 1.0
IN_FLIGHT_PER_NODE = 32
TARGET_SCALING = 0.85  # fleet / sum of single-node throughputs
# (c) foreground under a background flood
FLOOD_MODEL, FLOOD_COST_MS = "slow20", 20.0
FLOOD_CAPACITY = 64
BACKGROUND = 3
FLOOD_CALLERS = 2  # the same flood split over this many clients placing requests
SPLIT = "edgefleet, 2 callers"
IDLE = "edgefleet, a second caller idle"
FLOOD_MAX_RETRY_S = 1.0  # the router's retry hint is honoured, up to this
# (d) placement policies on one trace
CHEAP, DEAR = "cheap2", "dear10"
CHEAP_COST_MS, DEAR_COST_MS = 2.0, 10.0
CHEAP_SHARE = 0.5  # of the trace's requests
PRIORITY_MIX: tuple[tuple[int, float], ...] = ((10, 0.10), (7, 0.20), (3, 0.50), (0, 0.20))
LOAD = 0.8  # offered load over the measured fleet capacity
STALL_RATIO = 1.5  # a replay whose median engine call took this x the run's is run again
TRACE_SEED = 20261129
CHEAP_NODE = "edge-cheap"
TRACE_NODES: tuple[Mapping[str, Any], ...] = (
    {"name": CHEAP_NODE, "models": [CHEAP]},
    *({"name": f"edge-{i}"} for i in (1, 2, 3)),
)
CAPACITY_IN_FLIGHT_PER_NODE = 8
# (e) what placement costs: a tiny model at saturation
COST_NODES = 4
COST_MODEL = "classifier"
COST_IN_FLIGHT_PER_NODE = 32
LOOP_FIGURES = ("engine_ms", "cores", "cpu_ms")  # (a)'s per-loop columns


def _delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _added(counters: Sequence[Mapping[str, int]]) -> Counter[str]:
    return sum((Counter(c) for c in counters), Counter())


# ============================================================ (a) scaling at saturation


def _single_sum(r: Round) -> float:
    return sum(x.rate for k, x in r.loops.items() if k not in ("direct", "fleet"))


RATIOS: dict[str, Callable[[Round], float]] = {  # label -> a round's ratio
    "**scaling** = fleet placed by the client / sum of single-node throughputs": lambda r: (
        r["fleet"].rate / _single_sum(r)
    ),
    f"**placement efficiency** = fleet placed by the client / all {FLEET_NODES} nodes "
    "straight": lambda r: r["fleet"].rate / r["direct"].rate,
    f"machine limit = all {FLEET_NODES} nodes straight at once / sum of single-node": lambda r: (
        r["direct"].rate / _single_sum(r)
    ),
}


def measure_scaling(ctx: bc.RunContext, client: FleetClient, feed: Feed) -> list[Round]:
    """Every node alone, straight to its actor; all at once, straight; the fleet placed
    by the client; in rounds."""
    to = {n: partial(bc.node_submit, client, n, SAT_MODEL, feed) for n in bc.node_names(client)}
    loops = {n: partial(bc.closed_loop, [f], IN_FLIGHT_PER_NODE) for n, f in to.items()}
    loops["direct"] = partial(bc.closed_loop, list(to.values()), IN_FLIGHT_PER_NODE)
    placed = [lambda: client.submit(SAT_MODEL, feed)]
    loops["fleet"] = partial(bc.closed_loop, placed, IN_FLIGHT_PER_NODE * len(to))
    seconds, count, warm_s = ctx.pick(1.5, 0.6), ctx.count(3, 1), ctx.pick(0.5, 0.2)
    return bc.rounds("(a)", loops, seconds, count, warm_s=warm_s, attempts=2)


def _scaling_part(runs: list[Round], nodes: list[str], model: BenchModel) -> Part:
    def row(label: str, key: str) -> list[object]:
        total = _added([r[key].by_node for r in runs])
        n = sum(total.values())
        share = " · ".join(f"{total[x] / n * 100:.0f}%" for x in nodes) if n else "-"
        cells = [fmt(med(runs, lambda r, k=k: getattr(r[key], k)), 2) for k in LOOP_FIGURES]
        rate = [fmt(med(runs, lambda r: r[key].rate), 0), each(runs, lambda r: r[key].rate)]
        return [label, *rate, *cells, "-" if key in nodes else share]

    rows = [row(f"{n} alone, straight to its actor", n) for n in nodes]
    label = "**sum of single-node throughputs** (one at a time)"
    rows.append([label, fmt(med(runs, _single_sum), 0), each(runs, _single_sum), *"----"])
    direct = f"all {FLEET_NODES} nodes at once, straight to the actors (no router)"
    rows += [row(direct, "direct"), row("**fleet, placed by the client**", "fleet")]
    header = "measurement | requests/s (median) | per round | engine ms / call | cores used | "
    header += "CPU ms / request | share per node (" + " · ".join(nodes) + ")"
    ratios = [[k, fmt(med(runs, f), 2), each(runs, f, 2)] for k, f in RATIOS.items()]
    tables = [bc.md_table(bc.columns(header), rows)]
    tables.append(bc.md_table(["ratio", "median", "per round"], ratios))
    singles = [r[n] for r in runs for n in nodes]
    alone_cpu_ms, alone_cores = med(singles, lambda x: x.cpu_ms), med(singles, lambda x: x.cores)
    cpus = bc.cpu_count()
    most = cpus * 1000 / alone_cpu_ms
    measured = (
        f"{FLEET_NODES} simulated nodes on one embedded Ray, each serving a {model.describe()}, "
        f"batching off. Closed loops: every node alone, straight to its actor with "
        f"{IN_FLIGHT_PER_NODE} requests in flight; all {FLEET_NODES} straight at once (no "
        "placement); and the fleet placed by the client (`FleetClient.submit`, "
        f"{IN_FLIGHT_PER_NODE * FLEET_NODES} in flight, default placement). {len(runs)} "
        "round(s), the order rotating; ratios are medians of per-round ratios. Cores used "
        "and CPU ms / request count every process of this benchmark."
    )
    notes = [
        "The sum of single-node throughputs is measured one node at a time, each with the "
        f"machine to itself: not simultaneously achievable when {FLEET_NODES} engines share "
        f"{cpus} cores. The placement efficiency ratio isolates what placement costs.",
        f"What the machine allows: one node alone already uses {alone_cores:.2f} of the "
        f"{cpus} cores ({alone_cpu_ms:.1f} ms of CPU per request), so the machine cannot "
        f"serve more than about {most:.0f} requests/s: a scaling ratio of at most about "
        f"{most / med(runs, _single_sum):.2f} here, whatever placement does.",
        f"Failed replies: {sum(x.errors for r in runs for x in r.loops.values())}. "
        + bc.rounds_note(runs),
    ]
    scaling = med(runs, next(iter(RATIOS.values())))
    label = "(a) fleet throughput / sum of single-node throughputs"
    title = "(a) Fleet throughput at saturation vs the sum of its nodes"
    targets = [Target(label, scaling, ">=", TARGET_SCALING)]
    return Part(title, measured, tables, targets, notes)


# ============================================================ (b) added latency

LATENCY_PATHS = ("placed", "same node", "other node")
Sample = tuple[str, float, Reply, bool]  # path, ms, reply, placed on the node chosen last


def measure_latency(client: FleetClient, feed: Feed, pairs: int) -> list[Sample]:
    """``pairs`` sequential rounds of three requests, the order rotating: one placed by
    the client, one straight to the node it chose last, one straight to another node."""
    names = bc.node_names(client)
    last, out = names[0], []
    for i in range(pairs):
        for path in bc.rotated(LATENCY_PATHS, i):
            others = [n for n in names if n != last]
            node = last if path == "same node" else others[i % len(others)]
            t0 = time.perf_counter()
            if path == "placed":
                reply = client.infer_reply(LAT_MODEL, feed)
            else:
                reply = bc.reply_of(bc.node_submit(client, node, LAT_MODEL, feed))
            out.append((path, 1000 * (time.perf_counter() - t0), reply, reply.node == last))
            if path == "placed" and reply.error is None:
                last = reply.node
    return out


def _latency_part(c: bc.Calm[list[Sample]], model: BenchModel) -> Part:
    ok = [s for s in c.value if s[2].error is None]
    placed = [s for s in ok if s[0] == "placed"]
    direct, other, router = (
        bc.Summary.of([ms for p, ms, _, _ in ok if p == path])
        for path in ("same node", "other node", "placed")
    )

    def row(label: str, x: bc.Summary, path: str | None) -> list[object]:
        engine = [1000 * s[2].service_s for s in ok if s[0] == path]
        cells = [label, x.n, fmt(x.p50, 2), fmt(x.p99, 2), fmt(x.mean, 2)]
        return [*cells, fmt(bc.median(engine), 2) if path else "-"]

    def adds(label: str, base: bc.Summary) -> list[object]:
        gaps = (router.p50 - base.p50, router.p99 - base.p99, router.mean - base.mean)
        return [label, "-", *(fmt(g, 2, signed=True) for g in gaps), "-"]

    rows = [
        row("straight to the node actor the client chose last", direct, "same node"),
        row("straight to another node actor", other, None),
        row("placed by the client", router, "placed"),
        adds("**placement adds** (ms), over the node chosen last", direct),
        adds("placement adds (ms), over another node", other),
    ]
    table = bc.md_table(["path", "requests", "p50 ms", "p99 ms", "mean ms", "engine p50 ms"], rows)
    measured = (
        f"The 3-node fleet of (a), unloaded, serving a {model.describe()}. Sequential "
        "requests in rounds of three, the order rotating: one placed by the client "
        "(`FleetClient.infer_reply`), one straight to the node actor the client chose for "
        "the previous placed request, one straight to another node. Client end-to-end latency."
    )
    nodes = Counter(s[2].node for s in placed)
    notes = [
        "On an idle fleet placement spreads sequential requests over the nodes (a placed "
        f"request went to the node the one before it went to {sum(s[3] for s in placed)} "
        f"times of {router.n}); a node idle for longer answers later on this machine.",
        f"Nodes the client chose: {bc.pairs_text(nodes)}. Failed requests: "
        f"{len(c.value) - len(ok)}. Other processes used {c.foreign_cores:.2f} cores during "
        f"the kept measurement (attempts: {c.attempts}).",
    ]
    target = Target("(b) p50 added over a direct call, ms", router.p50 - direct.p50, "<=", 1.0)
    return Part("(b) Latency placement adds", measured, [table], [target], notes)


# =========================================================== (c) flood across the fleet


class FloodActor:
    """The background flood as a client of its own (a Ray actor with its own
    ``FleetClient``): ``lanes`` background lanes of a ``ClosedLoop``; without lanes it
    connects and sends nothing (idle)."""

    def __init__(self, fleet: str, feed: Feed, lanes: int) -> None:
        self._fleet, self._feed, self._lanes = fleet, feed, lanes
        self._client: FleetClient | None = None
        self._flood: ClosedLoop | None = None

    async def start(self) -> None:
        connect = partial(FleetClient.connect, fleet=self._fleet)  # waits on the router
        self._client = await asyncio.get_running_loop().run_in_executor(None, connect)
        if self._lanes:
            backoff = replace(pl.FLOOD_BACKOFF, max_retry_s=FLOOD_MAX_RETRY_S)
            kw = {"lanes": self._lanes, "priority": BACKGROUND, "backoff": backoff}
            self._flood = ClosedLoop(self._client, FLOOD_MODEL, self._feed, **kw)
            await self._flood.start()

    def counts(self) -> tuple[Counts, str | None]:
        """The counts so far, and the first failure of a lane."""
        if self._flood is None:
            return Counts(), None
        error = self._flood.error
        return self._flood.counts.copy(), None if error is None else repr(error)

    async def stop(self, timeout_s: float) -> tuple[Counts, str | None]:
        assert self._client is not None
        if self._flood is not None:
            await self._flood.stop(timeout_s)
        await asyncio.get_running_loop().run_in_executor(None, self._client.close)
        return self.counts()


@dataclass(frozen=True)
class FleetFlood:
    run: pl.ForegroundRun
    router: Mapping[str, int]  # placement counter deltas over the flood
    queues: tuple[int, ...]  # node queue lengths at the end
    seconds: float = 0.0  # from the flood's start to the last foreground reply
    foreign_cores: float = 0.0
    attempts: int = 1

    @property
    def refusals(self) -> float:
        """Background refusals per second of flood."""
        return (self.run.flood.rejected if self.run.flood else 0) / max(self.seconds, 1e-9)


def _floods(client: FleetClient, feed: Feed, callers: int, idle: int) -> list[Any]:
    """``callers`` flood actors sharing the lanes that fill every queue, ``idle`` more."""
    lanes = len(bc.node_names(client)) * FLOOD_CAPACITY
    # Ray warns of any blocking get in an async actor's process, whatever its thread.
    quiet = {"env_vars": {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}}
    actor = ray.remote(FloodActor).options(num_cpus=0, runtime_env=quiet)
    shares = [lanes // callers + (i < lanes % callers) for i in range(callers)] + [0] * idle
    return [actor.remote(client.config.fleet.name, feed, n) for n in shares]


def _wait_saturated(client: FleetClient, want_each: int, timeout_s: float = 20.0) -> int:
    deadline = time.perf_counter() + timeout_s
    while (least := min(n.queue_length for n in client.status(GET_TIMEOUT_S).nodes)) < want_each:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the flood filled the emptiest queue to {least}, not {want_each}")
        time.sleep(0.05)
    return least


def _flooded(
    client: FleetClient,
    feed: Feed,
    count: int,
    label: str,
    bg_limit: float,
    callers: int = 1,
    idle: int = 0,
) -> FleetFlood:
    """Foreground under a background flood from ``callers`` flood clients sharing the
    lanes, ``idle`` more connected and sending nothing; without callers, alone."""
    before, started = client.status(GET_TIMEOUT_S), time.perf_counter()
    floods = _floods(client, feed, callers, idle) if callers else []

    def counts_now() -> Counts:
        got = ray.get([f.counts.remote() for f in floods], timeout=GET_TIMEOUT_S)
        return Counts.total(c for c, _ in got)

    try:
        ray.get([f.start.remote() for f in floods], timeout=GET_TIMEOUT_S)
        if floods:
            least = _wait_saturated(client, max(1, int(bg_limit * FLOOD_CAPACITY) - 5))
            log(f"  {label}: flood running, at least {least} queued on every node")
        counts0, t0 = counts_now(), time.perf_counter()
        run = pl.foreground(client, feed, count, label, model=FLOOD_MODEL)
        counts1 = counts_now()
        bg_rate = (counts1.completed - counts0.completed) / (time.perf_counter() - t0)
        after = client.status(GET_TIMEOUT_S)  # before the flood's leftovers are cancelled
        seconds = time.perf_counter() - started
    finally:
        stops = [f.stop.remote(GET_TIMEOUT_S) for f in floods]
        errors = [e for _, e in ray.get(stops, timeout=2 * GET_TIMEOUT_S) if e is not None]
        for f in floods:
            ray.kill(f)
    if errors:
        raise RuntimeError(f"the background flood failed: {errors[0]}")
    if floods:
        counters = _delta(after.totals, before.totals)
        run = replace(run, flood=counts1, bg_rate=bg_rate, counters=counters)
    queues = tuple(n.queue_length for n in after.nodes)
    return FleetFlood(run, _delta(after.router, before.router), queues, seconds)


def background_limit(config: FleetConfig) -> float:
    """The largest queue occupancy placement lets background work fill (1.0: no shedding)."""
    shed = config.router.placement.shed
    return min((f for k, f in shed.items() if config.priorities[k] >= BACKGROUND), default=1.0)


def _pool_floods(runs: Sequence[FleetFlood]) -> FleetFlood:
    """One configuration's rounds as one: every foreground sample, the counts added, the
    worst disturbance."""
    fg = [f.run for f in runs]
    floods = [r.flood for r in fg if r.flood is not None]
    seconds = sum(f.seconds for f in runs)
    bg_done = sum(r.bg_rate * f.seconds for r, f in zip(fg, runs, strict=True))
    kinds = ("latencies_s", "service_s", "queue_s")
    samples = {k: tuple(x for r in fg for x in getattr(r, k)) for k in kinds}
    run = replace(
        fg[0],
        **samples,
        refused=sum(r.refused for r in fg),
        errors=sum(r.errors for r in fg),
        flood=Counts.total(floods) if floods else None,
        bg_rate=bg_done / seconds if floods else math.nan,
        counters=_added([r.counters for r in fg]),
    )
    foreign, attempts = max(f.foreign_cores for f in runs), sum(f.attempts for f in runs)
    router = _added([f.router for f in runs])
    return FleetFlood(run, router, runs[-1].queues, seconds, foreign, attempts)


def measure_flood(
    ctx: bc.RunContext, model: BenchModel, prio: FleetConfig, fifo: FleetConfig
) -> dict[str, FleetFlood]:
    """Foreground alone, under a flood from one caller, from ``FLOOD_CALLERS``, and from
    one with a second caller idle beside it, in interleaved rounds pooled; FIFO once."""
    feed = bc.slow_feed(model.width)
    n_fg, rounds, bg_limit = ctx.count(120, 8), ctx.count(3, 1), background_limit(prio)
    shapes = {"alone": (0, 0), "edgefleet": (1, 0), SPLIT: (FLOOD_CALLERS, 0), IDLE: (1, 1)}
    runs: dict[str, list[FleetFlood]] = {name: [] for name in shapes}
    with bc.deployed(prio) as client:
        bc.warm(lambda: client.submit(FLOOD_MODEL, feed), 5)
        for i in range(rounds):
            for name in bc.rotated(list(shapes), i):
                log(f"(c) round {i + 1}/{rounds}: {name}")
                flood = partial(_flooded, client, feed, n_fg, name, bg_limit, *shapes[name])
                runs[name].append(bc.kept(bc.calm(flood, f"(c) {name}", attempts=2)))
    out = {name: _pool_floods(r) for name, r in runs.items()}
    with bc.deployed(fifo) as client:
        bc.warm(lambda: client.submit(FLOOD_MODEL, feed), 5)
        log("(c) FIFO fleet under a background flood")  # long, with a wide margin: once
        flood = partial(_flooded, client, feed, ctx.count(10, 2), "FIFO", 1.0)
        out["FIFO"] = bc.kept(bc.calm(flood, "(c) FIFO", attempts=1))
    return out


def _flood_notes(f: dict[str, FleetFlood], bg_limit: float) -> list[str]:
    edge, split, idle, alone = f["edgefleet"].run, f[SPLIT].run, f[IDLE].run, f["alone"].run
    flooded = [x for k, x in f.items() if k != "alone"]
    seconds = max(f["edgefleet"].seconds, 1e-9)
    per_s = {k: f["edgefleet"].router.get(k, 0) / seconds for k in ("rejected", "completed")}
    slowest = sorted(zip(edge.latencies_s, edge.queue_s, edge.service_s, strict=True))[-3:]
    spent = "; ".join(
        f"{lat * 1000:.0f} ms = {q * 1000:.0f} + {s * 1000:.0f} + {(lat - q - s) * 1000:.0f}"
        for lat, q, s in reversed(slowest)
    )
    notes = [
        f"Foreground p99 over one caller's: the flood from {FLOOD_CALLERS} callers "
        f"{split.latency_ms.p99 / edge.latency_ms.p99:.2f}, from one with a second caller "
        f"idle {idle.latency_ms.p99 / edge.latency_ms.p99:.2f}; foreground engine time "
        f"(median) {split.service_ms:.1f} and {idle.service_ms:.1f} ms against "
        f"{edge.service_ms:.1f}.",
        "Fleet-wide placement counters over each flood (`shed`: refused by placement to "
        "keep headroom; `spilled`: a node refused and the caller tried elsewhere): "
        + "; ".join(f"{x.run.config}: {bc.pairs_text(x.router) or 'none'}" for x in flooded)
        + ".",
        "Node counters over each flood, added over the fleet: "
        + "; ".join(f"{x.run.config}: {bc.pairs_text(x.run.counters)}" for x in flooded)
        + f". Failed foreground requests: {sum(x.run.errors for x in f.values())}.",
        f"Refusal churn: on the edgefleet fleet callers were refused {per_s['rejected']:.0f} "
        f"background requests/s (while completing {per_s['completed']:.0f}/s): the flood "
        f"offers more than the {bg_limit:.0%} of each queue placement lets background work fill.",
        "Disturbance (CPU other processes used during the kept measurement; attempts): "
        + bc.disturbance({x.run.config: x for x in f.values()})
        + ". Alone and edgefleet: up to 2 attempts a round; FIFO: once.",
        "Where the edgefleet fleet's slowest foreground requests spent their time (end to "
        f"end = queued on the node + engine call + everything outside the node): {spent} ms.",
    ]
    if edge.service_ms > 1.2 * alone.service_ms:
        notes.append(
            f"A foreground call under the flood took {edge.service_ms:.1f} ms of engine "
            f"time against {alone.service_ms:.1f} ms alone: it preempts the background call "
            f"on its own node only, and {FLEET_NODES} engine threads share this machine's "
            "cores, so the call stretches."
        )
    return notes


FLOOD_LABELS = {
    "alone": "alone (edgefleet fleet, no flood)",
    "edgefleet": "edgefleet fleet under flood",
    SPLIT: f"edgefleet fleet, the flood from {FLOOD_CALLERS} callers",
    IDLE: "edgefleet fleet under flood, a second caller idle",
    "FIFO": "FIFO fleet under flood",
}


def _flood_part(f: dict[str, FleetFlood], model: BenchModel, bg_limit: float) -> Part:
    alone, edge, split, fifo = f["alone"].run, f["edgefleet"], f[SPLIT], f["FIFO"]
    rows = [
        [
            *x.run.row(FLOOD_LABELS[k]),
            "-" if x.run.flood is None else " / ".join(map(str, x.queues)),
        ]
        for k, x in f.items()
    ]
    table = bc.md_table([*pl.FOREGROUND_COLUMNS, "queues at end"], rows)
    edge_p99, fifo_p99 = edge.run.latency_ms.p99, fifo.run.latency_ms.p99
    callers = f"flood from {FLOOD_CALLERS} callers / from one"
    targets = [
        Target(f"(c) edgefleet fleet p99 / {pl.BOUND}", edge_p99 / alone.bound_ms, "<=", 1.0),
        Target("(c) FIFO fleet p99 / edgefleet fleet p99", fifo_p99 / edge_p99, ">=", 8.0, 1),
        Target(f"(c) fg p99, {callers}", split.run.latency_ms.p99 / edge_p99, "<=", 1.1),
        Target(f"(c) bg refusals, {callers}", split.refusals / max(1, edge.refusals), "<=", 1.1),
    ]
    measured = (
        f"{FLEET_NODES} nodes, each serving a {model.describe()}, batching off, queue "
        f"capacity {FLOOD_CAPACITY}; everything placed by the client. A background client "
        f"(a Ray actor of its own) keeps {FLEET_NODES * FLOOD_CAPACITY} background (priority "
        f"{BACKGROUND}) requests outstanding, a refused one sent again after its "
        f"`retry_after_s` hint (at most {FLOOD_MAX_RETRY_S:g} s). Foreground requests go one "
        "at a time, 100 ms apart, once every node's queue is full; latency is client end to "
        "end. Configurations: alone; edgefleet (priority order, preemption gap 5, the default "
        f"placement and shedding: background may fill {bg_limit:.0%} of a queue); the flood "
        f"split between {FLOOD_CALLERS} flood clients; the flood from one with a second "
        "client connected and idle (a control); FIFO (`order: fifo`, no shedding, placement "
        "round_robin). All but FIFO in interleaved rounds, pooled; FIFO once."
    )
    notes = [
        f"Bound used for the first target: 1.5 x {alone.latency_ms.p99:.1f} ms + "
        f"{alone.service_ms:.1f} ms (median service time alone) = {alone.bound_ms:.1f} ms.",
        *_flood_notes(f, bg_limit),
    ]
    title = "(c) Foreground p99 across the fleet under a background flood"
    return Part(title, measured, [table], targets, notes)


# ========================================================= (d) placement on one trace


def trace_workload(rate: float, count: int, seed: int = TRACE_SEED) -> Workload:
    """The placement trace: Poisson arrivals at ``rate``/s, ``CHEAP_SHARE`` of them
    cheap, priorities in ``PRIORITY_MIX``."""
    mix = [
        {"model": model, "priority": p, "weight": share * w}
        for model, share in ((CHEAP, CHEAP_SHARE), (DEAR, 1 - CHEAP_SHARE))
        for p, w in PRIORITY_MIX
    ]
    data = {"seed": seed, "requests": count, "arrivals": {"rate": rate}, "mix": mix}
    return parse_workload(data, source="the placement trace")


@dataclass(frozen=True)
class Replay(bc.OpenRun):
    """A policy's replays of the trace (pooled over rounds)."""

    policy: str = ""
    router: Mapping[str, int] = field(default_factory=dict)
    capacity: float = math.nan  # the default policy's closed-loop throughput on the mix
    rounds: tuple[Replay, ...] = ()
    stalled: int = 0  # replays run once more because the machine stalled

    @property
    def engine_p50_s(self) -> float:
        return bc.median([a.reply.service_s for a in self.ok()])

    def round_p99(self, priorities: Sequence[int] | None = None) -> float:
        """The median over the rounds of each round's p99."""
        return bc.median([r.latency_ms(priorities).p99 for r in self.rounds or (self,)])


def trace_config(name: str, models: Mapping[str, BenchModel], policy: str) -> FleetConfig:
    entries = [bc.ModelEntry(n, m.path) for n, m in models.items()]
    router = {"placement": {"policy": policy, "seed": TRACE_SEED}}  # default shedding
    return bc.fleet_config(
        name, entries, capacity=FLOOD_CAPACITY, node_list=TRACE_NODES, router=router
    )


def warm_nodes(client: FleetClient, feeds: Mapping[str, Feed], calls: int) -> None:
    """``calls`` requests per model on every node, straight to the actors, all at once:
    warms sessions and the per-row costs placement reads."""
    pairs = [(s.name, m) for s in client.config.node_specs() for m in s.models] * calls
    ray.get([bc.node_submit(client, n, m, feeds[m]) for n, m in pairs], timeout=GET_TIMEOUT_S)


def measure_capacity(client: FleetClient, feeds: Mapping[str, Feed], seconds: float) -> bc.Loop:
    """The fleet's throughput, placed by the client, at saturation on the trace's model
    mix (all at foreground priority, so nothing is shed)."""
    rng = random.Random(TRACE_SEED + 1)

    def submit() -> Any:
        model = CHEAP if rng.random() < CHEAP_SHARE else DEAR
        return client.submit(model, feeds[model])

    in_flight = CAPACITY_IN_FLIGHT_PER_NODE * len(client.config.node_specs())
    return bc.closed_loop([submit], in_flight, seconds)


def settle(client: FleetClient, timeout_s: float = GET_TIMEOUT_S) -> None:
    """Wait until every node is idle with nothing left in its busy window and ``client``
    holds those reports: each replay starts from the same idle fleet."""
    end = time.perf_counter() + timeout_s
    while any(n.queue_length or n.running or n.busy for n in client.status(GET_TIMEOUT_S).nodes):
        if time.perf_counter() > end:
            raise TimeoutError("the fleet did not go idle between replays")
        time.sleep(0.05)


def _replay(
    client: FleetClient, policy: str, arrivals: list[Arrival], feeds: Mapping[str, Feed]
) -> Replay:
    settle(client)

    def one() -> Replay:
        before = client.counters()  # this caller's: the replay's own
        run = bc.open_loop(client, arrivals, feeds)
        fields = {k: getattr(run, k) for k in bc.OpenRun.__dataclass_fields__}
        return Replay(**fields, policy=policy, router=_delta(client.counters(), before))

    return bc.kept(bc.calm(one, f"(d) {policy}", attempts=2))


def measure_placement(
    ctx: bc.RunContext, models: Mapping[str, BenchModel]
) -> tuple[list[Arrival], list[Replay]]:
    """Replay one trace under every policy on one fleet, in interleaved rounds, each
    policy from a caller of its own (``FleetClient.with_placement``); the default
    policy's capacity on the trace's mix sets the rate for all."""
    feeds = {n: bc.slow_feed(m.width) for n, m in models.items()}
    rounds = ctx.count(9, 1)
    pooled: dict[str, list[Replay]] = {p: [] for p in POLICIES}
    with bc.deployed(trace_config("bench-trace", models, DEFAULT_POLICY)) as base:
        warm_nodes(base, feeds, 10)
        cap = measure_capacity(base, feeds, ctx.pick(1.5, 0.8))
        workload = trace_workload(LOAD * cap.rate, ctx.count(600, 160))
        rng = random.Random(workload.seed)
        arrivals = list(workload.arrivals(rng, nodes=len(TRACE_NODES)))
        log(f"  (d) capacity {cap.rate:.0f}/s; {len(arrivals)} requests, {rounds} round(s)")
        callers = {p: base.with_placement(policy=p, seed=TRACE_SEED) for p in POLICIES}
        try:
            for i in range(rounds):
                for policy in bc.rotated(POLICIES, i):
                    r = _replay(callers[policy], policy, arrivals, feeds)
                    usual = bc.median([x.engine_p50_s for runs in pooled.values() for x in runs])
                    if i and r.engine_p50_s > STALL_RATIO * usual:
                        log(f"  (d) {policy}: the machine stalled, once more")
                        r = replace(_replay(callers[policy], policy, arrivals, feeds), stalled=1)
                    pooled[policy].append(r)
                    log(f"  (d) round {i + 1} {policy}: fg p99 {r.latency_ms([10]).p99:.1f} ms")
        finally:
            for caller in callers.values():
                caller.close()
    replays = []
    for policy, runs in pooled.items():
        router, stalled = _added([r.router for r in runs]), sum(r.stalled for r in runs)
        more = {"router": router, "capacity": cap.rate, "rounds": tuple(runs), "stalled": stalled}
        replays.append(Replay.pooled(runs, policy=policy, **more))
    return arrivals, replays


def _placement_tables(replays: list[Replay]) -> list[str]:
    nodes = [str(n["name"]) for n in TRACE_NODES]
    rows, share_rows = [], []
    for r in replays:
        fg, every, ok = r.latency_ms([10]), r.latency_ms(), r.ok()
        done, rejected, evicted = r.count(None), r.count("Rejected"), r.count("Evicted")
        other = len(r.answers) - done - rejected - evicted + r.lost
        rows.append(
            [r.policy, fmt(fg.p50), fmt(fg.p99), *(fmt(r.latency_ms([p]).p99) for p in (7, 3, 0))]
            + [fmt(every.p50), fmt(every.p99), done, rejected, evicted, other, fmt(r.capacity, 0)]
        )
        by = {m: Counter(a.reply.node for a in ok if a.arrival.model == m) for m in (CHEAP, DEAR)}
        share = [
            f"{(by[CHEAP][n] + by[DEAR][n]) / max(1, len(ok)) * 100:.0f}% "
            f"({by[CHEAP][n]} / {by[DEAR][n]})"
            for n in nodes
        ]
        share_rows.append([r.policy, *share, bc.pairs_text(r.router)])
    headers = "policy | fg p50 ms | fg p99 ms | prio 7 p99 ms | prio 3 p99 ms | prio 0 p99 ms | "
    headers += "all p50 ms | all p99 ms | completed | rejected | evicted | other / lost | "
    headers += "capacity req/s"
    share_headers = ["policy", *(f"{n} share (cheap / dear)" for n in nodes), "placement counters"]
    return [bc.md_table(bc.columns(headers), rows), bc.md_table(share_headers, share_rows)]


def _placement_part(
    replays: list[Replay], arrivals: list[Arrival], models: Mapping[str, BenchModel]
) -> Part:
    by = {r.policy: r for r in replays}
    default = by[DEFAULT_POLICY]
    pairs = [(label, prios, other) for label, prios in (("fg p99", [10]), ("all p99", None))
             for other in ("round_robin", "power_of_two")]  # fmt: skip
    pooled = [
        default.latency_ms(prios).p99 / by[other].latency_ms(prios).p99 for _, prios, other in pairs
    ]
    targets = [
        Target(f"(d) {DEFAULT_POLICY} {label} / {other} {label} (all rounds pooled)", x, "<=", 1.0)
        for (label, _, other), x in zip(pairs, pooled, strict=True)
    ]
    per_round = "; ".join(
        f"{label} / {other} {default.round_p99(prios) / by[other].round_p99(prios):.2f}"
        for label, prios, other in pairs
    )
    rounds, n_fg = len(default.rounds) or 1, sum(1 for a in arrivals if a.priority == 10)
    mix = " / ".join(f"{p}" for p, _ in PRIORITY_MIX)
    shares = " / ".join(f"{w:.0%}" for _, w in PRIORITY_MIX)
    measured = (
        f"4 nodes: {CHEAP_NODE} serves only {CHEAP} ({models[CHEAP].describe()}); "
        f"edge-1..3 serve {CHEAP} and {DEAR} ({models[DEAR].describe()}); queue capacity "
        f"{FLOOD_CAPACITY}, priority order, the default shedding. One seeded trace from "
        f"`sim.workload` (seed {TRACE_SEED}) of {len(arrivals)} requests: Poisson arrivals, "
        f"{CHEAP_SHARE:.0%} {CHEAP} / {1 - CHEAP_SHARE:.0%} {DEAR}, priorities {mix} in "
        f"proportions {shares} ({n_fg} foreground requests). One fleet for every policy of "
        "the registry: 10 calls per model per node straight to the actors, then a closed "
        f"loop placed by the default policy at saturation ({CAPACITY_IN_FLIGHT_PER_NODE} in "
        "flight per node, all foreground; the capacity column). Each policy then places from "
        f"a caller of its own (`FleetClient.with_placement`); in each of {rounds} round(s) "
        "every policy replays the trace open loop (`cluster.traffic.OpenLoop`) once, the "
        f"order rotating, after the fleet is idle. The rate is {LOAD:.0%} of that capacity: "
        f"{arrivals[-1].at:.1f} s of arrivals per replay. Latency is client end to end; "
        "nothing refused is retried."
    )
    disturbed = "; ".join(
        f"{r.policy} {r.foreign_cores:.2f} cores, {r.attempts}, {r.max_lag_s * 1000:.0f} ms"
        for r in replays
    )
    stalled = ", ".join(f"{r.policy} {r.stalled}" for r in replays)
    notes = [
        f"Share = the node's share of completed requests; in brackets the completed {CHEAP} "
        f"/ {DEAR} requests it served. Placement counters: the replaying caller's own.",
        f"Reading p99 of the foreground: the pooled replays hold {n_fg * rounds} foreground "
        f"requests per policy. The same ratios as medians over the rounds of each round's "
        f"own p99: {per_round}.",
        "Disturbance (CPU other processes used during the kept replay; attempts; worst "
        f"submit lag behind the trace): {disturbed}. Replays run again because the machine "
        f"stalled (median engine call over {STALL_RATIO:g}x the run's): {stalled}.",
    ]
    title = "(d) Placement policies on one trace"
    return Part(title, measured, _placement_tables(replays), targets, notes)


# ================================================= (e) what placement costs per request


def measure_routing_cost(
    client: FleetClient, feed: Feed, seconds: float, count: int
) -> list[Round]:
    """Closed loops at saturation, in rounds: all nodes straight to their actors, and as
    many in flight placed by the client, read on the loop's thread (``map_unordered``)
    and as futures (``submit``)."""
    nodes = bc.node_names(client)
    in_flight = COST_IN_FLIGHT_PER_NODE * len(nodes)
    direct = [partial(bc.node_submit, client, n, COST_MODEL, feed) for n in nodes]
    loops: dict[str, Callable[[float], bc.Loop]] = {
        "direct": partial(bc.closed_loop, direct, COST_IN_FLIGHT_PER_NODE),
        "pipelined": partial(bc.pipelined_loop, client, COST_MODEL, feed, in_flight),
        "futures": partial(bc.closed_loop, [lambda: client.submit(COST_MODEL, feed)], in_flight),
    }
    return bc.rounds("(e)", loops, seconds, count, warm_s=seconds / 2, attempts=2)


def _cpu_over(path: str, base: str) -> Callable[[Round], float]:
    return lambda r: r[path].cpu_ms - r[base].cpu_ms


def _rate_over(path: str, base: str) -> Callable[[Round], float]:
    return lambda r: r[path].rate / r[base].rate


def _cost_part(runs: list[Round], seconds: float) -> Part:
    def figures(f: Callable[[Round], float], digits: int) -> list[object]:
        return [fmt(med(runs, f), digits), each(runs, f, digits)]

    def loop_row(label: str, path: str) -> list[object]:
        rate, cpu = (lambda r: r[path].rate), (lambda r: r[path].cpu_ms)
        return [label, *figures(rate, 0), *figures(cpu, 3)]

    rows = [loop_row("all nodes straight to their actors", "direct")]
    for label, path in (("`map_unordered`", "pipelined"), ("`submit`", "futures")):
        x = _cpu_over(path, "direct")
        rows += [
            loop_row(f"placed by the client ({label})", path),
            ["**placed - direct**", "-", "-", fmt(med(runs, x), 3, signed=True), each(runs, x, 3)],
            ["**placed / direct** (throughput)", *figures(_rate_over(path, "direct"), 2), "-", "-"],
        ]
    header = "path | requests/s (median) | per round | CPU ms / request | per round"
    measured = (
        f"{COST_NODES} nodes serving the generated `classifier` (a tiny CNN, batching off), "
        f"closed loops of {seconds:g} s at saturation: {COST_IN_FLIGHT_PER_NODE} requests in "
        "flight per node straight to each node actor (`ray.wait` on the loop's thread), and "
        "as many placed by the client, two ways: `FleetClient.map_unordered` (answers read "
        "on the caller's thread, as the direct loop does) and `FleetClient.submit` (futures "
        f"Ray's thread completes). {len(runs)} round(s), the order rotating. CPU: every "
        "process of this benchmark, per completed request. The targets are on "
        "`map_unordered`."
    )
    note = (
        "What `submit`'s futures cost beyond `map_unordered` per request: "
        f"{med(runs, _cpu_over('futures', 'pipelined')):+.3f} ms of CPU, throughput "
        f"{med(runs, _rate_over('futures', 'pipelined')):.2f}x."
    )
    cpu = med(runs, _cpu_over("pipelined", "direct"))
    rate = med(runs, _rate_over("pipelined", "direct"))
    targets = [
        Target("(e) placed - direct CPU per request, ms", cpu, "<=", 0.25),
        Target("(e) placed / direct throughput", rate, ">=", 0.9),
    ]
    table = bc.md_table(bc.columns(header), rows)
    return Part("(e) What placement costs per request", measured, [table], targets, [note])


# ======================================================================== the scenario


def _parts_ab(ctx: bc.RunContext, m5: BenchModel, m1: BenchModel) -> list[bc.Section]:
    """(a) and (b): one 3-node fleet serving the 5 ms and the 1 ms model."""
    entries = [bc.ModelEntry(SAT_MODEL, m5.path), bc.ModelEntry(LAT_MODEL, m1.path)]
    config = bc.fleet_config("bench-fleet", entries, nodes=FLEET_NODES, router={})  # defaults
    with bc.deployed(config) as client:
        nodes = bc.node_names(client)
        log("(a) fleet throughput at saturation")
        feed5, feed1 = bc.slow_feed(m5.width), bc.slow_feed(m1.width)
        a = bc.timed(lambda: _scaling_part(measure_scaling(ctx, client, feed5), nodes, m5))
        log("(b) latency placement adds, sequential requests")
        bc.warm(lambda: client.submit(LAT_MODEL, feed1), 20)
        bc.warm(lambda: bc.node_submit(client, nodes[0], LAT_MODEL, feed1), 20)
        measure = partial(measure_latency, client, feed1, ctx.count(300, 60))
        b = bc.timed(lambda: _latency_part(bc.calm(measure, "(b) latency"), m1))
    return [a, b]


def _part_c(ctx: bc.RunContext, m20: BenchModel) -> bc.Section:
    entries = [bc.ModelEntry(FLOOD_MODEL, m20.path)]
    flood = {"capacity": FLOOD_CAPACITY, "nodes": FLEET_NODES}
    prio = bc.fleet_config("bench-fleet-prio", entries, router={}, **flood)
    fifo_router = {"placement": {"policy": "round_robin", "shed": {}}}
    fifo = bc.fleet_config("bench-fleet-fifo", entries, order="fifo", router=fifo_router, **flood)
    return _flood_part(measure_flood(ctx, m20, prio, fifo), m20, background_limit(prio))


def _part_e(ctx: bc.RunContext) -> bc.Section:
    classifier = make_classifier(ctx.models.directory / "classifier.onnx")
    entries = [bc.ModelEntry(COST_MODEL, classifier)]
    with bc.deployed(bc.fleet_config("bench-cost", entries, nodes=COST_NODES, router={})) as c:
        log("(e) what placement costs per request, tiny model at saturation")
        seconds = ctx.pick(2.0, 0.8)
        runs = measure_routing_cost(c, random_inputs(COST_MODEL), seconds, ctx.count(16, 1))
        return _cost_part(runs, seconds)


def run(ctx: bc.RunContext) -> bc.Section:
    costs = (SAT_COST_MS, LAT_COST_MS, FLOOD_COST_MS, CHEAP_COST_MS, DEAR_COST_MS)
    m5, m1, m20, m2, m10 = (ctx.models.calibrated(ms) for ms in costs)
    models = {CHEAP: m2, DEAR: m10}

    def part_d() -> bc.Section:
        arrivals, replays = measure_placement(ctx, models)
        return _placement_part(replays, arrivals, models)

    parts = _parts_ab(ctx, m5, m1)
    parts += [bc.timed(lambda: _part_c(ctx, m20)), bc.timed(part_d), bc.timed(lambda: _part_e(ctx))]
    measured = (
        "The fleet as clients see it: requests placed by the client (`FleetClient.submit`; "
        "in (e) also `FleetClient.map_unordered`) compared, in the same run, with requests "
        "sent straight to the node actors. Five parts, each with its own fleet(s) on the "
        "one embedded Ray; every ratio is of measurements taken side by side."
    )
    return bc.Section(TITLE, measured, parts=parts)
