"""Engine calls that hang: terminated past their model's max_call_s, and a node that
goes stuck when one does not stop (fake engines, a fake clock)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from actors.engine import Signature
from actors.models import ModelInfo
from actors.node import NodeRuntime
from cluster.cli.tables import status_table
from edgefleet.clock import FakeClock
from edgefleet.config import ModelConfig
from edgefleet.errors import EngineTimeout, Evicted, Rejected
from edgefleet.messages import FleetStatus, GenerationResult, NodeState
from edgefleet.modelgen import make_tiny_lm
from edgefleet.request import GenerateRequest
from tests.fakes import HANG, FakeLoader, fake_spec
from tests.unit.test_node import req


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def until(cond, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def hanging_node(*, deaf: bool) -> tuple[NodeRuntime, FakeClock, object]:
    """A node whose model ``m`` may run 1 s a call, stuck 2 s after a terminate that
    did not work; the watchdog looks every 0.1 s (real time) at the fake clock."""
    spec = fake_spec({"m": {"max_call_s": 1.0}}).model_copy(update={"stuck_after_s": 2.0})
    clock = FakeClock()
    loader = FakeLoader(m={"deaf": deaf})
    node = NodeRuntime(spec, clock=clock, loader=loader)
    await node.start()
    return node, clock, loader.engines["m"]


def test_a_call_past_max_call_s_is_terminated_and_the_node_serves_on():
    async def main():
        node, clock, engine = await hanging_node(deaf=False)
        hung = asyncio.create_task(node.infer(req(value=HANG, id="hung")))
        await until(lambda: engine.entered == 1)
        clock.advance(0.9)  # within its limit: left alone
        await asyncio.sleep(0.3)
        assert not hung.done()
        clock.advance(0.2)
        reply = await asyncio.wait_for(hung, 30)
        assert isinstance(reply.error, EngineTimeout)
        assert "max_call_s of 1 s" in str(reply.error) and "models.m.max_call_s" in str(reply.error)
        served = await node.infer(req(value=2.0))
        assert served.error is None
        status = node.status()
        assert status.state is NodeState.SERVING and status.counters["failed"] == 1
        await node.stop()

    run(main())


def test_a_call_that_does_not_stop_makes_the_node_stuck_until_it_returns():
    async def main():
        node, clock, engine = await hanging_node(deaf=True)
        hung = asyncio.create_task(node.infer(req(value=HANG, id="hung")))
        await until(lambda: engine.entered == 1)
        queued = [asyncio.create_task(node.infer(req(id=f"q{i}"))) for i in range(2)]
        await until(lambda: node.status().queue_length == 2)
        clock.advance(1.5)
        await until(lambda: node._engine._terminated_at is not None)  # terminated, in vain
        clock.advance(1.9)
        await asyncio.sleep(0.3)
        assert node.status().state is NodeState.SERVING  # within stuck_after_s
        clock.advance(0.2)
        await until(lambda: node.status().state == "stuck")
        status = node.status()
        assert "model 'm'" in status.failure and "has not stopped" in status.failure
        assert status.queue_length == 0 and status.running is None

        reply = await asyncio.wait_for(hung, 30)
        assert isinstance(reply.error, EngineTimeout) and "stuck" in str(reply.error)
        for q in await asyncio.wait_for(asyncio.gather(*queued), 30):
            assert isinstance(q.error, Evicted) and "stuck" in str(q.error)
        refused = await node.infer(req())
        assert isinstance(refused.error, Rejected) and "is stuck" in str(refused.error)
        status = node.status()
        assert status.counters["rejected"] == 1 and status.counters["evicted"] == 2
        table = status_table(FleetStatus("f", (status,), {status.name: True}))
        assert "stuck: an engine call of model 'm'" in table
        assert (await node.drain()).state == "stuck"  # nothing to drain: no wait

        engine.unstick.set()  # the call returns at last
        await until(lambda: node.status().state == "drained")  # a drain had begun
        assert node.status().failure == ""
        await node.stop()

    run(main())


def test_a_stuck_node_serves_again_when_the_call_returns():
    async def main():
        node, clock, engine = await hanging_node(deaf=True)
        hung = asyncio.create_task(node.infer(req(value=HANG)))
        await until(lambda: engine.entered == 1)
        clock.advance(1.5)
        await until(lambda: node._engine._terminated_at is not None)
        clock.advance(2.5)
        await until(lambda: node.status().state == "stuck")
        assert isinstance((await hung).error, EngineTimeout)
        engine.unstick.set()
        await until(lambda: node.status().state == "serving")
        assert (await node.infer(req(value=2.0))).error is None
        await node.stop()

    run(main())


def test_a_stuck_node_stops_without_waiting_for_its_engine_thread():
    async def main():
        node, clock, engine = await hanging_node(deaf=True)
        asyncio.create_task(node.infer(req(value=HANG)))
        await until(lambda: engine.entered == 1)
        clock.advance(1.5)
        await until(lambda: node._engine._terminated_at is not None)
        clock.advance(2.5)
        await until(lambda: node.status().state == "stuck")
        assert (await asyncio.wait_for(node.stop(), 10)).state == "stopped"
        engine.unstick.set()

    run(main())


def test_a_watchdog_that_dies_fails_the_node():
    async def main():
        node, _, _ = await hanging_node(deaf=False)

        def broken(*args):
            raise RuntimeError("watchdog bug")

        node._engine.watch = broken
        await until(lambda: node.status().state == "failed")
        assert "watchdog" in node.status().failure and "watchdog bug" in node.status().failure
        assert isinstance((await node.infer(req())).error, Rejected)
        await node.stop()

    run(main())


async def _result(node: NodeRuntime, request: GenerateRequest) -> GenerationResult:
    items = [item async for item in node.generate(request)]
    assert isinstance(items[-1], GenerationResult)
    return items[-1]


def test_a_generation_is_timed_from_its_last_token_and_ended_at_a_boundary(tmp_path):
    """A generation may run as long as it makes tokens within max_call_s of each other;
    one that makes none for longer is stopped and ends in EngineTimeout."""
    lm = make_tiny_lm(tmp_path / "lm.onnx")
    spec = fake_spec({"lm": {"path": lm, "kind": "decoder", "max_call_s": 1.0}})
    clock = FakeClock()

    async def main():
        node = NodeRuntime(spec, clock=clock)
        await node.start()
        engine = node._models.resident("lm")
        step = engine.step
        watch = node._engine.watch
        looked = threading.Event()

        def watched(*args):
            stuck = watch(*args)
            looked.set()
            return stuck

        node._engine.watch = watched

        def slow_step(gen, stop=None):  # each token 0.6 s after the last: 3 s in all
            clock.advance(0.6)
            for _ in range(2):  # the second look began after the clock moved
                looked.clear()
                looked.wait(30)
            return step(gen, stop)

        engine.step = slow_step
        slow = await _result(node, GenerateRequest("lm", (1, 2, 3), max_new_tokens=5))
        assert slow.error is None and len(slow.tokens) == 5

        entered = threading.Event()

        def hung_step(gen, stop=None):  # a step that never makes its token
            entered.set()
            stop.wait(30)

        engine.step = hung_step
        hung = asyncio.create_task(_result(node, GenerateRequest("lm", (1, 2, 3))))
        await until(entered.is_set)
        clock.advance(1.5)
        result = await asyncio.wait_for(hung, 30)
        assert isinstance(result.error, EngineTimeout) and "max_call_s" in str(result.error)

        engine.step = step
        again = await _result(node, GenerateRequest("lm", (1, 2, 3), max_new_tokens=3))
        assert again.error is None and len(again.tokens) == 3
        assert node.status().state is NodeState.SERVING
        await node.stop()

    run(main())


@pytest.mark.parametrize(
    ("configured", "costs", "rows", "limit"),
    [
        (None, {}, 1, 5.0),  # nothing measured: the floor
        (None, {1: 0.001, 8: 0.004}, 8, 5.0),  # a fast model: the floor
        (None, {1: 0.2, 8: 0.8}, 1, 8.0),  # 10x the largest batch measured
        (None, {1: 0.2, 8: 0.8}, 32, 32.0),  # ... scaled up for a larger call
        (0.5, {1: 0.2, 8: 0.8}, 32, 0.5),  # configured: as configured
    ],
)
def test_a_models_time_limit(configured, costs, rows, limit):
    config = ModelConfig(path=Path("m.onnx"), max_call_s=configured)
    info = ModelInfo("m", config, Signature((), ()), 1.0, costs_s=costs)
    assert info.max_call_s(rows, factor=10.0, floor_s=5.0) == pytest.approx(limit)
