"""Capacity planning: the fewest nodes that meet latency and completion targets for a
given traffic, found in simulation (``edgefleet plan``).

The traffic is fixed: a workload whose rate is given per node (``rate_per_node``) is
taken at the config's size (its rate times the config's nodes; a config of pools alone
counts as one node) and then held at that total while the fleet grows or shrinks.
Fleet sizes are tried doubling from one node until every target is met, then bisected
between the largest size that missed and the smallest that met, each size one
simulation with the real schedulers and placement (the workload's seed for all, so
sizes meet the same arrivals). The search takes more nodes to be no worse, which holds
for the fleets here (identical nodes, or the config's nodes repeated in turn); the curve
of every size tried is kept to show it.

Node types: each entry of ``nodes:`` and each pool of ``pools:`` is one (with
neither, the one type ``local``; :func:`sim.run.node_types`), and the workload's
``node_types:`` gives a type an engine speed, cost tables of its own and a price per
node. A config of one type is planned as above. With several (or a type of several
chosen alone) the search counts the nodes of each type, a mix, and takes adding a node
of any type to be no worse:

1. Rays: the search above along each type alone, then along all types in turn (the
   config's nodes repeated, as before), each about twice log2 of its answer in
   simulations: each type's own answer, and a mix.
2. Descent: from the best mix that met every target, try the mixes ``step`` nodes
   away that are better (one type ``step`` fewer, or ``step`` nodes of one type
   swapped for another type's, when that is cheaper), best first, moving to the first
   that still meets every target; when none does, halve ``step`` (it starts at half
   the largest count), down to 1.

It runs once for the fewest nodes (the cheaper of equal counts) and, when every type
has a price, once more for the cheapest mix (the fewer nodes of equal prices). A local
search: the answer is the best mix of those tried, each a neighbour of the rays'
answers, which the table of every mix tried shows. Mixes lacking a model the workload
uses miss every target, unsimulated and unlisted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from edgefleet.config import FleetConfig
from edgefleet.errors import InvalidInput
from sim.fleet import ModelCost
from sim.report import ALL, RunResult, md_table
from sim.run import NodeType, node_types, simulate
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

    def room(self, value: float | None) -> float:
        """How far ``value`` is inside the target, as a number: points of the share, or
        the share of the bound (-inf: no value)."""
        if value is None:
            return -math.inf
        if self.figure == "completed":
            return value - self.value
        return (self.value - value) / self.value if self.value else 0.0

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


class UnknownNodeType(InvalidInput):
    """A node type named that the config does not have."""


@dataclass(frozen=True)
class Trial:
    """One fleet size simulated: each target's value, and whether all were met."""

    nodes: int
    values: tuple[float | None, ...]
    met: tuple[bool, ...]
    counts: tuple[int, ...] = ()  # the nodes of each type searched (a plan of types)
    price: float | None = None  # of the mix, when every type has a price

    @property
    def passed(self) -> bool:
        return all(self.met)


