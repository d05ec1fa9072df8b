"""The one place that talks to node actors through Ray: requests for the dispatcher
(futures and a token iterator), control calls for the router (awaitables)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
from ray.actor import ActorHandle

from cluster.dispatch import NodeGone, NodeUnavailable
from cluster.names import PROBE_GROUP
from edgefleet.messages import GenerationResult, NodeStatus, Reply, TokenChunk
from edgefleet.request import GenerateRequest, InferRequest


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

    def _gone(self, exc: Exception) -> NodeGone:
        if isinstance(exc, ray.exceptions.ActorUnavailableError):
            return NodeUnavailable(str(exc))  # restarting or out of reach: ask again
        if isinstance(exc, ray.exceptions.ActorDiedError):
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
        if isinstance(result, ray.exceptions.RayActorError):
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
                except ray.exceptions.RayActorError as exc:
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
        except ray.exceptions.RayActorError as exc:
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
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, NodeGone):
            return None
        return answer

    def forget(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            self._handle().cancel.remote(request_id)  # not waited for: it may never answer

    # ---------------------------------------------------------- control (router)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle(), method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise self._gone(exc) from None

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return await self._call("set_lifecycle", state)

    async def status(self) -> NodeStatus:
        return await self._call("status")

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
        except ray.exceptions.RayActorError as exc:
            raise self._gone(exc) from None
        return True

    async def restart(self) -> None:
        """Kill the node's process; Ray starts the actor again in place (it is created
        with ``max_restarts=-1``), and the router brings it back into service."""
        ray.kill(self._handle(), no_restart=False)
