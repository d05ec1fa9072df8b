"""Pools follow the Ray cluster: the router's reconcile loop on a fake node table, fake
member actors and a fake clock (no Ray), and callers that learn of joins and leaves."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from actors.metrics import POOL_CHANGES, POOL_DEVICES, MemorySink
from cluster.dispatch import Dispatcher, FleetView, FutureCalls, NodeGone, NodeReport
from cluster.membership import DEVICE_MOVES, LEFT_KEPT_S, DeviceState, RayNodeRow, wanted
from cluster.metrics import RouterMetrics
from cluster.names import node_actor_name
from cluster.router import Router
from edgefleet.clock import FakeClock
from edgefleet.config import NodeSpec, parse_config
from edgefleet.labels import DEVICE_LABEL, device_name, parse_selector
from edgefleet.messages import ModelStatus, NodeState, NodeStatus, Reply
from edgefleet.providers import PROVIDERS_LABEL
from edgefleet.request import InferRequest
from tests.fakes import x


def config(model: dict[str, Any] | None = None, **router: Any) -> Any:
    return parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1, **(model or {})}},
            "nodes": [{"name": "fixed"}],
            "pools": [{"name": "cams", "selector": {"device": "camera"}, "queue": {"capacity": 4}}],
            "router": {"membership": {"retry_s": 1.0, "retry_max_s": 8.0}, **router},
        },
        Path("/nonexistent"),
    )


def row(node_id: str, name: str | None, *, alive: bool = True, at: float = 100.0, **labels):
    """A Ray node of a camera (unless ``labels`` say otherwise) named ``name``."""
    labels = {"device": "camera", **labels}
    if name is not None:
        labels[DEVICE_LABEL] = name
    return RayNodeRow(node_id, alive, labels, at, 0.0 if alive else at + 50)


def report(name: str, state: NodeState = NodeState.SERVING, failure: str = "") -> NodeStatus:
    model = ModelStatus("m", True, True, 8, {1: 1.0}, None, 1)
    return NodeStatus(name, state, {}, 0, None, (model,), failure=failure)


class FakeTable:
    def __init__(self) -> None:
        self.rows: list[RayNodeRow] = []
        self.broken: Exception | None = None
        self.reads = 0

    async def read(self) -> Sequence[RayNodeRow]:
        self.reads += 1
        if self.broken is not None:
            raise self.broken
        return list(self.rows)


class FakeControl:
    def __init__(self, spec: NodeSpec, fail: str = "") -> None:
        self.spec = spec
        self.fail = fail
        self.starts = 0

    async def status(self) -> NodeStatus:
        return report(self.spec.name)

    async def start(self) -> NodeStatus:
        self.starts += 1
        if self.fail:
            raise RuntimeError(self.fail)
        return report(self.spec.name)

    async def cancel(self, request_id: str) -> bool:
        return False

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return report(self.spec.name)

    async def restart(self) -> None:
        pass

    async def alive(self, timeout_s: float) -> bool:
        return True


class FakeActors:
    """Actors by name, as Ray holds them: ``create`` adopts one already there."""

    def __init__(self) -> None:
        self.actors: dict[str, FakeControl] = {}
        self.created: list[str] = []
        self.removed: list[str] = []
        self.fail_next: list[str] = []  # start() of the next actors made fails with these

    async def create(self, spec: NodeSpec) -> FakeControl:
        name = node_actor_name("t", spec)
        if name not in self.actors:
            fail = self.fail_next.pop(0) if self.fail_next else ""
            self.actors[name] = FakeControl(spec, fail)
            self.created.append(name)
        return self.actors[name]

    async def remove(self, spec: NodeSpec) -> None:
        name = node_actor_name("t", spec)
        if self.actors.pop(name, None) is not None:
            self.removed.append(name)


class Scene:
    """A router with a pool, on a fake table, fake actors, a fake clock and wall clock."""

    def __init__(
        self, actors: FakeActors | None = None, table: FakeTable | None = None, cfg: Any = None
    ) -> None:
        self.table = table or FakeTable()
        self.actors = actors or FakeActors()
        self.clock = FakeClock()
        self.sink = MemorySink()
        self.cfg = cfg or config()
        metrics = RouterMetrics("t", sink=self.sink)
        self.router = Router(
            self.cfg,
            {"fixed": FakeControl(self.cfg.node_specs()[0])},
            clock=self.clock,
            metrics=metrics,
            table=self.table,
            actors=self.actors,
        )
        assert self.router._membership is not None
        self.membership = self.router._membership
        self.membership._wall = lambda: 1000.0

    async def step(self) -> None:
        """One reconcile, then let the members' starts run."""
        await self.membership.reconcile()
        for _ in range(20):
            await asyncio.sleep(0)

    def pool(self):
        (pool,) = self.membership.status()
        return pool

    def states(self) -> dict[str, str]:
        return {d.node: d.state for d in self.pool().devices}


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


