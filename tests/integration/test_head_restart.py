"""The fleet keeps serving through a restart of its Ray head (Ray's GCS fault tolerance
on Redis): a head started as ``up --detach --redis`` starts it, two worker raylets each
hosting a node, the router on the head, and a caller attached to a worker raylet under
steady load. The head's GCS and raylet are killed, and the head is started again with
the same settings."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from cluster.head import kill_head, restart_head, start_head, stop_head
from cluster.raylet import kill_raylet, start_raylet

REPO = Path(__file__).resolve().parents[2]
NODES = ["edge-0", "edge-1"]
HEAD_DOWN_S = 5.0  # how long the head stays dead before it is started again
WAIT_S = 180.0  # for a condition on a busy machine (not a measure of anything)
pytestmark = pytest.mark.integration

# Fast failure detection on the restarted head (a dead node in 3-4 s, not 30), and
# raylets and callers that wait for the head longer than Ray's 60 s default.
HEAD_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_gcs_rpc_server_reconnect_timeout_s": "180",
}

# The caller: attached to a worker raylet (one attached to the head's raylet loses it
# with the head), it keeps a few requests in flight at a steady pace and writes a line per
# answer; when the stop file appears it waits for the last answers, asks the router
# for the fleet's status and writes a summary.
CALLER = """
import json, sys, threading, time
from pathlib import Path
import ray
from cluster.client import FleetClient
from cluster.deploy import pin_loopback, use_auth_mode
from cluster.names import NAMESPACE
from edgefleet.modelgen import random_inputs

address, raylet_dir, fleet, out, stop = sys.argv[1:]
pin_loopback()
use_auth_mode(token=True)
ray.init(address=address, _temp_dir=raylet_dir, namespace=NAMESPACE, log_to_driver=False)
client = FleetClient.connect(address, fleet)
inputs = random_inputs("classifier")
lines = open(out, "a", buffering=1)
lock = threading.Lock()
slots = threading.Semaphore(4)
sent = 0

def answered(future):
    reply = future.result()
    error = None if reply.error is None else f"{type(reply.error).__name__}: {reply.error}"
    with lock:
        lines.write(json.dumps({"t": time.time(), "node": reply.node, "error": error}) + "\\n")
    slots.release()

models = sorted(client.config.models)
futures = []
while not Path(stop).exists():
    if slots.acquire(timeout=1.0):
        future = client.submit(models[sent % len(models)], inputs)
        future.add_done_callback(answered)
        futures.append(future)
        sent += 1
        time.sleep(0.02)
FleetClient.gather(futures, 120)
status = client.status(timeout_s=60)
summary = {
    "sent": sent,
    "healthy": status.healthy,
    "feed_failures": client._feed.failures,
    "router": status.router,
}
client.close()
with lock:
    lines.write(json.dumps({"summary": summary}) + "\\n")
