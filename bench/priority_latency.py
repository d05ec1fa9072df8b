"""(c) Foreground latency on one node while a background flood keeps it saturated.

Model: a slow MLP calibrated to about 20 ms per call, batching off, queue capacity
64. Three configurations in one run: "alone" (foreground only), "edgefleet"
(priority order, preemption on with gap 5) and "FIFO" (``order: fifo``). During a
flood a background thread keeps ``capacity`` background requests (priority 3)
outstanding (a ``cluster.traffic.ClosedLoop``), resubmitting each as its reply comes
back, so the node is never idle and its queue never drains. Foreground requests
(priority 10) go one at a time with a pause between them; the client measures each end
to end. Every request goes straight to the node actor (``NodeRoute``), bypassing the
fleet's router: this scenario measures the node's scheduler (``bench.fleet`` measures
it behind the router).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from bench.common import (
    GET_TIMEOUT_S,
    BenchModel,
    Calm,
    ModelEntry,
    NodeRoute,
    Route,
    RunContext,
    Section,
    Summary,
    Target,
    calm,
    deployed,
    fleet_config,
    fmt,
    linear_call_ms,
    log,
    md_table,
    median,
    node_costs_ms,
    only_node,
    reply_of,
    slow_feed,
)
from cluster.client import FleetClient
from cluster.traffic import Answer, Backoff, ClosedLoop, Counts, OnAnswer, in_background

TITLE = "Foreground latency under a background flood (c)"
MODEL = "slow20"
TARGET_COST_MS = 20.0
CAPACITY = 64
FOREGROUND = 10
BACKGROUND = 3
OFFLINE = 0
GAP_S = 0.1  # pause between foreground requests
MAX_RETRY_S = 0.05  # cap on a refused request's back-off
# A flood's refused request waits its hint (2 ms to MAX_RETRY_S), an evicted or failed one 5 ms.
FLOOD_BACKOFF = Backoff(min_retry_s=0.002, max_retry_s=MAX_RETRY_S, error_pause_s=0.005)
TARGET_BOUND_RATIO = 1.0  # edgefleet p99 / (1.5 x alone p99 + one service time)
TARGET_FIFO_RATIO = 8.0  # FIFO p99 / edgefleet p99
REFERENCE = "FIFO 1420 ms vs 161 ms with the scheduler (isolated ~140 ms)"


@dataclass(frozen=True)
class ForegroundRun:
    """The foreground requests of one configuration."""

    config: str
    latencies_s: tuple[float, ...]
    service_s: tuple[float, ...]
    queue_s: tuple[float, ...]
    refused: int  # foreground attempts refused (retried)
    errors: int  # foreground requests that failed for another reason
    flood: Counts | None = None
    bg_rate: float = float("nan")  # background completions/s while the foreground ran
    counters: dict[str, int] = field(default_factory=dict)
    foreign_cores: float = 0.0  # CPU other processes used meanwhile
    attempts: int = 1
    batch_sizes: tuple[int, ...] = ()  # of the foreground requests' calls
    bg_window: Counts | None = None  # the background flood while the foreground ran
    offline: Counts | None = None  # the offline flood, while the foreground ran
    offline_wait_s: tuple[float, ...] = ()  # queue waits of offline requests completed then
    offline_share: float = float("nan")  # their share of the engine time of completed work

    @property
    def latency_ms(self) -> Summary:
        return Summary.of([x * 1000 for x in self.latencies_s])

    def row(self, label: str) -> list[object]:
        """The run's line of a table with the :data:`FOREGROUND_COLUMNS`."""
        lat = self.latency_ms
        flood = self.flood
        return [
            label,
            lat.n,
            fmt(lat.p50, 1),
            fmt(lat.p99, 1),
            fmt(lat.max, 1),
            fmt(median([q * 1000 for q in self.queue_s]), 1),
            fmt(median([s * 1000 for s in self.service_s]), 1),
            self.refused,
            "-" if flood is None else fmt(self.bg_rate, 1),
            "-" if flood is None else self.counters.get("preempted", 0),
            "-" if flood is None else f"{flood.rejected} / {flood.evicted}",
        ]


