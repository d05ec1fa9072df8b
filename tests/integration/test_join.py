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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from cluster.device import DEVICE_LABEL
from cluster.head import _free_port, start_head, stop_head
from edgefleet.providers import PROVIDERS_LABEL
from tests.integration.test_cli import EDGEFLEET, Running, edgefleet

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


class Head:
    """The module's Ray head (on loopback, fast failure detection, token authentication),
    reached by a host name of 127.0.0.1, and a driver on it that watches Ray's nodes."""

    def __init__(self, fleet: str, address: str, host: str, log: Path) -> None:
        self.fleet = fleet
        self.address = address
        self.join_address = f"{host}:{address.rpartition(':')[2]}"
        self.latest: list[dict[str, Any]] = []
        self._log = log
        self.watcher = subprocess.Popen(
            [sys.executable, "-c", NODES, address],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
        )
        threading.Thread(target=self._read, args=(self.watcher.stdout,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with contextlib.suppress(ValueError):
                self.latest = json.loads(line)

    def device_nodes(self, device: str, alive: bool = True) -> list[dict[str, Any]]:
        return [
            n
            for n in self.latest
            if n["alive"] is alive and n["labels"].get(DEVICE_LABEL) == device
        ]

    def seen(self, join: Running | None, *more: str) -> str:
        """What a failed wait shows: join's own lines, its last words, the nodes."""
        said = [line for line in join.out.splitlines() if " attempt " in line] if join else []
        return "\n".join(
            [
                *said,
                join.err[-2000:] if join else "",
                *more,
                f"nodes: {self.latest}",
                f"node watcher: {self.watcher.poll()} " + self._log.read_text()[-2000:],
            ]
        )

    def close(self) -> None:
        self.watcher.kill()
        self.watcher.wait(30)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One head for the module's tests that join a device to it (each its own device)."""
    host = _loopback_name()
    if host is None:
        pytest.skip(
            "needs a host name for 127.0.0.1 other than localhost (this machine's name in "
            "/etc/hosts): `ray start --address` swaps 127.0.0.1 for the machine's address"
        )
    fleet = f"jn{os.getpid()}"
    watching: Head | None = None
    try:
        address = start_head(fleet, 1, env=HEAD_ENV)  # loopback, token authentication
        watching = Head(fleet, address, host, tmp_path_factory.mktemp("head") / "nodes.err")
        yield watching
    finally:
        if watching is not None:
            watching.close()
        stop_head(fleet)


def _join(head: Head, device: str, folder: Path, *args: str) -> Running:
    return Running(
        "join",
        head.join_address,
        "--device",
        device,
        *args,
        "--num-cpus",
        "1",
        "--temp-dir",
        str(folder),
    )


def _end_join(join: Running | None, folder: Path) -> None:
    """Whatever a test left of a device: its `join`, what that started (stopped ones
    too), and anything else naming its Ray folder."""
    if join is not None:
        for p in _tree(join.proc.pid):
            with contextlib.suppress(psutil.Error):
                p.kill()
        join.kill()
    for p in _naming(str(folder)):
        with contextlib.suppress(psutil.Error):
            p.kill()
    shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class Attempt:
    """The attempt a `join` runs: its number, its raylet, the Ray node that raylet is."""

    number: int
    raylet: psutil.Process
    node: str


def _running(join: Running) -> Attempt | None:
    """The attempt `join` runs now, once its raylet runs (on a busy machine an attempt
    may fail as Ray starts, and `join` start another: a test follows the one running)."""
    for p in _tree(join.proc.pid):
        with contextlib.suppress(psutil.Error, StopIteration):
            if p.name() == "raylet":
                node = next(a for a in p.cmdline() if a.startswith("--node_id="))
                said = rf"attempt (\d+): joining .* \(ray start pid {p.ppid()}\)"
                if found := re.search(said, join.out):
                    return Attempt(int(found.group(1)), p, node.partition("=")[2])
    return None


def _sigterm_leaves_nothing(join: Running, folder: Path) -> tuple[float, int]:
    """SIGTERM to `join`: it exits 0 and none of the processes it started is left; how
    long it took and how many processes there were."""
    started = _tree(join.proc.pid)
    assert any(p.name() == "raylet" for p in started), started
    join.proc.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    join.proc.wait(WAIT_S)
    stop_s = time.monotonic() - stopping
    assert join.proc.returncode == 0, join.err[-3000:]
    left = [p for p in started if _alive(p)] + [p for p in _naming(str(folder)) if _alive(p)]
    assert not left, [(p.pid, p.name()) for p in left]
    return stop_s, len(started)


@pytest.mark.timeout(600)
def test_join_brings_the_device_back_after_its_raylet_dies_and_sigterm_leaves_nothing(head, capsys):
    device = f"cam-{os.getpid()}"
    folder = Path(tempfile.mkdtemp(prefix="ej-", dir="/tmp"))  # short: Ray's socket paths
    join: Running | None = None

    def seen() -> str:
        return head.seen(join)

    try:
        began = time.monotonic()
        join = _join(head, device, folder, "--labels", "zone=lab", "--resources", '{"cam": 1}')

        def up(after: int = 0) -> tuple[Attempt, dict[str, Any]] | None:
            """The running attempt (one after attempt ``after``) and its ALIVE node."""
            now = _running(join) if join else None
            if now is None or now.number <= after:
                return None
            node = [n for n in head.device_nodes(device) if n["id"] == now.node]
            return (now, node[0]) if node else None

        attempt, first = _wait("the device's node ALIVE", up, context=seen)
        joined_s = time.monotonic() - began
        assert first["labels"]["zone"] == "lab" and first["resources"]["cam"] == 1, first
        assert first["labels"][PROVIDERS_LABEL] == "cpu", first  # this machine's build

        attempt.raylet.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        join.wait_for(
            f"attempt {attempt.number}: ray start exited with status 1: raylet [exit code=-9]",
            err=True,
        )
        join.wait_for(f"attempt {attempt.number + 1}: joining")
        last, again = _wait(
            "a new ALIVE node of the device", lambda: up(attempt.number), context=seen
        )
        back_s = time.monotonic() - killed
        assert again["labels"]["zone"] == "lab"
        _wait(
            "the old node dead",
            lambda: first["id"] in {n["id"] for n in head.device_nodes(device, False)},
            context=seen,
        )

        stop_s, processes = _sigterm_leaves_nothing(join, folder)
        assert f"attempt {last.number}: stopped the" in join.out
        with capsys.disabled():  # the figures, in the test output
            print(
                f"\njoined (ALIVE) {joined_s:.1f} s after `join` started; a new ALIVE node "
                f"{back_s:.1f} s after its raylet was killed; SIGTERM to exit {stop_s:.1f} s "
                f"({processes} processes)"
            )
    finally:
        _end_join(join, folder)


# A caller on the head: a request every 0.1 s (at most 4 in flight), a JSON line per
# answer (when it was sent and answered, the node that served it), and a line with the
# pool's devices as the router has them every half second, until it is killed.
CALLER = """
import json, sys, threading, time
import ray
from cluster.client import FleetClient
from cluster.deploy import pin_loopback, use_auth_mode
from cluster.names import NAMESPACE
from edgefleet.modelgen import random_inputs

address, fleet, pool, out = sys.argv[1:]
pin_loopback()
use_auth_mode(token=True)
ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
client = FleetClient.connect(address, fleet)
inputs = random_inputs("classifier")
lines = open(out, "a", buffering=1)
lock = threading.Lock()
slots = threading.Semaphore(4)

def write(item):
    with lock:
        lines.write(json.dumps(item) + "\\n")

def watch():
    while True:
        try:
            devices = client.status(timeout_s=10).pool(pool).devices
            write({"t": time.time(), "devices": [
                {"device": d.device, "state": d.state, "joins": d.joins, "ray_node": d.ray_node}
                for d in devices
            ]})
        except Exception as exc:
            write({"t": time.time(), "status_error": repr(exc)[:300]})
        time.sleep(0.5)

def answered(future, sent):
    reply = future.result()
    error = None if reply.error is None else type(reply.error).__name__
    write({"t": time.time(), "sent": sent, "node": reply.node, "error": error})
    slots.release()

threading.Thread(target=watch, daemon=True).start()
while True:
    slots.acquire()
    sent = time.time()
    future = client.submit("classifier", inputs, timeout_s=30)
    future.add_done_callback(lambda f, sent=sent: answered(f, sent))
    time.sleep(0.1)
"""


def _lines(path: Path) -> list[dict[str, Any]]:
    items = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a line being written is left for the next read
                items.append(json.loads(line))
    return items


def _signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


@pytest.mark.timeout(600)
def test_a_frozen_device_serves_again_after_sigcont_with_no_operator_action(
    head, models_dir, tmp_path, capsys, record_property
):
    """The device's Ray (raylet, workers, the pool member's node actor, `ray start`)
    SIGSTOPped until the head declares its node dead, then SIGCONT: its raylet exits,
    `join` starts Ray again, and the pool's router starts a member on the new Ray node."""
    device = f"frozen-{os.getpid()}"
    fleet = f"jf{os.getpid()}"
    member = f"cams/{device}"
    folder = Path(tempfile.mkdtemp(prefix="ej-", dir="/tmp"))
    config = tmp_path / "fleet.json"  # JSON is YAML
    config.write_text(
        json.dumps(
            {
                "fleet": {"name": fleet},
                "model_dir": str(models_dir),
                "models": {"classifier": {"path": "classifier.onnx"}},
                "pools": [
                    {"name": "cams", "selector": {"device": "camera"}, "models": ["classifier"]}
                ],
                "router": {  # on the head, never on the device
                    "resources": {"node:__internal_head__": 0.001},
                    "report_interval_s": 0.2,
                    "lost_after_s": 2.0,
                    "membership": {"interval_s": 0.5},
                },
            }
        )
    )
    answers = tmp_path / "answers.jsonl"
    join: Running | None = None
    caller: subprocess.Popen[bytes] | None = None
    caller_log = tmp_path / "caller.log"
    frozen: list[psutil.Process] = []
    env = dict(os.environ, RAY_AUTH_MODE="token")

    def statuses() -> list[dict[str, Any]]:
        return [item for item in _lines(answers) if "devices" in item]

    def state() -> dict[str, Any] | None:
        """The device as the router last said."""
        latest = statuses()
        if not latest:
            return None
        return next((d for d in latest[-1]["devices"] if d["device"] == device), None)

    def seen() -> str:
        items = _lines(answers)
        return head.seen(
            join,
            f"caller: {caller.poll() if caller else None} " + caller_log.read_text()[-2000:]
            if caller_log.exists()
            else "",
            f"router says: {[i for i in items if 'devices' in i or 'status_error' in i][-3:]}",
            f"answers: {[i for i in items if 'node' in i][-5:]}",
        )

    try:
        up = subprocess.run(
            [str(EDGEFLEET), "up", str(config), "--address", head.address, "--detach"],
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        caller = subprocess.Popen(
            [sys.executable, "-c", CALLER, head.address, fleet, "cams", str(answers)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=caller_log.open("w"),
        )
        join = _join(head, device, folder, "--labels", f"device=camera,{DEVICE_LABEL}={device}")

        def serves(after: int = 0) -> tuple[Attempt, dict[str, Any]] | None:
            """The running attempt (one after attempt ``after``) once the router has the
            device serving from its Ray node."""
            now = _running(join) if join else None
            s = state()
            if now is None or now.number <= after or s is None or s["ray_node"] != now.node:
                return None
            return (now, s) if s["state"] == "serving" else None

        attempt, serving = _wait("the device serving", serves, context=seen)
        assert serving["joins"] == 1, serving
        _wait(
            "a request served there",
            lambda: any(a.get("node") == member and not a["error"] for a in _lines(answers)),
            context=seen,
        )
        (first,) = [n for n in head.device_nodes(device) if n["id"] == attempt.node]

        # The device freezes: every process of its Ray (what `join` started), not `join`.
        while fresh := [p for p in _tree(join.proc.pid) if p.pid not in {q.pid for q in frozen}]:
            _signal_all(fresh, signal.SIGSTOP)  # a worker started meanwhile: it too
            frozen += fresh
        assert any(p.name() == "raylet" for p in frozen), frozen
        stopped_at = time.monotonic()
        _wait(
            "the head declares the device's node dead",
            lambda: first["id"] in {n["id"] for n in head.device_nodes(device, False)},
            context=seen,
        )
        _wait(
            "the device left the pool", lambda: (state() or {}).get("state") == "left", context=seen
        )
        dead_s = time.monotonic() - stopped_at
        assert all(p.status() == psutil.STATUS_STOPPED for p in frozen), frozen
        assert f"attempt {attempt.number}: ray start exited" not in join.err, seen()

        _signal_all(frozen, signal.SIGCONT)
        cont_at, cont_mono = time.time(), time.monotonic()
        frozen = []
        # Its raylet learns it was declared dead and exits; `ray start` with it.
        join.wait_for(f"attempt {attempt.number}: ray start exited with status 1", WAIT_S, err=True)
        exited_s = time.monotonic() - cont_mono
        assert "marked as dead by the GCS" in join.out, seen()
        _wait(
            "a new ALIVE node of the device",
            lambda: [n for n in head.device_nodes(device) if n["id"] != first["id"]],
            context=seen,
        )
        alive_s = time.monotonic() - cont_mono
        last, back = _wait(
            "the device serving again, on a new Ray node",
            lambda: serves(attempt.number),
            context=seen,
        )
        alive = [n["id"] for n in head.device_nodes(device)]
        assert back["joins"] == 2 and first["id"] not in alive, (back, alive)
        serving_s = time.monotonic() - cont_mono
        served = _wait(
            "a request sent after SIGCONT served by the device",
            lambda: [
                a
                for a in _lines(answers)
                if a.get("node") == member and not a["error"] and a["sent"] >= cont_at
            ],
            context=seen,
        )[0]
        served_s = served["t"] - cont_at
        record_property("sigcont_to_first_served_s", round(served_s, 2))
        assert caller.poll() is None, seen()
        attempts = last.number - attempt.number

        stop_s, processes = _sigterm_leaves_nothing(join, folder)
        with capsys.disabled():  # the figures, in the test output
            print(
                f"\nfrozen {dead_s:.1f} s until the pool showed the device left; after SIGCONT: "
                f"`ray start` exited {exited_s:.1f} s, a new ALIVE node {alive_s:.1f} s, the "
                f"device serving again {serving_s:.1f} s ({attempts} attempt(s) to join), its "
                f"first request served {served_s:.1f} s; SIGTERM to exit {stop_s:.1f} s "
                f"({processes} processes)"
            )
    finally:
        _signal_all(frozen, signal.SIGCONT)
        if caller is not None:
            caller.kill()
            caller.wait(30)
        _end_join(join, folder)
