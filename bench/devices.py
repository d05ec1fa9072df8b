"""Devices that differ: the OpenVINO provider against the CPU provider, and a fleet of a
fast and a slow node.

Both use a second Python environment with ``onnxruntime-openvino`` in place of
``onnxruntime`` (``.ci/run`` makes ``.venv-openvino``; ``EDGEFLEET_OPENVINO_PYTHON``
names another). (a) In that Python one process opens each model twice through the
node's own session code (``actors.engine.open_planned``), on OpenVINO and on the same
build's CPU provider, and times the two interleaved: the median of N calls each, at 1
and 8 rows. (b) A Ray head on this Python's CPU build and a raylet of the OpenVINO
Python; a fleet of two nodes serving ``heavy``: ``cpu-0`` on the head, ``ov-0``
(``providers: [openvino]``) on the raylet. Each node measures its own costs at warm-up;
requests come in waves sent at once, and each node's share of them is set against its
share by speed (the inverse of its measured cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray

from bench.common import RunContext, Section, Target, fmt, log, md_table
from cluster.client import FleetClient
from cluster.deploy import init_loopback_ray
from cluster.raylet import head_and_device
from edgefleet.config import parse_config
from edgefleet.modelgen import random_inputs

REPO = Path(__file__).resolve().parents[1]
TITLE = "Devices that differ: OpenVINO against the CPU provider, and a fast and a slow node"
OPENVINO_PYTHON = Path(
    os.environ.get("EDGEFLEET_OPENVINO_PYTHON", REPO / ".venv-openvino" / "bin" / "python")
)
PROBED = ("detector", "classifier", "heavy")
WAVE = 8  # requests sent at once: enough to queue on the faster node
ANSWER_S = 300.0
FLEET = {
    "fleet": {"name": "devices"},
    "models": {"heavy": {"path": "heavy.onnx"}},
    "nodes": [
        {"name": "cpu-0", "labels": {"accel": "cpu"}},
        {"name": "ov-0", "labels": {"accel": "openvino"}, "providers": ["openvino"]},
    ],
    "router": {"resources": {"head": 0.5}},
}


def probe(models: Path, calls: int) -> list[list[Any]]:
    """In the OpenVINO Python: each model on OpenVINO and on the CPU provider, timed
    interleaved; a row each of model and rows: ms per call (the medians) and what the
    OpenVINO session ran on."""
    from actors.engine import open_planned
    from edgefleet.providers import ProviderConfig, SessionPlan

    out = []
    for model in PROBED:
        path = models / f"{model}.onnx"
        plans = [SessionPlan(path, (ProviderConfig(name=n),)) for n in ("openvino", "cpu")]
        opened = [open_planned(model, plan, 1) for plan in plans]
        for rows in (1, 8):
            feed, times = random_inputs(model, rows), [[], []]
            for _ in range(calls if model != "heavy" else max(3, calls // 20)):
                for (session, _), sink in zip(opened, times, strict=True):
                    began = time.perf_counter()
                    session.run(None, feed)
                    sink.append((time.perf_counter() - began) * 1000)
            ov, cpu = (statistics.median(t) for t in times)
            ran_on = opened[0][1].used[0]
            out.append([model, rows, fmt(ov, 3), fmt(cpu, 3), fmt(ov / cpu, 2), ran_on])
    return out


def serve(models: Path, waves: int) -> tuple[Counter[str], dict[str, float], dict[str, str]]:
    """The two-node fleet on a head and an OpenVINO raylet: requests served per node,
    each node's measured ms per call, and what each node's session runs on."""
    embedded, served = ray.is_initialized(), Counter[str]()  # bench.run's Ray: put back after
    labels = {"head_labels": {"accel": "cpu"}, "device_labels": {"accel": "openvino"}}
    config, inputs = parse_config(FLEET, models), random_inputs("heavy", 1)
    try:
        with (
            head_and_device(OPENVINO_PYTHON, **labels),
            FleetClient.local(config, progress=log) as client,
        ):
            for _ in range(waves):
                futures = [client.submit("heavy", inputs, timeout_s=ANSWER_S) for _ in range(WAVE)]
                for reply in (f.result(ANSWER_S + 30) for f in futures):
                    reply.unwrap()  # raises a failed request's error
                    served[reply.node] += 1
            nodes = client.status().nodes
    finally:
        if embedded:
            init_loopback_ray(num_cpus=2)
    cost = {n.name: n.models[0].cost_ms[1] for n in nodes}
    return served, cost, {n.name: n.models[0].providers.runs_on for n in nodes}


def run(ctx: RunContext) -> Section:
    measured = " ".join((__doc__ or "").split("\n\n", 1)[1].split())
    if not OPENVINO_PYTHON.is_file():
        return Section(
            TITLE, measured, notes=[f"Not run: no {OPENVINO_PYTHON} (`.ci/run` makes it)."]
        )
    from edgefleet.modelgen import make_all

    make_all(ctx.models.directory)
    calls = str(ctx.count(200, 20))
    command = [str(OPENVINO_PYTHON), "-m", "bench.devices", "--probe", str(ctx.models.directory)]
    kw = {"cwd": REPO, "capture_output": True, "text": True, "timeout": ANSWER_S}
    done = subprocess.run([*command, calls], **kw)
    if done.returncode != 0:
        raise RuntimeError(f"the OpenVINO probe failed: {done.stderr.strip()[-1500:]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    served, cost, ran_on = serve(ctx.models.directory, ctx.count(12, 3))
    total, speed = sum(served.values()), {n: 1.0 / c for n, c in cost.items()}
    fast, fleet = max(speed, key=lambda n: speed[n]), sum(speed.values())
    fleet_rows = [
        [n, ran_on[n], fmt(cost[n], 1), f"{served[n] / total:.0%}", f"{speed[n] / fleet:.0%}"]
        for n in sorted(cost)
    ]
    headers = ["model", "rows", "OpenVINO ms", "CPU ms", "OpenVINO / CPU", "session ran on"]
    fleet_headers = ["node", "runs on", "measured ms per call", "share served", "share by speed"]
    tables = [md_table(headers, times), md_table(fleet_headers, fleet_rows)]
    label = f"share of requests the faster node ({fast}) served"
    note = (
        f"{total} requests in waves of {WAVE}. A ratio above 1 means OpenVINO is slower "
        "here: this machine's CPU is not Intel's, and these models are small."
    )
    return Section(
        TITLE, measured, tables, [Target(label, served[fast] / total, ">=", 0.5)], [note]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.devices")
    parser.add_argument("--probe", nargs=2, metavar=("MODELS", "CALLS"), required=True)
    args = parser.parse_args(argv)
    print(json.dumps(probe(Path(args.probe[0]), int(args.probe[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
