"""Rollouts under load: a model's new version node by node on a fleet of 4 nodes while
it serves, and the automatic rollback of versions that should not go on.

The fleet serves a slow MLP calibrated to ~3 ms per call (`modelgen.calibrate_slow`)
to a foreground stream (30 requests/s of 1 row, open loop) and a background flood (2
requests in flight per node, closed loop), both from this process, every answer
counted by outcome. Both streams send 20 inputs in turn, one of them with a value
above the failing version's threshold (5% of the traffic). Four rollouts in turn, each
with its steady-state window first (its foreground latency is the baseline), then the
rollout (canary 1, step 1) and a few seconds after it: (1) v2, the same cost with
other weights, default gates; (2) a version 3x slower (3x the layers), gate
`p99<=1.5x`; (3) a version that fails requests holding a value above 8 (5% of the
traffic), gate `error_rate<=0.01`; (4) a version too large for the nodes' memory
budget (it does not load). Lost: requests sent that got no reply. Untyped: replies
whose error is not an `EdgeFleetError`. Wrong outputs: answers that are not those of
an in-process ONNX Runtime session of the version that should have answered (before
and during a rollout the old or the new one, after it the one the fleet serves).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import common as bc
from bench.common import GET_TIMEOUT_S, Feed, RunContext, Section, Target, fmt, log
from cluster.client import FleetClient
from cluster.rollout import Rollout
from cluster.traffic import Answer, ClosedLoop, OpenLoop, in_background
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import make_slow
from edgefleet.priorities import resolve_priority
from sim import rollout as sim_rollout
from sim.workload import Arrival

TITLE = "Rollouts under load: a new version on 4 nodes, and automatic rollbacks"
MODEL = "scorer"
NODES = 4
COST_MS = 3.0
FG_RATE = 30.0  # foreground requests/s
BG_PER_NODE = 2  # background requests in flight per node
MIX = 20  # inputs sent in turn; the last holds a value above FAIL_ABOVE (5% of them)
FAIL_ABOVE = 8.0
BUDGET_MB = 12.0  # each node's memory budget: v1 needs ~4 MB, the large version ~16
WARM_S = 1.0  # the start of a steady-state window, not counted
P99_LIMIT = 1.5  # foreground p99 during a rollout, times its steady-state p99


class Mixed:
    """The fleet's client as both streams' ``cluster.traffic.Client``: each request
    carries the next of ``feeds`` whatever input its driver gives, and the feed it
    carried is kept by request id (its outputs are checked against it)."""

    def __init__(self, client: FleetClient, feeds: Sequence[Feed]) -> None:
        self.client, self.feeds = client, list(feeds)
        self.sent: dict[str, int] = {}
        self._turn = itertools.count()

    def submit(self, model: str, inputs: Mapping[str, np.ndarray], **kw: Any) -> Any:
        i = next(self._turn) % len(self.feeds)
        self.sent[kw["request_id"]] = i
        return self.client.submit(model, self.feeds[i], **kw)

    def cancel(self, request_id: str, timeout_s: float = 10.0) -> bool:
        return self.client.cancel(request_id, timeout_s)


@dataclass
class Traffic:
    """Every answer of both streams, and how many requests they sent."""

    fg: list[Answer] = field(default_factory=list)
    bg: list[Answer] = field(default_factory=list)
    submitted: int = 0

    @property
    def lost(self) -> int:
        return self.submitted - len(self.fg) - len(self.bg)


@contextlib.contextmanager
def streams(mixed: Mixed) -> Iterator[Traffic]:
    """The foreground stream and the background flood while the block runs; at its end
    both stop sending and every reply still due is waited for (bounded)."""
    out = Traffic()
    level = resolve_priority("foreground", mixed.client.config.priorities)
    arrivals = (Arrival(i / FG_RATE, MODEL, level) for i in itertools.count())
    feed = {MODEL: mixed.feeds[0]}
    fg = OpenLoop(mixed, arrivals, feed, on_answer=out.fg.append)
    lanes = NODES * BG_PER_NODE
    bg = ClosedLoop(mixed, MODEL, feed[MODEL], lanes=lanes, on_answer=out.bg.append)
    with (
        in_background(bg, GET_TIMEOUT_S, drain=True, name="bench-rollout-bg"),
        in_background(fg, GET_TIMEOUT_S, drain=True, name="bench-rollout-fg"),
    ):
        yield out
    out.submitted = fg.counts.submitted + bg.counts.submitted


@dataclass(frozen=True)
class Case:
    label: str
    version: str
    path: Path
    gates: str
    bake_s: float
    expect: str  # the phase it should end in
    steady_s: float


@dataclass(frozen=True)
class Result:
    case: Case
    rollout: Rollout
    traffic: Traffic
    marks: tuple[float, float, float]  # steady window from, rollout asked, rollout ended
    wrong: int  # answers whose outputs are not the expected version's

    def fg_ms(self, window: int) -> bc.Summary:
        """Foreground latency of completed requests sent in the steady-state window (0),
        during the rollout (1) or after it (2)."""
        ends = (*self.marks, float("inf"))
        return bc.Summary.of(
            [
                1000 * a.latency_s
                for a in self.traffic.fg
                if a.reply.error is None and ends[window] <= a.sent < ends[window + 1]
            ]
        )

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(bc.error_name(a.reply) or "ok" for a in self.traffic.fg + self.traffic.bg)

    @property
    def untyped(self) -> int:
        errors = (a.reply.error for a in self.traffic.fg + self.traffic.bg)
        return sum(1 for e in errors if e is not None and not isinstance(e, EdgeFleetError))

    @property
    def seconds(self) -> float:
        return (self.rollout.ended or float("nan")) - self.rollout.started

    @property
    def ended_as_expected(self) -> bool:
        return self.rollout.phase == self.case.expect

    @property
    def p99_ratio(self) -> float:
        return self.fg_ms(1).p99 / self.fg_ms(0).p99


def expected_outputs(path: Path, feeds: Sequence[Feed]) -> list[np.ndarray | None]:
    """``y`` of each feed from an in-process session of ``path`` (None: the call fails)."""
    session = bc.raw_session(path)
    out: list[np.ndarray | None] = []
    for feed in feeds:
        try:
            out.append(session.run(None, feed)[0])
        except Exception:  # the failing version, on the feed above its threshold
            out.append(None)
    return out


def wrong_outputs(
    traffic: Traffic,
    sent: Mapping[str, int],
    after: float,
    old: list[Any],
    new: list[Any],
    done: bool,
) -> int:
    """Completed answers that are neither version's (before ``after``) or not the
    served version's (from ``after`` on: ``new`` when ``done``, else ``old``)."""
    wrong = 0
    for a in traffic.fg + traffic.bg:
        if a.reply.error is not None or a.reply.outputs is None:
            continue
        i = sent[a.reply.request_id]
        allowed = [new if done else old] if a.sent >= after else [old, new]
        y = a.reply.outputs["y"]
        if not any(
            v[i] is not None and np.allclose(y, v[i], rtol=1e-4, atol=1e-5) for v in allowed
        ):
            wrong += 1
    return wrong


