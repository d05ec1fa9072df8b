"""The results of a fleet simulation and the report written from them.

A :class:`Recorder` collects one run's answers, engine time per node, fleet-wide queue
samples and counters; a :class:`RunResult` wraps it with the run's timing and computes
the figures; :func:`write_report` writes ``report.md`` and its PNG plots for one run or
for several runs side by side (one per placement policy).
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from edgefleet.priorities import priority_name

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

OUTCOMES = (
    "completed",
    "rejected",
    "evicted",
    "expired",
    "superseded",
    "cancelled",
    "failed",
    "lost",
)
_OUTCOME_CODE = {name: code for code, name in enumerate(OUTCOMES)}
_COMPLETED = _OUTCOME_CODE["completed"]

ALL = "all"  # the class name of the row over every priority

CDF_POINTS = 500  # about this many points per latency line, whatever the number of requests
SERIES_POINTS = 2000  # at most this many points per queue / in-flight line
MIN_PLOT_MS = 1e-3  # latencies are drawn no lower than this on the log axis

LATENCY_PNG = "latency_cdf.png"
QUEUE_PNG = "queue.png"
CAPACITY_PNG = "capacity.png"
CAPACITY_ROWS = 12  # the capacity table: the run in this many intervals


# ------------------------------------------------------------------------ recording


@dataclass(frozen=True)
class Columns:
    """A recorder's columns as numpy arrays (copies: the recorder may go on appending).

    Answers, one element per request: ``priority`` (int8), ``outcome`` (uint8, an index
    into :data:`OUTCOMES`), ``latency_s`` (float64, arrival to answer), ``node`` (int32,
    the answering node's index, -1 for none). Samples, one element per sample: ``t``
    (float64, simulated seconds), ``queued`` and ``in_flight`` (int32).
    """

    priority: np.ndarray
    outcome: np.ndarray
    latency_s: np.ndarray
    node: np.ndarray
    t: np.ndarray
    queued: np.ndarray
    in_flight: np.ndarray


class Recorder:
    """Collects one run's per-request results compactly.

    Each answer costs 14 bytes in append-only ``array.array`` columns (1,000,000 answers:
    about 14 MB), so a long run fits in memory and is read back as numpy arrays without
    Python objects per request.
    """

    def __init__(self, nodes: Sequence[str], priorities: Mapping[str, int]) -> None:
        self.nodes: tuple[str, ...] = tuple(nodes)
        self.priorities: dict[str, int] = dict(priorities)
        self.busy_s: list[float] = [0.0] * len(self.nodes)  # engine seconds per node
        self.counters: dict[str, int] = {}
        self._priority = array.array("b")
        self._outcome = array.array("B")
        self._latency = array.array("d")
        self._node = array.array("i")
        self._t = array.array("d")
        self._queued = array.array("i")
        self._in_flight = array.array("i")
        self._columns: Columns | None = None
        self._columns_at = (-1, -1)
        # churn: serving devices at each change, time from coming back to serving again
        self._capacity_t = array.array("d")
        self._capacity = array.array("i")
        self._first_served = array.array("d")

    def answer(self, priority: int, outcome: str, latency_s: float, node: int) -> None:
        """Record a request's one answer: its priority, outcome (one of :data:`OUTCOMES`),
        the time from its arrival to the answer (for refusals too) and the index of the
        node that answered (-1 for none)."""
        code = _OUTCOME_CODE.get(outcome)
        if code is None:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        if not -1 <= node < len(self.nodes):
            raise ValueError(f"node index {node} is not -1 or one of {len(self.nodes)} nodes")
        if not -128 <= priority <= 127:
            raise ValueError(f"priority {priority} does not fit the priority column (int8)")
        latency = float(latency_s)
        self._priority.append(priority)
        self._outcome.append(code)
        self._latency.append(latency)
        self._node.append(node)

    def busy(self, node: int, seconds: float) -> None:
        """Add ``seconds`` of engine time to node ``node``."""
        if node < 0:
            raise ValueError(f"node index must be >= 0, got {node}")
        self.busy_s[node] += seconds

    def sample(self, t: float, queued: int, in_flight: int) -> None:
        """Record the fleet-wide number of requests queued on nodes and in flight at
        simulated time ``t``."""
        self._t.append(t)
        self._queued.append(queued)
        self._in_flight.append(in_flight)

    def capacity(self, t: float, serving: int) -> None:
        """Record that ``serving`` devices serve from simulated time ``t`` on (the fleet
        tells each change)."""
        if self._capacity_t and t < self._capacity_t[-1]:
            raise ValueError(f"capacity at {t} is earlier than the last at {self._capacity_t[-1]}")
        self._capacity_t.append(t)
        self._capacity.append(serving)

    def first_served(self, seconds: float) -> None:
        """Record a device's time from coming back to its first completed answer."""
        self._first_served.append(seconds)

    def capacity_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, serving devices from each time on): a step series, one point a change."""
        return (
            np.array(self._capacity_t, dtype=np.float64),
            np.array(self._capacity, dtype=np.int32),
        )

    def first_served_s(self) -> np.ndarray:
        return np.array(self._first_served, dtype=np.float64)

    def counter(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (e.g. spilled, shed, replaced, node_failures)."""
        if name in _OUTCOME_CODE:
            raise ValueError(f"{name!r} is an outcome: record it with answer(), not counter()")
        self.counters[name] = self.counters.get(name, 0) + n

    @property
    def answers(self) -> int:
        """How many answers were recorded."""
        return len(self._outcome)

    @property
    def samples(self) -> int:
        """How many queue samples were recorded."""
        return len(self._t)

    @property
    def nbytes(self) -> int:
        """Bytes held by the answer and sample columns (their allocations are a few
        percent larger: ``array.array`` over-allocates as it grows)."""
        return sum(
            len(c) * c.itemsize
            for c in (
                self._priority,
                self._outcome,
                self._latency,
                self._node,
                self._t,
                self._queued,
                self._in_flight,
            )
        )

    def columns(self) -> Columns:
        """The columns as numpy arrays; the same object until something is appended."""
        at = (self.answers, self.samples)
        if self._columns is None or self._columns_at != at:
            self._columns = Columns(
                priority=np.array(self._priority, dtype=np.int8),
                outcome=np.array(self._outcome, dtype=np.uint8),
                latency_s=np.array(self._latency, dtype=np.float64),
                node=np.array(self._node, dtype=np.int32),
                t=np.array(self._t, dtype=np.float64),
                queued=np.array(self._queued, dtype=np.int32),
                in_flight=np.array(self._in_flight, dtype=np.int32),
            )
            self._columns_at = at
        return self._columns


