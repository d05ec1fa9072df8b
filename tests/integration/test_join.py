"""`edgefleet join` as a device runs it: the real command, the real `ray start --address`,
against an address where nothing listens and against a real Ray head on loopback
(started as `up --detach` starts one, with fast failure detection)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from cluster.device import DEVICE_LABEL
from cluster.head import _free_port, start_head, stop_head
from tests.integration.test_cli import Running, edgefleet

pytestmark = pytest.mark.integration

OBSERVE_S = 8.0  # how long the backoff is watched against a dead address
STOP_S = 3.0  # Ctrl-C with no `ray start` running
WAIT_S = 180.0  # for a condition on a busy machine (not a measure of anything)

# Fast failure detection on the head, as test_head_restart.py has it (a dead node in
# 3-4 s, not a minute).
HEAD_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

# A driver on the head that prints the cluster's nodes, one JSON line every half second.
NODES = """
import json, sys, time
import ray
from cluster.deploy import pin_loopback, use_auth_mode

pin_loopback()
use_auth_mode(token=True)
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
while True:
    nodes = [
        {"id": n["NodeID"], "alive": n["Alive"], "labels": n.get("Labels", {}),
         "resources": n.get("Resources", {})}
        for n in ray.nodes()
    ]
    print(json.dumps(nodes), flush=True)
    time.sleep(0.5)
"""


def _wait(
    what: str,
    condition: Callable[[], Any],
    timeout_s: float = WAIT_S,
    context: Callable[[], str] = str,
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:g} s\n{context()}")


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _naming(marker: str) -> list[psutil.Process]:
    """Processes whose command line names ``marker`` (the device's Ray folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
    return found


def _loopback_name() -> str | None:
    """A host name of 127.0.0.1 that Ray takes for a remote host: `ray start --address`
    swaps 127.0.0.1 and localhost for this machine's address, where a head bound to
    loopback does not answer."""
    from ray._common.network_utils import is_localhost

    for name in (socket.gethostname(), socket.getfqdn()):
        try:
            found = {a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)}
        except OSError:
            continue
        if found == {"127.0.0.1"} and not is_localhost(name):
            return name
    return None


def test_join_where_nothing_listens_backs_off_one_line_per_attempt_and_stops_on_ctrl_c():
    port = _free_port()  # nothing listens there
    join = Running("join", f"127.0.0.1:{port}", "--device", "cam-0", "--labels", "zone=lab")
    try:
        join.wait_for("attempt 1: error", err=True)
        time.sleep(OBSERVE_S)  # the scenario: a head that stays away
        started = _tree(join.proc.pid)
        took = join.interrupt()
    finally:
        join.kill()
    assert join.proc.returncode == 0, join.err[-3000:]
    assert took < STOP_S, took
    assert started == [] and _tree(join.proc.pid) == []  # it never had a `ray start` to run

    lines = join.err.strip().splitlines()
    pattern = (
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d attempt (\d+): error: no Ray head answers at "
        rf"127\.0\.0\.1:{port} \(\S+:{port}\); next attempt in ([\d.]+) s"
    )
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches), lines  # one line per attempt, and nothing else
    numbers = [int(m.group(1)) for m in matches if m]
    delays = [float(m.group(2)) for m in matches if m]
    assert numbers == list(range(1, len(numbers) + 1)), lines
    # 0.5-1 s, then 1-2, 2-4, 4-8: 3 to 5 attempts in 8 s; a busy loop makes hundreds.
    assert 3 <= len(numbers) <= 6, lines
    assert delays == sorted(delays), lines  # the backoff grows
    for n, delay in enumerate(delays):
        assert 2**n / 2 - 0.05 <= delay <= 2**n + 0.05, (n, delays)
    assert "stopped while waiting to join again; exiting" in join.out


def test_join_gives_up_after_max_attempts():
    result = edgefleet("join", f"127.0.0.1:{_free_port()}", "--max-attempts", "2", timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[-1].endswith("giving up after 2 failed attempts in a row"), lines


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["head:6379", "--labels", "zone"], "Label string is not a key-value pair"),
        (["head:6379", "--labels", "ray.io/x=1"], "reserved for Ray defined labels"),
        (["head:6379", "--resources", '{"cam": "one"}'], "not a JSON object of resource"),
        (["head:6379", "--device", "no spaces"], "Invalid label key value"),
        (["head"], "is not HOST:PORT"),
    ],
)
def test_join_refuses_arguments_ray_start_would(cli, args, complaint):
    result = cli("join", *args)
    assert result.returncode == 2 and complaint in result.stderr, result.stderr


