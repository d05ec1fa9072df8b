"""The fleet simulator (``edgefleet simulate``): (a) how closely it follows the live
fleet on one seeded trace, (b) how large a fleet it simulates, (c) the placement
policies of the registry compared at 1,000 and 10,000 nodes.

``EDGEFLEET_BENCH_SIM_PARTS`` (e.g. ``a`` or ``bc``) runs only those parts; default all.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench import common as bc
from bench.common import OpenRun, Part, RunContext, Target, fmt, log, md_table, percentile, timed
from bench.fleet import (
    CHEAP,
    CHEAP_COST_MS,
    DEAR,
    DEAR_COST_MS,
    PRIORITY_MIX,
    measure_capacity,
    settle,
    trace_config,
    trace_workload,
    warm_nodes,
)
from cluster.traffic import Answer
from edgefleet.config import FleetConfig, parse_config
from edgefleet.request import priority_name
from policies.placement import placement_policies
from sim.fleet import ModelCost, Network
from sim.report import OUTCOMES, RunResult
from sim.run import RECORDED_WINDOW_S, measured_costs, recorded_costs, simulate, with_policy
from sim.workload import Workload, parse_workload, read_engine_times

POLICIES = placement_policies()  # the default first

TITLE = (
    "Fleet simulator: fidelity, scale, placement policies at 1,000 and 10,000 nodes (simulation)"
)
FIDELITY_LOAD = 0.6  # offered load over the measured fleet capacity
FIDELITY_TOLERANCE = 0.15  # simulated / real latency, per class, within this
RECORDED_RUNS = 4  # real replays the simulator is given; as many are held out between them
SIM_DRAWS = 2  # simulated replays per recorded run and variant, pooled (each draws anew)
# Requests in the trace: at 1,500 the simulator's own pooled p99 of the lowest classes
# moved by up to 25 % between draws from the same recorded runs; at 4,500 by up to 13 %.
FIDELITY_REQUESTS = 4500
COMPLETED = OUTCOMES.index("completed")
COUNT_TOLERANCE = 0.05
SCALE_NODES, SCALE_REQUESTS = 10_000, 1_000_000
SCALE_MINUTES, SCALE_RSS_GIB = 10.0, 4.0
SHORT = {  # variant -> its short name
    (WARMUP := "warm-up costs, shared cores"): "warm-up, shared",
    (OBSERVED := "costs observed in the run"): "observed costs",
    (ANYWHERE := "recorded run, drawn anywhere"): "recorded, anywhere",
    (RECORDED := "recorded run"): "recorded run",
}

# ------------------------------------------------------------------ (a) fidelity

Figures = dict[int, tuple[float, float, int]]  # by class: p50 ms, p99 ms, completed


def _by_class(done_ms: Sequence[tuple[int, float]], replays: int = 1) -> Figures:
    """Per class: p50 ms, p99 ms and the count per replay of completed requests, from
    their ``(priority, latency ms)``."""
    out = {}
    for p, _ in PRIORITY_MIX:
        lat = [ms for q, ms in done_ms if q == p]
        out[p] = (percentile(lat, 50), percentile(lat, 99), round(len(lat) / replays))
    return out


def _real_figures(answers: Iterable[Answer]) -> Figures:
    ok = [a for a in answers if a.reply.error is None and a.arrival is not None]
    return _by_class([(a.arrival.priority, a.latency_s * 1000) for a in ok])


def _sim_figures(results: Sequence[RunResult]) -> Figures:
    """The same of the simulated replays pooled."""
    done_ms: list[tuple[int, float]] = []
    for c in (r.recorder.columns() for r in results):
        done = c.outcome == COMPLETED
        ms = (c.latency_s[done] * 1000).tolist()
        done_ms += zip(c.priority[done].tolist(), ms, strict=True)
    return _by_class(done_ms, len(results))


@dataclass
class Fidelity:
    rate: float
    capacity: float
    rounds: list[OpenRun]  # in order: recorded runs and held-out replays alternate
    recorded_lines: int  # lines of the recorded runs in the call record
    costs: dict[str, dict[str, ModelCost]]  # warm-up, observed, recorded (pooled)
    hop_ms: float
    sims: dict[str, list[RunResult]]  # by variant label, the acceptance variant last
    stretch: float  # real engine time per call / the warm-up cost table's
    cores: float  # cores of the shared machine fitted to that stretch

    def answers(self, held_out: bool) -> list[Answer]:
        return [a for r in self.rounds[int(held_out) :: 2] for a in r.answers]


def _real_runs(
    ctx: RunContext, models: Mapping[str, bc.BenchModel], record_dir: Path
) -> tuple[Any, ...]:
    """The trace replayed on the real fleet, its caller keeping a call record: the
    replays, their windows (unix times), the workload, the rate and capacity and the
    nodes' warm-up status."""
    feeds = {n: bc.slow_feed(m.width) for n, m in models.items()}
    config = trace_config("bench-sim", models, POLICIES[0])
    router = config.router.model_copy(update={"record_dir": record_dir})
    with bc.deployed(config.model_copy(update={"router": router})) as client:
        warm_nodes(client, feeds, 10)
        cap = measure_capacity(client, feeds, ctx.pick(1.5, 0.8))
        rate = FIDELITY_LOAD * cap.rate
        workload = trace_workload(rate, ctx.count(FIDELITY_REQUESTS, 300))
        rng = random.Random(workload.seed)
        arrivals = list(workload.arrivals(rng, nodes=4, priorities=config.priorities))
        log(f"  (a) capacity {cap.rate:.0f}/s; {len(arrivals)} requests at {rate:.0f}/s")
        warm = client.status(bc.GET_TIMEOUT_S)

        def timed_run() -> tuple[OpenRun, tuple[float, float]]:
            start = time.time()
            return bc.open_loop(client, arrivals, feeds), (start, time.time())

        runs = []
        for i in range(2 * ctx.count(RECORDED_RUNS, 1)):  # recorded and held-out alternate
            settle(client)
            runs.append(bc.calm(timed_run, f"(a) round {i + 1}").value)
    return [r for r, _ in runs], [w for _, w in runs], workload, rate, cap.rate, warm, config


