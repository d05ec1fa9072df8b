"""(c) Foreground latency on one node while a background flood keeps it saturated, and
(c2) the same on a batching model, with starvation bounds. Every request goes straight
to the node actor: these measure the node's scheduler (``bench.fleet``: behind placement)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

from bench import common as bc
from bench.common import GET_TIMEOUT_S, Feed, Section, Summary, Target, calm, fmt, kept, log, warm
from cluster.client import FleetClient
from cluster.traffic import Answer, Backoff, Client, ClosedLoop, Counts, in_background

TITLE = "Foreground latency under a background flood (c)"
MODEL = "slow20"
TARGET_COST_MS = 20.0
CAPACITY = 64
FOREGROUND, BACKGROUND, OFFLINE = 10, 3, 0
GAP_S = 0.1  # pause between foreground requests
MAX_RETRY_S = 0.05  # cap on a refused request's back-off
# A flood's refused request waits its hint (2 ms to MAX_RETRY_S), an evicted or failed one 5 ms.
FLOOD_BACKOFF = Backoff(min_retry_s=0.002, max_retry_s=MAX_RETRY_S, error_pause_s=0.005)
TARGET_BOUND_RATIO = 1.0  # edgefleet p99 / (1.5 x alone p99 + one service time)
TARGET_FIFO_RATIO = 8.0  # FIFO p99 / edgefleet p99
BOUND = "(1.5 x alone p99 + one service time)"
REFERENCE = "FIFO 1420 ms vs 161 ms with the scheduler (isolated ~140 ms)"
NAN = float("nan")


@dataclass(frozen=True)
class ForegroundRun:
    """The foreground requests of one configuration (``bench.fleet`` pools them too)."""

    config: str
    latencies_s: tuple[float, ...]
    service_s: tuple[float, ...]
    queue_s: tuple[float, ...]
    refused: int  # foreground attempts refused (retried)
    errors: int  # foreground requests that failed for another reason
    flood: Counts | None = None
    bg_rate: float = NAN  # background completions/s while the foreground ran
    counters: dict[str, int] = field(default_factory=dict)
    foreign_cores: float = 0.0  # CPU other processes used meanwhile
    attempts: int = 1
    batch_sizes: tuple[int, ...] = ()  # of the foreground requests' calls
    bg_window: Counts | None = None  # the background flood while the foreground ran
    offline: Counts | None = None  # the offline flood, while the foreground ran
    offline_wait_s: tuple[float, ...] = ()  # queue waits of offline requests completed then
    offline_share: float = NAN  # their share of the engine time of completed work

    @property
    def latency_ms(self) -> Summary:
        return Summary.of([x * 1000 for x in self.latencies_s])

    @property
    def service_ms(self) -> float:
        return bc.median(self.service_s) * 1000

    @property
    def bound_ms(self) -> float:
        """1.5 x this (alone) run's p99 + its median service time."""
        return 1.5 * self.latency_ms.p99 + self.service_ms

    def row(self, label: str) -> list[object]:
        """The run's line of a table with the :data:`FOREGROUND_COLUMNS`."""
        lat, flood, queue_ms = self.latency_ms, self.flood, bc.median(self.queue_s) * 1000
        cells = [label, lat.n, *(fmt(x) for x in (lat.p50, lat.p99, lat.max, queue_ms))]
        cells += [fmt(self.service_ms), self.refused]
        if flood is None:
            return [*cells, "-", "-", "-"]
        preempted = self.counters.get("preempted", 0)
        return [*cells, fmt(self.bg_rate), preempted, f"{flood.rejected} / {flood.evicted}"]


FOREGROUND_COLUMNS = ["configuration", "fg requests", "p50 ms", "p99 ms", "max ms"]
FOREGROUND_COLUMNS += ["fg queue p50 ms", "fg service p50 ms", "fg refused", "bg done/s"]
FOREGROUND_COLUMNS += ["bg preempted", "bg rejected / evicted"]


