"""(a) The batching-window table: what each window costs in latency and buys in capacity.

One node serves a batch-friendly model under entries that differ only in the batching
window (`only_if_faster: false`), each adaptive (the default: a lone request does not
wait when no companion is due in time) and fixed (`adaptive_window: false`). Periodic
arrivals (`sim.workload`) go open loop straight to the node actor
(`cluster.traffic.OpenLoop`) at 25/s (the original table's rate) and at about half the
node's batch-1 capacity, windows in interleaved rounds, pooled; latency is client end
to end. Mean batch = requests / engine calls. Engine ms / request = each call's
`service_s` counted once, over requests. Capacity vs window 0 = engine ms per request at
window 0 / at window w, minus 1. Added queue p50 = median `Reply.queue_s` beyond window 0's.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from bench import common as bc
from bench.common import OpenRun, Section, Target, fmt, log, md_table, median, slow_feed
from sim.workload import Arrival, parse_workload

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


def periodic_arrivals(rate: float, model: str, count: int | None = None) -> Iterator[Arrival]:
    """Foreground arrivals of ``model`` from ``sim.workload``: the first at 0, then one
    every 1 / ``rate`` s; ``count`` of them, or (None) without end."""
    workload = {
        "requests": count or 2**62,
        "arrivals": {"process": "periodic", "rate": rate, "periodic": {"phase": "aligned"}},
        "mix": [{"model": model, "priority": "foreground"}],
    }
    return parse_workload(workload, source="periodic arrivals").arrivals(random.Random(0), nodes=1)


class Setting(NamedTuple):
    """One model entry: its window and whether the window adapts to arrivals."""

    window_ms: float
    adaptive: bool = True

    @property
    def entry(self) -> str:
        return f"bw_w{self.window_ms:g}" + ("" if self.adaptive else "_fixed")

    @property
    def label(self) -> str:
        kind = "adaptive" if self.adaptive else "fixed"
        return f"{self.window_ms:g} {kind}" if self.window_ms else "0"


SETTINGS = (Setting(0.0), *(Setting(w, a) for w in WINDOWS_MS[1:] for a in (True, False)))


class Result(NamedTuple):
    """One setting's runs at one rate, pooled: every completed request's batch size,
    service and queue seconds."""

    setting: Setting
    run: OpenRun
    repeats: int  # runs measured again because the machine was disturbed

    @property
    def ok(self) -> list[tuple[int, float, float]]:
        return [(a.reply.batch_size, a.reply.service_s, a.reply.queue_s) for a in self.run.ok()]

    @property
    def mean_batch(self) -> float:
        calls = sum(1.0 / max(1, b) for b, _, _ in self.ok)
        return len(self.ok) / calls if calls else math.nan

    def ms_per_request(self, costs: Mapping[int, float] | None = None) -> float:
        """Engine ms per request: each call's ``service_s`` counted once, or (``costs``)
        what the cost table says a call of its size costs."""
        ok = self.ok
        if not ok or (costs is not None and any(b not in costs for b, _, _ in ok)):
            return math.nan
        return sum((costs[b] if costs else 1000 * s) / max(1, b) for b, s, _ in ok) / len(ok)

    def gain(self, base: Result, costs: Mapping[int, float] | None = None) -> float:
        """Engine ms per request at window 0 / at this window, minus 1 (measured, or
        every call priced by the cost table: what batching alone explains)."""
        return base.ms_per_request(costs) / self.ms_per_request(costs) - 1

    def added_queue_ms(self, base: Result) -> float:
        """Median time queued on the node (``Reply.queue_s``) beyond window 0's."""
        return 1000 * (median([q for *_, q in self.ok]) - median([q for *_, q in base.ok]))


def _measure(route: bc.NodeRoute, rate: float, count: int, rounds: int) -> list[Result]:
    pooled: dict[Setting, list[OpenRun]] = {w: [] for w in SETTINGS}
    for r in range(rounds):
        for w in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            arrivals = list(periodic_arrivals(rate, w.entry, count))
            feeds = {w.entry: slow_feed(WIDTH)}
            label = f"{rate:g}/s window {w.label} ms round {r + 1}"
            c = bc.calm(lambda a=arrivals, f=feeds: bc.open_loop(route, a, f), label)
            pooled[w].append(bc.kept(c))
            lat = c.value.latency_ms()
            log(f"  {label}/{rounds}: p50 {lat.p50:.1f} ms, p99 {lat.p99:.1f} ms")
    return [Result(w, OpenRun.pooled(v), sum(r.attempts - 1 for r in v)) for w, v in pooled.items()]