def run_case(client: FleetClient, mixed: Mixed, case: Case, old: Path, after_s: float) -> Result:
    log(f"rollout: {case.label}")
    with streams(mixed) as traffic:
        t0 = time.perf_counter() + WARM_S
        time.sleep(WARM_S + case.steady_s)
        t1 = time.perf_counter()
        rollout = client.rollout(
            MODEL, case.path, version=case.version, canary=1, step=1, bake_s=case.bake_s,
            gates=case.gates, timeout_s=600, progress=lambda s: log(f"  {s}"),
        )  # fmt: skip
        t2 = time.perf_counter()
        time.sleep(after_s)
    done = rollout.phase == "done"
    olds, news = (expected_outputs(p, mixed.feeds) for p in (old, case.path))
    wrong = wrong_outputs(traffic, mixed.sent, t2, olds, news, done)
    result = Result(case, rollout, traffic, (t0, t1, t2), wrong)
    log(f"  {rollout.phase} in {result.seconds:.1f} s, {traffic.lost} lost: {rollout.why}")
    return result


def row(r: Result) -> list[str]:
    steady, during = r.fg_ms(0), r.fg_ms(1)
    bake = f"{len(r.rollout.steps)} x {r.case.bake_s:g}"
    return [
        f"{r.case.label} (@{r.rollout.old.name} -> @{r.rollout.new.name})",
        f"{len(r.traffic.fg)} / {len(r.traffic.bg)}", bc.pairs_text(r.outcomes),
        str(r.traffic.lost), f"{fmt(steady.p50)} / {fmt(during.p50)}",
        f"{fmt(steady.p99)} / {fmt(during.p99)}", fmt(r.p99_ratio, 2), fmt(r.seconds),
        bake, r.rollout.phase, str(r.wrong), r.rollout.why,
    ]  # fmt: skip


COLUMNS = ["case", "requests fg / bg", "outcomes", "lost", "fg p50 ms steady / during"]
COLUMNS += ["fg p99 ms steady / during", "p99 during / steady", "rollout s"]
COLUMNS += ["bake s (steps x s)", "phase", "wrong outputs", "why"]