def foreground(
    route: Client, feed: Feed, count: int, label: str, *, model: str = MODEL
) -> ForegroundRun:
    """``count`` foreground requests one at a time, ``GAP_S`` apart (a closed loop of
    one lane); a refused one is sent again after its hint for up to ``GET_TIMEOUT_S``.
    Latency runs from the first attempt to the reply, retries included."""
    answers: list[Answer] = []
    backoff = Backoff(min_retry_s=0.001, max_retry_s=MAX_RETRY_S, error_pause_s=GAP_S)
    timeouts = {"give_up_s": GET_TIMEOUT_S, "reply_timeout_s": GET_TIMEOUT_S}
    kw = {"requests": count, "think_s": GAP_S, "backoff": backoff, **timeouts}
    lane = ClosedLoop(
        route, model, feed, lanes=1, priority=FOREGROUND, on_answer=answers.append, **kw
    )
    asyncio.run(lane.run())
    final = [a for a in answers if a.final]
    ok = [a for a in final if a.reply.error is None]
    log(f"  {label}: {len(final)} foreground requests")
    times = [tuple(a.total_s for a in ok), tuple(a.reply.service_s for a in ok)]
    times += [tuple(a.reply.queue_s for a in ok)]
    sizes = tuple(a.reply.batch_size for a in ok)
    refused, errors = len(answers) - len(final), len(final) - len(ok)
    return ForegroundRun(label, *times, refused, errors, batch_sizes=sizes)


def flooded(
    route: bc.NodeRoute,
    feed: Feed,
    count: int,
    label: str,
    *,
    model: str = MODEL,
    outstanding: int = CAPACITY,
    running: int = 1,
    offline: int = 0,
) -> ForegroundRun:
    """Foreground requests while ``outstanding`` background requests (and ``offline``
    offline ones) stay outstanding; ``running`` is how many the node runs at once."""
    client, waits = route.client, []  # queue waits of completed offline requests
    before = client.status(GET_TIMEOUT_S).totals
    kw: dict[str, Any] = {"backoff": FLOOD_BACKOFF}
    flood = ClosedLoop(route, model, feed, lanes=outstanding, priority=BACKGROUND, **kw)
    kw["on_answer"] = lambda a: waits.append(a.reply.queue_s) if a.reply.error is None else None
    low = ClosedLoop(route, model, feed, lanes=offline, priority=OFFLINE, **kw) if offline else None
    with contextlib.ExitStack() as stack:  # leaving it stops the floods, or raises their failure
        stack.enter_context(in_background(flood, GET_TIMEOUT_S, name="bench-flood"))
        want, deadline = outstanding - running - 1, time.perf_counter() + 15.0
        while (queued := client.status(GET_TIMEOUT_S).node(route.node).queue_length) < want:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the flood filled the queue to {queued} only, wanted {want}")
            time.sleep(0.05)
        if low is not None:
            stack.enter_context(in_background(low, GET_TIMEOUT_S, name="bench-flood-offline"))
        log(f"  {label}: flood running, {queued} queued")
        bg0, low0 = flood.counts.copy(), low.counts.copy() if low is not None else Counts()
        waits0, t0 = len(waits), time.perf_counter()
        fg = foreground(route, feed, count, label, model=model)
        bg_rate = (flood.counts.completed - bg0.completed) / (time.perf_counter() - t0)
        snapshot = client.status(GET_TIMEOUT_S)  # before the flood's leftovers are cancelled
        bg, off = flood.counts.minus(bg0), low.counts.minus(low0) if low is not None else None
        offline_waits = tuple(waits[waits0:])
    counters = {k: v - before.get(k, 0) for k, v in snapshot.totals.items()}
    counters["queue_at_end"] = snapshot.node(route.node).queue_length
    share = NAN
    if off is not None:
        fg_engine = sum(s / max(1, b) for s, b in zip(fg.service_s, fg.batch_sizes, strict=True))
        total = bg.engine_s + off.engine_s + fg_engine
        share = off.engine_s / total if total > 0 else NAN
    got = {"flood": flood.counts, "bg_window": bg, "bg_rate": bg_rate, "counters": counters}
    return replace(fg, **got, offline=off, offline_wait_s=offline_waits, offline_share=share)