FOREGROUND_COLUMNS = [
    "configuration",
    "fg requests",
    "p50 ms",
    "p99 ms",
    "max ms",
    "fg queue p50 ms",
    "fg service p50 ms",
    "fg refused",
    "bg done/s",
    "bg preempted",
    "bg rejected / evicted",
]


def _flood(
    route: Route,
    model: str,
    feed: dict[str, np.ndarray],
    outstanding: int,
    *,
    priority: int = BACKGROUND,
    on_answer: OnAnswer | None = None,
) -> ClosedLoop:
    """``outstanding`` requests kept outstanding on ``route`` (one node actor, or the
    fleet's router), each replaced by a new one as its reply returns (``FLOOD_BACKOFF``
    after a refusal, an eviction or an error)."""
    return ClosedLoop(
        route,
        model,
        feed,
        lanes=outstanding,
        priority=priority,
        backoff=FLOOD_BACKOFF,
        on_answer=on_answer,
    )


def foreground(
    route: Route,
    feed: dict[str, np.ndarray],
    count: int,
    label: str,
    *,
    model: str = MODEL,
    priority: int = FOREGROUND,
    gap_s: float = GAP_S,
) -> ForegroundRun:
    """``count`` foreground requests one at a time on ``route``, ``gap_s`` apart (a
    closed loop of one lane that pauses ``gap_s`` after each answer); a refused one is
    sent again after the reply's ``retry_after_s`` (1 ms to ``MAX_RETRY_S``) for up to
    ``GET_TIMEOUT_S``.

    Latency runs from the first attempt to the reply, retries included.
    """
    answers: list[Answer] = []

    def answered(a: Answer) -> None:
        answers.append(a)
        done = sum(x.final for x in answers) if a.final else 0
        if done and done % 10 == 0:
            log(f"  {label}: {done}/{count} foreground requests, last {a.total_s * 1000:.0f} ms")

    lane = ClosedLoop(
        route,
        model,
        feed,
        lanes=1,
        priority=priority,
        requests=count,
        think_s=gap_s,
        backoff=Backoff(min_retry_s=0.001, max_retry_s=MAX_RETRY_S, error_pause_s=gap_s),
        give_up_s=GET_TIMEOUT_S,
        reply_timeout_s=GET_TIMEOUT_S,
        on_answer=answered,
    )
    asyncio.run(lane.run())
    final = [a for a in answers if a.final]
    ok = [a.reply for a in final if a.reply.error is None]
    return ForegroundRun(
        label,
        tuple(a.total_s for a in final if a.reply.error is None),
        tuple(r.service_s for r in ok),
        tuple(r.queue_s for r in ok),
        len(answers) - len(final),
        len(final) - len(ok),
        batch_sizes=tuple(r.batch_size for r in ok),
    )


def _wait_saturated(
    client: FleetClient, node: str, want_queued: int, timeout_s: float = 15.0
) -> int:
    """Wait (bounded) until ``node``'s queue holds ``want_queued`` requests."""
    deadline = time.perf_counter() + timeout_s
    queued = 0
    while time.perf_counter() < deadline:
        queued = client.status(GET_TIMEOUT_S).node(node).queue_length
        if queued >= want_queued:
            return queued
        time.sleep(0.05)
    raise TimeoutError(f"the flood filled the queue to {queued} only, wanted {want_queued}")


def _completed_wait(waits: list[float], answer: Answer) -> None:
    if answer.reply.error is None:
        waits.append(answer.reply.queue_s)


