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

import ray

from actors.trace import read_traces
from bench.chaos_cluster import HEAD_ENV, Raylets
from bench.common import Section, Target, fmt, log, md_table, percentile, utc_now, write_report
from cluster.client import FleetClient
from cluster.head import start_head
from cluster.names import NAMESPACE
from edgefleet.config import parse_config
from edgefleet.errors import EdgeFleetError
from edgefleet.labels import DEVICE_LABEL
from edgefleet.modelgen import make_classifier, random_inputs
from sim.workload import Workload, parse_workload

TITLE = "Device churn: devices leave and come back under load"
DEVICES = ("cam-0", "cam-1", "cam-2", "cam-3")
POOL = "cams"
HEALTH = {**HEAD_ENV, "RAY_health_check_timeout_ms": "1000"}  # a dead raylet found in 3-5 s
RATE = 40.0  # requests per second (Poisson)
AT_MOST_ONCE = 0.2  # share of the requests
EVERY_S = (3.0, 6.0)  # between two departures
AWAY_S = (3.0, 8.0)  # how long a device stays away
ANSWER_S = 120.0  # every answer arrives by then after the load stops


class Cluster(Raylets):
    """The head, the driver's raylet and the devices' raylets (each in its own folder)."""

    def __init__(self) -> None:
        super().__init__(f"churn{os.getpid()}")

    def start(self) -> None:
        self.address = start_head(self.name, 1, env=HEALTH)
        self.add("client")
        ray.init(address=self.address, _temp_dir=str(self.dirs["client"]), namespace=NAMESPACE)

    def add(self, device: str, **_: Any) -> float:
        """Start ``device``'s raylet with the pool's labels; the time it joined."""
        labels = {} if device == "client" else {"device": "camera", DEVICE_LABEL: device}
        return super().add(device, resources={}, labels=labels, num_cpus=1)


def workload(seconds: float, seed: int) -> Workload:
    """The load: Poisson arrivals at RATE, foreground and background alike, a share
    AT_MOST_ONCE of each at most once; ``seconds`` of it at most."""
    mix = [
        {"model": "classifier", "priority": p, "weight": share, "at_most_once": once}
        for p in ("foreground", "background")
        for once, share in ((False, 1 - AT_MOST_ONCE), (True, AT_MOST_ONCE))
    ]
    data = {"seed": seed, "duration_s": seconds, "arrivals": {"rate": RATE}, "mix": mix}
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
            kw = {"priority": a.priority, "request_id": rid, "at_most_once": once}
            future = self.client.submit(a.model, inputs, **kw)
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


def _churn(cluster: Cluster, load: Load, seconds: float, seed: int) -> list[tuple[str, float]]:
    """Devices leave and come back until ``seconds`` have passed (the last ones come back
    before the end); each return: (device, when its raylet joined). A device that came
    back leaves again only once it has served."""
    rng = random.Random(f"{seed}/churn")
    returns: list[tuple[str, float]] = []
    away: dict[str, float] = {}  # device -> when it comes back
    joined: dict[str, float] = {}  # device -> when it last came back
    end = time.monotonic() + seconds
    next_leave = time.monotonic() + rng.uniform(*EVERY_S)
    while time.monotonic() < end or away:
        now = time.monotonic()
        for device, back_at in sorted(away.items()):
            if now >= back_at:
                joined[device] = cluster.add(device)
                returns.append((device, joined[device]))
                del away[device]
                log(f"churn: {device} is back")
        present = [
            d
            for d in DEVICES
            if d not in away
            and (d not in joined or load.first_served(f"{POOL}/{d}", joined[d]) is not None)
        ]
        if now >= next_leave and now < end - AWAY_S[1] and len(present) > 1:
            device = rng.choice(present)
            cluster.kill(device)
            away[device] = now + rng.uniform(*AWAY_S)
            log(f"churn: {device} left")
            next_leave = now + rng.uniform(*EVERY_S)
        time.sleep(0.2)
    return returns


def _serving(client: FleetClient) -> int:
    return sum(d.state == "serving" for d in client.status().pool(POOL).devices)