# -------------------------------------------------------------------------- results


class LatencyRow(TypedDict):
    """One row of :meth:`RunResult.latency_table`; latencies are of completed requests,
    ``None`` when the class has none."""

    name: str  # the class name, or "all"
    priority: int | None  # None in the "all" row
    answered: int
    completed: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def _latency_row(name: str, priority: int | None, answered: int, done_s: np.ndarray) -> LatencyRow:
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    if done_s.size:
        p50, p99 = np.percentile(done_s, [50, 99])
        p50_ms, p99_ms, max_ms = 1000 * float(p50), 1000 * float(p99), 1000 * float(done_s.max())
    return LatencyRow(
        name=name,
        priority=priority,
        answered=answered,
        completed=int(done_s.size),
        p50_ms=p50_ms,
        p99_ms=p99_ms,
        max_ms=max_ms,
    )


class CapacityRow(TypedDict):
    """One stretch of :meth:`RunResult.capacity_table`: serving devices in it."""

    start_s: float
    end_s: float
    fewest: int
    mean: float  # time-weighted
    at_end: int


class ChurnSummary(TypedDict):
    """See :meth:`RunResult.churn_summary`."""

    leaves: int
    rejoins: int
    declared_dead: int
    stranded: int
    replaced: int
    node_lost: int
    served_again: int
    first_served_p50_s: float | None
    first_served_p99_s: float | None
    fewest_serving: int | None