# ------------------------------------------------------------------ selectors


def test_selectors_match_as_ray_reads_them():
    s = parse_selector({"device": "camera", "site": "in(s1, s2)", "tier": "!spare"})
    assert s.matches({"device": "camera", "site": "s1"})
    assert s.matches({"device": "camera", "site": "s2", "tier": "main"})
    assert not s.matches({"device": "camera", "site": "s3"})
    assert not s.matches({"device": "camera", "site": "s1", "tier": "spare"})
    assert not s.matches({"site": "s1"})
    assert parse_selector({"x": "!in(a,b)"}).matches({})  # absent: none of them
    for bad in ({"d": "in()"}, {"d": "a b"}, {"d": "!!a"}, {"-d": "a"}, {}):
        with pytest.raises(ValueError):
            parse_selector(bad)


def test_a_device_is_named_by_its_label_else_by_its_ray_node_id():
    assert device_name({DEVICE_LABEL: "cam-7"}, "f" * 56) == "cam-7"
    assert device_name({}, "0123456789abcdef" * 3) == "0123456789ab"


def test_the_wanted_members_are_each_devices_newest_alive_ray_node():
    rows = [
        row("a1", "cam-1", at=100),
        row("a2", "cam-1", at=200),  # the device came back before a1 was declared dead
        row("b1", "cam-2", alive=False, at=50),
        row("c1", "cam-3", device="doorbell"),  # not a camera
    ]
    want, gone = wanted([("cams", parse_selector({"device": "camera"}))], rows)
    assert set(want) == {"cams/cam-1"} and want["cams/cam-1"].row.node_id == "a2"
    assert want["cams/cam-1"].first_seen == 100
    assert set(gone) == {"cams/cam-2"} and gone["cams/cam-2"].left_at == 100


def test_device_states_move_only_along_the_table():
    assert DeviceState.STARTING in DEVICE_MOVES[DeviceState.LEFT]
    assert DeviceState.SERVING not in DEVICE_MOVES[DeviceState.FAILED]  # via a new start
    # A device may leave from any state (its Ray node dies whenever it dies).
    others = [s for s in DeviceState if s is not DeviceState.LEFT]
    assert all(DeviceState.LEFT in DEVICE_MOVES[s] for s in others)


# ------------------------------------------------------------------ reconcile


def test_a_pool_with_no_device_is_shown_empty_and_the_start_does_not_wait():
    async def scene() -> None:
        s = Scene()
        status = await s.router.start()
        (pool,) = status.pools
        assert pool.name == "cams" and pool.devices == () and pool.selector == "device=camera"
        assert s.table.reads == 1
        await s.router.stop()

    run(scene())