@dataclass
class Plan:
    targets: list[Target]
    rate: float | None  # the traffic held fixed (requests/s), None for a trace
    trials: list[Trial] = field(default_factory=list)  # every size tried, by nodes
    max_nodes: int = 0
    types: list[NodeType] = field(default_factory=list)  # searched by count (several)

    @property
    def answer(self) -> Trial | None:
        """The smallest size that met every target (of types: the cheaper of equal)."""
        passed = [t for t in self.trials if t.passed]
        return min(passed, key=_fewest, default=None)

    @property
    def cheapest(self) -> Trial | None:
        """The cheapest mix that met every target (the fewer nodes of equal prices);
        None without prices."""
        passed = [t for t in self.trials if t.passed and t.price is not None]
        return min(passed, key=_cheapest, default=None)

    def mix(self, trial: Trial) -> str:
        """``trial``'s nodes by type: '2 fast + 1 slow'."""
        if not self.types:
            return f"{trial.nodes} node(s)"
        parts = [f"{n} {t.name}" for t, n in zip(self.types, trial.counts, strict=True) if n]
        return " + ".join(parts) or "none"

    def lines(self) -> list[str]:
        """The answer (or why there is none), its margins, and the curve."""
        if self.types:
            return self._typed_lines()
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

    def _typed_lines(self) -> list[str]:
        out = []
        traffic = f"{self.rate:g} requests/s" if self.rate is not None else "the trace"
        names = ", ".join(t.name for t in self.types)
        answer = self.answer
        if answer is None:
            last = max(self.trials, key=lambda x: (x.nodes, sum(x.met), self._worst(x)))
            out.append(
                f"no mix of up to {self.max_nodes} nodes of types {names} meets every "
                f"target for {traffic}; at {self.mix(last)}{self._price(last)}:"
            )
            for t, v, ok in zip(self.targets, last.values, last.met, strict=True):
                out.append(f"  {t.text}: {t.show(v)} ({'met' if ok else 'missed'}, {t.margin(v)})")
            missed = sorted(
                (t.room(v), t.text)
                for t, v, ok in zip(self.targets, last.values, last.met, strict=True)
                if not ok
            )
            out.append(f"missed there, furthest first: {', '.join(text for _, text in missed)}")
        else:
            out.append(
                f"{answer.nodes} node(s) meet every target for {traffic}: "
                f"{self.mix(answer)}{self._price(answer)}"
            )
            out += self._margins(answer)
            cheapest = self.cheapest
            if cheapest is not None and cheapest != answer:
                out.append(
                    f"cheapest: {self.mix(cheapest)} ({cheapest.nodes} node(s)"
                    f"{self._price(cheapest, ', ')})"
                )
                out += self._margins(cheapest)
            unpriced = [t.name for t in self.types if t.price is None]
            if len(unpriced) < len(self.types) and unpriced:
                out.append(f"no cheapest mix: no price for {', '.join(unpriced)}")
        headers = [*[t.name for t in self.types], "nodes"]
        priced = any(x.price is not None for x in self.trials)
        headers += ["price"] if priced else []
        headers += [*[t.text for t in self.targets], "all met"]
        rows = []
        for x in sorted(self.trials, key=lambda x: (x.nodes, x.counts)):
            row: list[object] = [*x.counts, x.nodes]
            row += [f"{x.price:g}" if x.price is not None else None] if priced else []
            row += [t.show(v) for t, v in zip(self.targets, x.values, strict=True)]
            rows.append([*row, "yes" if x.passed else "no"])
        return [*out, "", md_table(headers, rows)]

    def _worst(self, trial: Trial) -> float:
        """The least room of any target at ``trial``."""
        return min(t.room(v) for t, v in zip(self.targets, trial.values, strict=True))

    @staticmethod
    def _price(trial: Trial, sep: str = ", ") -> str:
        return "" if trial.price is None else f"{sep}price {trial.price:g}"

    def _margins(self, answer: Trial) -> list[str]:
        """Each target's margin at ``answer``, and what fails first below it: the
        largest mix tried of no more of any type that missed."""
        out = [
            f"  {t.text}: {t.show(v)} ({t.margin(v)})"
            for t, v in zip(self.targets, answer.values, strict=True)
        ]
        below = [
            x
            for x in self.trials
            if not x.passed
            and x.counts != answer.counts
            and all(a <= b for a, b in zip(x.counts, answer.counts, strict=True))
        ]
        if below:
            worst = max(below, key=lambda x: (x.nodes, sum(x.met), self._worst(x)))
            missed = [t.text for t, ok in zip(self.targets, worst.met, strict=True) if not ok]
            out.append(f"  at {self.mix(worst)} {', '.join(missed)} fail(s) first")
        return out


def _fewest(trial: Trial) -> tuple[float, float]:
    return trial.nodes, trial.price or 0.0