@dataclass
class RunResult:
    """One simulation run: its recorder and how long it took."""

    label: str  # e.g. the placement policy's name
    recorder: Recorder
    simulated_s: float  # simulated time span
    wall_s: float  # wall time the run took
    events: int  # simulator events processed
    interrupted: bool = False
    live: bool = False  # a live fleet's run (`edgefleet drive`): its time is wall time

    def class_name(self, priority: int) -> str:
        """The class name of ``priority`` (the number itself when no class has it)."""
        return priority_name(priority, self.recorder.priorities)

    def latency_table(self) -> list[LatencyRow]:
        """A row per priority class that was answered (highest first), then the "all" row:
        answered and completed requests, p50 / p99 / max latency of completed requests."""
        cols = self.recorder.columns()
        done = cols.outcome == _COMPLETED
        rows = []
        for p in sorted({int(p) for p in np.unique(cols.priority)}, reverse=True):
            mine = cols.priority == p
            answered = int(np.count_nonzero(mine))
            rows.append(_latency_row(self.class_name(p), p, answered, cols.latency_s[mine & done]))
        rows.append(_latency_row(ALL, None, int(cols.outcome.size), cols.latency_s[done]))
        return rows

    def counts(self) -> dict[str, int]:
        """Answers by outcome (every outcome, zeros included, in :data:`OUTCOMES` order),
        then the counters in the order they were first counted."""
        by_code = np.bincount(self.recorder.columns().outcome, minlength=len(OUTCOMES))
        out = {name: int(by_code[code]) for code, name in enumerate(OUTCOMES)}
        out.update(self.recorder.counters)
        return out

    def busy_fractions(self) -> np.ndarray:
        """Each node's engine time over the simulated span (NaN when the span is 0)."""
        busy = np.asarray(self.recorder.busy_s, dtype=np.float64)
        if self.simulated_s <= 0:
            return np.full(busy.shape, math.nan)
        return busy / self.simulated_s

    def utilisation(self) -> dict[str, float]:
        """Mean / p50 / p99 / max of the nodes' busy fractions (NaN with no nodes)."""
        fractions = self.busy_fractions()
        if fractions.size == 0:
            return dict.fromkeys(("mean", "p50", "p99", "max"), math.nan)
        p50, p99 = np.percentile(fractions, [50, 99])
        return {
            "mean": float(fractions.mean()),
            "p50": float(p50),
            "p99": float(p99),
            "max": float(fractions.max()),
        }

    def churned(self) -> bool:
        """Whether devices left during the run (the report then shows the churn)."""
        return self.recorder.counters.get("leaves", 0) > 0

    def capacity_table(self, intervals: int = CAPACITY_ROWS) -> list[CapacityRow]:
        """Serving devices in each of ``intervals`` equal stretches of the simulated
        span: the fewest, the time-weighted mean and the number at its end (none without
        a capacity series or a span)."""
        t, serving = self.recorder.capacity_series()
        end = self.simulated_s
        if t.size == 0 or end <= 0:
            return []
        edges = np.linspace(0.0, end, intervals + 1)
        rows: list[CapacityRow] = []
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
            first = max(0, int(np.searchsorted(t, a, side="right")) - 1)
            last = int(np.searchsorted(t, b, side="left"))
            times = np.clip(t[first:last], a, b)
            values = serving[first:last]
            spans = np.diff(np.append(times, b))
            mean = float((values * spans).sum() / (b - a)) if b > a else float(values[-1])
            at_end = int(serving[max(0, int(np.searchsorted(t, b, side="right")) - 1)])
            rows.append(
                CapacityRow(start_s=a, end_s=b, fewest=int(values.min()), mean=mean, at_end=at_end)
            )
        return rows

    def churn_summary(self) -> ChurnSummary:
        """What churn did: leaves and rejoins, the requests departed devices held (or were
        sent while gone), the re-placements and NodeLost answers, and the time from a
        device coming back to its first completed answer (p50 / p99, of those that
        served again; None for none)."""
        counters = self.recorder.counters
        firsts = self.recorder.first_served_s()
        p50 = p99 = None
        if firsts.size:
            a, b = np.percentile(firsts, [50, 99])
            p50, p99 = float(a), float(b)
        _, serving = self.recorder.capacity_series()
        return ChurnSummary(
            leaves=counters.get("leaves", 0),
            rejoins=counters.get("rejoins", 0),
            declared_dead=counters.get("declared_dead", 0),
            stranded=counters.get("stranded", 0),
            replaced=counters.get("replaced", 0),
            node_lost=self.counts()["lost"],
            served_again=int(firsts.size),
            first_served_p50_s=p50,
            first_served_p99_s=p99,
            fewest_serving=int(serving.min()) if serving.size else None,
        )

    @property
    def events_per_s(self) -> float:
        """Simulator events processed per second of wall time (NaN for no wall time)."""
        return self.events / self.wall_s if self.wall_s > 0 else math.nan