"""


def _read(path: Path) -> tuple[list[dict], dict | None]:
    answers, summary = [], None
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a line being written is left for the next read
                item = json.loads(line)
                if "summary" in item:
                    summary = item["summary"]
                else:
                    answers.append(item)
    return answers, summary


def _wait(what: str, condition, timeout_s: float = WAIT_S, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:g} s")


def _status(fleet: str) -> dict | None:
    """``edgefleet status --json`` (the router's answer), or None while it fails."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "status", "--fleet", fleet, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return None
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="needs redis-server (Debian: apt-get install redis-server)",
)
@pytest.mark.timeout(900)
def test_requests_keep_completing_while_the_head_restarts(
    models_dir, tmp_path, monkeypatch, capsys
):
    for key, value in HEAD_ENV.items():
        monkeypatch.setenv(key, value)
    # start_raylet sets them in this process for the raylets it starts: undone after.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    fleet = f"hr{os.getpid()}"
    config = tmp_path / "fleet.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "fleet": {"name": fleet},
                "model_dir": str(models_dir),
                # One model per node, so that the caller's load reaches both.
                "models": {f"on-{n}": {"path": str(models_dir / "classifier.onnx")} for n in NODES},
                "nodes": [{"name": n, "models": [f"on-{n}"], "resources": {n: 0.5}} for n in NODES],
                # Ray gives the head this resource: the router lives (and dies) there.
                "router": {
                    "resources": {"node:__internal_head__": 0.001},
                    "report_interval_s": 0.2,
                    "lost_after_s": 2.0,
                },
            }
        )
    )
    raylet_dirs = {n: Path(tempfile.mkdtemp(prefix="ef-", dir="/tmp")) for n in NODES}
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    answers_file, stop_file = tmp_path / "answers.jsonl", tmp_path / "stop"
    caller: subprocess.Popen | None = None
    caller_log = (tmp_path / "caller.log").open("w")
    try:
        address = start_head(fleet, 1, redis=True)
        for name, directory in raylet_dirs.items():
            start_raylet(address, directory, resources={name: 1})
        up = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "up", str(config), "--address", address]
            + ["--detach"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]

        caller = subprocess.Popen(
            [sys.executable, "-c", CALLER, address, str(raylet_dirs["edge-0"]), fleet]
            + [str(answers_file), str(stop_file)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=caller_log,
        )
        _wait("the caller's first 100 answers", lambda: len(_read(answers_file)[0]) >= 100)

        # The head's machine dies: its GCS and raylet at once (the rest of its processes
        # follow the raylet, or are stopped by the restart).
        killed_at = time.time()
        assert len(kill_head(fleet)) == 2  # its GCS and its raylet
        time.sleep(HEAD_DOWN_S)  # the scenario: a head that stays down for a while
        assert caller.poll() is None, (tmp_path / "caller.log").read_text()[-3000:]
        restart_head(fleet)
        back_at = time.time()

        def router_back() -> dict | None:
            status = _status(fleet)
            if status and len(status["nodes"]) == len(NODES):
                return status if all(n["healthy"] for n in status["nodes"]) else None
            return None

        status = _wait("the router back with every node healthy", router_back)
        router_at = time.time()
        settled = len(_read(answers_file)[0])
        _wait("100 more answers", lambda: len(_read(answers_file)[0]) >= settled + 100)
        stop_file.touch()
        caller.wait(timeout=WAIT_S)
        log = (tmp_path / "caller.log").read_text()[-3000:]
        answers, summary = _read(answers_file)
        assert caller.returncode == 0 and summary is not None, log

        errors = [a["error"] for a in answers if a["error"]]
        times = sorted(a["t"] for a in answers)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        down = [t for t in times if killed_at <= t <= back_at]
        with capsys.disabled():  # the figures, in the test output
            print(
                f"\nhead down {back_at - killed_at:.1f} s (killed, left dead {HEAD_DOWN_S:g} s, "
                f"started again); the router back with every node healthy "
                f"{router_at - killed_at:.1f} s after the kill; {len(answers)} answers, "
                f"{len(down)} of them while the head was down and "
                f"{sum(killed_at <= t <= router_at for t in times)} until the router was back; "
                f"longest gap between two answers {max(gaps):.2f} s"
            )
        assert not errors, errors[:5]
        assert len(answers) == summary["sent"]  # every request answered, once
        assert len(down) > 0, "nothing completed while the head was down"
        assert {a["node"] for a in answers if killed_at <= a["t"] <= back_at} == set(NODES)
        assert all(summary["healthy"].values()), summary
        assert summary["feed_failures"] == 0, summary  # the caller's view is fresh again
        assert sorted(n["name"] for n in status["nodes"]) == NODES
    finally:
        stop_file.touch()
        if caller is not None and caller.poll() is None:
            caller.kill()
            caller.wait(timeout=30)
        caller_log.close()
        for directory in raylet_dirs.values():
            kill_raylet(directory)
        stop_head(fleet)
        for directory in raylet_dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