def targets(r: Result) -> list[Target]:
    name = r.case.label.split(":")[0]
    out = [
        Target(f"{name}: requests lost", r.traffic.lost, "<=", 0, 0),
        Target(f"{name}: replies with an untyped error", r.untyped, "<=", 0, 0),
        Target(f"{name}: answers with wrong outputs", r.wrong, "<=", 0, 0),
        Target(f"{name}: ended {r.case.expect} (1 yes, 0 no)", float(r.ended_as_expected),
               ">=", 1, 0),
    ]  # fmt: skip
    if r.case.expect == "done":
        label = f"{name}: foreground p99 during the rollout / steady state"
        out.append(Target(label, r.p99_ratio, "<=", P99_LIMIT))
    else:
        label = f"{name}: rollout seconds / the bakes of all its steps"
        out.append(Target(label, r.seconds / (len(r.rollout.steps) * r.case.bake_s), "<=", 1))
        label = f"{name}: rollout seconds / one bake (rolled back in the canary's bake)"
        out.append(Target(label, r.seconds / r.case.bake_s, "<=", 1))
    return out


def run(ctx: RunContext) -> Section:
    v1 = ctx.models.calibrated(COST_MS)
    folder = v1.path.parent / "rollout"
    w, n = v1.width, v1.layers

    def version(name: str, **kw: Any) -> Path:
        return make_slow(folder / name / f"{MODEL}.onnx", width=w, **kw)

    bake, steady = ctx.pick(10.0, 3.0), ctx.pick(30.0, 5.0)
    gate_bake, gate_steady = ctx.pick(30.0, 10.0), ctx.pick(10.0, 3.0)
    cases = [
        Case("1: v2, same cost", "v2", version("v2", layers=n, seed=2),
             "error_rate<=0.01,p99<=1.5x", bake, "done", steady),
        Case("2: 3x slower", "slow", version("slow", layers=3 * n, seed=3),
             "p99<=1.5x", gate_bake, "rolled back", gate_steady),
        Case("3: fails 5% of requests", "failing",
             version("failing", layers=n, seed=4, fail_above=FAIL_ABOVE),
             "error_rate<=0.01", gate_bake, "rolled back", gate_steady),
        Case("4: does not load (memory budget)", "large",
             version("large", layers=max(n, 32), seed=5, distinct_weights=max(n, 32)),
             "error_rate<=0.01,p99<=1.5x", gate_bake, "rolled back", gate_steady),
    ]  # fmt: skip
    feeds = [bc.slow_feed(w, seed=i) for i in range(MIX)]
    feeds[-1]["x"][0, 0] = 2 * FAIL_ABOVE
    nodes = [{"name": f"n{i}", "memory_budget_mb": BUDGET_MB} for i in range(NODES)]
    entry = bc.ModelEntry(MODEL, v1.path)
    config = bc.fleet_config("bench-rollout", [entry], node_list=nodes, router={})
    results: list[Result] = []
    with bc.deployed(config) as client:
        mixed, serving = Mixed(client, feeds), v1.path
        for case in cases:
            results.append(run_case(client, mixed, case, serving, ctx.pick(5.0, 2.0)))
            serving = case.path if results[-1].rollout.phase == "done" else serving
    return Section(
        TITLE,
        (__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(),
        tables=[bc.md_table(COLUMNS, [row(r) for r in results])],
        targets=[t for r in results for t in targets(r)],
        notes=[
            f"Model: {v1.describe()}; the slow version has {3 * n} layers, the large one "
            f"{max(n, 32)} distinct weight matrices (the nodes' memory budget is "
            f"{BUDGET_MB:g} MB). Latency: from submit to reply in this process, completed "
            f"requests; steady state is the {steady:g} s (case 1) or {gate_steady:g} s window "
            "before each rollout, during is from the rollout's start to its end. Each "
            "rollout starts from the version the fleet serves after the one before."
        ],
        parts=[simulated()],
    )


def simulated() -> Section:
    """The same rollouts at 1,000 nodes, in the simulator (sim/rollout.py)."""
    good, bad = sim_rollout.sweep(), sim_rollout.sweep(bakes=(60,), fail_at=3)
    return Section(
        "Simulated: 1,000 nodes",
        "`edgefleet simulate-rollout` (sim/rollout.py, its default parameters: a 200 MiB "
        "model, canary 1 %, per node a drain of 0.5 s, a load of 2 s and a warm-up of 1 s "
        "with a lognormal spread, 50 MiB/s per node from a store serving 1 GiB/s): time to "
        "finish, the largest share of nodes out of service at once and the capacity lost "
        "(node-seconds out / nodes), by step size and bake; then a version that fails its "
        "gate at step 3 (bake 60 s) and the rollback of the nodes moved by then.",
        tables=[sim_rollout.table(good), sim_rollout.table(bad)],
        level=3,
    )
