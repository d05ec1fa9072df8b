"""The Redis a head with ``ray.redis`` keeps its state in: started on loopback, found
and stopped by its recorded pid; a clear error where redis-server is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from cluster.head import _redis_process, _start_redis, _stop_redis, head_dir, start_head
from edgefleet.errors import FleetStartError

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_redis_server_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    fleet = f"noredis{tmp_path.name[-8:]}"
    try:
        with pytest.raises(FleetStartError) as err:
            start_head(fleet, 1, redis=True)
        assert "\n" not in str(err.value)
        assert "`apt-get install redis-server`" in str(err.value)
        assert list(head_dir(fleet).iterdir()) == []  # nothing recorded, nothing started
    finally:
        shutil.rmtree(head_dir(fleet), ignore_errors=True)


def test_up_redis_without_redis_server_fails_before_starting_anything(tmp_path):
    fleet = f"upredis{tmp_path.name[-8:]}"
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"fleet: {{name: {fleet}}}\nmodels:\n  classifier: {{path: models/classifier.onnx}}\n"
    )
    up = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", str(config), "--detach", "--redis"],
        env={"PATH": str(tmp_path), "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode != 0  # `up` writes the missing built-in model, then stops here
    assert "error: ray.redis (up --redis) needs redis-server" in up.stderr, up.stderr
    assert not head_dir(fleet).exists()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_listens_on_loopback_only_and_is_stopped_by_its_pid(tmp_path):
    started = _start_redis(tmp_path)
    state: dict[str, object] = {"redis": started}
    try:
        proc = _redis_process(state)
        assert proc is not None and proc.pid == started["pid"]
        listening = {c.laddr for c in proc.net_connections() if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", started["port"])}
        assert (tmp_path / "redis" / "appendonlydir").is_dir()  # its data under the folder
        assert _redis_process({"redis": {**started, "port": started["port"] + 1}}) is None
    finally:
        assert _stop_redis(state) == 1
    assert _redis_process(state) is None


TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)


def test_an_embedded_ray_that_timed_out_starting_is_started_again(monkeypatch):
    """Ray gives a starting node a fixed 30 s to register, which a busy machine can miss:
    the start is tried again once what the failed attempt started is stopped; a third
    timeout is one line naming it, and other errors are not retried."""
    from cluster import deploy

    started: list[subprocess.Popen] = []
    outcomes: list[Exception | None] = [Exception(TIMED_OUT), None]

    def init(**_: object) -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:  # an attempt that left a process behind, then failed
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise outcome

    monkeypatch.setattr(deploy.ray, "init", init)
    monkeypatch.setattr(deploy.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr("cluster.metrics.write_service_discovery", lambda: None)
    deploy.init_loopback_ray(num_cpus=1)
    assert outcomes == []  # started the second time
    assert started[0].wait(30) is not None  # the failed attempt's process was stopped

    outcomes[:] = [Exception(TIMED_OUT)] * 3
    with pytest.raises(FleetStartError) as err:
        deploy.init_loopback_ray(num_cpus=1)
    assert "in 3 attempts" in str(err.value) and "timed out during startup" in str(err.value)
    assert all(p.wait(30) is not None for p in started)

    outcomes[:] = [Exception("something else")]
    with pytest.raises(Exception, match="something else"):
        deploy.init_loopback_ray(num_cpus=1)
    assert outcomes == []  # not retried


def test_a_head_that_timed_out_starting_is_started_again(tmp_path, monkeypatch):
    import cluster.head as head

    runs: list[list[str]] = []
    stopped: list[str] = []
    codes = [(1, f"ray start failed: {TIMED_OUT}"), (0, "")]

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        runs.append(cmd)
        code, said = codes.pop(0)
        return subprocess.CompletedProcess(cmd, code, "", said)

    monkeypatch.setattr(head.subprocess, "run", run)
    monkeypatch.setattr(head, "_stop_processes", lambda fleet, grace_s: stopped.append(fleet))
    head._run_head("retry", ["ray", "start", "--head"], {})
    assert len(runs) == 2 and stopped == ["retry"]

    codes[:] = [(1, "port 6379 is taken")]
    with pytest.raises(FleetStartError, match="could not start a Ray head: port 6379 is taken"):
        head._run_head("retry", ["ray", "start", "--head"], {})
    assert stopped == ["retry"]  # not retried
