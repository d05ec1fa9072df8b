"""The cost of watching: the router's pool membership at 5,000 Ray nodes.

The router's reconcile pass (``cluster/membership.py``) over a node table of 5,000
alive Ray nodes, every one matched by one pool, in this process and without Ray: the
rows come from real ``GcsNodeInfo`` protobufs through ``RayNodeTable.rows`` (the code
a live router runs on the GCS's reply), and members start on fakes that answer at
once. Each figure is the CPU time (``time.process_time``) of one
``Membership.reconcile``, the members' start tasks included; parsing the reply's
serialized node infos (Ray's client does it) is timed apart.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray._raylet import NodeID
from ray.core.generated.gcs_pb2 import GcsNodeInfo

from bench.common import RunContext, Section, Target, fmt, md_table
from cluster.membership import RayNodeRow
from cluster.nodes import RayNodeTable
from cluster.router import Router
from edgefleet.clock import FakeClock
from edgefleet.config import parse_config
from edgefleet.labels import DEVICE_LABEL
from edgefleet.messages import NodeState, NodeStatus

TITLE = "The cost of watching: pool membership at 5,000 Ray nodes"
MAX_SHARE = 0.05  # of one core at the default reconcile interval, steady state
POOLS = {
    "fleet": {"name": "watch"},
    "models": {"m": {"path": "m.onnx"}},
    "pools": [{"name": "cams", "selector": {"device": "camera"}}],
}


@dataclass(frozen=True)
class WatchCost:
    """CPU of the router's pool membership per reconcile, at ``nodes`` Ray nodes."""

    nodes: int
    join_ms: float  # the first pass: every device joins (a one-off)
    steady_ms: float  # median pass, nothing changed
    churn_ms: float  # median pass with ``churned`` Ray nodes dead and as many new
    churned: int
    parse_ms: float  # parsing the GCS reply's node infos
    interval_s: float

    def share(self, ms: float) -> float:
        """Of one core, at the default reconcile interval."""
        return ms / 1000.0 / self.interval_s


class _Member:
    """A pool member's actor (and the actors' maker) that serves as soon as asked."""

    def __init__(self, name: str = "") -> None:
        self.name = name

    async def create(self, spec: Any) -> _Member:
        return _Member(spec.name)

    async def remove(self, spec: Any) -> None:
        pass

    async def start(self) -> NodeStatus:
        return NodeStatus(self.name, NodeState.SERVING, {}, 0, None, ())


class _Gcs(RayNodeTable):
    """The GCS's node infos of camera devices, read as a live router reads them."""

    def __init__(self, nodes: int) -> None:
        super().__init__(10.0)
        self.rng = random.Random(1)
        self.infos: dict[NodeID, GcsNodeInfo] = {}
        self.serial = 0  # the next device's number
        for i in range(nodes):
            self.join(int(time.time() * 1000) - 3_600_000 + i)

    async def read(self) -> list[RayNodeRow]:
        return self.rows(self.infos)

    def join(self, started_ms: int) -> None:
        node_id = NodeID(self.rng.randbytes(28))
        labels = {"device": "camera", DEVICE_LABEL: f"cam-{self.serial}"}
        info = GcsNodeInfo(
            node_id=node_id.binary(),
            state=GcsNodeInfo.ALIVE,
            node_manager_address="10.0.0.1",
            node_name="10.0.0.1",
            start_time_ms=started_ms,
            labels=labels | {"ray.io/node-id": node_id.hex()},
        )
        info.resources_total.update({"CPU": 4.0, "memory": 8e9})
        self.infos[node_id] = info
        self.serial += 1

    def churn(self, n: int) -> None:
        """``n`` Ray nodes die and as many new devices (new names) join."""
        for node_id in self.rng.sample(sorted(self.infos, key=lambda n: n.hex()), n):
            dead = GcsNodeInfo()
            dead.CopyFrom(self.infos[node_id])
            dead.state, dead.end_time_ms = GcsNodeInfo.DEAD, int(time.time() * 1000)
            self.infos[node_id] = dead
        for _ in range(n):
            self.join(int(time.time() * 1000))


def watch_cost(nodes: int = 5000, passes: int = 21, churned: int = 50) -> WatchCost:
    """Measure ``passes`` unchanged passes and ``passes`` passes with ``churned`` Ray
    nodes dead and as many new devices each, after the first pass (all join)."""
    config = parse_config(POOLS, Path("/nonexistent"))
    gcs = _Gcs(nodes)
    router = Router(config, {}, clock=FakeClock(), table=gcs, actors=_Member())  # type: ignore[arg-type]
    membership = router._membership
    assert membership is not None

    async def one(churn: int = 0) -> float:
        gcs.churn(churn)
        began = time.process_time()
        await membership.reconcile()
        await asyncio.gather(*(m.task for m in membership.members.values() if m.task))
        return (time.process_time() - began) * 1000.0

    async def measure() -> list[float]:
        join = await one()
        steady = [await one() for _ in range(passes)]
        churn = [await one(churned) for _ in range(passes)]
        return [join, statistics.median(steady), statistics.median(churn)]

    costs = asyncio.run(measure())
    blobs = [i.SerializeToString() for i in gcs.infos.values()]
    began = time.process_time()
    for blob in blobs:
        GcsNodeInfo.FromString(blob)
    parse_ms = (time.process_time() - began) * 1000.0 * nodes / len(blobs)
    return WatchCost(nodes, *costs, churned, parse_ms, config.router.membership.interval_s)


def run(ctx: RunContext) -> Section:
    cost = watch_cost(passes=5 if ctx.quick else 21)

    def pct(ms: float) -> str:
        return f"{cost.share(ms) * 100:.1f} %"

    churn = f"{cost.churned} Ray nodes dead and {cost.churned} new devices joined, every pass"
    rows = [
        ["nothing changed (the usual pass)", f"{fmt(cost.steady_ms)} ms", pct(cost.steady_ms)],
        [f"... plus parsing the GCS reply's {cost.nodes:,} node infos"]
        + [f"+{fmt(cost.parse_ms)} ms", f"+{pct(cost.parse_ms)}"],
        [churn, f"{fmt(cost.churn_ms)} ms", pct(cost.churn_ms)],
        [f"the first pass: all {cost.nodes:,} devices join (once)", f"{fmt(cost.join_ms)} ms", "-"],
    ]
    steady = cost.share(cost.steady_ms + cost.parse_ms)
    measured = __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()
    measured += " Median of the passes; the share is of one core at the default "
    measured += f"`router.membership.interval_s` of {cost.interval_s:g} s."
    label = "steady watch cost with the parse, share of one core"
    note = (
        "Not measured: the GCS's own work and the RPC (another process), and what "
        "callers pay when members change (each receives every member's spec once)."
    )
    table = md_table(["pass", "CPU per pass", "of one core"], rows)
    return Section(TITLE, measured, [table], [Target(label, steady, "<=", MAX_SHARE, 3)], [note])
