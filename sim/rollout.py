"""A model's staged rollout across a fleet, in simulated time: how long it takes and how
much of the fleet's capacity for the model it costs, by step size and bake time; and,
for a bad version, how long rolling back takes and what it costs.

The steps are :func:`policies.rollout.plan_steps`: a canary, then steps of a share of
the nodes. A step's nodes first fetch the new version's files while still serving, each
at its own bandwidth or its fair share of the store's, whichever is less (the store's
total bandwidth is shared by the nodes fetching at once). As its fetch ends, a node
drains (refuses new calls for the model, finishes the calls it holds), loads the new
version, warms it up and admits again: it is out of service for the model from the
start of its drain to its admission. When the step's last node admits, the moved nodes
bake for ``bake_s`` (every step, the last included: its gates still judge it); then the
next step begins. A bad version's gate fails at the end of step ``fail_at``'s bake (0:
the canary's) and every node moved so far rolls back at once, as policies/rollout.py
says: drain, load of the old version (still in the cache: no fetch), warm-up.

Per-node times are drawn from a seeded NumPy generator; the defaults (:class:`Params`)
are a 200 MiB model on 1,000 edge nodes: 50 MiB/s download per node, 1 GiB/s from the
store in all; a drain finishes the calls the node holds (Poisson, 5 on average, 0.1 s
median each: about 0.5 s); load 2 s and warm-up 1 s medians; per-node bandwidths, call,
load and warm-up times spread lognormally (sigma 0.3). Pure: no Ray, no ONNX Runtime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from policies.rollout import parse_share, plan_steps
from sim.report import md_table


@dataclass(frozen=True)
class Params:
    """The fleet, the model and the per-node time distributions (medians, and the
    lognormal sigma ``spread``)."""

    nodes: int = 1000
    model_mib: float = 200.0
    node_mib_s: float = 50.0  # each node's download bandwidth (median)
    store_mib_s: float = 1024.0  # the store's, shared by the nodes fetching at once
    queued_calls: float = 5.0  # calls a draining node holds, on average (Poisson)
    call_s: float = 0.1
    load_s: float = 2.0
    warmup_s: float = 1.0
    spread: float = 0.3


@dataclass(frozen=True)
class RolloutResult:
    """One scenario. ``peak_out``: the largest share of nodes out of service for the
    model at once; ``lost_s``: node-seconds out of service / nodes (whole-fleet seconds
    of capacity). For a bad version, ``failed_at`` is the step whose gate failed and the
    rollback figures are set."""

    step: str
    bake_s: float
    steps: int  # the canary included
    finish_s: float  # the last step's bake over, or the rollback done
    peak_out: float
    lost_s: float
    failed_at: int | None = None
    rolled_back: int = 0  # nodes moved back to the old version
    rollback_s: float | None = None  # from the failed gate to the last node back
    rollback_peak: float | None = None


def simulate(
    params: Params,
    step: str,
    bake_s: float,
    canary: str = "1%",
    *,
    fail_at: int | None = None,
    rng: np.random.Generator,
) -> RolloutResult:
    """One rollout; with ``fail_at`` a bad version whose gate fails at the end of that
    step's bake (the last step's when there are fewer steps)."""
    names = [f"node-{i}" for i in range(params.nodes)]
    steps = plan_steps(names, parse_share(canary, "canary"), parse_share(step, "step"))
    failing = None if fail_at is None else min(fail_at, len(steps) - 1)
    now, moved = 0.0, 0
    outages: list[tuple[float, float]] = []
    for k, group in enumerate(steps):
        starts = now + _fetch_s(params, len(group), rng)
        ends = starts + _outage_s(params, len(group), rng)
        outages += zip(starts.tolist(), ends.tolist(), strict=True)
        now = float(ends.max()) + bake_s
        moved += len(group)
        if k == failing:
            break
    rolled_back, rollback_s = 0, None
    if failing is not None:
        back = now + _outage_s(params, moved, rng)
        outages += [(now, end) for end in back.tolist()]
        rolled_back, rollback_s = moved, float(back.max()) - now
        now += rollback_s
    return RolloutResult(
        step=step,
        bake_s=bake_s,
        steps=len(steps),
        finish_s=now,
        peak_out=_peak(outages) / params.nodes,
        lost_s=sum(end - start for start, end in outages) / params.nodes,
        failed_at=failing,
        rolled_back=rolled_back,
        rollback_s=rollback_s,
        rollback_peak=None if failing is None else moved / params.nodes,
    )


def _lognormal(median: float, sigma: float, n: int, rng: np.random.Generator) -> np.ndarray:
    return median * rng.lognormal(0.0, sigma, n)


def _outage_s(params: Params, n: int, rng: np.random.Generator) -> np.ndarray:
    """Drain (the calls each node holds), load and warm-up of ``n`` nodes."""
    calls = rng.poisson(params.queued_calls, n)
    drain = np.array([_lognormal(params.call_s, params.spread, c, rng).sum() for c in calls])
    load = _lognormal(params.load_s, params.spread, n, rng)
    warm = _lognormal(params.warmup_s, params.spread, n, rng)
    return drain + load + warm


def _fetch_s(params: Params, n: int, rng: np.random.Generator) -> np.ndarray:
    """When each of ``n`` nodes that start fetching together has the files: events at
    each fetch's end, the store's bandwidth shared max-min fairly in between (a node
    slower than its share leaves the rest to the others)."""
    caps = _lognormal(params.node_mib_s, params.spread, n, rng)
    left = np.full(n, params.model_mib)
    done = np.zeros(n)
    active = np.arange(n)
    now = 0.0
    while active.size:
        rates = _shares(caps[active], params.store_mib_s)
        dt = float((left[active] / rates).min())
        now += dt
        left[active] -= rates * dt
        finished = left[active] <= params.model_mib * 1e-9
        done[active[finished]] = now
        active = active[~finished]
    return done


def _shares(caps: np.ndarray, total: float) -> np.ndarray:
    """Max-min fair shares of ``total`` among flows capped at ``caps``."""
    order = np.argsort(caps)
    rates = np.empty_like(caps)
    for i, j in enumerate(order):
        rates[j] = min(caps[j], total / (len(caps) - i))
        total -= rates[j]
    return rates


def _peak(outages: Sequence[tuple[float, float]]) -> int:
    """The most intervals open at once (one ending as another starts: not both)."""
    events = sorted([(end, -1) for _, end in outages] + [(start, 1) for start, _ in outages])
    most = now = 0
    for _, change in events:
        now += change
        most = max(most, now)
    return most


def sweep(
    nodes: int = 1000,
    steps: Sequence[str] = ("1%", "5%", "10%", "25%"),
    bakes: Sequence[float] = (0, 60, 300),
    canary: str = "1%",
    seed: int = 0,
    *,
    model_mib: float | None = None,
    fail_at: int | None = None,
    params: Params | None = None,
) -> list[RolloutResult]:
    """Every step size with every bake time, each scenario drawn from ``seed`` afresh
    (at one step size, bake times differ by the bake alone). ``model_mib`` (MiB) and
    ``nodes`` override ``params``' (default :class:`Params`)."""
    p = replace(params or Params(), nodes=nodes)
    if model_mib is not None:
        p = replace(p, model_mib=model_mib)
    return [
        simulate(p, s, b, canary, fail_at=fail_at, rng=np.random.default_rng(seed))
        for s in steps
        for b in bakes
    ]


def table(results: Sequence[RolloutResult]) -> str:
    """The results as a Markdown table; the rollback's columns when a version failed."""
    bad = any(r.failed_at is not None for r in results)
    headers = ["step", "bake s", "steps", "finish", "peak out", "capacity lost s"]
    if bad:
        headers += ["failed at step", "rolled back", "rollback s", "rollback peak"]
    rows = []
    for r in results:
        row: list[object] = [
            r.step, f"{r.bake_s:g}", r.steps, duration(r.finish_s), f"{r.peak_out:.1%}",
            f"{r.lost_s:.2f}",
        ]  # fmt: skip
        if bad:
            row += [r.failed_at, r.rolled_back, _s(r.rollback_s), _share(r.rollback_peak)]
        rows.append(row)
    return md_table(headers, rows)


def duration(seconds: float) -> str:
    """``95 s``, ``12.5 min``, ``8.4 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
