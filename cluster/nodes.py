"""The one place that talks to node actors through Ray: requests for the dispatcher
(futures and a token iterator), control calls for the router (awaitables), and, for
the pools, Ray's node table and the pool members' actors."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
from ray.actor import ActorHandle

from cluster.dispatch import NodeGone, NodeUnavailable
from cluster.membership import RayNodeRow
from cluster.names import NAMESPACE, PROBE_GROUP, node_actor_name
from edgefleet.artifacts import ModelArtifact
from edgefleet.config import ModelConfig, NodeSpec
from edgefleet.messages import GenerationResult, NodeStatus, Reply, TokenChunk
from edgefleet.request import GenerateRequest, InferRequest

GONE_POLL_S = 0.05  # how often an ended actor's name is looked up until it is free
# A call's actor is gone: it died, or Ray cannot start it again (a pool member pinned
# to a Ray node that died).
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)


def max_concurrency(spec: NodeSpec) -> int:
    """Concurrent calls a node actor holds open: its queue plus headroom for arrivals
    being admitted or refused. More would only hold memory for calls Ray can keep."""
    return max(1024, spec.queue.capacity + 256)


@dataclass(frozen=True, eq=False)
class RayCall:
    """A request sent to a node actor: its reply's reference, and the node."""

    ref: ray.ObjectRef
    node: RayNode