def _cheapest(trial: Trial) -> tuple[float, float]:
    return trial.price or 0.0, trial.nodes


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
    types: Sequence[str] | None = None,
) -> Plan:
    """The fewest nodes of ``config`` (grown as ``edgefleet simulate --nodes`` grows it)
    meeting every target on ``workload``'s traffic; ``tried`` hears of each size. With
    several node types (or ``types``, names of some: default all), the fewest and
    cheapest mix of them (see the module's note); UnknownNodeType for a name the config
    has no type of."""
    known = node_types(config, workload)
    chosen = list(known) if not types else list(dict.fromkeys(types))
    unknown = [t for t in chosen if t not in known]
    if unknown:
        raise UnknownNodeType(
            f"unknown node type {', '.join(map(repr, unknown))}; the config's: {', '.join(known)}"
        )
    fixed, rate = fixed_traffic(workload, max(1, len(config.node_specs())))
    result = Plan(list(targets), rate, max_nodes=max_nodes)
    if len(known) > 1 or known[chosen[0]].pool is not None:
        result.types = [known[t] for t in chosen]
        result.trials = _plan_types(
            config, fixed, targets, result.types, max_nodes, requests, costs, tried
        )
        return result
    seen: dict[int, Trial] = {}

    def trial(n: int) -> Trial:
        if n not in seen:
            run = simulate(config, fixed, nodes=n, requests=requests, costs=costs)
            seen[n] = _measured(n, run, targets)
            if tried is not None:
                tried(seen[n])
        return seen[n]

    _search(trial, max_nodes)
    result.trials = [seen[k] for k in sorted(seen)]
    return result


def _measured(
    n: int,
    run: RunResult,
    targets: Sequence[Target],
    counts: tuple[int, ...] = (),
    price: float | None = None,
) -> Trial:
    if run.interrupted:  # Ctrl-C: the search stops here
        raise KeyboardInterrupt
    values = tuple(t.measure(run) for t in targets)
    met = tuple(t.met(v) for t, v in zip(targets, values, strict=True))
    return Trial(n, values, met, counts, price)


def _search(trial: Callable[[int], Trial], max_nodes: int) -> None:
    """Sizes doubling from 1 until one meets every target, then bisected."""
    low, n = 0, 1  # low: the largest size known to miss
    while n < max_nodes and not trial(n).passed:
        low, n = n, min(2 * n, max_nodes)
    high = n if trial(n).passed else None
    while high is not None and high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if trial(mid).passed else (mid, high)