def _record_between(record_dir: Path, window: tuple[float, float], out: Path) -> int:
    """Write the call record's lines of requests that arrived within ``window`` to
    ``out``; how many."""
    kept = [
        line
        for path in sorted(record_dir.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip() and window[0] <= json.loads(line)["at"] <= window[1]
    ]
    out.write_text("".join(line + "\n" for line in kept))
    return len(kept)


def measure_fidelity(ctx: RunContext, models: Mapping[str, bc.BenchModel]) -> Fidelity:
    with tempfile.TemporaryDirectory() as tmp:
        record_dir, recorded = Path(tmp) / "calls", Path(tmp) / "recorded"
        runs, windows, workload, rate, capacity, warm, config = _real_runs(ctx, models, record_dir)
        recorded.mkdir()
        files = {recorded / f"run-{i}.jsonl": w for i, w in enumerate(windows[0::2])}
        lines = sum(_record_between(record_dir, w, f) for f, w in files.items())
        per_run = [read_engine_times(f) for f in files]
        pooled = read_engine_times(recorded)  # the recorded runs' calls together
    # What the simulator is given comes from the recorded runs alone.
    given = [a for r in runs[0::2] for a in r.ok()]
    warmup = measured_costs((m.name, m.cost_ms) for n in warm.nodes for m in n.models)
    costs = {
        WARMUP: warmup,
        OBSERVED: _costs_observed(given, warmup),
        RECORDED: recorded_costs(pooled, warmup, window_s=0.0),
    }
    outside = [
        a.latency_s - a.reply.service_s - a.reply.queue_s
        for a in given
        if a.latency_s > a.reply.service_s + a.reply.queue_s
    ]
    hop_ms = statistics.median(outside) * 1000 / 2 if outside else 0.5
    network = workload.network.model_copy(update={"hop_ms": hop_ms})
    apart = workload.model_copy(update={"network": network})
    # The warm-up tables on nodes sharing one machine whose cores are fitted so that
    # engine calls stretch as much as they did in the recorded runs.
    tabled = sum(warmup[a.arrival.model].call_s(1) for a in given)
    stretch = sum(a.reply.service_s for a in given) / tabled
    cores = _fit_cores(config, apart, warmup, stretch)
    drawn = Network(hop_ms / 1000, round_trip_s=tuple(outside))

    def replays(w: Workload, tables: Sequence[Mapping[str, ModelCost]]) -> list[RunResult]:
        return [
            simulate(config, w, costs=tables[k % len(tables)], network=drawn, draw_seed=w.seed + k)
            for k in range(SIM_DRAWS * len(per_run))
        ]

    sims = {
        WARMUP: replays(apart.model_copy(update={"shared_cores": cores}), [warmup]),
        OBSERVED: replays(apart, [costs[OBSERVED]]),
        ANYWHERE: replays(apart, [costs[RECORDED]]),
        RECORDED: replays(apart, [recorded_costs(times, warmup) for times in per_run]),
    }
    return Fidelity(rate, capacity, runs, lines, costs, hop_ms, sims, stretch, cores)


def _fit_cores(
    config: FleetConfig, workload: Workload, costs: Mapping[str, ModelCost], stretch: float
) -> float:
    """The cores a machine shared by the simulated nodes needs for engine calls to take
    ``stretch`` times their cost tables on average (bisection; fewer cores, longer)."""
    rng = random.Random(workload.seed)
    arrivals = workload.arrivals(rng, nodes=4, priorities=config.priorities)
    work = sum(costs[a.model].call_s(1) for a in arrivals)
    low, high = 0.25, 8.0
    for _ in range(12):
        mid = math.sqrt(low * high)
        result = simulate(config, workload.model_copy(update={"shared_cores": mid}), costs=costs)
        low, high = (mid, high) if sum(result.recorder.busy_s) / work > stretch else (low, mid)
    return math.sqrt(low * high)


def _costs_observed(
    answers: Sequence[Answer], warmup: Mapping[str, ModelCost]
) -> dict[str, ModelCost]:
    """Each model's warm-up table scaled to the median engine time of the replies."""
    out = dict(warmup)
    for name, cost in warmup.items():
        mine = [a for a in answers if a.arrival is not None and a.arrival.model == name]
        ms = [a.reply.service_s * 1000 for a in mine]
        if ms and 1 in cost.call_ms:
            scale = statistics.median(ms) / cost.call_ms[1]
            out[name] = ModelCost({k: v * scale for k, v in cost.call_ms.items()})
    return out


def _percent(value: float, reference: float) -> str:
    """``value`` / ``reference`` - 1 as a signed percentage."""
    return f"{fmt(_off(value, reference) * 100, 0, signed=True)}%"


def _off(value: float, reference: float) -> float:
    return value / reference - 1 if reference > 0 else math.nan


def _latency_tables(f: Fidelity) -> tuple[str, str, str, list[Target]]:
    """Real against simulated per class; the deviations (the real fleet's and the
    simulator's own repeatability first); the simulator against the recorded runs."""
    real, recorded = _real_figures(f.answers(True)), _real_figures(f.answers(False))
    sims = {label: _sim_figures(runs) for label, runs in f.sims.items()}
    half = len(f.sims[RECORDED]) // 2
    first, second = (_sim_figures(f.sims[RECORDED][i : i + half]) for i in (0, half))
    rows, gaps, itself, targets = [], [], [], []
    for p, _ in PRIORITY_MIX:
        name, r, mine, own = priority_name(p), real[p], sims[RECORDED][p], recorded[p]
        rows.append([name, r[2], fmt(r[0]), fmt(r[1])])
        pairs = ((recorded, real), (second, first))
        gaps.append([name, *(_percent(x[p][q], y[p][q]) for x, y in pairs for q in (0, 1))])
        for figures in sims.values():
            rows[-1] += [fmt(figures[p][0]), fmt(figures[p][1])]
            gaps[-1] += [_percent(figures[p][q], r[q]) for q in (0, 1)]
        for q, what in ((0, "p50"), (1, "p99")):
            label = f"(a) {RECORDED}: simulated / real {name} {what} - 1, absolute"
            targets.append(Target(label, abs(_off(mine[q], r[q])), "<=", FIDELITY_TOLERANCE))
        both = [f"{fmt(x[0])} / {fmt(x[1])}" for x in (own, mine)]
        itself.append([name, *both, f"{_percent(mine[0], own[0])} / {_percent(mine[1], own[1])}"])
    headers = ["class", "real completed (held out)", "real p50 ms", "real p99 ms"]
    headers += [f"sim {q} ({SHORT[label]})" for label in sims for q in ("p50", "p99")]
    gap_headers = ["class", "p50 (real: recorded runs)", "p99 (real: recorded runs)"]
    gap_headers += ["p50 (simulated: one draw)", "p99 (simulated: one draw)"]
    gap_headers += [f"{q} ({SHORT[label]})" for label in sims for q in ("p50", "p99")]
    own_headers = ["class", "real p50 / p99 ms", "simulated p50 / p99 ms", "simulated / real - 1"]
    tables = (md_table(headers, rows), md_table(gap_headers, gaps), md_table(own_headers, itself))
    return (*tables, targets)


def _count_table(f: Fidelity) -> tuple[str, list[Target]]:
    real = Counter(bc.error_name(a.reply) for a in f.answers(True))
    n_held = len(f.rounds) // 2
    total = sum(real.values()) / n_held
    rows, targets = [], []
    for kind, error in (("completed", None), ("rejected", "Rejected"), ("evicted", "Evicted")):
        real_n = real[error] / n_held
        sim = {k: statistics.mean(r.counts()[kind] for r in runs) for k, runs in f.sims.items()}
        rows.append([kind, fmt(real_n, 0), *(fmt(n, 0) for n in sim.values())])
        what = f"(a) {RECORDED}: |simulated - real| {kind} / requests"
        targets.append(Target(what, abs(sim[RECORDED] - real_n) / total, "<=", COUNT_TOLERANCE, 3))
    headers = ["outcome", "real (mean per held-out replay)"]
    headers += [f"sim ({SHORT[x]}, mean per replay)" for x in f.sims]
    return md_table(headers, rows), targets


def _cost_and_spread(f: Fidelity) -> tuple[str, str]:
    warmup, observed, recorded = (f.costs[k] for k in (WARMUP, OBSERVED, RECORDED))
    cost_rows = []
    for m in sorted(warmup):
        calls = recorded[m].samples_ms.get(1, ())
        tables = (fmt(t[m].call_ms.get(1, math.nan), 2) for t in (warmup, observed))
        spread = (fmt(percentile(calls, q), 2) for q in (50, 99))
        cost_rows.append([m, *tables, len(calls), *spread])
    headers = ["model", "warm-up ms per call (batch 1)", "observed ms per call (median)"]
    headers += ["recorded calls (batch 1)", "recorded p50 ms", "recorded p99 ms"]
    spread_rows = [
        [f"{i + 1} (held out)" if i % 2 else f"{i + 1} (recorded)"]
        + [f"{fmt(a)} / {fmt(b)}" for a, b, _ in _real_figures(r.answers).values()]
        for i, r in enumerate(f.rounds)
    ]
    classes = [f"{priority_name(p)} p50 / p99 ms" for p, _ in PRIORITY_MIX]
    return md_table(headers, cost_rows), md_table(["replay", *classes], spread_rows)


def _fidelity_part(f: Fidelity) -> Part:
    table, deviations, itself, targets = _latency_tables(f)
    counts, count_targets = _count_table(f)
    costs, spread = _cost_and_spread(f)
    waits = [w for cost in f.costs[RECORDED].values() for w in cost.abort_ms]
    aborts = (
        f"{len(waits)} in the recorded runs, mean {statistics.fmean(waits):.1f} ms, p50 "
        f"{percentile(waits, 50):.1f}, p99 {percentile(waits, 99):.1f}"
        if waits
        else "none recorded"
    )
    measured = (
        "The 4-node fleet of the fleet benchmark's part (d). One seeded trace from "
        f"`sim.workload` ({len(f.rounds[0].answers)} requests, Poisson at {f.rate:.0f}/s = "
        f"{FIDELITY_LOAD:.0%} of the fleet's measured capacity of {f.capacity:.0f}/s, the "
        f"priority mix of part (d)) replayed open loop on the real fleet {len(f.rounds)} "
        "times, its caller keeping a call record (`router.record_dir`). Replays 1, 3, 5, ... "
        "are the recorded runs: everything the simulator is given comes from them alone, "
        "and it is compared with the replays in between, pooled (held out). The simulator "
        f"replays the trace {SIM_DRAWS} times per recorded run and variant, pooled. "
        "Variants: **recorded run** (the acceptance figures): each engine call takes the "
        "engine time of a call of its model and batch size its node ran in one recorded "
        f"run within {RECORDED_WINDOW_S * 1000:.0f} ms of its own time into the replay "
        f"({f.recorded_lines} lines in all), its answer the time outside the node that call's "
        f"request spent, an aborted call a recorded abort wait ({aborts}); **recorded, "
        "anywhere**: drawn wherever in the recorded runs; **warm-up, shared**: the nodes' "
        "warm-up tables on one shared machine, its cores fitted so that calls take "
        f"{f.stretch:.2f}x their tables as in the recorded runs (`shared_cores: "
        f"{f.cores:.2f}`); **observed costs**: those tables scaled to the recorded runs' "
        f"median engine time. The simulated network: a request reaches its node after "
        f"{f.hop_ms:.2f} ms (half the median time replies spent outside their node), answers "
        "come back after a time drawn from those the recorded runs measured."
    )
    notes = [
        "Simulated / real - 1, per variant, and first the real fleet's own repeatability "
        "(its recorded runs against the held-out replays) and the simulator's (the "
        "recorded-run variant's second draw against its first):\n\n" + deviations,
        "The real fleet replay by replay (the same trace each time):\n\n" + spread,
        "The simulator against the recorded runs themselves:\n\n" + itself,
        "Engine costs (recorded: the recorded runs' completed calls):\n\n" + costs,
        "On this machine the four nodes share 2 cores: the recorded engine times carry the "
        "machine's contention and, drawn in time, its slow stretches into the simulation. "
        "Only the recorded-run variant has targets.",
    ]
    title = "(a) Fidelity: the same trace on the real fleet and in the simulator"
    return Part(title, measured, [table, counts], targets + count_targets, notes)


# --------------------------------------------------------------------- (b) scale


SCALE_WORKLOAD = """\
seed: 7
requests: 1000000
arrivals: {process: poisson, rate_per_node: 25}
callers: 8
mix:
  - {model: classify, priority: foreground, weight: 0.1, deadline_ms: 1000}
  - {model: classify, priority: inline, weight: 0.2}
  - {model: detect, priority: background, weight: 0.5}
  - {model: detect, priority: offline, weight: 0.2}
costs:
  classify: {call_ms: {1: 8.0, 4: 24.0}}
  detect: {call_ms: {1: 40.0}}
"""
TABLE_FLEET = """\
fleet: {name: sim}
models:
  classify: {path: classify.onnx, batching: {window_ms: 5, max_batch_size: 4}}
  detect: {path: detect.onnx}
"""
ONE_NODE = "local: {nodes: 1}\n"
MIXED_NODES = """\
nodes:
  - {name: both, models: [classify, detect]}
  - {name: classify, models: [classify]}
  - {name: detect, models: [detect]}
"""
FAILING = "1% of nodes failing"
FAILING_SHARE = 0.01  # of the nodes, failing at random times during the run
SCENARIOS = ("homogeneous", "three speeds", "mixed models", "bursts", FAILING)
SCENARIOS += ("100 ms stale reports",)


def table_config(mixed: bool = False) -> FleetConfig:
    data = yaml.safe_load(TABLE_FLEET + (MIXED_NODES if mixed else ONE_NODE))
    return parse_config(data, Path("."))


def table_workload(scenario: str, nodes: int, requests: int) -> Workload:
    """The table's workload of ``scenario``: about 70 % of the fleet's capacity."""
    data = yaml.safe_load(SCALE_WORKLOAD)
    horizon_s = requests / (data["arrivals"]["rate_per_node"] * nodes)
    if scenario == "three speeds":
        data["node_classes"] = [{"share": 1 / 3, "speed": s} for s in (1.0, 0.5, 0.25)]
        data["arrivals"]["rate_per_node"] = 25 * 0.583
    elif scenario == "bursts":
        bursts = {"every_s": 1.0, "length_s": 0.25, "factor": 3}
        data["arrivals"] = {"process": "bursts", "rate_per_node": 18, "bursts": bursts}
    elif scenario == FAILING:  # a minute's failures, within the run's few simulated seconds
        data["events"] = {"node_failures": {"per_minute": FAILING_SHARE * 60 / horizon_s}}
    elif scenario == "100 ms stale reports":
        data["network"] = {"report_delay_ms": 100}
    return parse_workload(data, source=f"the {scenario} scenario")


def measure_scale(nodes: int, requests: int, out: Path) -> dict[str, Any]:
    """``edgefleet simulate`` in a child process: its wall time and peak memory."""
    (out / "scale.yaml").write_text(SCALE_WORKLOAD)
    (out / "fleet.yaml").write_text(TABLE_FLEET + ONE_NODE)
    command = [sys.executable, "-m", "cluster.cli", "simulate", str(out / "fleet.yaml")]
    command += ["--workload", str(out / "scale.yaml"), "--nodes", str(nodes)]
    command += ["--requests", str(requests), "--out", str(out / "report")]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=SCALE_MINUTES * 180)
    wall = time.perf_counter() - t0
    line = next((ln for ln in done.stdout.splitlines() if "answered in" in ln), "")

    def number_before(word: str) -> float:
        head = line.split(word)[0].replace(",", "").replace("(", " ").split()
        try:
            return float(head[-1])
        except (IndexError, ValueError):
            return math.nan

    rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    failed = (done.stdout + done.stderr)[-2000:] if done.returncode else ""
    answered, events = int(number_before("answered") or 0), number_before("events/s")
    out = {"nodes": nodes, "requests": requests, "wall_s": wall, "rss_mib": rss_mib}
    return out | {"events": events, "answered": answered, "failed": failed}


