"""A fake engine with scripted costs and a call log, for node tests without ONNX Runtime."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.engine import InputInfo, RunAborted, Signature, TensorSpec, check_inputs
from actors.node import NodeRuntime
from cluster.dispatch import Dispatcher, FutureCalls, NodeGone, NodeUnavailable
from cluster.router import Router
from cluster.traffic import LoopThread
from edgefleet.config import FleetConfig, ModelConfig, NodeSpec, PreemptionConfig, QueueConfig
from edgefleet.errors import EngineError
from edgefleet.messages import GenerationResult, NodeStatus, Reply, TokenChunk
from edgefleet.request import GenerateRequest, InferRequest

F32 = np.dtype(np.float32)
HANG = 1000.0  # a row whose first value is this makes the call hang (see FakeEngine)


class FakeEngine:
    """Doubles its input ``x``. A row whose first value is negative makes the call fail.

    ``cost_s`` is real time spent per call (waiting on the call's stop event, so an
    abort ends it, ``stop_s`` later); keep both small. A row whose first value is
    ``HANG`` makes the call hang until it is aborted (at most a minute) or, when the
    engine is ``deaf`` to aborts, until the test sets ``unstick``.
    """

    def __init__(
        self,
        name: str,
        *,
        batchable: bool = True,
        cost_s: float = 0.0,
        stop_s: float = 0.0,
        deaf: bool = False,
    ) -> None:
        self.name = name
        shape: tuple[int | str | None, ...] = ("N", 4) if batchable else (4,)
        self._sig = Signature((TensorSpec("x", F32, shape),), (TensorSpec("y", F32, shape),))
        self.cost_s = cost_s
        self.stop_s = stop_s
        self.deaf = deaf
        self.unstick = threading.Event()
        self.entered = 0  # calls that started running
        self.calls: list[int] = []  # rows per call
        self.closed = False

    @property
    def signature(self) -> Signature:
        return self._sig

    def check(self, inputs: Mapping[str, Any], max_bytes: int) -> InputInfo:
        return check_inputs(self._sig, self.name, inputs, max_bytes)

    def run(
        self, batch: Sequence[Mapping[str, np.ndarray]], stop: threading.Event | None = None
    ) -> list[dict[str, np.ndarray]]:
        stop = stop or threading.Event()
        if stop.is_set():
            raise RunAborted(self.name)
        self.entered += 1
        x = [b["x"] for b in batch]
        if any(float(a.reshape(-1)[0]) == HANG for a in x):
            (self.unstick if self.deaf else stop).wait(60)
            if stop.is_set():
                raise RunAborted(self.name)
        if self.cost_s and stop.wait(self.cost_s):
            time.sleep(self.stop_s)
            raise RunAborted(self.name)
        self.calls.append(sum(a.shape[0] if a.ndim == 2 else 1 for a in x))
        if any(float(a.reshape(-1)[0]) < 0 for a in x):
            raise EngineError("negative input")
        return [{"y": a * 2} for a in x]

    def abort(self) -> None:
        pass  # the node sets the call's stop event, which ends the scripted wait

    def close(self) -> None:
        self.closed = True


def fake_spec(
    models: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    capacity: int = 64,
    budget_mb: float = 1000,
    gap: int = 5,
    order: str = "priority",
) -> NodeSpec:
    models = models or {"m": {}}
    return NodeSpec(
        name="fake-0",
        models={
            name: ModelConfig.model_validate(
                {"path": Path(f"/nonexistent/{name}.onnx"), "warmup": False, **m}
            )
            for name, m in models.items()
        },
        priorities={"foreground": 10, "inline": 7, "background": 3, "offline": 0},
        queue=QueueConfig(capacity=capacity),
        preemption=PreemptionConfig(min_priority_gap=gap),
        memory_budget_mb=budget_mb,
        order=order,  # type: ignore[arg-type]
    )


class FakeLoader:
    """Builds FakeEngines and remembers them, so tests can script and inspect them."""

    def __init__(self, **engine_kw: Any) -> None:
        self.engines: dict[str, FakeEngine] = {}
        self.loads: list[str] = []
        self._kw = engine_kw

    def __call__(self, name: str, config: ModelConfig) -> FakeEngine:
        self.loads.append(name)
        engine = FakeEngine(name, **self._kw.get(name, {}))
        self.engines[name] = engine
        return engine


def x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 4), value, dtype=np.float32)}


# --------------------------------------------------------------- a fleet in-process


class LocalNode(FutureCalls):
    """A NodeRuntime on a background event loop behind the handles a dispatcher and a
    router use; ``dead = True`` makes it behave like a dead actor (calls in progress
    fail with NodeGone, as Ray's would); ``frozen = True`` like a stopped process: calls
    and probes get no answer until it is set back (answers made meanwhile come then)."""

    def __init__(self, node: NodeRuntime, loop: asyncio.AbstractEventLoop) -> None:
        self.node = node
        self.loop = loop
        self.dead = False
        self.frozen = False
        self.unreachable = 0  # calls that run on the node but whose answer is lost
        self.calls = 0
        self.probes: list[list[str]] = []  # the request ids of each probe answered
        self.forgotten: list[str] = []
        self.restarts = 0

    async def _thawed(self) -> None:
        while self.frozen:
            await asyncio.sleep(0.01)

    def probe(self, request_ids: Sequence[str], timeout_s: float) -> Mapping[str, bool] | None:
        if self.dead or self.frozen:
            return None
        self.probes.append(list(request_ids))
        return self.node.probe(request_ids)

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)
        asyncio.run_coroutine_threadsafe(self.cancel(request_id), self.loop)

    def _gone(self) -> NodeGone:
        return NodeGone(self.node.spec.name)

    # dispatcher side (any thread)
    def infer(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        self.calls += 1
        if self.dead:
            raise self._gone()
        running = asyncio.run_coroutine_threadsafe(self._infer(request, inputs), self.loop)
        if self.unreachable:  # the node runs it; the caller hears only "unavailable"
            self.unreachable -= 1
            lost: cf.Future[Reply] = cf.Future()
            lost.set_exception(NodeUnavailable(f"{self.node.spec.name} is restarting"))
            return lost
        return running

    async def _infer(self, request: InferRequest, inputs: Any) -> Reply:
        await self._thawed()
        task = asyncio.ensure_future(self.node.infer(request, inputs))
        while not task.done() or self.frozen:
            await asyncio.wait({task}, timeout=0.01)
            if self.dead:
                task.cancel()
                raise self._gone()
        return task.result()

    def generate(
        self, request: GenerateRequest, wait_s: float | None = None
    ) -> Iterator[TokenChunk | GenerationResult | None]:
        self.calls += 1
        if self.dead:
            raise self._gone()
        stream = self.node.generate(request)

        async def next_item() -> Any:
            await self._thawed()
            item = await stream.__anext__()
            await self._thawed()
            return item

        try:
            while True:
                pending = asyncio.run_coroutine_threadsafe(next_item(), self.loop)
                while True:
                    try:
                        item = pending.result(60 if wait_s is None else wait_s)
                        break
                    except cf.TimeoutError:
                        yield None
                    except StopAsyncIteration:
                        return
                if self.dead:
                    raise self._gone()
                yield item
        finally:
            if not self.frozen:
                asyncio.run_coroutine_threadsafe(stream.aclose(), self.loop).result(60)

    # router side (on the loop)
    async def status(self) -> NodeStatus:
        if self.dead:
            raise self._gone()
        await self._thawed()
        return self.node.status()

    async def start(self) -> NodeStatus:
        return await self.node.start()

    async def cancel(self, request_id: str) -> bool:
        await self._thawed()
        return self.node.cancel(request_id)

    async def alive(self, timeout_s: float) -> bool:
        if self.dead:
            raise self._gone()
        return not self.frozen

    async def restart(self) -> None:
        self.restarts += 1
        self.frozen = False  # the process was killed: what it held is lost with it

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return self.node.set_lifecycle(state)


class LocalFleet:
    """Nodes, their router and a dispatcher in this process (no Ray): the nodes and the
    router on one background event loop, the dispatcher called from the test's thread
    as FleetClient calls it. ``refresh()`` hands the router's view to the dispatcher
    (a client's view feed does that every report interval)."""

    def __init__(
        self,
        config: FleetConfig,
        make_node: Callable[[NodeSpec], NodeRuntime],
        *,
        metrics: Any = None,
        router_metrics: Any = None,
    ) -> None:
        self.config = config
        self._thread = LoopThread("local-fleet")
        self.loop = self._thread.loop
        self.handles = {s.name: LocalNode(make_node(s), self.loop) for s in config.node_specs()}
        for h in self.handles.values():
            self.run(h.node.start())
        self.router = Router(config, self.handles, metrics=router_metrics)
        self.run(self.router.start())
        self.dispatcher = Dispatcher(config, self.handles, metrics=metrics, watch=True)
        self.refresh()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        """Run ``coro`` on the fleet's loop and wait for it."""
        return self._thread.run(coro, timeout)

    def spawn(self, coro: Any) -> cf.Future[Any]:
        """Start ``coro`` on the fleet's loop; its future."""
        return self._thread.spawn(coro)

    def refresh(self) -> None:
        async def view() -> Any:
            await self.router.status()  # polls every node now
            d = self.dispatcher
            return self.router.fleet_view("test", d.counted(), d.shed_waiting(), d.take_placed())

        self.dispatcher.update(self.run(view()))

    def infer(self, request: InferRequest, timeout: float = 60) -> Reply:
        return self.dispatcher.submit(request).result(timeout)

    def counters(self) -> dict[str, int]:
        self.refresh()
        return self.router.status_now().router

    def node(self, name: str) -> NodeRuntime:
        return self.handles[name].node

    def close(self) -> None:
        self.run(self.router.stop(), 10)
        for h in self.handles.values():
            with contextlib.suppress(Exception):
                self.run(h.node.stop(), 10)
        self.dispatcher.close()
        self._thread.close(10)


class CallGate:
    """Holds each call of a fake engine on the engine thread as it starts, before the
    engine looks at the call's stop event, until the test lets it go.

    ``await gate.entered()`` gives the first input value of each request in the call
    now held; ``gate.release()`` lets that call go on; ``gate.open()`` lets every call
    from now on through. ``ran`` lists the calls that did run (not aborted), in order.
    """

    def __init__(self, engine: FakeEngine) -> None:
        self._run = engine.run
        self._held: cf.Future[list[float]] | None = None
        self._go = threading.Event()
        self._opened = False
        self._lock = threading.Lock()
        self._waiting: list[cf.Future[list[float]]] = []
        self._queue: list[list[float]] = []
        self.ran: list[list[float]] = []
        engine.run = self._gated  # type: ignore[method-assign]

    def _gated(
        self, batch: Sequence[Mapping[str, np.ndarray]], stop: threading.Event | None = None
    ) -> list[dict[str, np.ndarray]]:
        values = [float(b["x"].reshape(-1)[0]) for b in batch]
        if not self._opened:
            self._go.clear()
            with self._lock:
                if self._waiting:
                    self._waiting.pop(0).set_result(values)
                else:
                    self._queue.append(values)
            self._go.wait(30)
        out = self._run(batch, stop)
        self.ran.append(values)
        return out

    async def entered(self) -> list[float]:
        """The call held now (waits for the next one to arrive)."""
        with self._lock:
            if self._queue:
                return self._queue.pop(0)
            fut: cf.Future[list[float]] = cf.Future()
            self._waiting.append(fut)
        return await asyncio.wrap_future(fut)

    def release(self) -> None:
        self._go.set()

    def open(self) -> None:
        self._opened = True
        self._go.set()