def run(ctx: bc.RunContext) -> Section:
    model = ctx.models.calibrated(TARGET_COST_MS)
    feed, entries = bc.slow_feed(model.width), [bc.ModelEntry(MODEL, model.path)]
    n_fg, n_fifo = ctx.count(40, 10), ctx.count(40, 5)
    runs: dict[str, ForegroundRun] = {}
    for order in ("priority", "fifo"):
        config = bc.fleet_config(f"bench-{order[:4]}", entries, capacity=CAPACITY, order=order)
        with bc.deployed(config) as client:
            route = bc.only_node(client)
            warm(lambda r=route: r.submit(MODEL, feed), 5)
            if order == "fifo":
                log("priority latency: FIFO under flood")  # long, with a wide margin: once
                fifo = calm(lambda r=route: flooded(r, feed, n_fifo, "FIFO"), "FIFO", attempts=1)
                runs["FIFO"] = kept(fifo)
                continue
            log("priority latency: alone")
            runs["alone"] = kept(calm(lambda r=route: foreground(r, feed, n_fg, "alone"), "alone"))
            log("priority latency: edgefleet (priority order, preemption gap 5) under flood")
            edge = calm(lambda r=route: flooded(r, feed, n_fg, "edgefleet"), "edgefleet")
            runs["edgefleet"] = kept(edge)
    alone, edge, fifo = runs["alone"], runs["edgefleet"], runs["FIFO"]
    edge_p99, fifo_p99 = edge.latency_ms.p99, fifo.latency_ms.p99
    targets = [
        Target(f"edgefleet p99 / {BOUND}", edge_p99 / alone.bound_ms, "<=", TARGET_BOUND_RATIO),
        Target("FIFO p99 / edgefleet p99", fifo_p99 / edge_p99, ">=", TARGET_FIFO_RATIO, 1),
    ]
    measured = (
        f"One node serving a {model.describe()}, batching off, queue capacity {CAPACITY}: "
        "alone (foreground only), edgefleet (priority order, preemption gap 5) and FIFO "
        f"(`node_defaults.order: fifo`). The flood keeps {CAPACITY} background (priority "
        f"{BACKGROUND}) requests outstanding: the node runs one and queues {CAPACITY - 1}, a "
        f"slot left for the foreground (priority {FOREGROUND}), sent one at a time "
        f"{GAP_S * 1000:.0f} ms apart straight to the node actor; latency is client end to "
        "end, retries included."
    )
    counters = "; ".join(f"{r.config}: {bc.pairs_text(r.counters)}" for r in (edge, fifo))
    notes = [
        f"Bound used for the first target: 1.5 x {alone.latency_ms.p99:.1f} ms + "
        f"{alone.service_ms:.1f} ms (median service time alone) = {alone.bound_ms:.1f} ms.",
        f"Reference numbers from the LLM seed: {REFERENCE}.",
        "bg preempted counts background calls aborted for a foreground arrival.",
        f"Node counters over each flood: {counters}. Failed foreground requests: "
        f"{sum(r.errors for r in runs.values())}.",
        "Disturbance (CPU other processes used during the kept measurement; attempts): "
        f"{bc.disturbance(runs)}; one disturbed by over 0.2 cores is taken again (FIFO: once).",
    ]
    if alone.service_ms > 1.1 * edge.service_ms:
        notes.append(
            f"A foreground call alone took {alone.service_ms:.1f} ms of engine time against "
            f"{edge.service_ms:.1f} ms under the flood (an engine idle between calls runs "
            "cold): that inflates the first target's bound."
        )
    if alone.latency_ms.p99 > 2 * alone.latency_ms.p50:
        notes.append("Caution: the alone p99 is more than twice its p50: outliers set it.")
    table = bc.md_table(FOREGROUND_COLUMNS, [r.row(r.config) for r in runs.values()])
    return Section(TITLE, measured, [table], targets, notes)


# ------------------------------------------------- (c2) batching model, starvation bounds

BATCHING_TITLE = "Foreground under a flood on a batching model; starvation bounds (c2)"
LINEAR_WIDTH = 256
WINDOW_MS = 5.0
MAX_BATCH = 4
OFFLINE_SHARE = 0.05
OFFLINE_MAX_WAIT_MS = 2000.0
OFFLINE_OUTSTANDING = 4
TARGET_P50_RATIO = 1.3  # flooded p50 / alone p50
TARGET_SHARE = 0.04  # offline share of engine time with a 5 % share configured
TARGET_BG_RATIO = 0.95  # background throughput with batching on / off (a few % of noise)
OLD_RULES = {"lower_priority_cost_bound": 1000.0, "adaptive_window": False}
VARIANTS = {  # entry -> (label, model entry keys)
    "lin_off": ("batching off", {"window_ms": 0.0, "max_batch_size": 1}),
    "lin_on": ("batching on (defaults)", {}),
    "lin_forced": ("batching forced (`only_if_faster: false`)", {"only_if_faster": False}),
    "lin_old": (
        "batching forced, previous rules (no cost bound, fixed window)",
        {"only_if_faster": False, "batching": OLD_RULES},
    ),
}
STARVATION = {
    "classes": {"offline": {"min_share": OFFLINE_SHARE, "max_wait_ms": OFFLINE_MAX_WAIT_MS}}
}
BATCH_COLUMNS = "configuration | batch limit | alone p50 ms | alone p99 ms | flood p50 ms | "
BATCH_COLUMNS += "flood p99 ms | p50 / alone | p99 / bound | largest fg batch | bg done/s | "
BATCH_COLUMNS += "bg mean batch | bg preempted"
STARVATION_COLUMNS = "configuration | fg alone p50 ms | fg flood p50 ms | fg flood p99 ms | "
STARVATION_COLUMNS += "p50 / alone | p99 / bound | bg done/s | offline done | offline engine "
STARVATION_COLUMNS += "share | offline wait p50 ms | offline wait p99 ms | offline wait max ms"