def test_devices_that_join_serve_and_one_without_the_labels_gets_no_node():
    async def scene() -> None:
        s = Scene()
        s.table.rows = [row(f"n{i}", f"cam-{i}") for i in range(3)]
        s.table.rows.append(row("other", "gw-1", device="gateway"))
        await s.step()
        assert s.states() == {f"cams/cam-{i}": "serving" for i in range(3)}
        assert sorted(s.actors.created) == [f"t/node/cams/cam-{i}@n{i}" for i in range(3)]
        members = s.router.members()
        assert sorted(m.name for m in members) == ["cams/cam-0", "cams/cam-1", "cams/cam-2"]
        assert all(m.queue.capacity == 4 and m.pool == "cams" for m in members)
        assert s.router.status_now().healthy["cams/cam-1"]
        assert s.sink.value(POOL_DEVICES, pool="cams", state="serving") == 3
        assert s.sink.value(POOL_CHANGES, pool="cams", change="joined") == 3
        await s.step()  # nothing changed: nothing happens
        assert len(s.actors.created) == 3

    run(scene())


def test_a_device_that_leaves_is_dropped_and_serves_again_when_it_comes_back():
    async def scene() -> None:
        s = Scene()
        s.table.rows = [row("n0", "cam-0"), row("n1", "cam-1", at=300)]
        await s.step()
        s.table.rows[1] = row("n1", "cam-1", alive=False, at=300)  # Ray declared it dead
        await s.step()
        assert s.states() == {"cams/cam-0": "serving", "cams/cam-1": "left"}
        assert "cams/cam-1" not in s.router.status_now().healthy
        assert s.actors.removed == ["t/node/cams/cam-1@n1"]
        left = {d.node: d for d in s.pool().devices}["cams/cam-1"]
        assert left.left_s == 1000.0 - 350.0
        assert s.sink.value(POOL_CHANGES, pool="cams", change="left") == 1
        # The device runs `ray start` again: a new Ray node, the same device label.
        s.table.rows.append(row("n9", "cam-1", at=900))
        await s.step()
        device = {d.node: d for d in s.pool().devices}["cams/cam-1"]
        assert device.state == "serving" and device.ray_node == "n9" and device.joins == 2
        assert device.age_s == 1000.0 - 300.0 and device.joined_s == 1000.0 - 900.0
        (member,) = [m for m in s.router.members() if m.name == "cams/cam-1"]
        assert member.ray_node == "n9"
        assert s.sink.value(POOL_CHANGES, pool="cams", change="joined") == 3

    run(scene())


def test_a_device_back_before_its_old_ray_node_is_declared_dead_moves_to_the_new_one():
    async def scene() -> None:
        s = Scene()
        s.table.rows = [row("old", "cam-1", at=100)]
        await s.step()
        s.table.rows.append(row("new", "cam-1", at=200))  # "old" still alive in Ray's eyes
        await s.step()
        (device,) = s.pool().devices
        assert device.state == "serving" and device.ray_node == "new"
        assert s.actors.removed == ["t/node/cams/cam-1@old"]

    run(scene())


def test_devices_ray_lists_as_dead_are_shown_left_until_they_are_old_news():
    async def scene() -> None:
        s = Scene()
        s.table.rows = [
            row("n0", "cam-0", alive=False, at=900),  # died at 950, the wall clock says 1000
            row("n1", "cam-1", alive=False, at=100 - LEFT_KEPT_S),  # died over an hour ago
        ]
        await s.step()
        (device,) = s.pool().devices
        assert device.device == "cam-0" and device.state == "left" and device.joins == 0
        assert s.actors.created == []

    run(scene())


def test_a_member_that_fails_to_start_says_why_and_is_tried_again_with_backoff():
    async def scene() -> None:
        s = Scene()
        s.actors.fail_next = ["model file missing", "model file missing"]
        s.table.rows = [row("n0", "cam-0")]
        await s.step()
        (device,) = s.pool().devices
        assert device.state == "failed" and "model file missing" in device.reason
        assert "cams/cam-0" not in s.router.status_now().healthy
        member = s.membership.members["cams/cam-0"]
        first_wait = member.retry_at - s.clock.now()
        assert 0.5 <= first_wait <= 1.5  # retry_s, with jitter
        await s.step()  # not due yet: left alone
        assert s.actors.created == ["t/node/cams/cam-0@n0"]
        s.clock.advance(first_wait)
        await s.step()  # again: the failed actor is ended first, a new one made
        assert s.actors.removed == ["t/node/cams/cam-0@n0"] and len(s.actors.created) == 2
        assert s.states() == {"cams/cam-0": "failed"}
        second_wait = member.retry_at - s.clock.now()
        assert 1.0 <= second_wait <= 3.0  # doubled
        s.clock.advance(second_wait)
        await s.step()
        assert s.states() == {"cams/cam-0": "serving"} and member.failures == 0
        assert s.router.status_now().healthy["cams/cam-0"]

    run(scene())