def _flooded(
    client: FleetClient,
    route: NodeRoute,
    feed: dict[str, np.ndarray],
    count: int,
    label: str,
    *,
    model: str = MODEL,
    outstanding: int = CAPACITY,
    running: int = 1,
    offline: int = 0,
) -> ForegroundRun:
    """Foreground requests while ``outstanding`` background requests (and ``offline``
    offline ones) stay outstanding; ``running`` is how many the node runs at once (its
    batch size), so the queue holds the rest."""
    before = client.status(GET_TIMEOUT_S).totals
    waits: list[float] = []  # queue waits of completed offline requests, in reply order
    flood = _flood(route, model, feed, outstanding)
    low = None
    if offline:
        on_answer = partial(_completed_wait, waits)
        low = _flood(route, model, feed, offline, priority=OFFLINE, on_answer=on_answer)
    with contextlib.ExitStack() as stack:  # leaving it stops the floods, or raises their failure
        stack.enter_context(in_background(flood, GET_TIMEOUT_S, name="bench-flood"))
        queued = _wait_saturated(client, route.node, outstanding - running - 1)
        if low is not None:
            stack.enter_context(in_background(low, GET_TIMEOUT_S, name="bench-flood-offline"))
        log(f"  {label}: flood running, {queued} queued")
        counts0, t0 = flood.counts.copy(), time.perf_counter()
        low0 = low.counts.copy() if low is not None else Counts()
        waits0 = len(waits)
        fg = foreground(route, feed, count, label, model=model)
        bg_rate = (flood.counts.completed - counts0.completed) / (time.perf_counter() - t0)
        snapshot = client.status(GET_TIMEOUT_S)  # before the flood's leftovers are cancelled
        depth = snapshot.node(route.node).queue_length
        bg = flood.counts.minus(counts0)
        off = low.counts.minus(low0) if low is not None else None
        offline_waits = tuple(waits[waits0:])
    after = snapshot.totals
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    counters["queue_at_end"] = depth
    share = float("nan")
    if off is not None:
        fg_engine = sum(s / max(1, b) for s, b in zip(fg.service_s, fg.batch_sizes, strict=True))
        total = bg.engine_s + off.engine_s + fg_engine
        share = off.engine_s / total if total > 0 else float("nan")
    return replace(
        fg,
        flood=flood.counts,
        bg_window=bg,
        bg_rate=bg_rate,
        counters=counters,
        offline=off,
        offline_wait_s=offline_waits,
        offline_share=share,
    )


def _kept(c: Calm[ForegroundRun]) -> ForegroundRun:
    return replace(c.value, foreign_cores=c.foreign_cores, attempts=c.attempts)


def run(ctx: RunContext) -> Section:
    model = ctx.models.calibrated(TARGET_COST_MS)
    feed = slow_feed(model.width)
    entries = [ModelEntry(MODEL, model.path)]
    n_fg = ctx.count(40, 10)
    n_fifo = ctx.count(40, 5)
    prio = fleet_config(
        "bench-prio",
        entries,
        model.path.parent,
        capacity=CAPACITY,
        order="priority",
        preemption=True,
        min_priority_gap=5,
    )
    fifo = fleet_config("bench-fifo", entries, model.path.parent, capacity=CAPACITY, order="fifo")
    with deployed(prio) as client:
        route = only_node(client)  # straight to the node actor: the node is measured
        for _ in range(5):
            reply_of(route.submit(MODEL, feed))
        log("priority latency: alone")
        alone = _kept(calm(lambda: foreground(route, feed, n_fg, "alone"), "alone"))
        log("priority latency: edgefleet (priority order, preemption gap 5) under flood")
        edge = _kept(calm(lambda: _flooded(client, route, feed, n_fg, "edgefleet"), "edgefleet"))
    with deployed(fifo) as client:
        route = only_node(client)
        for _ in range(5):
            reply_of(route.submit(MODEL, feed))
        log("priority latency: FIFO under flood")
        # Long, and its target has a wide margin: measured once, disturbance reported.
        base = _kept(
            calm(lambda: _flooded(client, route, feed, n_fifo, "FIFO"), "FIFO", attempts=1)
        )
    return _section(model, alone, edge, base)