def run(ctx: bc.RunContext) -> Section:
    model, rounds = ctx.models.calibrated(TARGET_COST_MS, width=WIDTH), ctx.count(2, 1)
    batching = {"max_batch_size": MAX_BATCH, "only_if_faster": False}
    entries = [
        bc.ModelEntry(
            w.entry, model.path, w.window_ms, **batching, batching={"adaptive_window": w.adaptive}
        )
        for w in SETTINGS
    ]
    session = bc.raw_session(model.path)  # every batch size, in-process back to back
    hot = {
        n: bc.median_call_ms(session, slow_feed(WIDTH, rows=n), 25) for n in range(1, MAX_BATCH + 1)
    }
    results: dict[float, list[Result]] = {}
    with bc.deployed(bc.fleet_config("bench-batching", entries)) as client:
        route = bc.only_node(client)  # straight to the node actor: the node is measured
        costs = bc.node_costs_ms(client.status(bc.GET_TIMEOUT_S), SETTINGS[0].entry)
        high_rate = round(0.5 * 1000.0 / costs.get(1, TARGET_COST_MS) / 5) * 5
        bc.warm(lambda: route.submit(SETTINGS[0].entry, slow_feed(WIDTH)), 20)
        for rate, seconds in (
            (REFERENCE_RATE, ctx.pick(4.0, 1.6)),
            (high_rate, ctx.pick(2.0, 0.8)),
        ):
            count = max(20, round(rate * seconds))
            log(f"batching window: {rate:g}/s, {count} requests x {rounds} round(s) per window")
            results[rate] = _measure(route, rate, count, rounds)
    measured = " ".join(__doc__.split("\n\n", 1)[1].split()) + f" Model: {model.describe()}; "
    measured += f"windows {'/'.join(f'{w:g}' for w in WINDOWS_MS)} ms, max batch {MAX_BATCH}; "
    measured += f"{rounds} round(s) per window."
    return Section(TITLE, measured, _tables(results, costs, hot), *_verdict(results, costs, hot))


def _tables(
    results: dict[float, list[Result]], costs: Mapping[int, float], hot: Mapping[int, float]
) -> list[str]:
    cost_rows = [
        [n, fmt(costs[n], 2) if n in costs else "-", fmt(ms, 2), fmt(ms / n, 2)]
        + [f"{(ms / n) / hot[1] * 100:.0f}%"]
        for n, ms in sorted(hot.items())
    ]
    headers = ["batch rows", "node warm-up ms / call", "in-process ms / call"]
    blocks = [
        "What a call costs by batch size: the node's own warm-up measurement "
        "(`NodeStatus.models[].cost_ms`, powers of two) and back-to-back calls on an "
        "in-process session in this run (every size):\n\n"
        + md_table([*headers, "in-process ms / row", "per-row vs batch 1"], cost_rows)
    ]
    headers = ["window ms", "requests", "mean batch", "p50 ms", "p99 ms", "added p50 ms"]
    headers += ["added queue p50 ms", "engine ms / request", "capacity vs window 0"]
    for rate, rs in results.items():
        base, rows = rs[0], []
        for r in rs:
            lat, base_p50 = r.run.latency_ms(), base.run.latency_ms().p50
            rows.append(
                [r.setting.label, len(r.ok), fmt(r.mean_batch, 2), fmt(lat.p50), fmt(lat.p99)]
                + [fmt(lat.p50 - base_p50, signed=True), fmt(r.added_queue_ms(base), signed=True)]
                + [fmt(r.ms_per_request(), 2), f"{r.gain(base) * 100:+.0f}%"]
                + [f"{r.gain(base, hot) * 100:+.0f}%"]
            )
        table = md_table([*headers, "same, by cost table"], rows)
        blocks.append(f"**{rate:g} requests/s** (one every {1000 / rate:.0f} ms):\n\n{table}")
    ref_rows = [[fmt(w, 0), fmt(b), fmt(a), f"+{g:.0f}%"] for w, (b, a, g) in REFERENCE.items()]
    ref = md_table(["window ms", "mean batch", "added latency ms", "throughput"], ref_rows)
    blocks.append(
        f"Reference — the original table (25 fps), which these figures are compared with:\n\n{ref}"
    )
    return ["\n\n".join(blocks)]