def _scale_part(run: dict[str, Any], target: bool) -> Part:
    row = [f"{run[k]:,}" for k in ("nodes", "requests", "answered")]
    row += [fmt(run["wall_s"], 0), fmt(run["rss_mib"], 0), f"{run['events']:,.0f}"]
    headers = ["nodes", "requests", "answered", "wall time s", "peak RSS MiB", "events/s"]
    answered = "(b) every request answered (answered / requests)"
    targets = [
        Target("(b) wall time, minutes", run["wall_s"] / 60, "<=", SCALE_MINUTES),
        Target("(b) peak RSS, GiB", run["rss_mib"] / 1024, "<=", SCALE_RSS_GIB),
        Target(answered, run["answered"] / run["requests"], ">=", 1.0),
    ]
    notes = [f"The run failed:\n\n```\n{run['failed']}\n```"] if run["failed"] else []
    measured = (
        f"`edgefleet simulate` in a child process: {run['nodes']:,} nodes (every node serves "
        "a batching 8 ms classifier and a 40 ms detector), 8 callers, Poisson arrivals at "
        f"about 70 % of the fleet's capacity, {run['requests']:,} requests of four priority "
        "classes. Wall time and the child's peak resident memory as the operating system "
        "counts them."
    )
    title = "(b) Scale: 10,000 nodes and 1,000,000 requests"
    return Part(title, measured, [md_table(headers, [row])], targets if target else [], notes)