def _plan_types(
    config: FleetConfig,
    workload: Workload,
    targets: Sequence[Target],
    types: Sequence[NodeType],
    max_nodes: int,
    requests: int | None,
    costs: Mapping[str, ModelCost] | None,
    tried: Callable[[Trial], None] | None,
) -> list[Trial]:
    """Every mix of ``types`` tried: the rays, then the descents (module note)."""
    k = len(types)
    needed = workload.models()
    priced = all(t.price is not None for t in types)
    seen: dict[tuple[int, ...], Trial] = {}

    def serves(counts: Sequence[int]) -> bool:
        models = {m for t, n in zip(types, counts, strict=True) if n for m in t.template.models}
        return sum(counts) > 0 and needed <= models

    def price(counts: Sequence[int]) -> float | None:
        if not priced:
            return None
        return sum(n * (t.price or 0.0) for t, n in zip(types, counts, strict=True))

    def trial(counts: tuple[int, ...]) -> Trial:
        if not serves(counts):  # misses every target, not simulated nor listed
            return Trial(sum(counts), (None,) * len(targets), (False,) * len(targets), counts)
        if counts not in seen:
            specs, kinds = [], []
            for t, n in zip(types, counts, strict=True):
                specs += [t.spec(config, i) for i in range(n)]
                kinds += [t] * n
            run = simulate(
                config, workload, specs=specs, types=kinds, requests=requests, costs=costs
            )
            seen[counts] = _measured(sum(counts), run, targets, counts, price(counts))
            if tried is not None:
                tried(seen[counts])
        return seen[counts]

    def along(pattern: Sequence[int]) -> None:
        def at(n: int) -> Trial:
            counts = [0] * k
            for i in range(n):
                counts[pattern[i % len(pattern)]] += 1
            return trial(tuple(counts))

        _search(at, max_nodes)

    if not serves([1] * k):
        served = {m for t in types for m in t.template.models}
        raise InvalidInput(
            f"node types {', '.join(t.name for t in types)} serve no "
            f"{', '.join(sorted(needed - served))}, which the workload uses"
        )
    rays = [(i,) for i in range(k)] + ([tuple(range(k))] if k > 1 else [])
    for ray in rays:
        if serves([ray.count(i) for i in range(k)]):
            along(ray)
    keys: list[Callable[[Sequence[int]], tuple[float, float]]] = [
        lambda c: (sum(c), price(c) or 0.0)
    ]
    if priced:
        keys.append(lambda c: (price(c) or 0.0, sum(c)))
    for key in keys:
        passed = [x for x in seen.values() if x.passed]
        if not passed:
            break
        best = min(passed, key=lambda x: key(x.counts)).counts
        step = max(1, max(best) // 2)
        while True:
            near = set()
            for t in range(k):
                if best[t] < step:
                    continue
                for u in [None, *range(k)]:
                    if u != t:
                        c = list(best)
                        c[t] -= step
                        if u is not None:
                            c[u] += step
                        near.add(tuple(c))
            better = sorted(
                (c for c in near if key(c) < key(best) and serves(c)), key=lambda c: (key(c), c)
            )
            moved = next((c for c in better if trial(c).passed), None)
            if moved is not None:
                best = moved
            elif step > 1:
                step //= 2
            else:
                break
    return sorted(seen.values(), key=lambda x: (x.nodes, x.counts))


def plot(result: Plan, path: Path) -> Path:
    """Each target's figure against the fleet size, its bound dashed: ``path`` (PNG).
    A plan of node types shows each mix tried as a point (green: every target met) at
    its total, and for two types first a map of the mixes tried, by count of each."""
    if result.types:
        return _plot_types(result, path)
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


def _plot_types(result: Plan, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    from sim.report import _new_figure

    two = len(result.types) == 2
    panels = len(result.targets) + (1 if two else 0)
    fig = _new_figure(6.5, 2.4 * panels + 0.6)
    axes = list(fig.subplots(panels, 1, squeeze=False)[:, 0])
    trials = result.trials
    colour = ["green" if x.passed else "red" for x in trials]
    chosen = [x for x in (result.answer, result.cheapest) if x is not None]
    if two:
        ax = axes.pop(0)
        ax.scatter([x.counts[0] for x in trials], [x.counts[1] for x in trials], c=colour, s=18)
        for x, label in zip(chosen, ("fewest", "cheapest"), strict=False):
            ax.scatter([x.counts[0]], [x.counts[1]], s=120, facecolors="none", edgecolors="k")
            ax.annotate(label, (x.counts[0], x.counts[1]), fontsize=8, xytext=(6, 6),
                        textcoords="offset points")  # fmt: skip
        ax.set_xlabel(f"{result.types[0].name} nodes")
        ax.set_ylabel(f"{result.types[1].name} nodes")
        ax.set_title("mixes tried (green: every target met)", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax, (i, target) in zip(axes, enumerate(result.targets), strict=True):
        scale = 100.0 if target.figure == "completed" else 1000.0
        shown = [(x, c) for x, c in zip(trials, colour, strict=True) if x.values[i] is not None]
        ax.scatter(
            [x.nodes for x, _ in shown],
            [(x.values[i] or 0.0) * scale for x, _ in shown],
            c=[c for _, c in shown],
            s=18,
        )
        ax.axhline(target.value * scale, linestyle="--", color="grey")
        for x in chosen:
            ax.axvline(x.nodes, color="green", alpha=0.4)
        ax.set_ylabel("%" if target.figure == "completed" else "ms")
        ax.set_title(f"{target.text}, each mix tried by its nodes", fontsize=9)
        ax.set_xlabel("nodes")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
