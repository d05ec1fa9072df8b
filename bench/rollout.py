"""Rollouts under load: a model's new version node by node on a fleet of 4 nodes while
it serves, and the automatic rollback of versions that should not go on.

The fleet serves a slow MLP calibrated to ~3 ms per call (`modelgen.calibrate_slow`)
to a foreground stream (30 requests/s of 1 row, periodic arrivals of `sim.workload`,
open loop) and a background flood (2 requests in flight per node, closed loop), every
answer counted by outcome. Both send 20 inputs in turn, one with a value above the
failing version's threshold (5% of the traffic). Four rollouts in turn (canary 1, step
1), each after a steady-state window (its foreground latency is the baseline): (1) v2,
the same cost with other weights, default gates; (2) a version 3x slower, gate
`p99<=1.5x`; (3) one that fails requests holding a value above 8, gate
`error_rate<=0.01`; (4) one too large for the nodes' memory budget. Lost: requests
sent that got no reply. Untyped: replies whose error is not an `EdgeFleetError`. Wrong
outputs: answers that are not those of an in-process session of the version that
should have answered (during a rollout the old or the new one, after it the one served).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import common as bc
from bench.batching_window import periodic_arrivals
from bench.common import GET_TIMEOUT_S, Feed, RunContext, Section, Target, fmt, log
from cluster.client import FleetClient
from cluster.rollout import Rollout
from cluster.traffic import Answer, ClosedLoop, OpenLoop, in_background
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import make_slow
from sim import rollout as sim_rollout

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
COLUMNS = "case | requests fg / bg | outcomes | lost | fg p50 ms steady / during | fg p99 ms "
COLUMNS += "steady / during | p99 during / steady | rollout s | bake s (steps x s) | phase | "
COLUMNS += "wrong outputs | why"


class Mixed:
    """The fleet's client as both streams' ``cluster.traffic.Client``: each request
    carries the next of ``feeds`` whatever its driver gives, kept by request id."""

    def __init__(self, client: FleetClient, feeds: list[Feed]) -> None:
        self.client, self.feeds = client, feeds
        self.sent: dict[str, int] = {}  # request id -> the feed it carried
        self._turn = itertools.count()

    def submit(self, model: str, inputs: Any, **kw: Any) -> Any:
        i = next(self._turn) % len(self.feeds)
        self.sent[kw["request_id"]] = i
        return self.client.submit(model, self.feeds[i], **kw)

    def cancel(self, request_id: str, timeout_s: float = 10.0) -> bool:
        return self.client.cancel(request_id, timeout_s)

    def wrong(self, a: Answer, allowed: list[list[Any]]) -> bool:
        """Whether ``a`` completed with outputs that no version of ``allowed`` (the
        ``y`` of every feed, by :func:`outputs`) gives."""
        if a.reply.error is not None or a.reply.outputs is None:
            return False
        i, y = self.sent[a.reply.request_id], a.reply.outputs["y"]
        return not any(v[i] is not None and np.allclose(y, v[i], 1e-4, 1e-5) for v in allowed)


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
    answers: tuple[list[Answer], list[Answer]]  # foreground, background
    lost: int  # sent and never answered
    marks: tuple[float, float, float]  # steady window from, rollout asked, rollout ended
    wrong: int  # answers whose outputs are not the expected version's

    def fg_ms(self, window: int) -> bc.Summary:
        """Foreground latency of completed requests sent in the steady-state window (0),
        during the rollout (1) or after it (2)."""
        ends = (*self.marks, float("inf"))
        fg = self.answers[0]
        ok = [a for a in fg if a.reply.error is None and ends[window] <= a.sent < ends[window + 1]]
        return bc.Summary.of([1000 * a.latency_s for a in ok])

    @property
    def errors(self) -> list[BaseException | None]:
        return [a.reply.error for a in itertools.chain(*self.answers)]

    @property
    def seconds(self) -> float:
        return (self.rollout.ended or float("nan")) - self.rollout.started

    @property
    def p99_ratio(self) -> float:
        return self.fg_ms(1).p99 / self.fg_ms(0).p99

    def row(self) -> list[object]:
        steady, during, r = self.fg_ms(0), self.fg_ms(1), self.rollout
        outcomes = Counter(type(e).__name__ if e else "ok" for e in self.errors)
        return [
            f"{self.case.label} (@{r.old.name} -> @{r.new.name})",
            f"{len(self.answers[0])} / {len(self.answers[1])}",
            bc.pairs_text(outcomes),
            self.lost,
            f"{fmt(steady.p50)} / {fmt(during.p50)}",
            f"{fmt(steady.p99)} / {fmt(during.p99)}",
            fmt(self.p99_ratio, 2),
            fmt(self.seconds),
            f"{len(r.steps)} x {self.case.bake_s:g}",
            r.phase,
            self.wrong,
            r.why,
        ]

    def targets(self) -> list[Target]:
        name, r, bake = self.case.label.split(":")[0], self.rollout, self.case.bake_s
        untyped = sum(1 for e in self.errors if e is not None and not isinstance(e, EdgeFleetError))
        ended = float(r.phase == self.case.expect)
        out = [
            Target(f"{name}: requests lost", self.lost, "<=", 0, 0),
            Target(f"{name}: replies with an untyped error", untyped, "<=", 0, 0),
            Target(f"{name}: answers with wrong outputs", self.wrong, "<=", 0, 0),
            Target(f"{name}: ended {self.case.expect} (1 yes, 0 no)", ended, ">=", 1, 0),
        ]
        if self.case.expect == "done":
            label = f"{name}: foreground p99 during the rollout / steady state"
            return [*out, Target(label, self.p99_ratio, "<=", P99_LIMIT)]
        all_bakes = self.seconds / (len(r.steps) * bake)
        return out + [
            Target(f"{name}: rollout seconds / the bakes of all its steps", all_bakes, "<=", 1),
            Target(
                f"{name}: rollout seconds / one bake (rolled back in the canary's bake)",
                self.seconds / bake,
                "<=",
                1,
            ),
        ]


def outputs(path: Path, feeds: list[Feed]) -> list[np.ndarray | None]:
    """``y`` of each feed from an in-process session of ``path`` (None: the call fails)."""
    session, out = bc.raw_session(path), []
    for feed in feeds:
        try:
            out.append(session.run(None, feed)[0])
        except Exception:  # the failing version, on the feed above its threshold
            out.append(None)
    return out


def run_case(client: FleetClient, mixed: Mixed, case: Case, old: Path, after_s: float) -> Result:
    """The case's rollout, and the traffic from its steady-state window to ``after_s``
    after it ended."""
    log(f"rollout: {case.label}")
    fg_answers: list[Answer] = []
    bg_answers: list[Answer] = []
    fg = OpenLoop(
        mixed,
        periodic_arrivals(FG_RATE, MODEL),
        {MODEL: mixed.feeds[0]},
        on_answer=fg_answers.append,
    )
    lanes = NODES * BG_PER_NODE
    bg = ClosedLoop(mixed, MODEL, mixed.feeds[0], lanes=lanes, on_answer=bg_answers.append)
    with (
        in_background(bg, GET_TIMEOUT_S, drain=True, name="bench-rollout-bg"),
        in_background(fg, GET_TIMEOUT_S, drain=True, name="bench-rollout-fg"),
    ):
        t0 = time.perf_counter() + WARM_S
        time.sleep(WARM_S + case.steady_s)
        t1 = time.perf_counter()
        kw = {"canary": 1, "step": 1, "bake_s": case.bake_s, "gates": case.gates}
        progress = lambda s: log(f"  {s}")  # noqa: E731
        rollout = client.rollout(
            MODEL, case.path, version=case.version, timeout_s=600, progress=progress, **kw
        )
        t2 = time.perf_counter()
        time.sleep(after_s)
    lost = fg.counts.submitted + bg.counts.submitted - len(fg_answers) - len(bg_answers)
    versions = [outputs(old, mixed.feeds), outputs(case.path, mixed.feeds)]
    after = [versions[rollout.phase == "done"]]  # the version served after the rollout
    wrong = sum(
        mixed.wrong(a, after if a.sent >= t2 else versions) for a in fg_answers + bg_answers
    )
    result = Result(case, rollout, (fg_answers, bg_answers), lost, (t0, t1, t2), wrong)
    log(f"  {rollout.phase} in {result.seconds:.1f} s, {lost} lost: {rollout.why}")
    return result


def run(ctx: RunContext) -> Section:
    v1 = ctx.models.calibrated(COST_MS)
    w, n, large = v1.width, v1.layers, max(v1.layers, 32)

    def version(name: str, seed: int, **kw: Any) -> Path:
        return make_slow(
            v1.path.parent / "rollout" / name / f"{MODEL}.onnx", width=w, seed=seed, **kw
        )

    bake, steady = ctx.pick(10.0, 3.0), ctx.pick(30.0, 5.0)
    gated = (ctx.pick(30.0, 10.0), "rolled back", ctx.pick(10.0, 3.0))  # bake, expect, steady
    both = "error_rate<=0.01,p99<=1.5x"
    cases = [
        Case("1: v2, same cost", "v2", version("v2", 2, layers=n), both, bake, "done", steady),
        Case("2: 3x slower", "slow", version("slow", 3, layers=3 * n), "p99<=1.5x", *gated),
        Case(
            "3: fails 5% of requests",
            "failing",
            version("failing", 4, layers=n, fail_above=FAIL_ABOVE),
            "error_rate<=0.01",
            *gated,
        ),
        Case(
            "4: does not load (memory budget)",
            "large",
            version("large", 5, layers=large, distinct_weights=large),
            both,
            *gated,
        ),
    ]
    feeds = [bc.slow_feed(w, seed=i) for i in range(MIX)]
    feeds[-1]["x"][0, 0] = 2 * FAIL_ABOVE
    nodes = [{"name": f"n{i}", "memory_budget_mb": BUDGET_MB} for i in range(NODES)]
    config = bc.fleet_config(
        "bench-rollout", [bc.ModelEntry(MODEL, v1.path)], node_list=nodes, router={}
    )
    results: list[Result] = []
    with bc.deployed(config) as client:
        mixed, serving = Mixed(client, feeds), v1.path
        for case in cases:
            results.append(run_case(client, mixed, case, serving, ctx.pick(5.0, 2.0)))
            serving = case.path if results[-1].rollout.phase == "done" else serving
    note = (
        f"Model: {v1.describe()}; the slow version has {3 * n} layers, the large one {large} "
        f"distinct weight matrices (the nodes' memory budget is {BUDGET_MB:g} MB). Latency: "
        "from submit to reply in this process, completed requests; steady state is the "
        f"{steady:g} s (case 1) or {gated[2]:g} s window before each rollout, during is from "
        "the rollout's start to its end. Each rollout starts from the version the fleet "
        "serves after the one before."
    )
    good, bad = sim_rollout.sweep(), sim_rollout.sweep(bakes=(60,), fail_at=3)
    simulated = Section(
        "Simulated: 1,000 nodes",
        "`edgefleet simulate-rollout` (sim/rollout.py, its default parameters: a 200 MiB "
        "model, canary 1 %, per node a drain of 0.5 s, a load of 2 s and a warm-up of 1 s "
        "with a lognormal spread, 50 MiB/s per node from a store serving 1 GiB/s): time to "
        "finish, the largest share of nodes out of service at once and the capacity lost "
        "(node-seconds out / nodes), by step size and bake; then a version that fails its "
        "gate at step 3 (bake 60 s) and the rollback of the nodes moved by then.",
        [sim_rollout.table(good), sim_rollout.table(bad)],
        level=3,
    )
    return Section(
        TITLE,
        " ".join(__doc__.split("\n\n", 1)[1].split()),
        [bc.md_table(bc.columns(COLUMNS), [r.row() for r in results])],
        [t for r in results for t in r.targets()],
        [note],
        parts=[simulated],
    )
