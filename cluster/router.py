"""The fleet router: places each request on a node, spills, sheds, re-places.

One router per fleet, a named detached async Ray actor. It keeps, per node, the work
it dispatched and has not seen finish (by priority) and the node's latest report.
Placement is the pipeline in ``policies.placement``; the node stays the authority on
admission. A request a node refuses or evicts is tried on the next candidate; a node
that dies takes none of its requests with it: they are placed again elsewhere.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle

from actors.node import GenerationResult, NodeStatus, Reply, TokenChunk
from cluster.deploy import NAMESPACE, actor_name
from cluster.metrics import RouterMetrics
from edgefleet.clock import Clock, MonotonicClock
from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.errors import (
    EdgeFleetError,
    Evicted,
    InvalidInput,
    ModelNotFound,
    NodeLost,
    Rejected,
)
from edgefleet.request import GenerateRequest, InferRequest
from policies.placement import (
    NodeView,
    PlacementParams,
    PlacementRequest,
    ShedBelowPriority,
    make_placement,
)


class NodeGone(Exception):
    """The node's actor died or cannot be reached."""


class NodeHandle(Protocol):
    """How the router talks to one node (a Ray actor in production, a fake in tests)."""

    async def infer(self, request: InferRequest, inputs: Any = None) -> Reply:
        """MUST raise NodeGone when the node died; every other outcome is a Reply."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | GenerationResult]:
        """Stream a generation; MUST raise NodeGone when the node died."""
        ...

    async def status(self) -> NodeStatus: ...

    async def start(self) -> NodeStatus: ...

    async def cancel(self, request_id: str) -> bool: ...

    async def set_lifecycle(self, state: str) -> NodeStatus: ...


@dataclass
class NodeEntry:
    spec: NodeSpec
    handle: NodeHandle
    healthy: bool = False
    report: NodeStatus | None = None
    reported_at: float = 0.0
    work: dict[str, int] = field(default_factory=dict)  # request id -> priority

    def view(self) -> NodeView:
        by_priority: dict[int, int] = {}
        for p in self.work.values():
            by_priority[p] = by_priority.get(p, 0) + 1
        report = self.report
        row_cost: dict[str, float] = {}
        load_cost: dict[str, float] = {}
        loaded: frozenset[str] = frozenset(self.spec.models)
        running_left = 0.0
        draining = False
        sessions: frozenset[str] = frozenset()
        if report is not None:
            sessions = frozenset(report.sessions)
            # Work others sent (another router, direct callers) shows in the node's report.
            reported = dict(report.queued)
            if report.running is not None:
                p = report.running.priority
                reported[p] = reported.get(p, 0) + len(report.running.request_ids)
            for p, n in reported.items():
                by_priority[p] = max(by_priority.get(p, 0), n)
            loaded = frozenset(m.name for m in report.models if m.loaded)
            draining = report.state in ("draining", "drained", "stopped")
            for m in report.models:
                ms = m.row_ms if m.row_ms is not None else m.cost_ms.get(1)
                if ms is not None:
                    row_cost[m.name] = ms / 1000
            if report.running is not None:
                expected = row_cost.get(report.running.model, 0.0) * len(report.running.request_ids)
                running_left = max(0.0, expected - report.running.elapsed_s)
        return NodeView(
            name=self.spec.name,
            models=frozenset(self.spec.models),
            loaded=loaded,
            healthy=self.healthy,
            draining=draining,
            capacity=self.spec.queue.capacity,
            work=by_priority,
            row_cost_s=row_cost,
            load_cost_s=load_cost,
            running_left_s=running_left,
            sessions=sessions,
        )


@dataclass(frozen=True)
class RouterStatus:
    fleet: str
    nodes: tuple[NodeStatus, ...]
    healthy: dict[str, bool]
    counters: dict[str, int]


class Router:
    """Placement, spill, shed, re-placement and membership for one fleet."""

    def __init__(
        self,
        config: FleetConfig,
        handles: Mapping[str, NodeHandle],
        *,
        clock: Clock | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self._metrics = metrics or RouterMetrics(config.fleet.name, config.priorities)
        rc = config.router
        pc = rc.placement
        shed = {config.priorities[name]: frac for name, frac in pc.shed.items()}
        params = PlacementParams(
            load_weight=pc.load_weight, affinity_penalty_s=pc.affinity_penalty_s, shed=shed
        )
        self._placement = make_placement(pc.policy, params)
        self._shed = ShedBelowPriority(shed)
        self._rng = random.Random(pc.seed)
        self._clock = clock or MonotonicClock()
        self._nodes = {
            spec.name: NodeEntry(spec, handles[spec.name]) for spec in config.node_specs()
        }
        self._counters: Counter[str] = Counter()
        self._monitor: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self._shed_waiting: list[float] = []  # heap: when each shed request was told to retry

    # ------------------------------------------------------------------- membership

    async def start(self) -> RouterStatus:
        """Poll every node once, then keep polling in the background. Idempotent."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            await asyncio.gather(*(self._poll(e) for e in self._nodes.values()))
            self._monitor = asyncio.create_task(self._watch())
            self._started.set_result(None)
        await self._started
        return self.status_now()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.router.report_interval_s)
            await asyncio.gather(*(self._poll(e) for e in self._nodes.values()))

    async def _poll(self, entry: NodeEntry) -> None:
        timeout = self.config.router.lost_after_s
        try:
            report = await asyncio.wait_for(entry.handle.status(), timeout)
            if report.state == "starting":  # restarted by Ray: bring it back into service
                report = await asyncio.wait_for(entry.handle.start(), None)
        except NodeGone:
            self._lose(entry)
            return
        except TimeoutError:  # alive but silent: lost once it has been silent too long
            if self._clock.now() - entry.reported_at >= timeout:
                self._lose(entry)
            return
        if not entry.healthy:
            self._counters["rejoined" if entry.report is not None else "joined"] += 1
        entry.report, entry.reported_at, entry.healthy = report, self._clock.now(), True
        self._metrics.node_health(entry.spec.name, True)

    def _lose(self, entry: NodeEntry) -> None:
        if entry.healthy:
            entry.healthy = False
            self._counters["nodes_lost"] += 1
            self._metrics.node_lost(entry.spec.name)

    # -------------------------------------------------------------------- requests

    async def infer(self, request: InferRequest, inputs: Any = None) -> Reply:
        """Place ``request`` and answer it once (see :meth:`_place`); records the answer."""
        started = self._clock.now()
        reply = await self._place(request, inputs)
        self._metrics.answered(request, reply.error, self._clock.now() - started)
        return reply

    async def _place(self, request: InferRequest, inputs: Any = None) -> Reply:
        """Place ``request``; try candidates until one serves it; exactly one Reply.

        ``inputs`` is an optional Ray object reference (in a list, so Ray passes it
        through the router unresolved) holding the inputs of a large request.
        """
        self._counters["received"] += 1
        preq = PlacementRequest(request.model, request.priority)
        unknown = self._unknown_model(request)
        if unknown is not None:
            return self._answer(Reply(request.id, "", error=unknown))
        tried: set[str] = set()
        refusals: list[Rejected] = []
        evicted: Reply | None = None
        attempts = 0
        while attempts < self.config.router.max_attempts:
            entry = self._next_node(preq, tried)
            if entry is None:
                break
            entry.work[request.id] = request.priority
            try:
                reply = await entry.handle.infer(request, inputs)
            except NodeGone:
                self._lose(entry)
                self._counters["replaced"] += 1  # its node died: place it again
                self._metrics.replaced(request.priority, "node_lost")
                continue
            finally:
                entry.work.pop(request.id, None)
            attempts += 1
            if isinstance(reply.error, Rejected):
                refusals.append(reply.error)
                self._counters["spilled"] += 1
                self._metrics.spilled(request.priority)
                continue
            if isinstance(reply.error, Evicted):
                evicted = reply
                self._counters["replaced"] += 1
                self._metrics.replaced(request.priority, "evicted")
                continue
            return self._answer(reply)
        if evicted is not None:
            return self._answer(evicted)
        return self._answer(Reply(request.id, "", error=self._refusal(request, refusals, tried)))

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenChunk | GenerationResult]:
        """Place a generation and stream its tokens; the last item is its result.

        A refusal spills to the next node. When the node dies mid-stream, the
        generation continues on another node from the tokens already sent (prompt
        plus output so far), so the caller sees each token once.
        """
        started = self._clock.now()
        async for item in self._stream(request):
            if isinstance(item, GenerationResult):
                self._counters[_kind(item.error)] += 1
                self._metrics.answered(request, item.error, self._clock.now() - started)
            yield item

    async def _stream(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenChunk | GenerationResult]:
        self._counters["received"] += 1
        unknown = self._unknown_model(request)
        if unknown is not None:
            yield GenerationResult(request.id, "", error=unknown)
            return
        preq = PlacementRequest(request.model, request.priority, session=request.session)
        tried: set[str] = set()
        refusals: list[Rejected] = []
        sent: list[int] = []
        current = request
        attempts = 0
        while attempts < self.config.router.max_attempts:
            entry = self._next_node(preq, tried)
            if entry is None:
                break
            entry.work[request.id] = request.priority
            result: GenerationResult | None = None
            try:
                async for item in entry.handle.generate(current):
                    if isinstance(item, TokenChunk):
                        sent.extend(item.tokens)
                        yield item
                    else:
                        result = item
            except NodeGone:
                self._lose(entry)
                self._counters["replaced"] += 1
                self._metrics.replaced(request.priority, "node_lost")
                left = request.max_new_tokens - len(sent)
                if left <= 0:
                    result = GenerationResult(request.id, "", tuple(sent), finish_reason="length")
                else:
                    current = replace(
                        request,
                        prompt_ids=(*request.prompt_ids, *sent),
                        max_new_tokens=left,
                    )
                    continue
            finally:
                entry.work.pop(request.id, None)
            attempts += 1
            if result is None:  # cannot happen with a live node: its stream ends with one
                err = NodeLost(f"node {entry.spec.name} ended the stream without a result")
                result = GenerationResult(request.id, entry.spec.name, error=err)
            if isinstance(result.error, Rejected) and not sent:
                refusals.append(result.error)
                self._counters["spilled"] += 1
                self._metrics.spilled(request.priority)
                continue
            if isinstance(result.error, Evicted) and not sent:
                self._counters["replaced"] += 1
                self._metrics.replaced(request.priority, "evicted")
                continue
            yield replace(result, tokens=tuple(sent))
            return
        yield GenerationResult(
            request.id, "", tuple(sent), error=self._refusal(request, refusals, tried)
        )

    async def set_lifecycle(self, node: str, state: str) -> NodeStatus:
        """Tell ``node`` its lifecycle state changed (an event, e.g. the device's app
        went to the background); token budgets follow at the next token."""
        entry = self._nodes.get(node)
        if entry is None:
            raise InvalidInput(f"no node {node!r}; nodes: {', '.join(self._nodes)}")
        try:
            report = await entry.handle.set_lifecycle(state)
        except NodeGone:
            self._lose(entry)
            raise NodeLost(f"node {node} is gone; its lifecycle state was not set") from None
        entry.report = report
        return report

    def _next_node(self, request: PlacementRequest, tried: set[str]) -> NodeEntry | None:
        """The best node not tried yet for ``request`` (and mark it tried)."""
        views = [e.view() for n, e in self._nodes.items() if n not in tried]
        ranked = self._placement.rank(views, request, self._rng)
        if not ranked:
            return None
        tried.add(ranked[0].name)
        return self._nodes[ranked[0].name]

    def _unknown_model(self, request: InferRequest | GenerateRequest) -> ModelNotFound | None:
        if any(request.model in e.spec.models for e in self._nodes.values()):
            return None
        served = sorted({m for e in self._nodes.values() for m in e.spec.models})
        return ModelNotFound(
            f"no node serves model {request.model!r}; the fleet serves: {', '.join(served)}",
            request_id=request.id,
        )

    def _refusal(
        self,
        request: InferRequest | GenerateRequest,
        refusals: list[Rejected],
        tried: set[str],
    ) -> EdgeFleetError:
        if refusals:
            return Rejected(
                f"every node refused the request ({len(refusals)} tried): {refusals[-1]}",
                retry_after_s=min(
                    (r.retry_after_s for r in refusals if r.retry_after_s > 0), default=1.0
                ),
                request_id=request.id,
            )
        serving = [e for e in self._nodes.values() if request.model in e.spec.models]
        healthy = [e for e in serving if e.healthy and e.spec.name not in tried]
        if not healthy:
            return NodeLost(
                f"no healthy node serves model {request.model!r} right now",
                request_id=request.id,
            )
        limit = self._shed.limit(request.priority)
        self._counters["shed"] += 1
        self._metrics.shed(request.priority)
        return Rejected(
            f"shed: every node serving {request.model!r} is over {limit:.0%} full, the share "
            f"priority-{request.priority} work may use; capacity is kept for urgent work",
            retry_after_s=self._shed_retry_after(healthy, limit),
            request_id=request.id,
        )

    def _shed_retry_after(self, entries: list[NodeEntry], limit: float) -> float:
        """When a shed request should come back: after the node drains below ``limit``
        *and* the requests shed before it, still waiting, have had their turn. Without
        that queue of waiters every shed client would retry at the same moment."""
        now = self._clock.now()
        while self._shed_waiting and self._shed_waiting[0] <= now:
            heapq.heappop(self._shed_waiting)

        def drain_s(e: NodeEntry) -> tuple[float, float]:
            view = e.view()
            per_row = max(view.row_cost_s.values(), default=0.005)
            excess = sum(view.work.values()) + 1 - int(limit * view.capacity)
            return view.running_left_s + max(1, excess) * per_row, per_row

        waits = [drain_s(e) for e in entries]
        first, per_row = min(waits)
        # The nodes take the waiters in turn, in parallel.
        delay = first + len(self._shed_waiting) * per_row / len(entries)
        heapq.heappush(self._shed_waiting, now + delay)
        return max(0.001, delay)

    def _answer(self, reply: Reply) -> Reply:
        self._counters[_kind(reply.error)] += 1
        return reply

    async def cancel(self, request_id: str) -> bool:
        results = await asyncio.gather(
            *(e.handle.cancel(request_id) for e in self._nodes.values() if e.healthy),
            return_exceptions=True,
        )
        return any(r is True for r in results)

    # ----------------------------------------------------------------------- status

    def status_now(self) -> RouterStatus:
        return RouterStatus(
            fleet=self.config.fleet.name,
            nodes=tuple(e.report for e in self._nodes.values() if e.report is not None),
            healthy={n: e.healthy for n, e in self._nodes.items()},
            counters=dict(self._counters),
        )

    async def status(self) -> RouterStatus:
        """Fresh reports from every reachable node, plus the router's counters."""
        await asyncio.gather(*(self._poll(e) for e in self._nodes.values()))
        return self.status_now()