def _section(
    model: BenchModel, alone: ForegroundRun, edge: ForegroundRun, fifo: ForegroundRun
) -> Section:
    service_ms = median(list(alone.service_s)) * 1000
    bound = 1.5 * alone.latency_ms.p99 + service_ms
    table = md_table(FOREGROUND_COLUMNS, [r.row(r.config) for r in (alone, edge, fifo)])
    edge_p99 = edge.latency_ms.p99
    targets = [
        Target(
            "edgefleet p99 / (1.5 x alone p99 + one service time)",
            edge_p99 / bound,
            "<=",
            TARGET_BOUND_RATIO,
        ),
        Target(
            "FIFO p99 / edgefleet p99", fifo.latency_ms.p99 / edge_p99, ">=", TARGET_FIFO_RATIO, 1
        ),
    ]
    measured = (
        f"One node serving a {model.describe()}, batching off, queue capacity {CAPACITY}. "
        "Three configurations in one run: alone (foreground only), edgefleet (priority "
        "order, preemption on, gap 5) and FIFO (`node_defaults.order: fifo`). During the "
        f"flood a background thread keeps {CAPACITY} background (priority {BACKGROUND}) "
        "requests outstanding, resubmitting each as its reply returns, so the node runs "
        f"one and queues {CAPACITY - 1} at all times (one slot stays free, so a foreground "
        "request is admitted under both disciplines: a completely full FIFO queue would "
        "refuse it outright, which measures nothing; a refused foreground attempt would be "
        "retried and its latency counted from the first attempt). Foreground requests "
        f"(priority {FOREGROUND}) go one at a time, {GAP_S * 1000:.0f} ms apart, once the "
        "queue is full; latency is client end to end. Every request goes straight to the "
        "node actor (`infer.remote` on it), bypassing the fleet's router."
    )
    notes = [
        f"Bound used for the first target: 1.5 x {alone.latency_ms.p99:.1f} ms + "
        f"{service_ms:.1f} ms (median service time alone) = {bound:.1f} ms.",
        f"Reference numbers from the LLM seed: {REFERENCE}.",
        "bg done/s is the background throughput while the foreground requests ran; "
        "bg preempted counts background calls aborted for a foreground arrival (their "
        "engine time is lost and they rerun from the head of their lane).",
        "Node counters over each flood: "
        + "; ".join(
            f"{r.config}: " + ", ".join(f"{k} {v}" for k, v in sorted(r.counters.items()) if v)
            for r in (edge, fifo)
        )
        + " (from the start of the flood to the last foreground reply). Failed foreground "
        f"requests: {alone.errors + edge.errors + fifo.errors}.",
        "Disturbance (CPU other processes used during the kept measurement; attempts): "
        + "; ".join(
            f"{r.config} {r.foreign_cores:.2f} cores, {r.attempts}" for r in (alone, edge, fifo)
        )
        + ". A measurement disturbed by more than 0.2 cores is taken again (alone and "
        "edgefleet: up to 3 attempts; FIFO: once, its margin is wide).",
    ]
    alone_svc = median(list(alone.service_s)) * 1000
    edge_svc = median(list(edge.service_s)) * 1000
    if alone_svc > 1.1 * edge_svc:
        notes.append(
            f"A foreground call alone took {alone_svc:.1f} ms of engine time against "
            f"{edge_svc:.1f} ms under the flood: alone, each call starts on an engine idle "
            f"for {GAP_S * 1000:.0f} ms (cold caches, a sleeping CPU), while the flood keeps "
            "it hot. That inflates the alone figures and with them the first target's bound."
        )
    if alone.latency_ms.p99 > 2 * alone.latency_ms.p50:
        notes.append(
            f"Caution: the alone p99 ({alone.latency_ms.p99:.1f} ms) is more than twice its "
            f"p50 ({alone.latency_ms.p50:.1f} ms): a few outliers set it, and with it the "
            "bound of the first target."
        )
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
# Background throughput with batching on / off. The same behaviour measured twice on
# this machine differs by a few per cent, so "not below" is checked with that slack.
TARGET_BG_RATIO = 0.95


@dataclass(frozen=True)
class Variant:
    """One model entry on the batching node: how it batches."""

    name: str
    label: str
    batching: dict[str, object]
    window_ms: float = WINDOW_MS
    max_batch_size: int = MAX_BATCH
    only_if_faster: bool = True