# ---------------------------------------------------------------- (c) the table


def measure_table(sizes: Sequence[tuple[int, int]]) -> list[list[Any]]:
    """Every scenario under every policy at every (nodes, requests) size, two runs at a
    time (each is deterministic, and one core's work)."""
    jobs = [(n, r, s, p) for n, r in sizes for s in SCENARIOS for p in POLICIES]
    out = []
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(_table_row, jobs):
            log(f"  (c) {row[0]} nodes, {row[1]}, {row[2]}: fg p99 {row[3]:.1f} ({row[7]:.0f} s)")
            out.append(row)
    return out


def _table_row(job: tuple[int, int, str, str]) -> list[Any]:
    """nodes, scenario, policy, fg p99 ms, all p99 ms, counts, simulated s, wall s and
    each class's p50 and p99 ms."""
    nodes, requests, scenario, policy = job
    config = with_policy(table_config(mixed=scenario == "mixed models"), policy)
    workload = table_workload(scenario, nodes, requests)
    r = simulate(config, workload, nodes=nodes, requests=requests, label=policy)
    rows = r.latency_table()
    nan = lambda v: math.nan if v is None else v  # noqa: E731
    by_class = {row["name"]: (nan(row["p50_ms"]), nan(row["p99_ms"])) for row in rows[:-1]}
    fg, every = rows[0]["p99_ms"], rows[-1]["p99_ms"]
    return [nodes, scenario, policy, fg, every, r.counts(), r.simulated_s, r.wall_s, by_class]


