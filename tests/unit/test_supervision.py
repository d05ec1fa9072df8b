"""Long-lived tasks are supervised: the router's polling survives a node's unexpected
errors and slow starts, a node whose start failed is not taken for healthy, and a
node whose serve loop dies says so and answers what it held."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from actors.node import NodeRuntime
from cluster.router import Router
from edgefleet.config import parse_config
from edgefleet.errors import Cancelled, EngineError, Rejected
from edgefleet.messages import NodeStatus
from tests.fakes import FakeLoader, fake_spec
from tests.unit.test_node import req


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def fleet_config(names: list[str]) -> Any:
    return parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "nodes": [{"name": n} for n in names],
            "router": {"report_interval_s": 0.02, "lost_after_s": 0.5},
        },
        Path("/nonexistent"),
    )


class Control:
    """A node as the router sees it, with scripted trouble."""

    def __init__(self, node: NodeRuntime) -> None:
        self.node = node
        self.broken: Exception | None = None  # status() raises this
        self.hang_start = False  # start() never returns
        self.polls = 0

    async def status(self) -> NodeStatus:
        self.polls += 1
        if self.broken is not None:
            raise self.broken
        return self.node.status()

    async def start(self) -> NodeStatus:
        if self.hang_start:
            await asyncio.Event().wait()
        return await self.node.start()

    async def cancel(self, request_id: str) -> bool:
        return self.node.cancel(request_id)

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return self.node.set_lifecycle(state)


async def until(cond: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def test_router_starts_and_keeps_watching_when_a_node_poll_fails_unexpectedly():
    async def main() -> None:
        a, b = (
            Control(NodeRuntime(fake_spec(), loader=FakeLoader())),
            Control(NodeRuntime(fake_spec(), loader=FakeLoader())),
        )
        await a.node.start()
        await b.node.start()
        a.broken = RuntimeError("boom")  # not NodeGone, not a timeout
        router = Router(fleet_config(["a", "b"]), {"a": a, "b": b})
        status = await asyncio.wait_for(router.start(), 10)
        assert status.healthy == {"a": False, "b": True}
        polls = b.polls
        await until(lambda: b.polls > polls + 3)  # the watch goes on for the others
        a.broken = None
        await until(lambda: router.status_now().healthy["a"])
        await router.stop()

    run(main())


def test_a_node_slow_to_start_does_not_hold_up_polling_of_the_others():
    async def main() -> None:
        a = Control(NodeRuntime(fake_spec(), loader=FakeLoader()))
        b = Control(NodeRuntime(fake_spec(), loader=FakeLoader()))
        await b.node.start()
        a.hang_start = True  # restarted by Ray; its models take long to load
        router = Router(fleet_config(["a", "b"]), {"a": a, "b": b})
        await asyncio.wait_for(router.start(), 10)
        polls = b.polls
        await until(lambda: b.polls > polls + 5)
        assert router.status_now().healthy == {"a": False, "b": True}
        await router.stop()

    run(main())


class FailingLoader(FakeLoader):
    def __call__(self, name: str, config: Any) -> Any:
        raise EngineError(f"cannot load model {name!r}: not an ONNX file")


def test_a_node_whose_start_failed_is_not_healthy_and_says_why():
    async def main() -> None:
        node = NodeRuntime(fake_spec(), loader=FailingLoader())
        with pytest.raises(EngineError):
            await node.start()
        with pytest.raises(EngineError, match="not an ONNX file"):
            await node.start()  # again: the same failure, not a normal answer
        status = node.status()
        assert status.state == "failed" and "not an ONNX file" in status.failure
        refused = await node.infer(req())
        assert isinstance(refused.error, Rejected) and "failed" in str(refused.error)
        router = Router(fleet_config(["a"]), {"a": Control(node)})
        assert (await asyncio.wait_for(router.start(), 10)).healthy == {"a": False}
        await router.stop()

    run(main())


def test_a_node_whose_serve_loop_dies_answers_what_it_held_and_says_failed():
    async def main() -> None:
        node = NodeRuntime(fake_spec(), loader=FakeLoader(m={"cost_s": 0.2}))
        await node.start()
        running = asyncio.create_task(node.infer(req(id="running")))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(node.infer(req(id="queued")))
        await asyncio.sleep(0.01)

        def broken() -> Any:
            raise RuntimeError("scheduler bug")

        node._sched.next_work = broken  # type: ignore[method-assign]
        replies = await asyncio.wait_for(asyncio.gather(running, queued), 10)
        assert replies[0].error is None  # the call in progress finished
        assert isinstance(replies[1].error, Cancelled) and "scheduler bug" in str(replies[1].error)
        status = node.status()
        assert status.state == "failed" and "scheduler bug" in status.failure
        refused = await node.infer(req())
        assert isinstance(refused.error, Rejected)
        await node.stop()

    run(main())


def test_a_serve_loop_that_dies_in_a_call_answers_the_call_cancelled():
    async def main() -> None:
        node = NodeRuntime(fake_spec(), loader=FakeLoader(m={"cost_s": 0.05}))
        await node.start()

        async def broken(plan: Any) -> None:
            raise RuntimeError("executor bug")

        node._execute = broken  # type: ignore[method-assign]
        reply = await asyncio.wait_for(node.infer(req(id="lost")), 10)
        assert isinstance(reply.error, Cancelled) and "executor bug" in str(reply.error)
        assert node.status().state == "failed"
        await node.stop()

    run(main())


def test_the_router_stops_even_when_a_poll_swallows_its_cancellation():
    """asyncio.wait_for on Python 3.11 can return the result of a call that ended just
    as the cancellation came, swallowing it: the polling must stop all the same."""

    async def main() -> None:
        node = NodeRuntime(fake_spec(), loader=FakeLoader())
        await node.start()
        router = Router(fleet_config(["a"]), {"a": Control(node)})
        await router.start()
        polled = asyncio.Event()

        async def swallowing(entry: Any) -> None:
            polled.set()
            with contextlib.suppress(asyncio.CancelledError):  # as wait_for can do
                await asyncio.sleep(0.5)

        router._poll = swallowing  # type: ignore[method-assign]
        await asyncio.wait_for(polled.wait(), 5)
        await asyncio.wait_for(router.stop(), 5)

    run(main())
