"""(a) The batching-window table: what each window costs in latency and buys in capacity.

A batch-friendly model (width 512, so a batch-8 call costs about 2x a batch-1 call;
deep enough for ~4 ms per batch-1 call, since a few layers would cost ~0.05 ms, far
below what one request costs Ray and the node on this machine) is served by one node
under model entries that differ only in their batching window (0/5/15/30/100 ms;
max batch 8; ``only_if_faster`` off so the window is honoured), each window both
adaptive (the default: a request alone does not wait when no companion is expected in
time) and fixed (``adaptive_window: false``, always waited out). The driver sends open-loop arrivals
straight to the node actor (bypassing the fleet's router) on a steady schedule
(``submit`` at fixed intervals, never waiting for replies) at two rates, and measures
each request end to end. Windows are measured in interleaved rounds so drift spreads
over all.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.common import (
    GET_TIMEOUT_S,
    BenchModel,
    Inbox,
    ModelEntry,
    Pending,
    Route,
    RunContext,
    Section,
    Summary,
    Target,
    calm,
    deployed,
    fleet_config,
    fmt,
    log,
    md_table,
    median,
    median_call_ms,
    node_costs_ms,
    only_node,
    raw_session,
    replies_of,
    reply_of,
    slow_feed,
)

TITLE = "Batching window (a)"
WINDOWS_MS: tuple[float, ...] = (0.0, 5.0, 15.0, 30.0, 100.0)
MAX_BATCH = 8
WIDTH = 512
TARGET_COST_MS = 4.0  # batch-1 engine cost of the model
REFERENCE_RATE = 25.0  # arrivals/s of the original table
REFERENCE = {  # window ms -> (mean batch, added latency ms, throughput gain %), at 25 fps
    5.0: (1.1, 2.5, 0.0),
    15.0: (1.4, 7.5, 18.0),
    30.0: (1.8, 15.0, 35.0),
    100.0: (2.9, 50.0, 65.0),
}
BATCHING_PAYS_MAX = 0.95  # per-row cost at the largest batch over batch-1 cost
WINDOW_SLACK_MS = 3.0  # a lone request is held for a fixed window, give or take this
LONE_ADDED_QUEUE_MS = 1.0  # ... and for at most this long by an adaptive one
KEPT_GAIN = 0.9  # adaptive windows keep this share of a fixed window's capacity gain
MATERIAL_GAIN = 0.5  # ... where that gain (by the cost table) is at least this


@dataclass(frozen=True)
class Setting:
    """One model entry: its window and whether the window adapts to arrivals."""

    window_ms: float
    adaptive: bool = True

    @property
    def entry(self) -> str:
        return f"bw_w{self.window_ms:g}" + ("" if self.adaptive else "_fixed")

    @property
    def label(self) -> str:
        if self.window_ms == 0:
            return "0"
        return f"{self.window_ms:g} {'adaptive' if self.adaptive else 'fixed'}"


SETTINGS: tuple[Setting, ...] = (
    Setting(0.0),
    *(Setting(w, adaptive) for w in WINDOWS_MS if w > 0 for adaptive in (True, False)),
)


def entry_name(window_ms: float, adaptive: bool = True) -> str:
    return Setting(window_ms, adaptive).entry


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it, plus what its reply reported."""

    latency_s: float
    batch_size: int
    service_s: float
    queue_s: float
    error: str | None  # the error's type name, None when the request succeeded

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Arrivals:
    """One open-loop run: the samples and how well the schedule was kept."""

    samples: tuple[Sample, ...]
    max_lag_s: float  # worst delay of a submit behind its scheduled time
    lost: int  # requests with no reply by the end of the run (should be 0)
    foreign_cores: float = 0.0  # CPU other processes used meanwhile
    attempts: int = 1


@dataclass(frozen=True)
class WindowResult:
    setting: Setting
    rate: float
    samples: tuple[Sample, ...]
    max_lag_s: float
    lost: int
    repeats: int  # runs measured again because the machine was disturbed
    foreign_cores: float  # most CPU other processes used during a kept run

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    @property
    def latency_ms(self) -> Summary:
        return Summary.of([s.latency_s * 1000 for s in self.ok])

    @property
    def engine_calls(self) -> float:
        return sum(1.0 / max(1, s.batch_size) for s in self.ok)

    @property
    def mean_batch(self) -> float:
        calls = self.engine_calls
        return len(self.ok) / calls if calls else float("nan")

    @property
    def engine_ms_per_request(self) -> float:
        """Engine time divided by requests: each call's ``service_s`` counted once."""
        ok = self.ok
        if not ok:
            return float("nan")
        return 1000 * sum(s.service_s / max(1, s.batch_size) for s in ok) / len(ok)