class RayNode:
    """A node actor found by name. After the actor dies it is looked up again on the
    next call, so a node redeployed under the same name rejoins by itself."""

    def __init__(self, name: str, namespace: str, actor: ActorHandle | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._actor = actor

    def _handle(self) -> ActorHandle:
        if self._actor is None:
            try:
                self._actor = ray.get_actor(self._name, namespace=self._namespace)
            except ValueError as exc:  # no such actor (yet, or any more)
                raise NodeGone(str(exc)) from None
        return self._actor

    def actor(self) -> ActorHandle:
        """The node's actor; NodeGone when there is none under its name."""
        return self._handle()

    def _gone(self, exc: Exception) -> NodeGone:
        if isinstance(exc, ray.exceptions.ActorUnavailableError):
            return NodeUnavailable(str(exc))  # restarting or out of reach: ask again
        if isinstance(exc, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnschedulableError):
            self._actor = None
        return NodeGone(str(exc))

    # ---------------------------------------------------------- requests (dispatcher)

    def infer(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        """``inputs``: an object reference Ray resolves on the node (large requests)."""
        actor = self._handle()
        ref = actor.infer.remote(request) if inputs is None else actor.infer.remote(request, inputs)
        out: cf.Future[Reply] = cf.Future()
        # Ray calls back with the reply or the error stored in its place. The callback
        # resolves the one future, where ObjectRef.future() would make a second one to
        # be copied into this (Ray Serve's handles use the same hook). It holds the
        # reference until then: Ray releases the call's objects (its reply, and inputs
        # put in the object store) once no reference to them is left.
        ref._on_completed(partial(self._answered, out, ref))
        return out

    def _answered(self, out: cf.Future[Reply], ref: ray.ObjectRef, result: Any) -> None:
        """Ray's callback: ``result`` is the reply or the error stored in its place
        (``ref``, unused, is what keeps the call's objects alive until now)."""
        if isinstance(result, ACTOR_GONE):
            out.set_exception(self._gone(result))
        elif isinstance(result, ray.exceptions.RayTaskError):
            out.set_exception(result.as_instanceof_cause())
        elif isinstance(result, BaseException):
            out.set_exception(result)
        else:
            out.set_result(result)

    def send(self, request: InferRequest, inputs: Any = None) -> RayCall:
        actor = self._handle()
        ref = actor.infer.remote(request) if inputs is None else actor.infer.remote(request, inputs)
        return RayCall(ref, self)

    def wait(self, calls: Sequence[RayCall], timeout_s: float) -> list[tuple[RayCall, Any]]:
        """Ray waits for the replies and reads them together, on this thread."""
        by_ref = {c.ref: c for c in calls}
        ready, rest = ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
        if ready and rest:  # and whatever else is answered by now
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        try:
            answers: list[Any] = ray.get(ready)
        except Exception:  # one failed: read them one by one
            answers = []
            for ref in ready:
                try:
                    answers.append(ray.get(ref))
                except ACTOR_GONE as exc:
                    answers.append(by_ref[ref].node._gone(exc))
                except ray.exceptions.RayTaskError as exc:
                    answers.append(exc.as_instanceof_cause())
                except Exception as exc:
                    answers.append(exc)
        return [(by_ref[ref], a) for ref, a in zip(ready, answers, strict=True)]

    def generate(
        self, request: GenerateRequest, wait_s: float | None = None
    ) -> Iterator[TokenChunk | GenerationResult | None]:
        stream = self._handle().generate.remote(request)
        finished = False
        try:
            while True:
                try:
                    # Ray's own iteration waits without a bound; this one returns a nil
                    # reference after wait_s (-1: no bound).
                    ref = stream._next_sync(-1 if wait_s is None else wait_s)
                except StopIteration:
                    return
                if ref.is_nil():
                    yield None
                    continue
                item = ray.get(ref)
                finished = isinstance(item, GenerationResult)
                yield item
        except ACTOR_GONE as exc:
            raise self._gone(exc) from None
        finally:
            if not finished:  # the consumer went away: the node stops generating for nobody
                with contextlib.suppress(Exception):
                    ray.cancel(stream)

    def _probe(self, request_ids: Sequence[str]) -> ray.ObjectRef:
        probe = self._handle().probe.options(concurrency_group=PROBE_GROUP)
        return probe.remote(list(request_ids))

    def probe(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, bool] | None:
        try:
            answer: dict[str, bool] = ray.get(self._probe(request_ids), timeout=timeout_s)
        except (ray.exceptions.GetTimeoutError, *ACTOR_GONE, NodeGone):
            return None
        return answer

    def forget(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            self._handle().cancel.remote(request_id)  # not waited for: it may never answer

    # ---------------------------------------------------------- control (router)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle(), method).remote(*args)
        except ACTOR_GONE as exc:
            raise self._gone(exc) from None

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return await self._call("set_lifecycle", state)

    async def status(self) -> NodeStatus:
        return await self._call("status")

    async def set_version(
        self, model: str, config: ModelConfig, artifact: ModelArtifact, drain_s: float
    ) -> NodeStatus:
        return await self._call("set_version", model, config, artifact, drain_s)

    async def start(self) -> NodeStatus:
        return await self._call("start")

    async def cancel(self, request_id: str) -> bool:
        return bool(await self._call("cancel", request_id))

    async def alive(self, timeout_s: float) -> bool:
        """Whether the node's process answers a probe within ``timeout_s`` (its event
        loop may be too busy to report; a frozen process answers nothing)."""
        try:
            await asyncio.wait_for(self._probe([]), timeout_s)
        except TimeoutError:
            return False
        except ACTOR_GONE as exc:
            raise self._gone(exc) from None
        return True

    async def restart(self) -> None:
        """Kill the node's process; Ray starts the actor again in place (it is created
        with ``max_restarts=-1``), and the router brings it back into service."""
        ray.kill(self._handle(), no_restart=False)


# ------------------------------------------------------------------------- pools


class RayNodeTable:
    """Ray's node table, read from the GCS (what ``ray.nodes()`` reads), bounded by
    ``timeout_s``. A Ray node's labels never change while it lives, so a row is made
    once per Ray node and state: reading a large table again costs little more than
    the call."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._rows: dict[bytes, RayNodeRow] = {}

    async def read(self) -> list[RayNodeRow]:
        gcs = ray._private.worker.global_worker.gcs_client
        call = gcs.async_get_all_node_info(timeout=self.timeout_s)
        infos, _ = await asyncio.wait_for(call, self.timeout_s + 1.0)
        return self.rows(infos)

    def rows(self, infos: Mapping[Any, Any]) -> list[RayNodeRow]:
        """Rows of the GCS's node infos (node id -> ``GcsNodeInfo``), made again only
        for a Ray node that is new or changed state."""
        held = self._rows
        fresh: dict[bytes, RayNodeRow] = {}
        for node_id, info in infos.items():
            key = node_id.binary()
            alive = info.state == 0  # GcsNodeInfo.ALIVE
            row = held.get(key)
            if row is None or row.alive != alive:
                row = RayNodeRow(
                    node_id.hex(),
                    alive,
                    dict(info.labels),
                    info.start_time_ms / 1000.0,
                    info.end_time_ms / 1000.0,
                )
            fresh[key] = row
        self._rows = fresh
        return list(fresh.values())


class RayMemberActors:
    """Pool members' node actors: detached (a router restart leaves them serving),
    pinned to their Ray node by node id, restarted in place by Ray after a crash of
    their process, and named so a restarted router finds them
    (:func:`cluster.names.node_actor_name`). Every call is bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._remote: Any = None

    async def create(self, spec: NodeSpec) -> RayNode:
        name = node_actor_name(spec.fleet, spec)
        actor = await asyncio.wait_for(asyncio.to_thread(self._create, spec, name), self.timeout_s)
        return RayNode(name, NAMESPACE, actor)

    def _create(self, spec: NodeSpec, name: str) -> ActorHandle:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._remote is None:
            from actors.node import NodeRuntime  # ONNX Runtime: only where members start

            self._remote = ray.remote(concurrency_groups={PROBE_GROUP: 1})(NodeRuntime)
        assert spec.ray_node is not None
        return self._remote.options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=spec.num_cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(spec.ray_node, soft=False),
            max_concurrency=max_concurrency(spec),
            max_restarts=-1,
        ).remote(spec)

    async def remove(self, spec: NodeSpec) -> None:
        name = node_actor_name(spec.fleet, spec)
        await asyncio.wait_for(asyncio.to_thread(self._remove, name), self.timeout_s)

    def _remove(self, name: str) -> None:
        """Kill the actor and wait until its name is free (a new one may take it)."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return
            ray.kill(actor, no_restart=True)
            time.sleep(GONE_POLL_S)
