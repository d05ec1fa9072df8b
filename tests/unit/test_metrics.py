"""Metric recorders without Ray: what a node and the router record (into a
MemorySink), the generation hooks, failure isolation, and the overview figures that
``edgefleet status`` computes from node reports."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import pytest

from actors import metrics as m
from actors.metrics import (
    MemorySink,
    MetricsSummary,
    NodeMetrics,
    NullSink,
    RaySink,
    default_sink,
)
from actors.node import NodeRuntime
from cluster import dashboard
from cluster.metrics import OverviewWindow, RouterMetrics
from edgefleet.config import parse_config
from edgefleet.errors import Rejected
from edgefleet.messages import FleetStatus, NodeStatus, bucket_quantile
from edgefleet.priorities import DEFAULT_PRIORITIES
from edgefleet.request import InferRequest
from tests.fakes import FakeLoader, LocalFleet, fake_spec, x

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def req(priority=3, model="m", **kw):
    return InferRequest(model=model, inputs=x(1.0), priority=priority, **kw)


async def recorded_node(spec=None, **engines):
    sink = MemorySink()
    metrics = NodeMetrics("f", "fake-0", DEFAULT_PRIORITIES, sink=sink)
    node = NodeRuntime(spec or fake_spec(), loader=FakeLoader(**engines), metrics=metrics)
    await node.start()
    return node, sink


@pytest.mark.parametrize(
    "q, cumulative, expected",
    [
        (0.5, (2, 4, 8, 8), 2.0),  # rank 4 ends bucket (1, 2]
        (0.75, (2, 4, 8, 8), 3.0),  # rank 6: halfway through (2, 4]
        (0.25, (2, 4, 8, 8), 1.0),
        (0.9, (1, 1, 1, 3), 4.0),  # in +Inf: the highest finite bound, as Prometheus
        (0.5, (0, 0, 0, 0), math.nan),
    ],
)
def test_bucket_quantile_interpolates_as_prometheus(q, cumulative, expected):
    got = bucket_quantile(q, (1.0, 2.0, 4.0), cumulative)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_node_records_requests_engine_calls_and_gauges():
    batching = {"window_ms": 30, "max_batch_size": 8, "only_if_faster": False}

    async def main():
        node, sink = await recorded_node(fake_spec({"m": {"batching": batching}}, capacity=4))
        replies = await asyncio.gather(*(node.infer(req(priority=p)) for p in (10, 10, 3, 0)))
        assert all(r.error is None for r in replies)
        assert sink.value(m.ADMITTED) == 4
        assert sink.value(m.REQUESTS, state="completed") == 4
        assert sink.value(m.REQUESTS, state="completed", priority="foreground") == 2
        assert len(sink.observed(m.LATENCY)) == 4
        assert len(sink.observed(m.QUEUE_WAIT, priority="offline")) == 1
        calls = sink.value(m.ENGINE_CALLS, model="m")
        assert sink.value(m.BATCHED, model="m") == 4 and 1 <= calls < 4  # they shared calls
        assert sum(sink.observed(m.BATCH_SIZE)) == 4
        assert sink.value(m.ENGINE_BUSY) > 0

        status = node.status()
        summary = status.metrics
        assert summary.completed("foreground") == 2 and summary.completed("offline") == 1
        assert summary.latency["inline"][-1] == 0 and summary.errors == 0
        # Gauges: every class gets a value, zero included; one state is 1.
        gauged = {
            dict(tags)["priority"] for name, tags in sink.values if name == m.QUEUE_DEPTH.name
        }
        assert gauged == set(DEFAULT_PRIORITIES)
        assert sink.value(m.NODE_STATE, state="serving") == 1
        assert sink.value(m.NODE_STATE, state="draining") == 0
        assert sink.value(m.MODEL_RESIDENT, model="m") == 1
        await node.stop()

    run(main())


def test_refusals_preemption_and_model_loads_are_recorded():
    spec = fake_spec({"m": {"memory_mb": 60}, "n": {"memory_mb": 60}}, budget_mb=100, capacity=1)

    async def main():
        node, sink = await recorded_node(spec, m={"cost_s": 0.3})
        bg = asyncio.create_task(node.infer(req(priority=3, id="bg")))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(node.infer(req(priority=0, id="queued")))
        await asyncio.sleep(0.01)
        fg = asyncio.create_task(node.infer(req(priority=10, id="fg")))  # evicts, preempts
        await asyncio.sleep(0.01)
        refused = await node.infer(req(priority=0, id="late"))
        assert isinstance(refused.error, Rejected)
        await asyncio.gather(bg, queued, fg)
        assert sink.value(m.REQUESTS, state="evicted", priority="offline") == 1
        assert sink.value(m.REQUESTS, state="rejected", priority="offline") == 1
        assert sink.value(m.PREEMPTED, priority="background", model="m") == 1

        await node.infer(req(model="n"))  # n is not resident: loaded on demand
        assert sink.value(m.MODEL_LOADS, model="n") == 1
        assert len(sink.observed(m.MODEL_LOAD_SECONDS, model="n")) == 1
        await node.stop()

    run(main())


def test_generation_hooks():
    sink = MemorySink()
    rec = NodeMetrics("f", "edge-0", DEFAULT_PRIORITIES, sink=sink)
    rec.tokens("chat", 10, 32)
    rec.tokens("chat", 10, 0)  # nothing generated: nothing recorded
    rec.tokens("chat", 2, 8)
    assert sink.value(m.TOKENS, priority="foreground", model="chat") == 32
    assert sink.value(m.TOKENS, priority="offline") == 8
    rec.paused(3)
    rec.paused(3)
    rec.resumed(3)
    assert sink.value(m.PAUSES, priority="background") == 2
    assert sink.value(m.RESUMES, priority="background") == 1
    rec.budget_cut(7)
    assert sink.value(m.BUDGET_CUTS, priority="inline") == 1
    assert rec.errors == 0


def test_status_sets_the_generation_gauges():
    """Paused work, lifecycle and KV bytes come from each status (Ray's agent drops a
    gauge nobody sets again)."""
    sink = MemorySink()
    rec = NodeMetrics("f", "edge-0", sink=sink)
    status = NodeStatus(
        "edge-0",
        "serving",
        {},
        0,
        None,
        (),
        paused={3: 2, 5: 1},
        lifecycle="background",
        kv_bytes={"paused": 10, "cached": 20},
    )
    rec.observe(status)
    assert sink.value(m.PAUSED, priority="background") == 3
    assert sink.value(m.PAUSED, priority="foreground") == 0
    assert sink.value(m.NODE_LIFECYCLE, lifecycle="background") == 1
    assert sink.value(m.NODE_LIFECYCLE, lifecycle="foreground") == 0
    assert sink.value(m.KV_BYTES, kind="cached") == 20


class Broken:
    def record(self, metric, value, tags):
        raise RuntimeError("metrics backend down")


def test_a_failing_metrics_backend_never_breaks_the_node():
    async def main():
        metrics = NodeMetrics("f", "fake-0", sink=Broken())
        node = NodeRuntime(fake_spec(), loader=FakeLoader(), metrics=metrics)
        await node.start()
        replies = await asyncio.gather(*(node.infer(req()) for _ in range(3)))
        assert all(r.error is None for r in replies)
        status = node.status()
        assert status.counters["completed"] == 3
        assert status.metrics.errors > 0  # dropped and counted
        await node.stop()

    run(main())


def test_outside_ray_metrics_record_nothing(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert isinstance(default_sink(), NullSink)
    rec = NodeMetrics("f", "n")  # a node run in-process: no Ray, no error
    rec.tokens("chat", 10, 5)
    rec.paused(3)
    assert rec.errors == 0
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert isinstance(default_sink(), RaySink)


def test_memory_sink_refuses_wrong_labels():
    with pytest.raises(ValueError, match="labels"):
        MemorySink().record(m.TOKENS, 1, {"fleet": "f", "node": "n"})


# --------------------------------------------------------------------------- router


def test_placement_records_answers_spills_shedding_and_the_router_health():
    config = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "node_defaults": {"queue": {"capacity": 2}},
            "nodes": [{"name": "a"}, {"name": "b"}],
            "router": {"report_interval_s": 0.05, "placement": {"shed": {"offline": 0.5}}},
        },
        Path("/nonexistent"),
    )
    sink = MemorySink()
    fleet = LocalFleet(
        config,
        lambda spec: NodeRuntime(spec, loader=FakeLoader(m={"cost_s": 0.2})),
        metrics=RouterMetrics("t", sink=sink),
        router_metrics=RouterMetrics("t", sink=sink),
    )
    try:
        assert sink.value(m.NODE_HEALTHY, node="a") == 1
        flood = [fleet.dispatcher.submit(req(priority=10)) for _ in range(8)]
        offline = fleet.infer(req(priority=0))  # the nodes are busy: shed
        replies = [f.result(30) for f in flood]
        completed = sum(r.error is None for r in replies)
        rejected = sum(isinstance(r.error, Rejected) for r in replies)
        assert completed and rejected and isinstance(offline.error, Rejected)
        assert sink.value(m.ROUTER_REQUESTS, outcome="completed") == completed
        assert sink.value(m.ROUTER_REQUESTS, outcome="rejected", priority="foreground") == rejected
        assert len(sink.observed(m.ROUTER_LATENCY, priority="foreground")) == completed
        assert sink.value(m.ROUTER_SPILLED, priority="foreground") >= rejected
        assert sink.value(m.ROUTER_SHED, priority="offline") == 1
        fleet.router._lose(fleet.router._nodes["b"])
        assert sink.value(m.NODE_HEALTHY, node="b") == 0
        assert sink.value(m.NODES_LOST, node="b") == 1
    finally:
        fleet.close()


# ------------------------------------------------------------------------ catalogue


def test_every_metric_is_well_named_and_documented():
    doc = METRICS_DOC.read_text()  # generated: python -m edgefleet.docgen
    names = [d.name for d in m.CATALOGUE]
    assert len(names) == len(set(names))
    for d in m.CATALOGUE:
        assert re.fullmatch(r"edgefleet_[a-z_]+", d.name), d.name
        assert d.labels[0] == "fleet", d.name
        assert (d.kind == "counter") == d.name.endswith("_total"), d.name
        assert (d.kind == "histogram") == bool(d.buckets), d.name
        assert list(d.buckets) == sorted(d.buckets), d.name
        assert d.help, d.name
        start = f"| `{d.exported}` |"
        row = next((line for line in doc.splitlines() if line.startswith(start)), None)
        assert row is not None, f"docs/metrics.md has no row for {d.exported}"
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] == d.kind, f"docs/metrics.md gives {d.exported} the type {cells[1]}"
        assert cells[2].split(", ") == list(d.labels), (
            f"docs/metrics.md row of {d.exported} has labels {cells[2]}, not {d.labels}"
        )


def test_dashboard_reads_only_defined_metrics():
    known = {d.exported for d in m.CATALOGUE}
    used = set()
    for q in dashboard.panel_queries(dashboard.build()):
        for name in re.findall(r"ray_edgefleet_\w+", q.expr):
            used.add(re.sub(r"_bucket$", "", name))
    assert used <= known, used - known
    # Every metric is on a panel but two whose figures show elsewhere: admissions (the
    # outcomes add up to them) and nodes lost (the health panel drops to 0).
    assert known - used <= {m.ADMITTED.exported, m.NODES_LOST.exported}, known - used


# ------------------------------------------------------------------------- overview


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def snapshot(completed: dict[str, list[int]], evicted: int, rejected: int) -> FleetStatus:
    """One node ``n`` whose latency buckets (bounds 0.01, 0.1, 1) are ``completed``."""
    summary = MetricsSummary((0.01, 0.1, 1.0), {c: tuple(v) for c, v in completed.items()})
    node = NodeStatus("n", "serving", {}, 0, None, (), {"evicted": evicted}, metrics=summary)
    return FleetStatus("f", (node,), {"n": True}, {"rejected": rejected})


def test_overview_window_gives_the_dashboards_figures():
    clock = Clock()
    window = OverviewWindow(60.0, clock=clock)
    first = window.add(snapshot({"foreground": [10, 10, 10, 10]}, evicted=1, rejected=2))
    assert first.seconds == 0 and first.rejected_per_s is None  # no rate from one snapshot
    assert first.p50["foreground"] == pytest.approx(0.005)  # lifetime
    clock.t = 10.0
    ov = window.add(snapshot({"foreground": [10, 30, 30, 30]}, evicted=6, rejected=12))
    assert ov.seconds == 10.0
    assert ov.throughput["foreground"] == pytest.approx(2.0)
    assert ov.p50["foreground"] == pytest.approx(0.055)  # the new 20 sit in (0.01, 0.1]
    assert ov.p99["foreground"] == pytest.approx(0.01 + 0.09 * 0.99)
    assert ov.rejected_per_s == pytest.approx(1.0) and ov.evicted_per_s == pytest.approx(0.5)
    assert (ov.rejected, ov.evicted) == (12, 6)
    clock.t = 100.0  # the first two fell out of the window; a restarted node starts at 0
    window.add(snapshot({"foreground": [10, 30, 30, 30]}, evicted=6, rejected=12))
    clock.t = 110.0
    ov = window.add(snapshot({"foreground": [0, 5, 5, 5]}, evicted=0, rejected=12))
    assert ov.seconds == 10.0 and ov.throughput["foreground"] == pytest.approx(0.5)
    assert ov.evicted_per_s == 0 and ov.rejected_per_s == 0


def test_counters_exist_at_zero_before_the_first_event():
    async def main():
        node, sink = await recorded_node()
        counters = [d for d in vars(m).values() if isinstance(d, m.MetricDef)]
        node_counters = [d for d in counters if d.kind == "counter" and "node" in d.labels]
        for metric in node_counters:
            if metric in (m.TOKENS, m.NODES_LOST, m.NODE_RESTARTS):
                continue  # no decoder on this node; the router counts losses and restarts
            series = {k: v for k, v in sink.values.items() if k[0] == metric.name}
            assert series and set(series.values()) == {0.0}, metric.name
        for state in ("completed", "rejected", "evicted", "expired"):
            for cls in DEFAULT_PRIORITIES:
                assert sink.value(m.REQUESTS, priority=cls, model="m", state=state) == 0
        await node.stop()

    run(main())
    sink = MemorySink()
    RouterMetrics("f", sink=sink).start()
    for cls in DEFAULT_PRIORITIES:
        for outcome in ("completed", "rejected", "nodelost"):
            assert (
                m.ROUTER_REQUESTS.name,
                frozenset({"fleet": "f", "priority": cls, "outcome": outcome}.items()),
            ) in sink.values
        assert sink.value(m.ROUTER_SHED, priority=cls) == 0


def test_a_callers_metrics_go_out_together_and_none_are_lost_between_threads():
    """In Ray a caller records its answers' counters and latencies in batches (one Ray
    metric record per answer costs tens of microseconds on a busy machine): nothing
    before the flush, everything after it, whatever threads answered."""
    from concurrent.futures import ThreadPoolExecutor

    from edgefleet.clock import FakeClock

    class RecordingRaySink(RaySink):
        def __init__(self) -> None:
            self.memory = MemorySink()

        def record(self, metric, value, tags):
            self.memory.record(metric, value, tags)

    sink = RecordingRaySink()
    clock = FakeClock()
    rec = RouterMetrics("t", sink=sink, clock=clock)
    request = req(priority=10)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: rec.answered(request, None, 0.01), range(4000)))
    rec.shed(3)
    assert sink.memory.value(m.ROUTER_REQUESTS) == 0
    assert sink.memory.observed(m.ROUTER_LATENCY) == []
    rec.flush()  # the view feed's, every report interval (and on closing)
    assert sink.memory.value(m.ROUTER_REQUESTS, outcome="completed") == 4000
    assert len(sink.memory.observed(m.ROUTER_LATENCY, priority="foreground")) == 4000
    assert sink.memory.value(m.ROUTER_SHED, priority="background") == 1
    clock.advance(m.COUNTER_FLUSH_S)
    rec.answered(request, None, 0.01)  # a second on: out without a flush
    assert sink.memory.value(m.ROUTER_REQUESTS, outcome="completed") == 4001


def test_the_routers_occasional_gauges_are_recorded_again_every_few_seconds():
    """Ray exports a gauge when it is recorded: one the router sets once (no node is
    unresponsive, a pool with no device) must be recorded again, or the dashboard shows
    no data for it once the first record is gone."""
    from cluster.metrics import GAUGE_REFRESH_S
    from edgefleet.clock import FakeClock

    class Counting(MemorySink):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[tuple[str, float, dict]] = []

        def record(self, metric, value, tags):
            self.records.append((metric.name, value, dict(tags)))
            super().record(metric, value, tags)

    sink, clock = Counting(), FakeClock()
    rec = RouterMetrics("t", sink=sink, clock=clock)
    rec.node_unresponsive("edge-0", False)
    rec.pool_devices("cams", "serving", 0)
    rec.node_unresponsive("edge-0", True)  # the last value is the one kept
    sink.records.clear()
    rec.refresh()  # too soon: nothing again
    assert sink.records == []
    clock.advance(GAUGE_REFRESH_S)
    rec.refresh()
    assert sorted((name, value) for name, value, _ in sink.records) == [
        (m.NODE_UNRESPONSIVE.name, 1.0),
        (m.POOL_DEVICES.name, 0.0),
    ]
    assert sink.value(m.NODE_UNRESPONSIVE, node="edge-0") == 1