def open_loop(
    route: Route,
    model: str,
    feed: dict[str, np.ndarray],
    rate: float,
    count: int,
    *,
    drain_s: float = GET_TIMEOUT_S,
) -> Arrivals:
    """Submit ``count`` requests at ``rate``/s on a fixed schedule; time each reply.

    Between submits the driver waits on the outstanding replies (never past the next
    submit time) and stamps each as it arrives. Bounded: the run stops ``drain_s``
    after the last submit whatever is still outstanding.
    """
    interval = 1.0 / rate
    sent: dict[Pending, float] = {}
    inbox = Inbox()
    samples: list[Sample] = []
    max_lag = 0.0
    i = 0
    start = time.perf_counter() + 0.01
    hard_stop = start + count * interval + drain_s
    while i < count or sent:
        now = time.perf_counter()
        if now > hard_stop:
            break
        due = start + i * interval
        if i < count and now >= due:
            max_lag = max(max_lag, now - due)
            sent[inbox.add(route.submit(model, feed, priority="foreground"))] = time.perf_counter()
            i += 1
            continue
        wait_s = (due - now) if i < count else (hard_stop - now)
        if not sent:
            time.sleep(max(0.0, wait_s))
            continue
        ready = inbox.ready(max(0.0, wait_s))
        if not ready:
            continue
        done_at = time.perf_counter()
        for ref, reply in zip(ready, replies_of(ready), strict=True):
            samples.append(
                Sample(
                    latency_s=done_at - sent.pop(ref),
                    batch_size=reply.batch_size,
                    service_s=reply.service_s,
                    queue_s=reply.queue_s,
                    error=None if reply.error is None else type(reply.error).__name__,
                )
            )
    return Arrivals(tuple(samples), max_lag, len(sent))


def _measure(
    route: Route, feed: dict[str, np.ndarray], rate: float, count: int, rounds: int
) -> list[WindowResult]:
    pooled: dict[Setting, list[Arrivals]] = {w: [] for w in SETTINGS}
    for r in range(rounds):
        order = SETTINGS if r % 2 == 0 else tuple(reversed(SETTINGS))
        for w in order:
            label = f"{rate:g}/s window {w.label} ms round {r + 1}"

            def one_run(model: str = w.entry) -> Arrivals:
                return open_loop(route, model, feed, rate, count)

            c = calm(one_run, label)
            run = replace(c.value, foreign_cores=c.foreign_cores, attempts=c.attempts)
            pooled[w].append(run)
            lat = Summary.of([s.latency_s * 1000 for s in run.samples if s.ok])
            log(
                f"  {label}/{rounds}: p50 {lat.p50:.1f} ms, "
                f"p99 {lat.p99:.1f} ms, max submit lag {run.max_lag_s * 1000:.1f} ms"
            )
    return [
        WindowResult(
            setting=w,
            rate=rate,
            samples=tuple(s for run in runs for s in run.samples),
            max_lag_s=max(run.max_lag_s for run in runs),
            lost=sum(run.lost for run in runs),
            repeats=sum(run.attempts - 1 for run in runs),
            foreign_cores=max(run.foreign_cores for run in runs),
        )
        for w, runs in pooled.items()
    ]


def run(ctx: RunContext) -> Section:
    model = ctx.models.calibrated(TARGET_COST_MS, width=WIDTH)
    entries = [
        ModelEntry(
            w.entry,
            model.path,
            window_ms=w.window_ms,
            max_batch_size=MAX_BATCH,
            only_if_faster=False,
            batching={"adaptive_window": w.adaptive},
        )
        for w in SETTINGS
    ]
    config = fleet_config("bench-batching", entries, model.path.parent)
    feed = slow_feed(WIDTH)
    rounds = ctx.count(2, 1)
    hot = hot_costs_ms(model.path, WIDTH, MAX_BATCH)
    tables: dict[float, list[WindowResult]] = {}
    with deployed(config) as client:
        route = only_node(client)  # straight to the node actor: the node is measured
        costs = node_costs_ms(client.status(GET_TIMEOUT_S), entry_name(0.0))
        batch1_ms = costs.get(1, TARGET_COST_MS)
        high_rate = round(0.5 * 1000.0 / batch1_ms / 5) * 5  # half of batch-1 capacity
        for _ in range(20):  # warm the path (actor, sessions) before timing anything
            reply_of(route.submit(entry_name(0.0), feed))
        for rate, seconds in (
            (REFERENCE_RATE, ctx.pick(4.0, 1.6)),
            (high_rate, ctx.pick(2.0, 0.8)),
        ):
            count = max(20, round(rate * seconds))
            log(f"batching window: {rate:g}/s, {count} requests x {rounds} round(s) per window")
            tables[rate] = _measure(route, feed, rate, count, rounds)
    return _section(tables, costs, hot, model, rounds)


