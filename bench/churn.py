"""Device churn: a pool whose devices leave and come back every few seconds under load.

A Ray head on loopback with short health checks (a dead raylet is declared dead in a
few seconds), one raylet per device carrying the pool's labels, and one for this
driver. A steady mixed load (foreground and background priorities, a share of the
requests at most once) runs while, every few seconds, one device's raylet and all its
processes are killed (the device drops off) and a new raylet with the same labels
starts a few seconds later (it comes back). The router's membership retires the old
member and starts a new one; callers re-place what the departed device held.

Checked: every request gets exactly one answer (none lost, every error typed), no
at-most-once request runs twice (the nodes' traces), and how long a device that comes
back takes from its raylet's join to its first served request.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures as cf
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from actors.trace import read_traces
from bench.chaos_cluster import CLIENT, HEAD_ENV, Raylets
from bench.common import Section, Target, fmt, log, md_table, percentile, utc_now, write_report
from cluster.client import FleetClient
from edgefleet.config import parse_config
from edgefleet.errors import EdgeFleetError
from edgefleet.labels import DEVICE_LABEL
from edgefleet.modelgen import make_classifier, random_inputs
from sim.workload import FleetEvent, Workload, parse_workload

TITLE = "Device churn: devices leave and come back under load"
DEVICES = ("cam-0", "cam-1", "cam-2", "cam-3")
POOL = "cams"
HEALTH = {**HEAD_ENV, "RAY_health_check_timeout_ms": "1000"}  # a dead raylet found in 3-5 s
RATE = 40.0  # requests per second (Poisson)
AT_MOST_ONCE = 0.2  # share of the requests
LEAVE_EVERY_S = 4.5  # mean time between two departures
AWAY_S = 5.5  # how long a device stays away
ANSWER_S = 120.0  # every answer arrives by then after the load stops


def _raylet(device: str) -> dict[str, Any]:
    """The keywords of a device's raylet: the pool's labels (the driver's: none)."""
    labels = {} if device == CLIENT else {"device": "camera", DEVICE_LABEL: device}
    return {"resources": {}, "labels": labels, "num_cpus": 1}


def workload(seconds: float, seed: int) -> Workload:
    """The load: Poisson arrivals at RATE, foreground and background alike, a share
    AT_MOST_ONCE of each at most once; ``seconds`` of it at most. The churn: a device
    leaves every LEAVE_EVERY_S on average, and comes back AWAY_S later."""
    mix = [
        {"model": "classifier", "priority": p, "weight": share, "at_most_once": once}
        for p in ("foreground", "background")
        for once, share in ((False, 1 - AT_MOST_ONCE), (True, AT_MOST_ONCE))
    ]
    per_hour = 3600 / LEAVE_EVERY_S / len(DEVICES)
    churn: dict[str, Any] = {"leave_per_device_per_hour": per_hour, "declared_dead_after_s": 4.0}
    churn |= {"rejoin_after_s": AWAY_S, "rejoin_distribution": "fixed"}
    data = {"seed": seed, "duration_s": seconds, "arrivals": {"rate": RATE}, "mix": mix}
    data["churn"] = churn
    return parse_workload(data, source="the churn load")


class Load:
    """The workload's requests, sent at their times in a thread: each one's id, whether
    it is at most once and its future; when each node answered one."""

    def __init__(self, client: FleetClient, seed: int, seconds: float) -> None:
        self.client = client
        rng, priorities = random.Random(f"{seed}/load"), client.config.priorities
        self.arrivals = workload(seconds, seed).arrivals(rng, nodes=1, priorities=priorities)
        self.sent: list[tuple[str, bool, Any]] = []
        self.served: dict[str, list[float]] = {}  # node -> when its answers came, in order
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="churn-load", daemon=True)
        self._lock = threading.Lock()

    def _run(self) -> None:
        inputs, began = random_inputs("classifier"), time.monotonic()
        for i, a in enumerate(self.arrivals):
            if self.stop.wait(max(0.0, began + a.at - time.monotonic())):
                return
            rid, once = f"churn-{i}", a.at_most_once
            future = self.client.submit(
                a.model, inputs, priority=a.priority, request_id=rid, at_most_once=once
            )
            future.add_done_callback(self._done)
            self.sent.append((rid, once, future))

    def _done(self, future: Any) -> None:
        node = future.result().node
        with self._lock:
            self.served.setdefault(node, []).append(time.monotonic())

    def first_served(self, node: str, since: float) -> float | None:
        """When ``node`` first answered a request at or after ``since``."""
        with self._lock:
            times = self.served.get(node, [])
            i = bisect.bisect_left(times, since)
            return times[i] if i < len(times) else None


def _churn(cluster: Raylets, load: Load, seconds: float, seed: int) -> list[tuple[str, float]]:
    """Devices leave and come back as the workload's churn has them, until ``seconds``
    (those still away come back then); never the last one present, nor one back that
    has not served yet. Each return: (device, when its raylet joined)."""
    rng, horizon = random.Random(f"{seed}/churn"), seconds - AWAY_S
    events = workload(seconds, seed).events(rng, nodes=len(DEVICES), horizon_s=horizon)
    events += [FleetEvent(seconds, "join", i) for i in range(len(DEVICES))]
    returns: list[tuple[str, float]] = []
    joined: dict[str, float] = {}  # device -> when it last came back
    left: set[str] = set()
    began = time.monotonic()
    for e in events:
        time.sleep(max(0.0, began + e.at - time.monotonic()))
        device = DEVICES[e.node]
        if e.kind == "join" and device in left:
            left.remove(device)
            joined[device] = cluster.add(device)
            returns.append((device, joined[device]))
            log(f"churn: {device} is back")
        elif e.kind == "leave" and len(left) < len(DEVICES) - 1:
            since = joined.get(device)
            if since is None or load.first_served(f"{POOL}/{device}", since) is not None:
                cluster.kill(device)
                left.add(device)
                log(f"churn: {device} left")
    return returns