def test_a_node_table_that_cannot_be_read_changes_nothing_and_backs_the_loop_off():
    async def scene() -> None:
        s = Scene()
        s.table.rows = [row("n0", "cam-0")]
        await s.step()
        s.table.broken = TimeoutError("GCS")
        delays = []
        for _ in range(6):
            await s.membership.step()
            delays.append(s.membership._delay())
        assert s.membership.failures == 6 and s.states() == {"cams/cam-0": "serving"}
        assert delays[0] < delays[2] and max(delays) <= 8.0 * 1.5  # retry_max_s, jittered
        s.table.broken = None
        await s.membership.step()
        assert s.membership.failures == 0 and s.membership._delay() == 1.0

    run(scene())


def test_a_restarted_router_adopts_the_running_members():
    async def scene() -> None:
        first = Scene()
        first.table.rows = [row(f"n{i}", f"cam-{i}") for i in range(2)]
        await first.step()
        await first.router.stop()
        # Ray starts the router again: the same table, the same actors still running.
        again = Scene(actors=first.actors, table=first.table)
        status = await again.router.start()
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(first.actors.created) == 2  # adopted, none made again
        assert again.states() == {"cams/cam-0": "serving", "cams/cam-1": "serving"}
        assert status.pools[0].name == "cams"
        await again.router.stop()

    run(scene())


def test_callers_are_sent_the_members_only_when_they_change():
    async def scene() -> None:
        s = Scene()
        view = s.router.fleet_view("c", members_seen=0)
        assert view.members is None  # nothing joined yet: nothing to send
        s.table.rows = [row("n0", "cam-0")]
        await s.step()
        view = s.router.fleet_view("c", members_seen=0)
        assert [m.name for m in view.members or ()] == ["cams/cam-0"]
        assert s.router.fleet_view("c", members_seen=view.members_version).members is None

    run(scene())


# ------------------------------------------------------------------ callers


class HeldNode(FutureCalls):
    """Keeps each call open until the test answers it."""

    def __init__(self) -> None:
        self.calls: list[tuple[InferRequest, cf.Future[Reply]]] = []

    def infer(self, request: InferRequest, inputs: object = None) -> cf.Future[Reply]:
        fut: cf.Future[Reply] = cf.Future()
        self.calls.append((request, fut))
        return fut


def members_view(cfg: Any, devices: dict[str, str], version: int) -> FleetView:
    specs = [cfg.member_spec("cams", d, ray_node) for d, ray_node in devices.items()]
    model = ModelStatus("m", True, True, 8, {1: 1.0}, None, 1)
    reports = {
        s.name: NodeReport(NodeStatus(s.name, NodeState.SERVING, {}, 0, None, (model,)), True, 0)
        for s in specs
    }
    return FleetView(reports, members=specs, members_version=version)