# ------------------------------------------------------------------------- Markdown


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table padded to aligned columns; numeric columns (bold numbers
    included) are right-aligned, text left-aligned."""

    def cell(value: object) -> str:
        return "-" if value is None else str(value).replace("|", "\\|")

    body = [[cell(v) for v in row] for row in rows]
    numeric = []
    for i in range(len(headers)):
        filled = [row[i] for row in body if row[i].strip() not in _NEUTRAL]
        numeric.append(bool(filled) and all(_looks_numeric(c) for c in filled))
    widths = [max([len(h), 3, *(len(row[i]) for row in body)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(cells, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric, strict=True)]
    return "\n".join([line(list(headers)), line(rule), *(line(row) for row in body)])


_NEUTRAL = {"-", "n/a", ""}  # cells that do not decide a column's alignment


def _looks_numeric(text: str) -> bool:
    stripped = text.strip().strip("*").lstrip("<>").rstrip("%x").replace(",", "").lstrip("+-")
    try:
        float(stripped)
    except ValueError:
        return False
    return True


def fmt_ms(value: float | None) -> str:
    """Milliseconds to about three significant digits; "-" for none."""
    if value is None or math.isnan(value):
        return "-"
    if value < 1:
        return f"{value:.3f}"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}"


def fmt_pct(fraction: float) -> str:
    """A fraction as a percentage with one decimal; "-" for NaN."""
    return "-" if math.isnan(fraction) else f"{100 * fraction:.1f}%"


def fmt_share(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a percentage that never shows a non-zero share as 0.0%
    nor a partial one as 100.0%; "-" when ``whole`` is 0."""
    if whole <= 0:
        return "-"
    share = 100 * part / whole
    if 0 < share < 0.1:
        return "<0.1%"
    if 99.9 < share < 100:
        return ">99.9%"
    return f"{share:.1f}%"


def _fmt_rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def _bold_best(
    values: Sequence[float | None], fmt: Callable[[float | None], str], *, lower: bool
) -> list[str]:
    """The values formatted, the best one(s) as displayed in bold; "-" for none."""
    cells = [fmt(v) for v in values]
    shown = [None if v is None else float(c) for v, c in zip(values, cells, strict=True)]
    present = [s for s in shown if s is not None]
    if not present:
        return cells
    best = min(present) if lower else max(present)
    return [f"**{c}**" if s == best else c for c, s in zip(cells, shown, strict=True)]


def _top_class(results: Sequence[RunResult]) -> tuple[str, int] | None:
    """The highest priority class answered in any run, as (name, priority)."""
    best: tuple[str, int] | None = None
    for result in results:
        for row in result.latency_table():
            p = row["priority"]
            if p is not None and (best is None or p > best[1]):
                best = (row["name"], p)
    return best


def compare_table(results: Sequence[RunResult]) -> str:
    """A row per run: p99 of the highest class and of all priorities, completed, rejected
    and evicted, the best value of each column in bold."""
    top = _top_class(results)
    top_p99: list[float | None] = []
    all_p99: list[float | None] = []
    completed: list[float | None] = []
    rejected: list[float | None] = []
    evicted: list[float | None] = []
    for result in results:
        rows = result.latency_table()
        by_priority = {row["priority"]: row for row in rows}
        top_row = by_priority.get(top[1]) if top is not None else None
        top_p99.append(top_row["p99_ms"] if top_row is not None else None)
        all_p99.append(rows[-1]["p99_ms"])
        counts = result.counts()
        completed.append(counts["completed"])
        rejected.append(counts["rejected"])
        evicted.append(counts["evicted"])

    def count(v: float | None) -> str:
        return "-" if v is None else str(int(v))

    columns = [
        [r.label + (" (interrupted)" if r.interrupted else "") for r in results],
        _bold_best(top_p99, fmt_ms, lower=True),
        _bold_best(all_p99, fmt_ms, lower=True),
        _bold_best(completed, count, lower=False),
        _bold_best(rejected, count, lower=True),
        _bold_best(evicted, count, lower=True),
    ]
    top_name = top[0] if top is not None else "highest class"
    headers = ["run", f"{top_name} p99 ms", "all p99 ms", "completed", "rejected", "evicted"]
    return md_table(headers, list(zip(*columns, strict=True)))


