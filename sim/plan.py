"""Capacity planning: the fewest nodes that meet latency and completion targets for a
given traffic, found in simulation (``edgefleet plan``).

The traffic is fixed: a workload whose rate is given per node (``rate_per_node``) is
taken at the config's size (its rate times the config's nodes) and then held at that
total while the fleet grows or shrinks. Fleet sizes are tried doubling from one node
until every target is met, then bisected between the largest size that missed and the
smallest that met, each size one simulation with the real schedulers and placement
(the workload's seed for all, so sizes meet the same arrivals). The search takes more
nodes to be no worse, which holds for the fleets here (identical nodes, or the config's
nodes repeated in turn); the curve of every size tried is kept to show it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from edgefleet.config import FleetConfig
from edgefleet.errors import InvalidInput
from sim.fleet import ModelCost
from sim.report import ALL, RunResult, md_table
from sim.run import simulate
from sim.workload import Workload

Figure = Literal["p50", "p99", "max", "completed"]
_TARGET = re.compile(
    r"^\s*(?P<cls>[\w-]+)\.(?P<figure>p50|p99|max|completed)\s*(?P<op><=|>=)\s*"
    r"(?P<value>[0-9]*\.?[0-9]+)\s*(?P<unit>ms|s|%)?\s*$"
)
TARGET_HELP = (
    "CLASS.FIGURE<=VALUE or >=, comma-separated: FIGURE p50, p99 or max (latency of "
    "completed requests, in ms or s) or completed (the share answered with a result, a "
    "fraction or %); CLASS a priority class or 'all'. E.g. "
    "'foreground.p99<=50ms,offline.completed>=0.99'"
)


@dataclass(frozen=True)
class Target:
    """One target: ``cls``'s ``figure`` ``op`` ``value`` (seconds, or a fraction)."""

    cls: str
    figure: Figure
    op: Literal["<=", ">="]
    value: float
    text: str

    def measure(self, result: RunResult) -> float | None:
        """The figure in ``result`` (None: the class had no completed request)."""
        row = next((r for r in result.latency_table() if r["name"] == self.cls), None)
        if row is None:
            return None
        if self.figure == "completed":
            return row["completed"] / row["answered"] if row["answered"] else None
        ms = row[f"{self.figure}_ms"]  # type: ignore[literal-required]
        return None if ms is None else ms / 1000.0

    def met(self, value: float | None) -> bool:
        if value is None:
            return False
        return value <= self.value if self.op == "<=" else value >= self.value

    def show(self, value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.1%}" if self.figure == "completed" else f"{value * 1000:.1f} ms"

    def margin(self, value: float | None) -> str:
        """How far ``value`` is inside the target (negative: outside)."""
        if value is None:
            return "-"
        if self.figure == "completed":
            return f"{(value - self.value) * 100:+.1f} points"
        room = (self.value - value) / self.value if self.value else 0.0
        return f"{room:+.0%} of the bound"


def parse_targets(text: str, classes: Sequence[str]) -> list[Target]:
    """Targets from ``CLASS.FIGURE<=VALUE,...``; InvalidInput naming a bad one."""
    targets = []
    for part in [p for p in text.split(",") if p.strip()]:
        m = _TARGET.match(part)
        if m is None:
            raise InvalidInput(f"target {part.strip()!r} is not {TARGET_HELP}")
        cls, figure, unit = m["cls"], m["figure"], m["unit"]
        if cls != ALL and cls not in classes:
            known = ", ".join([*classes, ALL])
            raise InvalidInput(f"target {part.strip()!r}: unknown class {cls!r}; known: {known}")
        value = float(m["value"])
        if figure == "completed":
            if unit in ("ms", "s"):
                raise InvalidInput(f"target {part.strip()!r}: completed is a share, not a time")
            value = value / 100 if unit == "%" else value
            if not 0 <= value <= 1:
                raise InvalidInput(f"target {part.strip()!r}: a share from 0 to 1 (or 0-100%)")
        else:
            if unit not in ("ms", "s"):
                raise InvalidInput(f"target {part.strip()!r}: give the latency in ms or s")
            value = value / 1000 if unit == "ms" else value
        op = "<=" if m["op"] == "<=" else ">="
        targets.append(Target(cls, figure, op, value, part.strip()))  # type: ignore[arg-type]
    if not targets:
        raise InvalidInput(f"no target given: {TARGET_HELP}")
    return targets


@dataclass(frozen=True)
class Trial:
    """One fleet size simulated: each target's value, and whether all were met."""

    nodes: int
    values: tuple[float | None, ...]
    met: tuple[bool, ...]

    @property
    def passed(self) -> bool:
        return all(self.met)