def _verdict(
    results: dict[float, list[Result]], costs: Mapping[int, float], hot: Mapping[int, float]
) -> tuple[list[Target], list[str]]:
    """The targets and notes."""
    largest, gap_ms = max(costs, default=1), 1000 / REFERENCE_RATE
    pays = (costs[largest] / largest) / costs[1] if 1 in costs else math.nan
    # At the reference rate a window shorter than the gap between arrivals holds a lone
    # request: fixed for the window, adaptive not at all.
    base, *lone = (r for r in results[REFERENCE_RATE] if r.setting.window_ms < gap_ms)
    base_p50 = base.run.latency_ms().p50
    off = [
        abs(r.run.latency_ms().p50 - base_p50 - r.setting.window_ms)
        for r in lone
        if not r.setting.adaptive
    ]
    held = [r.added_queue_ms(base) for r in lone if r.setting.adaptive]
    fixed = f"{REFERENCE_RATE:g}/s, fixed windows shorter than the {gap_ms:.0f} ms gap between "
    fixed += "arrivals: the window is honoured (worst |added p50 - window|, ms)"
    adaptive = f"{REFERENCE_RATE:g}/s, adaptive windows shorter than the gap: a lone request is "
    adaptive += "not held (worst added queue p50, ms)"
    targets = [
        Target(
            f"batching pays on this model (per-row cost at batch {largest} / batch 1)",
            pays,
            "<=",
            BATCHING_PAYS_MAX,
        ),
        Target(fixed, max(off, default=math.nan), "<=", WINDOW_SLACK_MS, digits=1),
        Target(adaptive, max(held, default=math.nan), "<=", LONE_ADDED_QUEUE_MS, digits=2),
    ]
    every = [r for rs in results.values() for r in rs]
    errors = Counter(bc.error_name(a.reply) for r in every for a in r.run.answers)
    errors.pop(None, None)
    notes = [
        "Reading the table: on a steady schedule a batch forms only when the window is longer "
        "than the gap between arrivals or the engine is still busy; a fixed window below the "
        "gap holds each request alone for the whole window, an adaptive one sees that no "
        "companion is due and does not. 'Same, by cost table' prices every call at the "
        "in-process back-to-back cost for its batch size: the gain batching alone explains "
        "(the measured `service_s` also stretches when the engine shares the CPUs).",
        f"Worst submit lag behind schedule: {max(r.run.max_lag_s for r in every) * 1000:.1f} "
        f"ms; requests without a reply at the end: {sum(r.run.lost for r in every)}; failed "
        f"replies: {sum(errors.values())}"
        + (f" ({', '.join(f'{n} {k}' for k, n in errors.most_common())})" if errors else "")
        + f". Runs measured again because other processes used more than 0.2 cores "
        f"meanwhile: {sum(r.repeats for r in every)}; most CPU other processes used during a "
        f"kept run: {max(r.run.foreign_cores for r in every):.2f} cores.",
    ]
    for rate, rs in results.items():
        if rate != REFERENCE_RATE:
            target, note = _kept_gain(rate, rs, hot)
            targets.append(target)
            notes.append(note)
    dearer = [
        f"{n} rows {hot[n]:.2f} ms vs {up} rows {hot[up]:.2f} ms"
        for n in sorted(hot)
        if (up := 1 << (n - 1).bit_length()) in hot and up != n and hot[n] > 1.1 * hot[up]
    ]
    if dearer:
        notes.append(
            "Some batch sizes cost over 10% more per call than the next power of two ("
            + "; ".join(dearer)
            + "): `batching.pad_to: [2, 4, 8]` would run those batches padded, for less."
        )
    return targets, notes


def _kept_gain(rate: float, rs: list[Result], hot: Mapping[int, float]) -> tuple[Target, str]:
    """The capacity gain adaptive windows keep of the fixed windows' at ``rate``."""
    by, kept, worst = {r.setting: r for r in rs}, [], math.nan
    for w in WINDOWS_MS[1:]:
        a, f = by[Setting(w, True)], by[Setting(w, False)]
        fixed_gain = f.gain(rs[0], hot)
        ratio = a.gain(rs[0], hot) / fixed_gain if fixed_gain > 0 else math.nan
        measured = a.gain(rs[0]) / f.gain(rs[0])
        kept.append(
            f"{w:g} ms: {ratio * 100:.0f}% by the cost table, {measured * 100:.0f}% measured"
        )
        if fixed_gain >= MATERIAL_GAIN:
            worst = ratio if math.isnan(worst) else min(worst, ratio)
    label = f"{rate:g}/s: adaptive windows keep the fixed windows' capacity gain (worst share "
    label += f"kept, by the cost table, where that gain is >= {MATERIAL_GAIN:.0%})"
    note = f"Capacity gain kept by the adaptive window at {rate:g}/s (adaptive gain / fixed "
    note += f"gain, each vs window 0): {'; '.join(kept)}."
    return Target(label, worst, ">=", KEPT_GAIN), note