VARIANTS = (
    Variant("lin_off", "batching off", {}, 0.0, 1),
    Variant("lin_on", "batching on (defaults)", {}),
    Variant("lin_forced", "batching forced (`only_if_faster: false`)", {}, only_if_faster=False),
    Variant(
        "lin_old",
        "batching forced, previous rules (no cost bound, fixed window)",
        {"lower_priority_cost_bound": 1000.0, "adaptive_window": False},
        only_if_faster=False,
    ),
)
STARVATION = {
    "classes": {
        "offline": {"min_share": OFFLINE_SHARE, "max_wait_ms": OFFLINE_MAX_WAIT_MS},
    }
}


@dataclass(frozen=True)
class VariantRun:
    variant: Variant
    batch_limit: int
    alone: ForegroundRun
    flooded: ForegroundRun

    @property
    def bound_ms(self) -> float:
        """1.5 x alone p99 + one service time (median alone)."""
        return 1.5 * self.alone.latency_ms.p99 + median(list(self.alone.service_s)) * 1000


def _entry(model: BenchModel, v: Variant) -> ModelEntry:
    return ModelEntry(
        v.name,
        model.path,
        window_ms=v.window_ms,
        max_batch_size=v.max_batch_size,
        only_if_faster=v.only_if_faster,
        batching=v.batching,
    )


def _with_offline(
    client: FleetClient, feed: dict[str, np.ndarray], variant: Variant, count: int, alone: int
) -> VariantRun:
    """One variant's run with offline work kept outstanding beside the flood."""
    return _variant_runs(
        client, feed, [variant], count, alone=alone, offline=OFFLINE_OUTSTANDING, label=" + offline"
    )[0]


def _variant_runs(
    client: FleetClient,
    feed: dict[str, np.ndarray],
    variants: Iterable[Variant],
    count: int,
    *,
    alone: int,
    offline: int = 0,
    label: str = "",
) -> list[VariantRun]:
    route = only_node(client)
    limits = {m.name: m.batch_limit for m in client.status(GET_TIMEOUT_S).nodes[0].models}
    out = []
    for v in variants:
        for _ in range(5):
            reply_of(route.submit(v.name, feed))
        rows = limits.get(v.name, 1)
        out.append(_variant_run(client, route, feed, v, rows, (alone, count), offline, label))
    return out


def _variant_run(
    client: FleetClient,
    route: NodeRoute,
    feed: dict[str, np.ndarray],
    v: Variant,
    rows: int,
    counts: tuple[int, int],
    offline: int,
    label: str,
) -> VariantRun:
    """Foreground alone, then under the flood (``counts``: requests of each)."""
    name = f"{v.name}{label}"
    n_alone, count = counts
    log(f"priority batching: {name} alone")
    alone = _kept(
        calm(lambda: foreground(route, feed, n_alone, f"{name} alone", model=v.name), name)
    )
    log(f"priority batching: {name} under flood (batch limit {rows})")

    def flooded() -> ForegroundRun:
        outstanding = CAPACITY - (OFFLINE_OUTSTANDING + 2 if offline else 0)
        return _flooded(
            client,
            route,
            feed,
            count,
            f"{name} flood",
            model=v.name,
            outstanding=outstanding,
            running=rows,
            offline=offline,
        )

    flood = _kept(calm(flooded, f"{name} flood", attempts=2))
    return VariantRun(v, rows, alone, flood)


def run_batching(ctx: RunContext) -> Section:
    model = ctx.models.linear(TARGET_COST_MS, width=LINEAR_WIDTH)
    feed = slow_feed(LINEAR_WIDTH)
    # Back-to-back calls in-process: steadier than the node's three-call warm-up figures.
    hot = {n: linear_call_ms(model.path, LINEAR_WIDTH, rows=n) for n in (1, 2, 4)}
    n_fg = ctx.count(40, 10)
    n_starve = ctx.count(120, 20)
    base = model.path.parent
    plain = fleet_config(
        "bench-prio-batch", [_entry(model, v) for v in VARIANTS], base, capacity=CAPACITY
    )
    lin_on = VARIANTS[1]
    bounded = fleet_config(
        "bench-starvation", [_entry(model, lin_on)], base, capacity=CAPACITY, starvation=STARVATION
    )
    with deployed(plain) as client:
        status = client.status(GET_TIMEOUT_S)
        costs = node_costs_ms(status, VARIANTS[2].name)  # an entry measured at every size
        tables = {v.name: node_costs_ms(status, v.name) for v in VARIANTS}
        runs = _variant_runs(client, feed, VARIANTS, n_fg, alone=n_fg)
        strict = _with_offline(client, feed, lin_on, n_starve, n_fg)
    with deployed(bounded) as client:
        starved = _with_offline(client, feed, lin_on, n_starve, n_fg)
    return _batching_section(model, hot, costs, tables, runs, strict, starved)


