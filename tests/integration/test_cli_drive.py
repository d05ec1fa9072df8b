"""`edgefleet drive` as a user runs it (the console script, in a subprocess) on the
embedded default: the same arrivals as the simulator, every one answered, the report,
the call record; and Ctrl-C, which keeps what it has."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from sim.workload import load_workload

REPO = Path(__file__).resolve().parents[2]
EDGEFLEET = Path(sys.executable).parent / "edgefleet"  # the console script
pytestmark = pytest.mark.integration

RUN_S = 600.0  # starting Ray and a fleet, a few seconds of traffic, stopping: busy machine
PRIORITIES = {"foreground": 10, "inline": 7, "background": 3, "offline": 0}


def _config(tmp_path: Path, models_dir: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"""\
fleet: {{name: drive-test}}
local: {{nodes: 2}}
model_dir: {models_dir}
priorities: {PRIORITIES}
models:
  classifier: {{path: classifier.onnx, batching: {{window_ms: 5, max_batch_size: 8}}}}
  heavy: {{path: heavy.onnx, batching: {{window_ms: 10, max_batch_size: 8}}}}
  stateful: {{path: stateful.onnx}}
  tiny_lm: {{path: tiny_lm.onnx, kind: decoder}}
"""
    )
    return path


def _workload(tmp_path: Path, requests: int, rate: float) -> Path:
    path = tmp_path / "workload.yaml"
    path.write_text(
        f"""\
seed: 7
requests: {requests}
arrivals: {{process: poisson, rate: {rate}}}
mix:
  - {{model: classifier, priority: foreground, weight: 0.4, deadline_ms: 2000}}
  - {{model: classifier, priority: inline, weight: 0.3}}
  - {{model: heavy, priority: background, weight: 0.2, rows: 2}}
  - {{model: stateful, priority: offline, weight: 0.05}}
  - {{model: tiny_lm, priority: offline, weight: 0.05, sessions: 3,
      generate: {{prompt_tokens: 8, max_new_tokens: 6}}}}
costs:
  classifier: {{call_ms: {{1: 1.0, 8: 6.5}}}}
  heavy: {{call_ms: {{1: 4.0, 8: 12.0}}}}
  stateful: {{call_ms: {{1: 0.2}}}}
  tiny_lm: {{prefill_ms_per_token: 0.05, step_ms: {{1: 0.15}}}}
"""
    )
    return path


def _class_rows(report: str) -> dict[str, dict[str, int]]:
    """The latency table's rows: class -> completed, answered."""
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in {*PRIORITIES, "all"}:
            rows[cells[0]] = {"completed": int(cells[5]), "answered": int(cells[6])}
    return rows


def _simulated_classes(workload: Path) -> Counter[str]:
    """Arrivals by class, as `edgefleet simulate` generates them for 2 nodes."""
    w = load_workload(workload)
    names = {v: k for k, v in PRIORITIES.items()}
    arrivals = w.arrivals(random.Random(w.seed), nodes=2, priorities=PRIORITIES)
    return Counter(names[a.priority] for a in arrivals)


def test_drive_sends_the_simulators_arrivals_and_reports_every_answer(tmp_path, models_dir):
    config, workload = _config(tmp_path, models_dir), _workload(tmp_path, 240, 80)
    calls, out = tmp_path / "calls", tmp_path / "report"
    result = subprocess.run(
        [str(EDGEFLEET), "drive", str(config), "--workload", str(workload)]
        + ["--record", str(calls), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    rows = _class_rows(result.stdout)
    expected = _simulated_classes(workload)
    assert set(rows) == {*PRIORITIES, "all"}, result.stdout
    for name, count in expected.items():  # the same arrivals as the simulator's
        assert rows[name]["answered"] == count, (name, rows)
    assert rows["all"]["answered"] == 240  # every request got its answer
    assert rows["all"]["completed"] > 0
    assert "# Live fleet" in result.stdout and "Drove a live fleet for" in result.stdout
    assert "**Outcomes** of the answered requests" in result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "driving" in result.stderr  # the progress bar
    written = (out / "report.md").read_text()
    assert _class_rows(written) == rows and (out / "latency_cdf.png").is_file()
    lines = [json.loads(x) for f in calls.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert len(lines) == 240  # the call record: a line per request, for simulate --costs
    generations = [x for x in lines if x["prompt_tokens"] > 0]
    assert generations and all(x["outcome"] == "completed" for x in generations), generations
    assert {x["prompt_tokens"] for x in generations} == {8}  # the workload's prompts
    replay = subprocess.run(
        [str(EDGEFLEET), "simulate", str(config), "--workload", str(workload)]
        + ["--costs", str(calls), "--out", str(tmp_path / "sim")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    simulated = _class_rows((tmp_path / "sim" / "report.md").read_text())
    assert {k: v["answered"] for k, v in simulated.items()} == {
        k: v["answered"] for k, v in rows.items()
    }


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_sending_and_reports_what_it_has(tmp_path, models_dir):
    config, workload = _config(tmp_path, models_dir), _workload(tmp_path, 20000, 100)
    proc = subprocess.Popen(
        [str(EDGEFLEET), "drive", str(config), "--workload", str(workload)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C in a terminal reaches the whole process group
        preexec_fn=_default_sigint,
    )
    out: list[bytes] = []
    err: list[bytes] = []
    driving = threading.Event()

    def read(stream: object, into: list[bytes]) -> None:
        while chunk := os.read(stream.fileno(), 4096):  # type: ignore[attr-defined]
            into.append(chunk)
            if b"sent " in b"".join(err):  # the progress bar: traffic is out
                driving.set()

    readers = [
        threading.Thread(target=read, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        assert driving.wait(RUN_S), b"".join(err).decode()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    for reader in readers:
        reader.join(10)
    stdout, stderr = b"".join(out).decode(), b"".join(err).decode()
    assert proc.returncode == 130, (stdout[-2000:], stderr[-4000:])
    assert "Traceback" not in stderr, stderr[-4000:]
    assert "interrupted: stopped sending" in stderr
    assert "Interrupted: results so far" in stdout
    assert "not sent (interrupted)" in stdout  # 20,000 arrivals take minutes
    rows = _class_rows(stdout)
    assert rows["all"]["answered"] > 0, stdout
    assert "Traceback" not in stderr, stderr[-3000:]
