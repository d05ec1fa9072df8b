"""The router's spill, shed, re-placement and failover, over real node runtimes with
fake engines (no Ray): each node is a NodeRuntime behind an in-process handle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from actors.node import NodeRuntime, NodeStatus, Reply
from cluster.router import NodeGone, Router
from edgefleet.config import parse_config
from edgefleet.errors import Evicted, ModelNotFound, NodeLost, Rejected
from edgefleet.request import InferRequest
from tests.fakes import FakeLoader, x


class LocalHandle:
    """A node in this process; ``kill()`` makes it behave like a dead actor."""

    def __init__(self, node: NodeRuntime) -> None:
        self.node = node
        self.dead = False
        self.calls = 0

    async def infer(self, request: InferRequest, inputs=None) -> Reply:
        self.calls += 1
        if self.dead:
            raise NodeGone(self.node.spec.name)
        task = asyncio.ensure_future(self.node.infer(request))
        while not task.done():
            await asyncio.wait({task}, timeout=0.01)
            if self.dead:
                task.cancel()
                raise NodeGone(self.node.spec.name)
        return task.result()

    async def status(self) -> NodeStatus:
        if self.dead:
            raise NodeGone(self.node.spec.name)
        return self.node.status()

    async def start(self) -> NodeStatus:
        return await self.node.start()

    async def cancel(self, request_id: str) -> bool:
        return self.node.cancel(request_id)


async def fleet(nodes: dict[str, dict], *, cost_s: float = 0.0, shed=None, capacity=8):
    config = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "node_defaults": {"queue": {"capacity": capacity}},
            "nodes": [{"name": n, **extra} for n, extra in nodes.items()],
            "router": {
                "placement": {"shed": shed if shed is not None else {"background": 0.75}},
                "report_interval_s": 0.05,
                "lost_after_s": 0.5,
            },
        },
        Path("/nonexistent"),
    )
    handles = {}
    for spec in config.node_specs():
        node = NodeRuntime(spec, loader=FakeLoader(m={"cost_s": cost_s}))
        await node.start()
        handles[spec.name] = LocalHandle(node)
    router = Router(config, handles)
    await router.start()
    return router, handles


def req(priority=10, rid=None, value=1.0):
    kw = {"id": rid} if rid else {}
    return InferRequest(model="m", inputs=x(value), priority=priority, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_spills_to_the_next_node_when_one_refuses():
    async def main():
        router, handles = await fleet({"a": {}, "b": {"queue": {"capacity": 1}}}, cost_s=0.2)
        # Fill b (one running, one queued) behind the router's back, and make a refuse.
        hb = handles["b"].node
        blockers = []
        for _ in range(2):
            blockers.append(asyncio.create_task(hb.infer(req(10))))
            await asyncio.sleep(0.03)
        assert hb.status().queue_length == 1
        handles["a"].node._sched.draining = True
        reply = await router.infer(req(10))
        assert isinstance(reply.error, Rejected)
        assert "every node refused" in str(reply.error) and reply.error.retry_after_s > 0
        handles["a"].node._sched.draining = False
        reply = await router.infer(req(10, value=3.0))
        assert reply.error is None and reply.node == "a"
        np.testing.assert_array_equal(reply.outputs["y"], x(6.0)["x"])
        assert router.status_now().counters["spilled"] >= 2
        await asyncio.gather(*blockers)

    run(main())


def test_foreground_goes_to_the_node_with_least_higher_priority_work():
    async def main():
        router, handles = await fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64)
        # Background floods a (a long queue), foreground work sits on b (a short one).
        bg = [asyncio.create_task(router.infer(req(3))) for _ in range(1)]
        await asyncio.sleep(0.01)
        router._nodes["a"].work.update({f"bg{i}": 3 for i in range(30)})
        router._nodes["b"].work.update({f"fg{i}": 10 for i in range(5)})
        reply = await router.infer(req(10))
        assert reply.node == "a"  # 30 background requests are not ahead of foreground
        router._nodes["a"].work.clear()
        router._nodes["b"].work.clear()
        await asyncio.gather(*bg)

    run(main())


def test_background_is_shed_before_foreground():
    async def main():
        router, handles = await fleet({"a": {}}, cost_s=0.3, capacity=4, shed={"background": 0.5})
        first = [asyncio.create_task(router.infer(req(3))) for _ in range(2)]
        await asyncio.sleep(0.02)
        shed = await router.infer(req(3))
        assert isinstance(shed.error, Rejected) and "shed" in str(shed.error)
        assert shed.error.retry_after_s > 0
        fg = await router.infer(req(10))
        assert fg.error is None
        assert router.status_now().counters["shed"] == 1
        await asyncio.gather(*first)

    run(main())


def test_evicted_request_is_placed_again_on_another_node():
    async def main():
        router, handles = await fleet(
            {"a": {"queue": {"capacity": 1}}, "b": {}}, cost_s=0.2, shed={}
        )
        ha = handles["a"].node
        running = asyncio.create_task(ha.infer(req(10)))  # a busy...
        await asyncio.sleep(0.05)
        router._nodes["b"].work.update({f"x{i}": 10 for i in range(50)})  # ...b looks worse
        victim = asyncio.create_task(router.infer(req(3, rid="victim")))
        await asyncio.sleep(0.05)
        assert ha.status().queue_length == 1
        await ha.infer(req(10))  # evicts the victim from a's one-slot queue
        router._nodes["b"].work.clear()
        reply = await victim
        assert reply.error is None and reply.node == "b"
        assert router.status_now().counters["replaced"] == 1
        await running

    run(main())


def test_evicted_fails_only_when_no_node_has_room():
    async def main():
        router, handles = await fleet({"a": {"queue": {"capacity": 1}}}, cost_s=0.2, shed={})
        ha = handles["a"].node
        running = asyncio.create_task(ha.infer(req(10)))
        await asyncio.sleep(0.05)
        victim = asyncio.create_task(router.infer(req(3)))
        await asyncio.sleep(0.05)
        await ha.infer(req(10))
        reply = await victim
        assert isinstance(reply.error, Evicted)
        await running

    run(main())


def test_requests_on_a_dying_node_are_placed_again_and_answered_once():
    async def main():
        router, handles = await fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64, shed={})
        tasks = [asyncio.create_task(router.infer(req(10, rid=f"r{i}"))) for i in range(40)]
        await asyncio.sleep(0.1)
        handles["a"].dead = True
        replies = await asyncio.gather(*tasks)
        assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(40))
        assert all(r.error is None for r in replies)
        counters = router.status_now().counters
        assert counters["nodes_lost"] == 1 and counters["replaced"] >= 1
        assert not router.status_now().healthy["a"]
        late = await router.infer(req(10))
        assert late.node == "b"
        handles["a"].dead = False  # the node comes back: the next poll lets it rejoin
        await asyncio.sleep(0.2)
        assert router.status_now().healthy["a"] and router.status_now().counters["rejoined"] == 1

    run(main())


def test_every_node_lost_or_unknown_model():
    async def main():
        router, handles = await fleet({"a": {}})
        handles["a"].dead = True
        reply = await router.infer(req(10))
        assert isinstance(reply.error, NodeLost)
        unknown = await router.infer(InferRequest(model="zzz", inputs=x(1.0)))
        assert isinstance(unknown.error, ModelNotFound) and "the fleet serves: m" in str(
            unknown.error
        )

    run(main())


def test_shed_clients_are_told_to_come_back_in_turn():
    async def main():
        router, handles = await fleet({"a": {}}, cost_s=0.3, capacity=4, shed={"background": 0.5})
        first = [asyncio.create_task(router.infer(req(3))) for _ in range(2)]
        await asyncio.sleep(0.02)
        hints = [(await router.infer(req(3))).error.retry_after_s for _ in range(5)]
        assert hints == sorted(hints) and hints[-1] > hints[0]  # later waiters wait longer
        await asyncio.gather(*first)

    run(main())