def test_join_refuses_two_names_for_one_device(cli):
    result = cli("join", "h:1", "--device", "a", "--labels", f"{DEVICE_LABEL}=b")
    assert result.returncode == 2
    assert "name the device differently" in result.stderr, result.stderr


@pytest.mark.timeout(600)
def test_join_brings_the_device_back_after_its_raylet_dies_and_sigterm_leaves_nothing(
    monkeypatch, tmp_path, capsys
):
    host = _loopback_name()
    if host is None:
        pytest.skip(
            "needs a host name for 127.0.0.1 other than localhost (this machine's name in "
            "/etc/hosts): `ray start --address` swaps 127.0.0.1 for the machine's address"
        )
    for key, value in HEAD_ENV.items():
        monkeypatch.setenv(key, value)
    fleet = f"jn{os.getpid()}"
    device = f"cam-{os.getpid()}"
    folder = Path(tempfile.mkdtemp(prefix="ej-", dir="/tmp"))  # short: Ray's socket paths
    join: Running | None = None
    watcher: subprocess.Popen[str] | None = None
    try:
        address = start_head(fleet, 1)  # loopback, token authentication
        port = address.rpartition(":")[2]
        watcher = subprocess.Popen(
            [sys.executable, "-c", NODES, address],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "nodes.err").open("w"),
            text=True,
        )
        latest: list[list[dict[str, Any]]] = [[]]

        def read(stream: Any) -> None:
            for line in stream:
                with contextlib.suppress(ValueError):
                    latest[0] = json.loads(line)

        threading.Thread(target=read, args=(watcher.stdout,), daemon=True).start()

        def device_nodes(alive: bool = True) -> list[dict[str, Any]]:
            return [
                n
                for n in latest[0]
                if n["alive"] is alive and n["labels"].get(DEVICE_LABEL) == device
            ]

        def seen() -> str:
            """What a failed wait shows: join's own lines, its last words, the nodes."""
            said = [line for line in join.out.splitlines() if " attempt " in line] if join else []
            return "\n".join(
                [
                    *said,
                    join.err[-2000:] if join else "",
                    f"nodes: {latest[0]}",
                    f"node watcher: {watcher.poll() if watcher else None} "
                    + (tmp_path / "nodes.err").read_text()[-2000:],
                ]
            )

        began = time.monotonic()
        join = Running(
            "join",
            f"{host}:{port}",
            "--device",
            device,
            "--labels",
            "zone=lab",
            "--resources",
            '{"cam": 1}',
            "--num-cpus",
            "1",
            "--temp-dir",
            str(folder),
        )
        (first,) = _wait("the device's node ALIVE", device_nodes, context=seen)
        joined_s = time.monotonic() - began
        assert first["labels"]["zone"] == "lab" and first["resources"]["cam"] == 1, first
        assert "attempt 1: joining" in join.out

        raylet = _wait(
            "its raylet",
            lambda: [p for p in _tree(join.proc.pid) if p.name() == "raylet"],
            context=seen,
        )[0]
        raylet.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        join.wait_for("attempt 1: ray start exited with status 1: raylet [exit code=-9]", err=True)
        join.wait_for("attempt 2: joining")
        (again,) = _wait(
            "a new ALIVE node of the device",
            lambda: [n for n in device_nodes() if n["id"] != first["id"]],
            context=seen,
        )
        back_s = time.monotonic() - killed
        assert again["labels"]["zone"] == "lab"
        _wait(
            "the old node dead",
            lambda: first["id"] in {n["id"] for n in device_nodes(False)},
            context=seen,
        )

        started = _tree(join.proc.pid)
        assert any(p.name() == "raylet" for p in started), started
        join.proc.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        join.proc.wait(WAIT_S)
        stop_s = time.monotonic() - stopping
        assert join.proc.returncode == 0, join.err[-3000:]
        assert "attempt 2: stopped the" in join.out
        left = [p for p in started if _alive(p)] + [p for p in _naming(str(folder)) if _alive(p)]
        assert not left, [(p.pid, p.name()) for p in left]
        with capsys.disabled():  # the figures, in the test output
            print(
                f"\njoined (ALIVE) {joined_s:.1f} s after `join` started; a new ALIVE node "
                f"{back_s:.1f} s after its raylet was killed; SIGTERM to exit {stop_s:.1f} s "
                f"({len(started)} processes)"
            )
    finally:
        if join is not None:
            for p in _tree(join.proc.pid):
                with contextlib.suppress(psutil.Error):
                    p.kill()
            join.kill()
        if watcher is not None:
            watcher.kill()
            watcher.wait(30)
        for p in _naming(str(folder)):
            with contextlib.suppress(psutil.Error):
                p.kill()
        stop_head(fleet)
        shutil.rmtree(folder, ignore_errors=True)