def _run_section(result: RunResult) -> list[str]:
    rec = result.recorder
    lines = [f"## Run: {result.label}", ""]
    clock = "" if result.live else " of simulated time"
    if result.interrupted:
        lines += [
            f"**Interrupted: results so far** (stopped at {result.simulated_s:.1f} s"
            f"{clock}; the figures cover the answers recorded by then).",
            "",
        ]
    speed = result.simulated_s / result.wall_s if result.wall_s > 0 else math.nan
    speed_text = "-" if math.isnan(speed) else f"{speed:,.1f}x" if speed < 10 else f"{speed:,.0f}x"
    if result.live:
        ran = f"Drove a live fleet for {result.simulated_s:.1f} s; {rec.answers} answers."
    else:
        ran = (
            f"Simulated {result.simulated_s:.1f} s in {result.wall_s:.1f} s of wall time "
            f"({speed_text} real time); {result.events} "
            f"events, {_fmt_rate(result.events_per_s)} events/s; {rec.answers} answers."
        )
    lines += [
        ran,
        "",
        "**Latency of completed requests by priority class** (arrival to answer):",
        "",
    ]
    lat_rows = [
        [
            row["name"],
            row["priority"],
            fmt_ms(row["p50_ms"]),
            fmt_ms(row["p99_ms"]),
            fmt_ms(row["max_ms"]),
            row["completed"],
            row["answered"],
        ]
        for row in result.latency_table()
    ]
    headers = ["class", "priority", "p50 ms", "p99 ms", "max ms", "completed", "answered"]
    lines += [md_table(headers, lat_rows), ""]

    counts = result.counts()
    answered = rec.answers
    outcome_rows = [[name, counts[name], fmt_share(counts[name], answered)] for name in OUTCOMES]
    lines += [
        "**Outcomes** of the answered requests:",
        "",
        md_table(["outcome", "requests", "of answered"], outcome_rows),
        "",
    ]
    if rec.counters:
        counter_rows = [[name, n] for name, n in rec.counters.items()]
        lines += ["**Counters:**", "", md_table(["counter", "count"], counter_rows), ""]
    else:
        lines += ["Counters: none recorded.", ""]

    if result.churned():
        lines += _churn_lines(result)

    util = result.utilisation()
    fractions = result.busy_fractions()
    lines += [
        f"**Node utilisation** (engine busy time over "
        f"{'the run' if result.live else 'simulated time'}, {len(rec.nodes)} nodes):",
        "",
        md_table(
            ["mean", "p50", "p99", "max"],
            [[fmt_pct(util[k]) for k in ("mean", "p50", "p99", "max")]],
        ),
        "",
    ]
    if fractions.size and not math.isnan(fractions.max()):
        busiest = int(np.argmax(fractions))
        answered_there = int(np.count_nonzero(rec.columns().node == busiest))
        lines += [
            f"Busiest node: {rec.nodes[busiest]}, {fmt_pct(float(fractions[busiest]))} busy, "
            f"{answered_there} answers.",
            "",
        ]

    cols = rec.columns()
    if cols.t.size:
        lines += [
            f"Fleet-wide queue ({cols.t.size} samples): {cols.queued.mean():.1f} requests "
            f"queued on nodes on average, at most {int(cols.queued.max())}; in flight "
            f"{cols.in_flight.mean():.1f} on average, at most {int(cols.in_flight.max())}.",
            "",
        ]
    else:
        lines += ["Fleet-wide queue: no samples recorded.", ""]
    return lines