@dataclass(frozen=True)
class VariantRun:
    name: str
    label: str
    batch_limit: int
    alone: ForegroundRun
    flooded: ForegroundRun

    def cells(self) -> list[object]:
        """p50 alone, p50 and p99 flooded, p50 / alone, p99 / bound (for each table)."""
        a, f = self.alone.latency_ms, self.flooded.latency_ms
        return [fmt(f.p50), fmt(f.p99), fmt(f.p50 / a.p50, 2), fmt(f.p99 / self.alone.bound_ms, 2)]


def _variant(
    client: FleetClient, feed: Feed, name: str, counts: tuple[int, int], offline: int = 0
) -> VariantRun:
    """Foreground alone, then under the flood (``counts``: requests of each)."""
    route = bc.only_node(client)
    limit = {m.name: m.batch_limit for m in client.status(GET_TIMEOUT_S).nodes[0].models}[name]
    warm(lambda: route.submit(name, feed), 5)
    label = name + (" + offline" if offline else "")
    log(f"priority batching: {label} alone")
    alone = calm(lambda: foreground(route, feed, counts[0], f"{label} alone", model=name), label)
    log(f"priority batching: {label} under flood (batch limit {limit})")
    outstanding = CAPACITY - (OFFLINE_OUTSTANDING + 2 if offline else 0)
    kw = {"model": name, "outstanding": outstanding, "running": limit, "offline": offline}
    measure = lambda: flooded(route, feed, counts[1], f"{label} flood", **kw)  # noqa: E731
    flood = calm(measure, f"{label} flood", attempts=2)
    return VariantRun(name, VARIANTS[name][0], limit, kept(alone), kept(flood))


def run_batching(ctx: bc.RunContext) -> Section:
    model = ctx.models.linear(TARGET_COST_MS, width=LINEAR_WIDTH)
    feed = bc.slow_feed(LINEAR_WIDTH)
    # Back-to-back calls in-process: steadier than the node's three-call warm-up figures.
    hot = {n: bc.linear_call_ms(model.path, LINEAR_WIDTH, rows=n) for n in (1, 2, 4)}
    n_fg, starve = ctx.count(40, 10), (ctx.count(40, 10), ctx.count(120, 20))
    keys: dict[str, Any] = {"window_ms": WINDOW_MS, "max_batch_size": MAX_BATCH}
    entries = [bc.ModelEntry(v, model.path, **keys | more) for v, (_, more) in VARIANTS.items()]
    with bc.deployed(bc.fleet_config("bench-prio-batch", entries, capacity=CAPACITY)) as client:
        status = client.status(GET_TIMEOUT_S)
        costs = {v: bc.node_costs_ms(status, v) for v in VARIANTS}
        runs = {v: _variant(client, feed, v, (n_fg, n_fg)) for v in VARIANTS}
        runs["strict"] = _variant(client, feed, "lin_on", starve, OFFLINE_OUTSTANDING)
    config = bc.fleet_config(
        "bench-starvation", entries[1:2], capacity=CAPACITY, starvation=STARVATION
    )
    with bc.deployed(config) as client:
        runs["starved"] = _variant(client, feed, "lin_on", starve, OFFLINE_OUTSTANDING)
    return _batching_report(model, hot, costs, runs)