def hot_costs_ms(path: Path, width: int, max_rows: int, repeats: int = 25) -> dict[int, float]:
    """Median ms of back-to-back calls of every batch size 1..max_rows, in-process.

    The node measures only 1, 2, 4, 8 rows; odd sizes can cost more than the next
    power of two (GEMM kernels), so the per-size table is measured here directly.
    """
    session = raw_session(path)
    return {
        rows: median_call_ms(session, slow_feed(width, rows=rows), repeats)
        for rows in range(1, max_rows + 1)
    }


def table_ms_per_request(result: WindowResult, costs: Mapping[int, float]) -> float:
    """Engine ms per request had each call cost what ``costs`` says for its size."""
    ok = result.ok
    if not ok or any(s.batch_size not in costs for s in ok):
        return float("nan")
    return sum(costs[s.batch_size] / max(1, s.batch_size) for s in ok) / len(ok)


def _base(results: list[WindowResult]) -> WindowResult:
    base = results[0]
    assert base.setting.window_ms == 0.0
    return base


def capacity_gain(r: WindowResult, base: WindowResult) -> float:
    """Measured: engine ms per request at window 0 / at ``r``'s window, minus 1."""
    return base.engine_ms_per_request / r.engine_ms_per_request - 1


def table_gain(r: WindowResult, base: WindowResult, costs: Mapping[int, float]) -> float:
    """The same with every call priced by the cost table: what batching alone explains."""
    return table_ms_per_request(base, costs) / table_ms_per_request(r, costs) - 1


def added_queue_ms(r: WindowResult, base: WindowResult) -> float:
    """Median time queued on the node (``Reply.queue_s``) beyond window 0's."""
    return 1000 * (median([s.queue_s for s in r.ok]) - median([s.queue_s for s in base.ok]))


def _table(results: list[WindowResult], costs: Mapping[int, float]) -> str:
    base = _base(results)
    rows = []
    for r in results:
        lat = r.latency_ms
        rows.append(
            [
                r.setting.label,
                len(r.ok),
                fmt(r.mean_batch, 2),
                fmt(lat.p50, 1),
                fmt(lat.p99, 1),
                fmt(lat.p50 - base.latency_ms.p50, 1, signed=True),
                fmt(added_queue_ms(r, base), 1, signed=True),
                fmt(r.engine_ms_per_request, 2),
                f"{capacity_gain(r, base) * 100:+.0f}%",
                f"{table_gain(r, base, costs) * 100:+.0f}%",
            ]
        )
    return md_table(
        [
            "window ms",
            "requests",
            "mean batch",
            "p50 ms",
            "p99 ms",
            "added p50 ms",
            "added queue p50 ms",
            "engine ms / request",
            "capacity vs window 0",
            "same, by cost table",
        ],
        rows,
    )


