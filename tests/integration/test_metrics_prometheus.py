"""Every panel of the Grafana dashboard returns data from a real Prometheus that
scrapes a live embedded fleet under a mixed load, through Ray's own metrics agent and
Ray's service-discovery file; and ``edgefleet status`` counts what Prometheus counts.

Prometheus is Debian's ``prometheus`` (``.ci/run`` installs it where apt can); the test
is skipped only where the binary cannot be found.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray

from actors.metrics import REQUESTS, ROUTER_REQUESTS
from cluster.cli import main
from cluster.client import FleetClient
from cluster.dashboard import check, prometheus_query, series
from cluster.deploy import init_loopback_ray
from cluster.metrics import SERVICE_DISCOVERY_FILE, prometheus_config
from edgefleet.config import parse_config
from edgefleet.errors import Rejected
from edgefleet.modelgen import random_inputs

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus")
FLEET = "metrics"
LOAD_BUDGET_S = 25.0  # bursts until every kind of event happened, at most this long
DATA_BUDGET_S = 90.0  # for Ray's agent and Prometheus to show it (a busy machine is slow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_prometheus(sd_file: Path, workdir: Path) -> Iterator[str]:
    """A Prometheus on loopback scraping every second what ``sd_file`` lists; stopped
    (by its pid) on exit."""
    assert PROMETHEUS is not None
    config = workdir / "prometheus.yml"
    config.write_text(prometheus_config(sd_file, scrape_interval="1s"))
    url = f"http://127.0.0.1:{_free_port()}"
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, "Prometheus did not become ready in 30 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _generation_round(fleet: FleetClient, n: int) -> None:
    """A background generation paused by a foreground one on edge-1 (the node that
    serves the decoder); every other round edge-1's device is in the background, so
    the background generation is cut by its token budget."""
    fleet.set_lifecycle("edge-1", "background" if n % 2 else "foreground")
    prompt = [1 + (n + i) % 400 for i in range(8)]
    for _ in range(20):  # the router sheds background work while edge-1's queue is full
        bg = fleet.generate("tiny_lm", prompt, max_new_tokens=480, priority="background")
        try:
            next(bg)
            break
        except Rejected as exc:
            time.sleep(exc.retry_after_s)
    fleet.generate("tiny_lm", prompt, max_new_tokens=8, session=f"chat-{n % 3}").collect()
    bg.collect()


WANTED_NODE = ("completed", "evicted", "superseded", "expired", "cancelled", "preempted")
WANTED_ROUTER = ("spilled", "replaced", "shed", "rejected")


def _mixed_load(fleet: FleetClient) -> dict[str, int]:
    """Bursts of mixed work until every kind of event the dashboard shows happened."""
    heavy, classifier = random_inputs("heavy"), random_inputs("classifier")
    deadline = time.monotonic() + LOAD_BUDGET_S
    burst = 0
    while True:
        burst += 1
        refs = [fleet.submit("classifier", classifier, priority="foreground") for _ in range(3)]
        refs += [fleet.submit("heavy", heavy, priority="background") for _ in range(24)]
        refs += [fleet.submit("heavy", heavy, priority="offline") for _ in range(8)]
        # Frames of one camera: a newer one supersedes its queued predecessor.
        refs += [
            fleet.submit("heavy", heavy, priority="foreground", key=f"cam-{burst}")
            for _ in range(6)
        ]
        refs += [fleet.submit("heavy", heavy, priority="inline") for _ in range(16)]
        refs += [fleet.submit("heavy", heavy, priority="foreground") for _ in range(8)]
        refs.append(fleet.submit("heavy", heavy, priority="inline", deadline_s=-1.0))
        # Queued behind the burst, then cancelled (the router forwards cancels in order).
        for priority in ("inline", "foreground"):
            late = f"cancel-{priority}-{burst}"
            refs.append(fleet.submit("heavy", heavy, priority=priority, request_id=late))
            fleet.cancel(late)
        FleetClient.gather(refs, 120)
        status = fleet.status()
        seen = {**status.totals, **{f"router_{k}": v for k, v in status.router.items()}}
        missing = [k for k in WANTED_NODE if not seen.get(k)]
        missing += [k for k in WANTED_ROUTER if not seen.get(f"router_{k}")]
        if not missing:
            return {"bursts": burst, **seen}
        assert time.monotonic() < deadline, f"after {burst} bursts no {missing} yet: {seen}"


class SteadyLoad:
    """A light mixed load in a thread while Prometheus is read: a rate needs increases
    between two scrapes, and Ray's agent exports about once a second. It switches
    edge-0's model now and then, and generates on edge-1."""

    def __init__(self, fleet: FleetClient) -> None:
        self.fleet = fleet
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="steady-load", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        heavy, classifier = random_inputs("heavy"), random_inputs("classifier")
        rounds = 0
        try:
            while not self.stop.wait(0.1):
                refs = [self.fleet.submit("classifier", classifier, priority="foreground")]
                for priority, n in (("inline", 2), ("background", 4), ("offline", 2)):
                    refs += [self.fleet.submit("heavy", heavy, priority=priority) for _ in range(n)]
                FleetClient.gather(refs, 60)
                _generation_round(self.fleet, rounds)
                if rounds % 10 == 0:
                    model = ("detector", "classifier")[rounds // 10 % 2]
                    self.fleet.switch_model("edge-0", model, timeout_s=60)
                rounds += 1
        except BaseException as exc:  # reported by __exit__
            self.error = exc

    def __enter__(self) -> SteadyLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the load thread did not stop"
        if self.error is not None:
            raise self.error


def _listening(port: int) -> set[str]:
    addresses = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            addresses.add(conn.laddr.ip)
    return addresses


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")
def test_every_dashboard_panel_returns_data_from_prometheus(models_dir, tmp_path):
    started = time.monotonic()
    if ray.is_initialized():
        ray.shutdown()  # this test needs Ray to report metrics every half second
    init_loopback_ray(num_cpus=3, system_config={"metrics_report_interval_ms": 500})
    try:
        # Ray's service-discovery file lists the metrics agent, on loopback only.
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        sd_file = session / SERVICE_DISCOVERY_FILE
        (entry,) = json.loads(sd_file.read_text())
        (target,) = entry["targets"]
        host, port = target.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert _listening(int(port)) <= {"127.0.0.1", "::ffff:127.0.0.1"}, _listening(int(port))

        config = parse_config(
            {
                "fleet": {"name": FLEET},
                "models": {
                    "heavy": {"path": "heavy.onnx", "memory_mb": 20},
                    "classifier": {"path": "classifier.onnx", "memory_mb": 60},
                    "detector": {"path": "detector.onnx", "memory_mb": 60},
                    "tiny_lm": {"path": "tiny_lm.onnx", "kind": "decoder", "memory_mb": 10},
                },
                "nodes": [
                    {"name": "edge-0", "models": ["heavy", "classifier", "detector"]},
                    {"name": "edge-1", "models": ["heavy", "classifier", "tiny_lm"]},
                ],
                # A pool no Ray node here matches: its panel shows 0 devices, not nothing.
                "pools": [{"name": "cams", "selector": {"device": "camera"}}],
                "node_defaults": {"queue": {"capacity": 4}, "memory_budget_mb": 100},
                "router": {"report_interval_s": 0.2},
            },
            models_dir,
        )
        where = f'fleet="{FLEET}"'
        with (
            running_prometheus(sd_file, tmp_path) as prometheus,
            FleetClient.local(config) as fleet,
        ):
            # Before any request the counters' series exist, at zero: a fresh fleet's
            # panels show 0, not "no data".
            fresh = {
                "node": f"sum({series(REQUESTS, '', where, state='evicted')})",
                "caller": f"sum({series(ROUTER_REQUESTS, '', where, outcome='rejected')})",
            }
            deadline = time.monotonic() + 30
            while True:
                zeros = {k: prometheus_query(prometheus, q) for k, q in fresh.items()}
                if all(zeros.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert {k: [v["value"][1] for v in vec] for k, vec in zeros.items()} == {
                "node": ["0"],
                "caller": ["0"],
            }
            seen = _mixed_load(fleet)
            loaded_at = time.monotonic()

            # Every panel query returns data (as Grafana asks: all nodes, 1m window).
            with SteadyLoad(fleet):
                deadline = time.monotonic() + DATA_BUDGET_S
                while True:
                    results = check(prometheus, fleet=FLEET)
                    empty = [r for r in results if not r.has_data]
                    if not empty or time.monotonic() > deadline:
                        break
                    time.sleep(1.0)
            checked_at = time.monotonic()
            assert not empty, "panels without data:\n" + "\n".join(
                f"{r.query.panel} [{r.query.legend}]: {r.expr} {r.error}" for r in empty
            )

            # `edgefleet status` and Prometheus count the same requests.
            status = fleet.status()
            expected = {
                "completed": sum(
                    n.metrics.completed(c) for n in status.nodes for c in n.metrics.latency
                ),
                "evicted": status.totals.get("evicted", 0),
                "rejected": status.router.get("rejected", 0),
            }
            queries = {
                "completed": f"sum({series(REQUESTS, '', where, state='completed')})",
                "evicted": f"sum({series(REQUESTS, '', where, state='evicted')})",
                "rejected": f"sum({series(ROUTER_REQUESTS, '', where, outcome='rejected')})",
            }
            deadline = time.monotonic() + 15
            while True:
                got = {k: _scalar(prometheus, q) for k, q in queries.items()}
                if got == expected or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert got == expected
            # The command an operator runs says the same.
            assert main(["dashboard", "check", "--prometheus", prometheus, "--fleet", FLEET]) == 0
        print(
            f"\nprometheus test: bursts done at {loaded_at - started:.1f} s, every panel had "
            f"data at {checked_at - started:.1f} s, total {time.monotonic() - started:.1f} s; "
            f"{len(results)} panel queries; events {seen}"
        )
    finally:
        ray.shutdown()


def _scalar(prometheus: str, expr: str) -> int:
    vector = prometheus_query(prometheus, expr)
    return int(float(vector[0]["value"][1])) if vector else 0