def _batching_tables(runs: dict[str, VariantRun]) -> list[str]:
    rows, starvation = [], []
    for r in list(runs.values())[:4]:
        bg, a = r.flooded.bg_window, r.alone.latency_ms
        mean_batch = fmt(bg.completed / bg.calls, 2) if bg is not None and bg.calls else "-"
        largest = fmt(max(r.flooded.batch_sizes, default=0), 0)
        rows.append(
            [r.label, r.batch_limit, fmt(a.p50), fmt(a.p99), *r.cells(), largest]
            + [fmt(r.flooded.bg_rate), mean_batch, r.flooded.counters.get("preempted", 0)]
        )
    for label, r in (
        ("strict priority (no bounds)", runs["strict"]),
        ("offline share 5 %", runs["starved"]),
    ):
        waits = Summary.of([w * 1000 for w in r.flooded.offline_wait_s])
        done = r.flooded.offline.completed if r.flooded.offline else 0
        starvation.append(
            [label, fmt(r.alone.latency_ms.p50), *r.cells(), fmt(r.flooded.bg_rate), done]
            + [f"{r.flooded.offline_share * 100:.1f}%"]
            + [fmt(x, 0) for x in (waits.p50, waits.p99, waits.max)]
        )
    return [
        bc.md_table(bc.columns(BATCH_COLUMNS), rows),
        bc.md_table(bc.columns(STARVATION_COLUMNS), starvation),
    ]


def _batching_report(
    model: bc.BenchModel, hot: dict[int, float], costs: dict[str, Any], runs: dict[str, VariantRun]
) -> Section:
    off = runs["lin_off"].flooded.bg_rate

    def latency(name: str, r: VariantRun) -> list[Target]:
        a, f, bound = r.alone.latency_ms, r.flooded.latency_ms, r.alone.bound_ms
        return [
            Target(f"{name} flood p50 / alone p50", f.p50 / a.p50, "<=", TARGET_P50_RATIO),
            Target(f"{name} flood p99 / {BOUND}", f.p99 / bound, "<=", TARGET_BOUND_RATIO),
        ]

    label = "batch 4 / batch 1 cost, in-process back to back (near-linear model)"
    targets = [Target(label, hot[4] / hot[1], ">=", 3.5)]
    for r in (runs["lin_on"], runs["lin_forced"]):
        targets += latency(f"{r.label}:", r)
        label = f"{r.label}: bg done/s / batching off"
        targets.append(Target(label, r.flooded.bg_rate / off, ">=", TARGET_BG_RATIO))
    starved = runs["starved"].flooded
    wait = f"starvation: offline wait p99, ms (max_wait_ms {OFFLINE_MAX_WAIT_MS:g})"
    waits = Summary.of([w * 1000 for w in starved.offline_wait_s])
    targets += [
        Target(
            "starvation: offline share of engine time", starved.offline_share, ">=", TARGET_SHARE
        ),
        Target(wait, waits.p99, "<=", OFFLINE_MAX_WAIT_MS, 0),
        *latency("starvation: fg", runs["starved"]),
    ]

    def table(costs: dict[int, float], unit: str = "") -> str:
        return ", ".join(f"{n}{unit} {ms:.1f}" for n, ms in sorted(costs.items()))

    measured = (
        f"One node serving a {model.describe()}, under four entries of that file differing "
        f"only in batching (window {WINDOW_MS:g} ms, max batch {MAX_BATCH} where on), queue "
        f"capacity {CAPACITY}, priority order, preemption gap 5; the node's warm-up costs: "
        f"{table(costs['lin_forced'], ' rows')} ms (in-process, back to back: "
        f"{table(hot, ' rows')} ms). Each entry: foreground alone, then under the flood of "
        f"(c). Then the default entry with {OFFLINE_OUTSTANDING} offline (priority "
        f"{OFFLINE}) requests also kept outstanding (the flood keeps {OFFLINE_OUTSTANDING + 2} "
        "fewer), without starvation bounds and with `starvation: {classes: {offline: "
        f"{{min_share: {OFFLINE_SHARE}, max_wait_ms: {OFFLINE_MAX_WAIT_MS:g}}}}}}}`. Every "
        "request goes straight to the node actor."
    )
    disturbance = "; ".join(
        f"{r.name}: {r.alone.foreign_cores:.2f}/{r.flooded.foreign_cores:.2f} cores, "
        f"{r.alone.attempts}/{r.flooded.attempts}"
        for r in runs.values()
    )
    notes = [
        "Each entry's own warm-up table (ms per call by rows; the same file, so the spread "
        "is measurement noise): " + "; ".join(f"{k}: {table(t)}" for k, t in costs.items()),
        "Batch limit: the batch size the node waits for (`min_gain` 0.25 by default). "
        "'Forced' batches whatever the gain; 'previous rules' lets background rows fill a "
        "foreground call's free slots and always waits out the window. Offline engine "
        "share: of the engine time of completed requests while the foreground ran; offline "
        "wait: their `Reply.queue_s`.",
        "Disturbance (CPU other processes used during the kept measurement; attempts): "
        f"{disturbance} (alone/flood).",
    ]
    return Section(BATCHING_TITLE, measured, _batching_tables(runs), targets, notes)