def soak(models: Path, seconds: float, seed: int = 0) -> dict[str, Any]:
    """Run the churn for ``seconds``; its figures."""
    cluster, traces = Cluster(), Path(tempfile.mkdtemp(prefix="churn-traces-"))
    try:
        cluster.start()
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
        client = FleetClient.local(parse_config(config, models))
        for device in DEVICES:
            cluster.add(device)
        deadline = time.monotonic() + 180
        while _serving(client) < len(DEVICES):
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
        sent = list(load.sent)
        cf.wait([f for _, _, f in sent], timeout=ANSWER_S)
        replies = [f.result() for _, _, f in sent if f.done()]
        figures = _figures(sent, replies, read_traces(traces)[0], load, returns)
        figures["minutes"] = (time.monotonic() - t0) / 60
        figures["asked"] = seconds / 60
        client.close()
        return figures
    finally:
        cluster.stop()
        shutil.rmtree(traces, ignore_errors=True)


def _figures(
    sent: list[tuple[str, bool, Any]],
    replies: list[Any],
    traces: list[dict[str, Any]],
    load: Load,
    returns: list[tuple[str, float]],
) -> dict[str, Any]:
    errors = Counter(type(r.error).__name__ for r in replies if r.error is not None)
    untyped = sum(r.error is not None and not isinstance(r.error, EdgeFleetError) for r in replies)
    ran = Counter(line["id"] for line in traces if line.get("ran"))
    amo = {rid for rid, once, _ in sent if once}
    to_first = [
        t - joined
        for device, joined in returns
        if (t := load.first_served(f"{POOL}/{device}", joined)) is not None
    ]
    return {
        "sent": len(sent),
        "answered": len(replies),
        "completed": sum(r.error is None for r in replies),
        "errors": errors,
        "untyped": untyped,
        "amo_twice": sum(ran[rid] > 1 for rid in amo),
        "alo_twice": sum(n > 1 for rid, n in ran.items() if rid not in amo),
        "returns": len(returns),
        "served_again": len(to_first),
        "first_p50": percentile(to_first, 50) if to_first else float("nan"),
        "first_p99": percentile(to_first, 99) if to_first else float("nan"),
    }


def section(f: dict[str, Any]) -> Section:
    errors = ", ".join(f"{k} {v}" for k, v in f["errors"].most_common()) or "none"
    rows = [
        ["requests sent", f["sent"]],
        ["answered", f["answered"]],
        ["completed", f["completed"]],
        ["typed errors", errors],
        ["untyped errors", f["untyped"]],
        ["at-most-once requests that ran twice", f["amo_twice"]],
        ["at-least-once requests that ran twice (re-placed: allowed)", f["alo_twice"]],
        ["devices back / served again", f"{f['returns']} / {f['served_again']}"],
        [
            "raylet joined to first served request, p50 / p99",
            f"{fmt(f['first_p50'], 1)} s / {fmt(f['first_p99'], 1)} s",
        ],
    ]
    return Section(
        TITLE,
        __doc__.split("\n\n", 2)[1].replace("\n", " ")
        + f" {len(DEVICES)} devices, {RATE:g} requests/s, {f['minutes']:.1f} minutes"
        + f" (`python -m bench.churn --minutes {f['asked']:g}`).",
        tables=[md_table(["figure", "value"], rows)],
        targets=[
            Target("requests without an answer", f["sent"] - f["answered"], "<=", 0, 0),
            Target("untyped errors", f["untyped"], "<=", 0, 0),
            Target("at-most-once requests run twice", f["amo_twice"], "<=", 0, 0),
            Target("devices back that served again", f["served_again"], ">=", f["returns"], 0),
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
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="also write the section into this report (bench/RESULTS.md: its section replaced)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="churn-models-") as tmp:
        make_classifier(Path(tmp) / "classifier.onnx")
        began, started = time.monotonic(), utc_now()
        figures = soak(Path(tmp), args.minutes * 60, args.seed)
    result = section(figures)
    result.seconds = time.monotonic() - began
    print(result.markdown())
    if args.out is not None:
        shown = " ".join(argv if argv is not None else sys.argv[1:])
        run = f"`python -m bench.churn {shown}`, {started}, {result.seconds:.0f} s"
        write_report(args.out, [result], run)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
