"""The simulator on workloads it was not tuned to: each run live, recorded, replayed.

Six workloads of different shapes, each from its own seed: multi-row requests on a
batching model, bursts, a diurnal cycle, mixed models with deadlines, batching off,
and periodic camera streams on six nodes; 2 to 6 nodes. Each is sent to a live fleet
on an embedded Ray as a user does it (``edgefleet drive CONFIG --workload W.yaml
--record calls/``, in a process of its own), then replayed in the simulator from its
own call record (the recorded arrivals as a ``trace:``, engine times drawn from the
recorded calls: ``simulate --costs calls/``). Per priority class with at least
``MIN_COMPLETED`` completions: simulated p50 and p99 latency against the live ones
(the call record's latency: arrival at the caller to the answer). Nothing is fitted to
these workloads: the simulator runs with its defaults.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.common import RunContext, Section, Target, log, md_table
from edgefleet.config import parse_config
from edgefleet.modelgen import make_all
from edgefleet.priorities import priority_name
from sim.report import OUTCOMES
from sim.run import simulate, workload_costs
from sim.workload import Workload

TITLE = "Simulator fidelity on held-out workloads (fidelity)"
REPO = Path(__file__).resolve().parents[1]
MIN_COMPLETED = 200
P50_TOLERANCE, P99_TOLERANCE = 0.10, 0.20
CLASSIFIER = {"path": "classifier.onnx", "batching": {"window_ms": 4, "max_batch_size": 8}}


@dataclass(frozen=True)
class Shape:
    name: str
    nodes: int
    models: dict[str, Any]
    workload: dict[str, Any]


def _mix(*classes: tuple[str, str, float, int, float | None]) -> list[dict[str, Any]]:
    return [
        {"model": m, "priority": p, "weight": w, "rows": r}
        | ({"deadline_ms": d} if d is not None else {})
        for m, p, w, r, d in classes
    ]


SHAPES = (
    Shape("multi-row on a batching model", 2, {"classifier": CLASSIFIER}, {
        "seed": 11, "arrivals": {"process": "poisson", "rate_per_node": 60},
        "mix": _mix(("classifier", "foreground", 0.3, 1, None),
                    ("classifier", "inline", 0.4, 2, None),
                    ("classifier", "background", 0.3, 4, None)),
    }),
    Shape("bursts", 3, {"classifier": CLASSIFIER, "detector": {"path": "detector.onnx"}}, {
        "seed": 12,
        "arrivals": {"process": "bursts", "rate_per_node": 40,
                     "bursts": {"every_s": 8, "length_s": 1, "factor": 2.5}},
        "mix": _mix(("detector", "foreground", 0.3, 1, None),
                    ("classifier", "inline", 0.3, 2, None),
                    ("classifier", "background", 0.2, 1, None),
                    ("detector", "offline", 0.2, 1, None)),
    }),
    Shape("diurnal", 2, {"classifier": CLASSIFIER}, {
        "seed": 13,
        "arrivals": {"process": "diurnal", "rate_per_node": 80,
                     "diurnal": {"period_s": 20, "low": 0.3}},
        "mix": _mix(("classifier", "foreground", 0.5, 1, None),
                    ("classifier", "offline", 0.5, 2, None)),
    }),
    Shape("mixed models, deadlines", 4, {
        "classifier": CLASSIFIER, "detector": {"path": "detector.onnx"},
        "heavy": {"path": "heavy.onnx"}}, {
        "seed": 14, "arrivals": {"process": "poisson", "rate_per_node": 25},
        "mix": _mix(("classifier", "foreground", 0.4, 1, 100.0),
                    ("detector", "inline", 0.3, 1, 250.0),
                    ("heavy", "background", 0.3, 1, None)),
    }),
    Shape("batching off", 3, {"classifier": {"path": "classifier.onnx"}}, {
        "seed": 15, "arrivals": {"process": "poisson", "rate_per_node": 70},
        "mix": _mix(("classifier", "foreground", 0.5, 1, None),
                    ("classifier", "background", 0.5, 1, None)),
    }),
    Shape("periodic cameras, 6 nodes", 6, {"detector": {"path": "detector.onnx"}}, {
        "seed": 16, "arrivals": {"process": "periodic", "rate_per_node": 20},
        "mix": _mix(("detector", "foreground", 0.6, 1, None),
                    ("detector", "offline", 0.4, 1, None)),
    }),
)  # fmt: skip


def _fleet(shape: Shape) -> dict[str, Any]:
    return {
        "fleet": {"name": "fidelity"},
        "local": {"nodes": shape.nodes, "num_cpus": 2},
        "models": shape.models,
    }


def _live(shape: Shape, folder: Path, duration_s: float) -> Path:
    """Drive the workload on a live fleet in a process of its own; its call record."""
    (folder / "fleet.yaml").write_text(yaml.safe_dump(_fleet(shape)))
    workload = dict(shape.workload, duration_s=duration_s)
    (folder / "w.yaml").write_text(yaml.safe_dump(workload))
    calls = folder / "calls"
    command = [sys.executable, "-m", "cluster.cli", "drive", str(folder / "fleet.yaml")]
    command += ["--workload", str(folder / "w.yaml"), "--record", str(calls)]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=duration_s * 4 + 300
    )
    if done.returncode != 0:
        raise RuntimeError(f"drive failed ({shape.name}): {done.stderr.strip()[-1500:]}")
    return calls


def _live_figures(calls: Path) -> dict[int, np.ndarray]:
    """Completed requests' latency (s) by priority, from the call record."""
    by: dict[int, list[float]] = {}
    for file in sorted(calls.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            row = json.loads(line) if line.strip() else None
            if row and row.get("outcome") == "completed":
                by.setdefault(int(row["priority"]), []).append(float(row["latency_s"]))
    return {p: np.asarray(v) for p, v in by.items()}


def _replayed(shape: Shape, folder: Path, calls: Path) -> dict[int, np.ndarray]:
    config = parse_config(_fleet(shape), folder)
    workload = Workload.model_validate({"seed": shape.workload["seed"], "trace": str(calls)})
    result = simulate(config, workload, costs=workload_costs(workload, calls))
    cols = result.recorder.columns()
    done = cols.outcome == OUTCOMES.index("completed")
    return {int(p): cols.latency_s[(cols.priority == p) & done] for p in np.unique(cols.priority)}


def _rows(shape: Shape, live: dict[int, np.ndarray], sim: dict[int, np.ndarray]) -> list[list[Any]]:
    classes = parse_config(_fleet(shape), Path(".")).priorities
    rows = []
    for p in sorted(live, reverse=True):
        real = live[p]
        if real.size < MIN_COMPLETED or p not in sim or not sim[p].size:
            continue
        r50, r99 = np.percentile(real, [50, 99]) * 1000
        s50, s99 = np.percentile(sim[p], [50, 99]) * 1000
        rows.append([shape.name, priority_name(p, classes), real.size, r50, s50, s50 / r50 - 1,
                     r99, s99, s99 / r99 - 1])  # fmt: skip
    return rows


def run(ctx: RunContext) -> Section:
    duration = ctx.pick(30.0, 8.0)
    table: list[list[Any]] = []
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        for i, shape in enumerate(SHAPES if not ctx.quick else SHAPES[:2]):
            folder = Path(tmp) / f"w{i}"
            folder.mkdir()
            make_all(folder)
            log(f"  fidelity: {shape.name} live ({duration:g} s, {shape.nodes} nodes)")
            calls = _live(shape, folder, duration)
            table += _rows(shape, _live_figures(calls), _replayed(shape, folder, calls))
    worst50 = max((abs(r[5]) for r in table), default=float("nan"))
    worst99 = max((abs(r[8]) for r in table), default=float("nan"))
    shown = [
        [r[0], r[1], r[2], f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[5]:+.0%}", f"{r[6]:.1f}",
         f"{r[7]:.1f}", f"{r[8]:+.0%}"]
        for r in table
    ]  # fmt: skip
    headers = ["workload", "class", "completed", "live p50 ms", "sim p50 ms", "p50 off",
               "live p99 ms", "sim p99 ms", "p99 off"]  # fmt: skip
    return Section(
        TITLE,
        (__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(),
        tables=[md_table(headers, shown)],
        targets=[
            Target("worst p50 error, any workload and class", worst50, "<=", P50_TOLERANCE),
            Target("worst p99 error, any workload and class", worst99, "<=", P99_TOLERANCE),
        ],
        notes=[
            f"Each workload {duration:g} s live; classes with fewer than {MIN_COMPLETED} "
            "completions are left out."
        ],  # fmt: skip
    )