def test_a_caller_adds_members_that_join_and_places_again_what_one_that_left_held():
    cfg = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx"}},
            "pools": [{"name": "cams", "selector": {"device": "camera"}}],
        },
        Path("/nonexistent"),
    )
    handles: dict[str, HeldNode] = {}

    def member_handle(spec: NodeSpec) -> HeldNode:
        return handles.setdefault(f"{spec.name}@{spec.ray_node}", HeldNode())

    d = Dispatcher(cfg, {}, clock=FakeClock(), member_handle=member_handle, watch=True)
    try:
        assert d.healthy() == {} and d.unknown_model("m") is None
        d.update(members_view(cfg, {"cam-0": "n0"}, 1))
        assert d.healthy() == {"cams/cam-0": True} and d.members_version() == 1
        reply = d.submit(InferRequest("m", x(1.0), 10, id="r1"))
        ((sent, held),) = handles["cams/cam-0@n0"].calls
        # cam-0 leaves (its Ray node died), cam-1 joins: r1 goes to cam-1, once.
        d.update(members_view(cfg, {"cam-1": "n1"}, 2))
        assert d.healthy() == {"cams/cam-1": True}
        for _ in range(200):
            if handles.get("cams/cam-1@n1") and handles["cams/cam-1@n1"].calls:
                break
            cf.wait([reply], timeout=0.01)
        ((again, fut),) = handles["cams/cam-1@n1"].calls
        assert again.id == "r1"
        fut.set_result(Reply("r1", "cams/cam-1"))
        held.set_exception(NodeGone("its actor died with its Ray node"))  # comes later
        assert reply.result(10).node == "cams/cam-1"
        assert d.counted()["completed"] == 1 and d.counted()["replaced"] == 1
        # A view that does not carry the members keeps them.
        d.update(FleetView({}, members=None, members_version=2))
        assert d.healthy() == {"cams/cam-1": True}
    finally:
        d.close()


# ------------------------------------------------------------------ status


def test_status_shows_each_pool_with_its_devices():
    from cluster.cli.tables import status_dict, status_table
    from edgefleet.messages import DeviceStatus, FleetStatus, PoolStatus

    devices = (
        DeviceStatus("cams/cam-0", "cam-0", "serving", "3f2a" * 14, 3900.0, 65.0, 2),
        DeviceStatus("cams/cam-1", "cam-1", "failed", "9b1c" * 14, 30.0, 30.0, 0, "timed out"),
        DeviceStatus("cams/cam-2", "cam-2", "left", "77aa" * 14, 700.0, 700.0, 1, "", 12.0),
    )
    status = FleetStatus(
        "f",
        (report("cams/cam-0"),),
        {"cams/cam-0": True},
        pools=(PoolStatus("cams", "device=camera", devices), PoolStatus("gw", "site=s1")),
    )
    table = status_table(status)
    assert "pool cams (device=camera): 1 serving  0 starting  1 failed  1 left" in table
    assert "cam-0       serving   1h05m    1m05s ago   2      3f2a3f2a3f2a" in table
    assert "timed out" in table and "left 12s ago" in table
    assert "pool gw (site=s1): 0 serving" in table and "no Ray node matches yet" in table
    assert status_dict(status)["pools"][0]["devices"][1]["reason"] == "timed out"


def test_the_watch_cost_bench_measures_each_pass_on_real_node_infos():
    from bench.membership import watch_cost

    cost = watch_cost(nodes=200, passes=2, churned=5)
    assert cost.nodes == 200 and cost.churned == 5
    assert cost.join_ms > 0 and cost.steady_ms > 0 and cost.churn_ms > 0 and cost.parse_ms > 0
    assert cost.share(cost.steady_ms) == cost.steady_ms / 1000.0 / cost.interval_s


def test_a_device_whose_label_lacks_a_strict_models_provider_fails_without_an_actor():
    # `edgefleet join` labels a device with its ONNX Runtime build's providers.
    scene = Scene(cfg=config({"providers": ["openvino", "cpu"], "strict": True}))
    scene.table.rows = [
        row("a1", "cam-1", **{PROVIDERS_LABEL: "cpu"}),
        row("b1", "cam-2", **{PROVIDERS_LABEL: "openvino.cpu"}),
        row("c1", "cam-3"),  # no label: its node finds out when it loads the model
    ]
    run(scene.step())
    assert scene.states() == {
        "cams/cam-1": "failed",
        "cams/cam-2": "serving",
        "cams/cam-3": "serving",
    }
    assert sorted(scene.actors.created) == ["t/node/cams/cam-2@b1", "t/node/cams/cam-3@c1"]
    (failed,) = [d for d in scene.pool().devices if d.state == "failed"]
    assert "model 'm' is strict and needs provider openvino" in failed.reason
    assert f"its {PROVIDERS_LABEL} label: cpu" in failed.reason