def _adaptive_targets(
    tables: dict[float, list[WindowResult]], costs: Mapping[int, float]
) -> tuple[list[Target], list[str]]:
    """Lone requests at the reference rate, and the capacity gain kept at the high rate."""
    targets: list[Target] = []
    notes: list[str] = []
    ref = tables.get(REFERENCE_RATE, [])
    gap_ms = 1000 / REFERENCE_RATE
    if ref:
        base = _base(ref)
        lone = [r for r in ref if 0 < r.setting.window_ms < gap_ms]
        fixed = [r for r in lone if not r.setting.adaptive]
        adaptive = [r for r in lone if r.setting.adaptive]
        if fixed:
            off = max(
                abs(r.latency_ms.p50 - base.latency_ms.p50 - r.setting.window_ms) for r in fixed
            )
            targets.append(
                Target(
                    f"{REFERENCE_RATE:g}/s, fixed windows shorter than the {gap_ms:.0f} ms gap "
                    "between arrivals: the window is honoured (worst |added p50 - window|, ms)",
                    off,
                    "<=",
                    WINDOW_SLACK_MS,
                    digits=1,
                )
            )
        if adaptive:
            targets.append(
                Target(
                    f"{REFERENCE_RATE:g}/s, adaptive windows shorter than the gap: a lone "
                    "request is not held (worst added queue p50, ms)",
                    max(added_queue_ms(r, base) for r in adaptive),
                    "<=",
                    LONE_ADDED_QUEUE_MS,
                    digits=2,
                )
            )
    high = [rate for rate in tables if rate != REFERENCE_RATE]
    for rate in high:
        results = tables[rate]
        base = _base(results)
        by = {r.setting: r for r in results}
        kept: list[str] = []
        worst = float("nan")
        for w in WINDOWS_MS[1:]:
            a, f = by.get(Setting(w, True)), by.get(Setting(w, False))
            if a is None or f is None:
                continue
            fixed_gain = table_gain(f, base, costs)
            ratio = table_gain(a, base, costs) / fixed_gain if fixed_gain > 0 else float("nan")
            measured = capacity_gain(a, base) / capacity_gain(f, base)
            kept.append(
                f"{w:g} ms: {ratio * 100:.0f}% by the cost table, {measured * 100:.0f}% measured"
            )
            if fixed_gain >= MATERIAL_GAIN:
                worst = ratio if math.isnan(worst) else min(worst, ratio)
        targets.append(
            Target(
                f"{rate:g}/s: adaptive windows keep the fixed windows' capacity gain (worst "
                f"share kept, by the cost table, where that gain is >= {MATERIAL_GAIN:.0%})",
                worst,
                ">=",
                KEPT_GAIN,
            )
        )
        notes.append(
            f"Capacity gain kept by the adaptive window at {rate:g}/s (adaptive gain / fixed "
            "gain, each vs window 0): " + "; ".join(kept) + "."
        )
    return targets, notes