def _churn_lines(result: RunResult) -> list[str]:
    c = result.churn_summary()
    p50, p99 = c["first_served_p50_s"], c["first_served_p99_s"]
    first = "no device that came back served yet"
    if p50 is not None and p99 is not None:
        first = (
            f"p50 {fmt_ms(1000 * p50)} ms, p99 {fmt_ms(1000 * p99)} ms "
            f"({c['served_again']} devices)"
        )
    rows: list[list[object]] = [
        ["devices that left", c["leaves"]],
        ["devices that came back", c["rejoins"]],
        ["declared dead", c["declared_dead"]],
        ["requests stranded on a departed device (held, or sent while gone)", c["stranded"]],
        ["requests placed again (replaced)", c["replaced"]],
        ["answered NodeLost (lost)", c["node_lost"]],
        ["fewest devices serving", c["fewest_serving"]],
    ]
    capacity = [
        [f"{r['start_s']:.1f}-{r['end_s']:.1f}", r["fewest"], f"{r['mean']:.1f}", r["at_end"]]
        for r in result.capacity_table()
    ]
    return [
        "**Churn** (devices leaving and coming back):",
        "",
        md_table(["", "count"], rows),
        "",
        f"Time from a device coming back to its first completed answer: {first}.",
        "",
        "**Capacity over time** (devices serving):",
        "",
        md_table(["simulated s", "fewest", "mean", "at end"], capacity),
        "",
    ]


def write_report(
    out_dir: str | Path,
    results: Sequence[RunResult],
    *,
    title: str,
    description: Sequence[str] = (),
) -> Path:
    """Write ``out_dir/report.md`` and its PNG plots (latency CDF, queue and in flight
    over time) for one run or several side by side; return the path of the Markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = report_markdown(results, title=title, description=description, plots=out)
    path = out / "report.md"
    path.write_text(text)
    return path


def report_markdown(
    results: Sequence[RunResult],
    *,
    title: str,
    description: Sequence[str] = (),
    plots: Path | None = None,
) -> str:
    """The Markdown of :func:`write_report`; with ``plots`` (a folder) its PNG plots are
    drawn there and linked, without them the text has the tables alone (to print)."""
    lines = [f"# {title}", ""]
    if description:
        lines += [f"- {line}" for line in description] + [""]
    interrupted = [r.label for r in results if r.interrupted]
    if interrupted:
        lines += [
            f"**Interrupted: results so far** (stopped early: {', '.join(interrupted)}).",
            "",
        ]
    if not results:
        lines += ["No run produced results.", ""]
    else:
        if len(results) > 1:
            lines += [
                "## Comparison",
                "",
                compare_table(results),
                "",
                "Latencies (ms) are of completed requests. Best of each column in bold: "
                "lowest p99, rejected and evicted; most completed.",
                "",
            ]
        if plots is not None:
            lines += _plots(results, plots)
        for result in results:
            lines += _run_section(result)
    return "\n".join(lines).rstrip("\n") + "\n"


def _clock(results: Sequence[RunResult]) -> str:
    """What the runs' time axis is: a live run's seconds are the run's own."""
    return "time into the run" if any(r.live for r in results) else "simulated time"


def _plots(results: Sequence[RunResult], out: Path) -> list[str]:
    """Draw the report's plots in ``out``; the lines of its section linking them."""
    clock = _clock(results)
    _plot_latency_cdf(results, out / LATENCY_PNG)
    _plot_queue(results, out / QUEUE_PNG)
    lines = [
        "## Plots",
        "",
        f"![Latency CDF of completed requests by priority class]({LATENCY_PNG})",
        "",
        f"![Requests queued on nodes and in flight over {clock}]({QUEUE_PNG})",
        "",
    ]
    if any(r.churned() for r in results):
        _plot_capacity(results, out / CAPACITY_PNG)
        lines += [f"![Devices serving over {clock}]({CAPACITY_PNG})", ""]
    return lines + [
        f"Latency lines are drawn at about {CDF_POINTS} quantiles each. A run with "
        f"more than {SERIES_POINTS} queue samples is drawn with the largest value of "
        "each stretch of time.",
        "",
    ]


# ---------------------------------------------------------------------------- plots