def _batching_section(
    model: BenchModel,
    hot: Mapping[int, float],
    costs: Mapping[int, float],
    tables: Mapping[str, Mapping[int, float]],
    runs: list[VariantRun],
    strict: VariantRun,
    starved: VariantRun,
) -> Section:
    def mean_batch(c: Counts | None) -> str:
        return "-" if c is None or not c.calls else fmt(c.completed / c.calls, 2)

    rows = []
    for r in runs:
        a, f = r.alone.latency_ms, r.flooded.latency_ms
        rows.append(
            [
                r.variant.label,
                r.batch_limit,
                fmt(a.p50, 1),
                fmt(a.p99, 1),
                fmt(f.p50, 1),
                fmt(f.p99, 1),
                fmt(f.p50 / a.p50, 2),
                fmt(f.p99 / r.bound_ms, 2),
                fmt(max(r.flooded.batch_sizes, default=0), 0),
                fmt(r.flooded.bg_rate, 1),
                mean_batch(r.flooded.bg_window),
                r.flooded.counters.get("preempted", 0),
            ]
        )
    table = md_table(
        [
            "configuration",
            "batch limit",
            "alone p50 ms",
            "alone p99 ms",
            "flood p50 ms",
            "flood p99 ms",
            "p50 / alone",
            "p99 / bound",
            "largest fg batch",
            "bg done/s",
            "bg mean batch",
            "bg preempted",
        ],
        rows,
    )
    cost_line = ", ".join(f"{n} rows {ms:.1f} ms" for n, ms in sorted(costs.items()))
    hot_line = ", ".join(f"{n} rows {ms:.1f} ms" for n, ms in sorted(hot.items()))
    off = runs[0]
    targets = [
        Target(
            "batch 4 / batch 1 cost, in-process back to back (near-linear model)",
            hot[4] / hot[1],
            ">=",
            3.5,
        ),
    ]
    for r in runs[1:3]:
        a, f = r.alone.latency_ms, r.flooded.latency_ms
        targets += [
            Target(f"{r.variant.label}: flood p50 / alone p50", f.p50 / a.p50, "<=", 1.3),
            Target(
                f"{r.variant.label}: flood p99 / (1.5 x alone p99 + one service time)",
                f.p99 / r.bound_ms,
                "<=",
                TARGET_BOUND_RATIO,
            ),
            Target(
                f"{r.variant.label}: bg done/s / batching off",
                r.flooded.bg_rate / off.flooded.bg_rate,
                ">=",
                TARGET_BG_RATIO,
            ),
        ]

    srows = []
    for label, r in (("strict priority (no bounds)", strict), ("offline share 5 %", starved)):
        a, f = r.alone.latency_ms, r.flooded.latency_ms
        waits = Summary.of([w * 1000 for w in r.flooded.offline_wait_s])
        done = r.flooded.offline.completed if r.flooded.offline else 0
        srows.append(
            [
                label,
                fmt(a.p50, 1),
                fmt(f.p50, 1),
                fmt(f.p99, 1),
                fmt(f.p50 / a.p50, 2),
                fmt(f.p99 / r.bound_ms, 2),
                fmt(r.flooded.bg_rate, 1),
                done,
                f"{r.flooded.offline_share * 100:.1f}%",
                fmt(waits.p50, 0),
                fmt(waits.p99, 0),
                fmt(waits.max, 0),
            ]
        )
    stable = md_table(
        [
            "configuration",
            "fg alone p50 ms",
            "fg flood p50 ms",
            "fg flood p99 ms",
            "p50 / alone",
            "p99 / bound",
            "bg done/s",
            "offline done",
            "offline engine share",
            "offline wait p50 ms",
            "offline wait p99 ms",
            "offline wait max ms",
        ],
        srows,
    )
    sa, sf = starved.alone.latency_ms, starved.flooded.latency_ms
    swaits = Summary.of([w * 1000 for w in starved.flooded.offline_wait_s])
    targets += [
        Target(
            "starvation: offline share of engine time", starved.flooded.offline_share, ">=", 0.04
        ),
        Target(
            f"starvation: offline wait p99, ms (max_wait_ms {OFFLINE_MAX_WAIT_MS:g})",
            swaits.p99,
            "<=",
            OFFLINE_MAX_WAIT_MS,
            0,
        ),
        Target("starvation: fg flood p50 / alone p50", sf.p50 / sa.p50, "<=", TARGET_P50_RATIO),
        Target(
            "starvation: fg flood p99 / (1.5 x alone p99 + one service time)",
            sf.p99 / starved.bound_ms,
            "<=",
            TARGET_BOUND_RATIO,
        ),
    ]
    measured = (
        f"One node serving a {model.describe()}, under four model entries of the same file "
        f"that differ only in batching (window {WINDOW_MS:g} ms, max batch {MAX_BATCH} where "
        "on), queue capacity "
        f"{CAPACITY}, priority order, preemption gap 5. The node's warm-up cost table: "
        f"{cost_line} (in-process, back to back: {hot_line}). For each entry: foreground "
        "requests alone, then under a background "
        f"flood as in (c) ({CAPACITY} background requests kept outstanding). Then the "
        "starvation bound: the same flood on the default entry with "
        f"{OFFLINE_OUTSTANDING} offline (priority {OFFLINE}) requests also kept outstanding "
        f"(the background flood keeps {OFFLINE_OUTSTANDING + 2} fewer, so offline work is "
        "admitted), on a node without starvation bounds and on one with "
        f"`starvation: {{classes: {{offline: {{min_share: {OFFLINE_SHARE}, max_wait_ms: "
        f"{OFFLINE_MAX_WAIT_MS:g}}}}}}}` (foreground protected by default). Every request "
        "goes straight to the node actor."
    )
    notes = [
        "Each entry's own warm-up table (ms per call by rows; every entry measures the same "
        "file, so the spread is measurement noise, which the batch limit and the cost "
        "bound both rely on): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{n} {ms:.1f}" for n, ms in sorted(t.items()))
            for name, t in tables.items()
        )
        + ".",
        "Batch limit: the batch size the node waits for, from its warm-up measurement "
        "(`min_gain` 0.25 by default: at batch 4 this model saves well under 25 % per row, "
        "so with the defaults it never batches). 'Forced' batches whatever the gain, so "
        "the cost bound on lower-priority rows decides what joins a foreground call; "
        "'previous rules' lets background rows fill a foreground call's free slots and "
        "always waits out the window, as the node did before.",
        "p99 / bound: flood p99 / (1.5 x alone p99 + the median service time alone). bg "
        "done/s: background completions per second while the foreground ran; bg mean batch "
        "over the same time; bg preempted: background calls aborted for a foreground "
        "arrival (their engine time is lost).",
        "Offline engine share: engine time of completed offline requests (a call's time "
        "divided among its rows) over that of every completed request while the foreground "
        "ran; aborted calls count for nobody. Offline wait: time queued on the node "
        "(`Reply.queue_s`) of offline requests completed then.",
        "Disturbance (CPU other processes used during the kept measurement; attempts): "
        + "; ".join(
            f"{r.variant.name}: {r.alone.foreign_cores:.2f}/{r.flooded.foreign_cores:.2f} "
            f"cores, {r.alone.attempts}/{r.flooded.attempts}"
            for r in (*runs, strict, starved)
        )
        + " (alone/flood).",
    ]
    return Section(BATCHING_TITLE, measured, [table, stable], targets, notes)


__all__ = ["ForegroundRun", "foreground", "run", "run_batching"]