def _kind(error: EdgeFleetError | None) -> str:
    return "completed" if error is None else type(error).__name__.lower()


# ------------------------------------------------------------------------- on Ray


class RayNode:
    """A node actor found by name. After the actor dies it is looked up again on the
    next call, so a node redeployed under the same name rejoins by itself."""

    def __init__(self, name: str, namespace: str) -> None:
        self._name = name
        self._namespace = namespace
        self._actor: ActorHandle | None = None

    def _handle(self) -> ActorHandle:
        if self._actor is None:
            try:
                self._actor = ray.get_actor(self._name, namespace=self._namespace)
            except ValueError as exc:  # no such actor (yet, or any more)
                raise NodeGone(str(exc)) from None
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle(), method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            if isinstance(exc, ray.exceptions.ActorDiedError):
                self._actor = None
            raise NodeGone(str(exc)) from None

    async def infer(self, request: InferRequest, inputs: Any = None) -> Reply:
        # ``inputs`` is [ref]: passed on as a top-level argument, Ray resolves it on the node.
        if inputs is None:
            return await self._call("infer", request)
        return await self._call("infer", request, inputs[0])

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenChunk | GenerationResult]:
        try:
            async for ref in self._handle().generate.remote(request):
                yield await ref
        except ray.exceptions.RayActorError as exc:
            if isinstance(exc, ray.exceptions.ActorDiedError):
                self._actor = None
            raise NodeGone(str(exc)) from None

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return await self._call("set_lifecycle", state)

    async def status(self) -> NodeStatus:
        return await self._call("status")

    async def start(self) -> NodeStatus:
        return await self._call("start")

    async def cancel(self, request_id: str) -> bool:
        return bool(await self._call("cancel", request_id))


class RouterActor:
    """The router as a Ray actor: finds its fleet's node actors by name."""

    def __init__(self, config: FleetConfig) -> None:
        handles = {
            spec.name: RayNode(actor_name(config.fleet.name, spec.name), NAMESPACE)
            for spec in config.node_specs()
        }
        self._router = Router(config, handles)

    async def start(self) -> RouterStatus:
        return await self._router.start()

    def config(self) -> FleetConfig:
        return self._router.config

    async def infer(self, request: InferRequest, inputs: Any = None) -> Reply:
        await self._router.start()  # after a restart of the router itself
        return await self._router.infer(request, inputs)

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenChunk | GenerationResult]:
        await self._router.start()
        async for item in self._router.generate(request):
            yield item

    async def set_lifecycle(self, node: str, state: str) -> NodeStatus:
        await self._router.start()
        return await self._router.set_lifecycle(node, state)

    async def status(self) -> RouterStatus:
        return await self._router.status()

    async def cancel(self, request_id: str) -> bool:
        return await self._router.cancel(request_id)