def _why_all_p99(nodes: int, scenario: str, mine: list[Any], winner: list[Any]) -> str:
    """Where the default's all-priorities p99 loses to ``winner``'s: the figures by
    class, and why when only the lowest classes lose."""
    classes = list(mine[8])  # highest priority first
    worse = [c for c in classes if mine[8][c][1] > winner[8][c][1]]
    figures = ", ".join(
        f"{c} {fmt(mine[8][c][0])} / {fmt(mine[8][c][1])} vs {fmt(winner[8][c][0])} / "
        f"{fmt(winner[8][c][1])} ms"
        for c in classes
    )
    head = (
        f"{nodes:,} nodes, {scenario}: {fmt(mine[4])} ms vs {fmt(winner[4])} ms "
        f"({winner[2]}); {figures}."
    )
    if not worse or worse != classes[len(classes) - len(worse) :]:
        return head
    share = table_config().router.placement.lower_share
    return (
        f"{head} Every class above {worse[0]} has the lower p99 under the default: it "
        "places each request where it would finish soonest at its own priority (the "
        f"delay it adds to lower work counts at `lower_share` = {share:g}), and "
        f"{' and '.join(worse)} work waits the longer."
    )


def _table_part(rows: list[list[Any]], default: str) -> Part:
    table_rows, targets, wins = [], [], []
    for nodes in sorted({r[0] for r in rows}):
        for scenario in SCENARIOS:
            group = [r for r in rows if r[0] == nodes and r[1] == scenario]
            best_fg, best_all = min(r[3] for r in group), min(r[4] for r in group)
            for r in group:
                c = r[5]
                table_rows.append(
                    [f"{nodes:,}", scenario, r[2]]
                    + [f"**{fmt(r[3])}**" if r[3] == best_fg else fmt(r[3])]
                    + [f"**{fmt(r[4])}**" if r[4] == best_all else fmt(r[4])]
                    + [c["completed"], c["rejected"] + c["evicted"] + c["expired"]]
                    + [c.get("node_failures", 0), fmt(r[6], 2)]
                )
            mine = next(r for r in group if r[2] == default)
            label = f"(c) {nodes:,} nodes, {scenario}: {default} fg p99 / best"
            targets.append(Target(label, mine[3] / best_fg, "<=", 1.05))
            if mine[4] > best_all * 1.05:
                wins.append(_why_all_p99(nodes, scenario, mine, min(group, key=lambda r: r[4])))
    headers = ["nodes", "scenario", "policy", "fg p99 ms", "all p99 ms", "completed"]
    headers += ["refused / evicted / expired", "node failures", "simulated s"]
    why = "Where the default loses on all-priorities p99, and why (by class, p50 and p99 of "
    notes = [why + "the default and of the winner): " + " ".join(wins)] if wins else []
    measured = (
        "Simulated fleets of 1,000 and 10,000 nodes, each node serving a batching 8 ms "
        "classifier and a 40 ms detector (mixed models: a third serve only the classifier, "
        "a third only the detector), 8 callers placing requests, every placement policy of "
        "the registry (`policies.placement`) on the same arrivals: homogeneous Poisson at "
        "~70 % load; three node classes at speeds 1, 0.5 and 0.25; mixed models; bursts of "
        "3x for a quarter of every second; 1 % of the nodes failing at random times during "
        "the run (they stay down, what they held is re-placed); reports 100 ms older when "
        "callers get them. Best of each column per scenario in bold."
    )
    table = md_table(headers, table_rows)
    return Part("(c) Placement policies x scenarios, simulated", measured, [table], targets, notes)