def _section(
    tables: dict[float, list[WindowResult]],
    costs: Mapping[int, float],
    hot: Mapping[int, float],
    model: BenchModel,
    rounds: int,
) -> Section:
    cost = dict(costs)
    cost_table = md_table(
        [
            "batch rows",
            "node warm-up ms / call",
            "in-process ms / call",
            "in-process ms / row",
            "per-row vs batch 1",
        ],
        [
            [
                n,
                fmt(cost[n], 2) if n in cost else "-",
                fmt(ms, 2),
                fmt(ms / n, 2),
                f"{(ms / n) / hot[1] * 100:.0f}%",
            ]
            for n, ms in sorted(hot.items())
        ],
    )
    largest = max(cost) if cost else 1
    pays = (cost[largest] / largest) / cost[1] if 1 in cost else float("nan")
    targets = [
        Target(
            f"batching pays on this model (per-row cost at batch {largest} / batch 1)",
            pays,
            "<=",
            BATCHING_PAYS_MAX,
        )
    ]
    parts = [
        "What a call costs by batch size: the node's own warm-up measurement "
        "(`NodeStatus.models[].cost_ms`, powers of two) and back-to-back calls on an "
        "in-process session in this run (every size):",
        "",
        cost_table,
    ]
    all_lost = repeats = 0
    worst_lag = foreign = 0.0
    errors: Counter[str] = Counter()
    for rate, results in tables.items():
        parts += [
            "",
            f"**{rate:g} requests/s** (one every {1000 / rate:.0f} ms):",
            "",
            _table(results, hot),
        ]
        all_lost += sum(r.lost for r in results)
        errors.update(s.error for r in results for s in r.samples if s.error is not None)
        repeats += sum(r.repeats for r in results)
        foreign = max([foreign, *(r.foreign_cores for r in results)])
        worst_lag = max([worst_lag, *(r.max_lag_s for r in results)])
    ref = tables.get(REFERENCE_RATE, [])
    gap_ms = 1000 / REFERENCE_RATE
    lone = [r for r in ref if 0 < r.setting.window_ms < gap_ms and not r.setting.adaptive]
    more_targets, gain_notes = _adaptive_targets(tables, hot)
    targets += more_targets
    ref_rows = [
        [fmt(w, 0), fmt(b, 1), fmt(a, 1), f"+{g:.0f}%"] for w, (b, a, g) in REFERENCE.items()
    ]
    parts += [
        "",
        "Reference — the original table (25 fps), which these figures are compared with:",
        "",
        md_table(["window ms", "mean batch", "added latency ms", "throughput"], ref_rows),
    ]
    measured = (
        f"One node serving a {model.describe()} (a few layers at width 512 would cost "
        "~0.05 ms, far below the ~1 ms of CPU one request costs Ray and the node here, so "
        "the depth is calibrated; width 512 keeps it batch-friendly), under model "
        "entries that differ only in the batching window "
        f"({'/'.join(f'{w:g}' for w in WINDOWS_MS)} ms; max batch {MAX_BATCH}, "
        "`only_if_faster: false` so the window is honoured), each window both adaptive "
        "(the default: a request alone does not wait when the recent arrival rate says no "
        "companion will come in time) and fixed (`adaptive_window: false`: always waited "
        "out, as before). "
        "The driver submits "
        "open-loop arrivals straight to the node actor (bypassing the fleet's router) "
        "on a steady schedule (fixed intervals, never waiting for "
        "replies) at 25/s (the original table's rate) and at about half the node's batch-1 "
        "capacity, and stamps each reply as it arrives (client end-to-end latency). "
        f"{rounds} interleaved round(s) per window, pooled. Mean batch = requests / engine "
        "calls (each reply carries its call's batch size). Engine ms / request = each "
        "call's `service_s` counted once, over requests. Capacity vs window 0 = engine ms "
        "per request at window 0 / at window w, minus 1. Added queue p50 = median time "
        "queued on the node (`Reply.queue_s`) beyond window 0's."
    )
    notes = [
        "Reading the table: on a steady schedule a batch forms only when the window is "
        "longer than the gap between arrivals or the engine is still busy. At "
        f"{REFERENCE_RATE:g}/s (one every {gap_ms:.0f} ms) fixed windows below the gap gave "
        f"mean batches of {', '.join(fmt(r.mean_batch, 2) for r in lone) or 'n/a'}: a "
        "request (nearly) always waits out the whole window alone, so the added latency is "
        "the full window and the capacity gain nil; an adaptive window sees that no "
        "companion is due before it closes and does not hold the request. Where "
        "companions are due it waits, and once one has joined the window runs its course "
        "as before. The original table's 1.1-1.8 batches "
        "and half-window added latency fit irregular (camera-like) arrivals, which a "
        "steady schedule does not reproduce; the higher rate shows the regime where "
        "windows do pay.",
        "Capacity vs window 0 is measured: each call's `service_s` is wall time on the "
        "node's engine thread, which also stretches when the engine shares the CPUs with "
        "the actor's loop and the driver (at window 0 a call starts while the request's "
        "intake is still being processed), so it moves by about +-15% even where no batch "
        "formed. 'Same, by cost table' prices every call of the run at the in-process "
        "back-to-back cost for its batch size: the gain batching alone explains. Calls "
        "after an idle gap run slower than back to back (cold caches), which is why the "
        "measured engine ms / request sits above the table.",
        f"Worst submit lag behind schedule: {worst_lag * 1000:.1f} ms; requests without "
        f"a reply at the end: {all_lost}; failed replies: {sum(errors.values())}"
        + (f" ({', '.join(f'{n} {k}' for k, n in errors.most_common())})" if errors else "")
        + f". Runs measured again because other processes used more than 0.2 cores "
        f"meanwhile: {repeats}; most CPU other processes used during a kept run: "
        f"{foreign:.2f} cores.",
        *gain_notes,
    ]
    dearer = [
        f"{n} rows {hot[n]:.2f} ms vs {up} rows {hot[up]:.2f} ms"
        for n in sorted(hot)
        if (up := 1 << (n - 1).bit_length()) in hot and up != n and hot[n] > 1.1 * hot[up]
    ]
    if dearer:
        notes.append(
            "On this model some batch sizes cost over 10% more per call than the next power "
            "of two ("
            + "; ".join(dearer)
            + "): `batching.pad_to: [2, 4, 8]` would run those batches padded, for less."
        )
    return Section(TITLE, measured, ["\n".join(parts)], targets, notes)


__all__ = ["Arrivals", "Sample", "open_loop", "run"]