def soak(models: Path, seconds: float, seed: int = 0) -> Section:
    """Run the churn for ``seconds``; its report section."""
    cluster = Raylets(f"churn{os.getpid()}", _raylet)
    traces = Path(tempfile.mkdtemp(prefix="churn-traces-"))
    try:
        cluster.start_cluster([CLIENT], CLIENT, HEALTH, redis=False)
        config = {
            "fleet": {"name": cluster.name},
            "models": {"classifier": {"path": "classifier.onnx"}},
            "pools": [{"name": POOL, "selector": {"device": "camera"}}],
            "node_defaults": {"queue": {"capacity": 32}, "trace_dir": str(traces)},
            "router": {
                "resources": {"node:__internal_head__": 0.001},
                "report_interval_s": 0.25,
                "lost_after_s": 2.0,
                "membership": {"interval_s": 0.5},
            },
        }
        with FleetClient.local(parse_config(config, models)) as client:
            for device in DEVICES:
                cluster.add(device)
            deadline = time.monotonic() + 180
            while sum(d.state == "serving" for d in client.status().pool(POOL).devices) < len(
                DEVICES
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the devices did not all serve within 180 s")
                time.sleep(0.5)
            load = Load(client, seed, seconds + ANSWER_S + 60)
            load.thread.start()
            t0 = time.monotonic()
            returns = _churn(cluster, load, seconds, seed)
            deadline = time.monotonic() + ANSWER_S  # the last devices back serve under load
            while time.monotonic() < deadline and any(
                load.first_served(f"{POOL}/{d}", joined) is None for d, joined in returns
            ):
                time.sleep(0.5)
            load.stop.set()
            load.thread.join(30)
            cf.wait([f for _, _, f in load.sent], timeout=ANSWER_S)
            minutes = (time.monotonic() - t0) / 60
            return section(load, read_traces(traces)[0], returns, minutes, seconds / 60)
    finally:
        cluster.stop()
        shutil.rmtree(traces, ignore_errors=True)


def section(
    load: Load,
    traces: list[dict[str, Any]],
    returns: list[tuple[str, float]],
    minutes: float,
    asked: float,
) -> Section:
    """The figures and targets: answers (the futures done), executions (the traces),
    and how long each device back took to serve."""
    replies = [f.result() for _, _, f in load.sent if f.done()]
    errors = Counter(type(r.error).__name__ for r in replies if r.error is not None)
    untyped = sum(r.error is not None and not isinstance(r.error, EdgeFleetError) for r in replies)
    ran = Counter(line["id"] for line in traces if line.get("ran"))
    amo = {rid for rid, once, _ in load.sent if once}
    amo_twice = sum(ran[rid] > 1 for rid in amo)
    to_first = [
        t - joined
        for device, joined in returns
        if (t := load.first_served(f"{POOL}/{device}", joined)) is not None
    ]
    first = " / ".join(f"{fmt(percentile(to_first, q), 1)} s" for q in (50, 99))
    rows: list[list[object]] = [
        ["requests sent", len(load.sent)],
        ["answered", len(replies)],
        ["completed", sum(r.error is None for r in replies)],
        ["typed errors", ", ".join(f"{k} {v}" for k, v in errors.most_common()) or "none"],
        ["untyped errors", untyped],
        ["at-most-once requests that ran twice", amo_twice],
        [
            "at-least-once requests that ran twice (re-placed: allowed)",
            sum(n > 1 for rid, n in ran.items() if rid not in amo),
        ],
        ["devices back / served again", f"{len(returns)} / {len(to_first)}"],
        ["raylet joined to first served request, p50 / p99", first],
    ]
    measured = __doc__.split("\n\n", 2)[1].replace("\n", " ")
    measured += f" {len(DEVICES)} devices, {RATE:g} requests/s, {minutes:.1f} minutes"
    measured += f" (`python -m bench.churn --minutes {asked:g}`)."
    return Section(
        TITLE,
        measured,
        tables=[md_table(["figure", "value"], rows)],
        targets=[
            Target("requests without an answer", len(load.sent) - len(replies), "<=", 0, 0),
            Target("untyped errors", untyped, "<=", 0, 0),
            Target("at-most-once requests run twice", amo_twice, "<=", 0, 0),
            Target("devices back that served again", len(to_first), ">=", len(returns), 0),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.churn",
        description="Devices of a pool leave and come back under load; prints a report.",
        epilog="example: python -m bench.churn --minutes 5 --out /tmp/churn.md",
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="churn time (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    out = "also write the section into this report (bench/RESULTS.md: its section replaced)"
    parser.add_argument("--out", type=Path, metavar="FILE", help=out)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="churn-models-") as tmp:
        make_classifier(Path(tmp) / "classifier.onnx")
        began, started = time.monotonic(), utc_now()
        result = soak(Path(tmp), args.minutes * 60, args.seed)
    result.seconds = time.monotonic() - began
    print(result.markdown())
    if args.out is not None:
        shown = " ".join(argv if argv is not None else sys.argv[1:])
        run = f"`python -m bench.churn {shown}`, {started}, {result.seconds:.0f} s"
        write_report(args.out, [result], run)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