# ------------------------------------------------------------------------ the run


def run(ctx: RunContext) -> bc.Section:
    chosen = os.environ.get("EDGEFLEET_BENCH_SIM_PARTS", "abc")
    parts = []
    if "a" in chosen:
        log("(a) fidelity: one trace on the real fleet and in the simulator")
        costs = {CHEAP: CHEAP_COST_MS, DEAR: DEAR_COST_MS}
        models = {m: ctx.models.calibrated(ms) for m, ms in costs.items()}
        parts.append(timed(lambda: _fidelity_part(measure_fidelity(ctx, models))))
    if "b" in chosen:
        nodes, requests = (1000, 20_000) if ctx.quick else (SCALE_NODES, SCALE_REQUESTS)
        log(f"(b) scale: {nodes:,} nodes, {requests:,} requests in a child process")
        with tempfile.TemporaryDirectory() as tmp:
            measure = partial(measure_scale, nodes, requests, Path(tmp))
            parts.append(timed(lambda: _scale_part(measure(), target=not ctx.quick)))
    if "c" in chosen:
        sizes = [(100, 5_000)] if ctx.quick else [(1000, 100_000), (10_000, 200_000)]
        log(f"(c) placement policies x scenarios at {', '.join(f'{n:,}' for n, _ in sizes)} nodes")
        default = table_config().router.placement.policy
        parts.append(timed(lambda: _table_part(measure_table(sizes), default)))
    measured = (
        "The discrete-event fleet simulator (`edgefleet simulate`, `sim/`): the real node "
        "scheduler and the real placement in simulated time, engine time from cost tables "
        "or drawn from a recorded run."
    )
    return bc.Section(TITLE, measured, parts=parts)