def _new_figure(width: float, height: float) -> Figure:
    """A figure drawn by matplotlib's Agg backend (no pyplot, no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def cdf_points(latency_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """About :data:`CDF_POINTS` points (latency ms, fraction of requests at or below it)
    of the empirical CDF of ``latency_s``, denser in the tail (p99 and above)."""
    n = latency_s.size
    if n == 0:
        return np.empty(0), np.empty(0)
    ordered = np.sort(latency_s)
    body = np.linspace(0.0, 0.99, CDF_POINTS * 4 // 5)
    tail = 1.0 - np.logspace(-2, -6, CDF_POINTS - body.size)
    probs = np.concatenate([body, tail, [1.0]])
    idx = np.unique(np.round(probs * (n - 1)).astype(np.int64))
    x_ms = np.maximum(1000 * ordered[idx], MIN_PLOT_MS)
    return x_ms, (idx + 1) / n


def _completed_by_class(result: RunResult) -> dict[int, np.ndarray]:
    cols = result.recorder.columns()
    done = cols.outcome == _COMPLETED
    prio = cols.priority[done]
    lat = cols.latency_s[done]
    return {int(p): lat[prio == p] for p in np.unique(prio)}


def _style_cdf_axes(ax: Axes, title: str) -> None:
    ax.set_xscale("log")
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("latency, ms (log scale)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
        ax.axhline(0.99, linestyle=":", color="grey", linewidth=0.8)  # where p99 is read off
    else:
        ax.set_xlim(1, 1000)
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)


def _plot_latency_cdf(results: Sequence[RunResult], path: Path) -> None:
    """One subplot per run with a line per class (one run), or one subplot per class
    with a line per run (several runs)."""
    completed = [_completed_by_class(r) for r in results]
    if len(results) == 1:
        fig = _new_figure(7, 4.5)
        ax = fig.subplots()
        result = results[0]
        for p, lat in sorted(completed[0].items(), reverse=True):
            x, y = cdf_points(lat)
            ax.plot(x, y, label=f"{result.class_name(p)} ({lat.size})")
        _style_cdf_axes(ax, f"Latency CDF: {result.label}")
    else:
        priorities = sorted({p for c in completed for p in c}, reverse=True)
        n = max(1, len(priorities))
        ncols = 1 if n == 1 else 2
        nrows = math.ceil(n / ncols)
        fig = _new_figure(6.5 * ncols, 4 * nrows)
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax in axes[n:]:
            ax.set_visible(False)
        if not priorities:
            _style_cdf_axes(axes[0], "Latency CDF")
        for ax, p in zip(axes, priorities, strict=False):
            for result, by_class in zip(results, completed, strict=True):
                of_class = by_class.get(p)
                if of_class is not None:
                    x, y = cdf_points(of_class)
                    ax.plot(x, y, label=f"{result.label} ({of_class.size})")
            _style_cdf_axes(ax, f"Latency CDF: {results[0].class_name(p)}")
    fig.savefig(path, dpi=100)


def series_points(
    t: np.ndarray, values: np.ndarray, limit: int = SERIES_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """At most ``limit`` points of a time series: the samples themselves, or the first
    time and the largest value of each run of consecutive samples."""
    n = t.size
    if n <= limit:
        return t, values
    size = math.ceil(n / limit)
    starts = np.arange(0, n, size)
    return t[starts], np.maximum.reduceat(values, starts)


def _plot_queue(results: Sequence[RunResult], path: Path) -> None:
    """Requests queued on nodes (fleet-wide) and requests in flight, a line per run."""
    fig = _new_figure(9, 6)
    queued_ax, flight_ax = fig.subplots(2, 1, sharex=True)
    for result in results:
        cols = result.recorder.columns()
        if cols.t.size:
            t, queued = series_points(cols.t, cols.queued)
            queued_ax.plot(t, queued, drawstyle="steps-post", label=result.label)
            t, in_flight = series_points(cols.t, cols.in_flight)
            flight_ax.plot(t, in_flight, drawstyle="steps-post", label=result.label)
    queued_ax.set_ylabel("queued on nodes")
    queued_ax.set_title("Requests queued on nodes (fleet-wide)")
    flight_ax.set_ylabel("in flight")
    flight_ax.set_title("Requests in flight")
    flight_ax.set_xlabel(f"{_clock(results)}, s")
    for ax in (queued_ax, flight_ax):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=100)


def _plot_capacity(results: Sequence[RunResult], path: Path) -> None:
    """Devices serving over time, a line per run."""
    fig = _new_figure(9, 3.5)
    ax = fig.subplots()
    for result in results:
        t, serving = result.recorder.capacity_series()
        if t.size:
            t = np.append(t, max(result.simulated_s, float(t[-1])))
            serving = np.append(serving, serving[-1])
            ax.plot(t, serving, drawstyle="steps-post", label=result.label)
    ax.set_ylabel("devices serving")
    ax.set_xlabel(f"{_clock(results)}, s")
    ax.set_title("Capacity: devices serving")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