@dataclass
class Plan:
    targets: list[Target]
    rate: float | None  # the traffic held fixed (requests/s), None for a trace
    trials: list[Trial] = field(default_factory=list)  # every size tried, by nodes
    max_nodes: int = 0

    @property
    def answer(self) -> Trial | None:
        """The smallest size that met every target."""
        return next((t for t in self.trials if t.passed), None)

    def lines(self) -> list[str]:
        """The answer (or why there is none), its margins, and the curve."""
        out = []
        answer = self.answer
        traffic = f"{self.rate:g} requests/s" if self.rate is not None else "the trace"
        if answer is None:
            last = self.trials[-1]
            out.append(
                f"no fleet of up to {self.max_nodes} nodes meets every target for {traffic}; "
                f"at {last.nodes} nodes:"
            )
            for t, v, ok in zip(self.targets, last.values, last.met, strict=True):
                out.append(f"  {t.text}: {t.show(v)} ({'met' if ok else 'missed'}, {t.margin(v)})")
        else:
            out.append(f"{answer.nodes} node(s) meet every target for {traffic}")
            for t, v in zip(self.targets, answer.values, strict=True):
                out.append(f"  {t.text}: {t.show(v)} ({t.margin(v)})")
            below = [x for x in self.trials if x.nodes < answer.nodes]
            if below:  # the targets that fail first as the fleet shrinks
                worst = below[-1]
                missed = [t.text for t, ok in zip(self.targets, worst.met, strict=True) if not ok]
                out.append(f"at {worst.nodes} node(s) {', '.join(missed)} fail(s) first")
        headers = ["nodes", *[t.text for t in self.targets], "all met"]
        rows = [
            [x.nodes, *[t.show(v) for t, v in zip(self.targets, x.values, strict=True)],
             "yes" if x.passed else "no"]
            for x in self.trials
        ]  # fmt: skip
        return [*out, "", md_table(headers, rows)]


def fixed_traffic(workload: Workload, nodes: int) -> tuple[Workload, float | None]:
    """``workload`` with its rate for the whole fleet: a per-node rate times ``nodes``."""
    a = workload.arrival_process
    if a is None or a.rate_per_node is None:
        return workload, a.rate if a is not None else None
    rate = a.rate_per_node * nodes
    arrivals = a.model_copy(update={"rate": rate, "rate_per_node": None})
    return workload.model_copy(update={"arrival_process": arrivals}), rate


def plan(
    config: FleetConfig,
    workload: Workload,
    targets: Sequence[Target],
    *,
    max_nodes: int = 1024,
    requests: int | None = None,
    costs: Mapping[str, ModelCost] | None = None,
    tried: Callable[[Trial], None] | None = None,
) -> Plan:
    """The fewest nodes of ``config`` (grown as ``edgefleet simulate --nodes`` grows it)
    meeting every target on ``workload``'s traffic; ``tried`` hears of each size."""
    fixed, rate = fixed_traffic(workload, len(config.node_specs()))
    result = Plan(list(targets), rate, max_nodes=max_nodes)
    seen: dict[int, Trial] = {}

    def trial(n: int) -> Trial:
        if n not in seen:
            run = simulate(config, fixed, nodes=n, requests=requests, costs=costs)
            if run.interrupted:  # Ctrl-C: the search stops here
                raise KeyboardInterrupt
            values = tuple(t.measure(run) for t in targets)
            seen[n] = Trial(
                n, values, tuple(t.met(v) for t, v in zip(targets, values, strict=True))
            )
            if tried is not None:
                tried(seen[n])
        return seen[n]

    low, n = 0, 1  # low: the largest size known to miss
    while n < max_nodes and not trial(n).passed:
        low, n = n, min(2 * n, max_nodes)
    high = n if trial(n).passed else None
    while high is not None and high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if trial(mid).passed else (mid, high)
    result.trials = [seen[k] for k in sorted(seen)]
    return result


def plot(result: Plan, path: Path) -> Path:
    """Each target's figure against the fleet size, its bound dashed: ``path`` (PNG)."""
    from matplotlib.ticker import ScalarFormatter

    from sim.report import _new_figure

    fig = _new_figure(6.5, 2.2 * len(result.targets) + 0.6)
    axes = fig.subplots(len(result.targets), 1, squeeze=False)[:, 0]
    nodes = [x.nodes for x in result.trials]
    for ax, (i, target) in zip(axes, enumerate(result.targets), strict=True):
        scale = 100.0 if target.figure == "completed" else 1000.0
        values = [x.values[i] for x in result.trials]
        ax.plot(
            [n for n, v in zip(nodes, values, strict=True) if v is not None],
            [v * scale for v in values if v is not None],
            marker="o",
        )
        ax.axhline(target.value * scale, linestyle="--", color="grey")
        if result.answer is not None:
            ax.axvline(result.answer.nodes, color="green", alpha=0.4)
        ax.set_ylabel("%" if target.figure == "completed" else "ms")
        ax.set_title(target.text, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
    axes[-1].set_xlabel("nodes")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
