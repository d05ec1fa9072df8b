"""FleetClient: the Python entry point to a fleet (services, dashboards, scripts)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle

from actors.node import NodeStatus, Reply
from cluster.deploy import (
    connect_ray,
    deploy_nodes,
    deploy_router,
    find_fleet,
    node_handles,
    router_name,
    start_local_ray,
    teardown,
)
from edgefleet.config import FleetConfig, load_config
from edgefleet.errors import ModelNotFound, NodeLost
from edgefleet.request import InferRequest, new_request_id, resolve_priority

Progress = Callable[[str], None]
CONTROL_TIMEOUT_S = 30.0
LARGE_INPUT_BYTES = 1024 * 1024
ROUTER_RETRIES = 3
ROUTER_RETRY_S = 1.0
SWITCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class FleetStatus:
    """A snapshot of every node, which are healthy, and the router's counters
    (received, completed, spilled, replaced, shed, nodes_lost, ...)."""

    fleet: str
    nodes: tuple[NodeStatus, ...]
    healthy: dict[str, bool] = field(default_factory=dict)
    router: dict[str, int] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, int]:
        """Node counters added up over the fleet."""
        out: dict[str, int] = {}
        for node in self.nodes:
            for k, v in node.counters.items():
                out[k] = out.get(k, 0) + v
        return out

    def node(self, name: str) -> NodeStatus:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


class FleetClient:
    """Send inference to a fleet and watch it.

    Use :meth:`local` to run a fleet inside an embedded Ray cluster on loopback.
    Requests go through the fleet's router, which places each on the node where it
    would finish soonest at its priority and spills to the next when a node refuses;
    a request every node refuses raises :class:`Rejected` with a retry-after hint.
    """

    def __init__(
        self,
        config: FleetConfig,
        router: ActorHandle,
        nodes: Mapping[str, ActorHandle],
        *,
        owns_fleet: bool = False,
        owns_ray: bool = False,
    ) -> None:
        self.config = config
        self._router = router
        self._nodes = dict(nodes)
        self._owns_fleet = owns_fleet
        self._owns_ray = owns_ray
        self._served = {m for spec in config.node_specs() for m in spec.models}

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def local(
        cls, config: str | Path | FleetConfig, *, progress: Progress | None = None
    ) -> FleetClient:
        """Deploy ``config``'s nodes on an embedded Ray cluster bound to loopback.

        Reuses the Ray instance this process is already connected to, if any. Use it
        as a context manager, or call :meth:`close`, to tear the fleet down.
        """
        cfg = config if isinstance(config, FleetConfig) else load_config(config)
        cfg.require_models()
        owns_ray = not ray.is_initialized()
        if owns_ray:
            if progress:
                progress("starting an embedded Ray cluster on 127.0.0.1")
            start_local_ray(cfg)
        nodes: dict[str, ActorHandle] = {}
        try:
            nodes = deploy_nodes(cfg, progress)
            router = deploy_router(cfg)
        except BaseException:
            teardown(nodes)
            if owns_ray:
                ray.shutdown()
            raise
        if progress:
            progress(f"router {router_name(cfg.fleet.name)} ready")
        return cls(cfg, router, nodes, owns_fleet=True, owns_ray=owns_ray)

    @classmethod
    def connect(cls, address: str = "auto", fleet: str = "edgefleet") -> FleetClient:
        """Attach to a fleet running on a Ray cluster (e.g. from a dashboard process).

        ``address`` is a Ray address; ``auto`` finds the head ``edgefleet up --detach``
        started for ``fleet``, else ``RAY_ADDRESS`` or the cluster on this machine.
        Closing this client leaves the fleet running.
        """
        if not ray.is_initialized():
            connect_ray(address, fleet)
        router, config = find_fleet(fleet)
        return cls(config, router, node_handles(config))

    def close(self) -> None:
        """Tear down what this client started (nodes, and Ray if it started it)."""
        if self._owns_fleet and self._nodes:
            teardown(self._nodes, self._router)
            self._nodes = {}
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inference

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one inference and return its outputs, or raise a typed EdgeFleetError."""
        return self.infer_reply(
            model, inputs, priority=priority, deadline_s=deadline_s, key=key, request_id=request_id
        ).unwrap()

    def infer_reply(self, model: str, inputs: Mapping[str, np.ndarray], **kw: Any) -> Reply:
        """Like :meth:`infer`, but returns the :class:`Reply` (outputs or error, node,
        queue and service time, batch size) without raising."""
        if kw.get("request_id") is None:  # one id for every retry of this request
            kw["request_id"] = new_request_id()
        for attempt in range(ROUTER_RETRIES + 1):
            try:
                (reply,) = _get([self.submit(model, inputs, **kw)], None, "infer")
                return reply
            except NodeLost:
                # The router died; Ray restarts it. The same id lets nodes answer a
                # request that already ran instead of running it twice.
                if attempt == ROUTER_RETRIES:
                    raise
                time.sleep(ROUTER_RETRY_S)
        raise AssertionError("unreachable")

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> ray.ObjectRef:
        """Send one request without waiting; returns a Ray reference to its :class:`Reply`.

        For pipelining many requests from one process (``ray.wait`` / ``ray.get`` on the
        references). Inputs larger than 1 MiB are put in Ray's object store once and
        travel to the chosen node by reference, not through the router.
        """
        if model not in self._served:
            known = ", ".join(sorted(self._served)) or "none"
            raise ModelNotFound(f"no node serves model {model!r}; the fleet serves: {known}")
        request = InferRequest(
            model=model,
            inputs=inputs,
            priority=resolve_priority(priority, self.config.priorities),
            id=request_id or new_request_id(),
            deadline_unix=InferRequest.deadline_from_timeout(deadline_s),
            key=key,
        )
        if sum(getattr(v, "nbytes", 0) for v in inputs.values()) > LARGE_INPUT_BYTES:
            ref = ray.put(dict(inputs))
            return self._router.infer.remote(replace(request, inputs={}), [ref])
        return self._router.infer.remote(request)

    async def infer_async(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Awaitable :meth:`infer`, for asyncio services."""
        reply: Reply = await self.submit(
            model, inputs, priority=priority, deadline_s=deadline_s, key=key, request_id=request_id
        )
        return reply.unwrap()

    # -------------------------------------------------------------------- control

    def status(self, timeout_s: float = CONTROL_TIMEOUT_S) -> FleetStatus:
        """Fresh reports from every reachable node, with the router's view."""
        (rs,) = _get([self._router.status.remote()], timeout_s, "status")
        return FleetStatus(rs.fleet, rs.nodes, rs.healthy, rs.counters)

    def cancel(self, request_id: str, timeout_s: float = CONTROL_TIMEOUT_S) -> bool:
        """Cancel a request wherever it is queued or running; True if a node had it."""
        (found,) = _get([self._router.cancel.remote(request_id)], timeout_s, "cancel")
        return bool(found)

    def switch_model(
        self, node: str, model: str, timeout_s: float = SWITCH_TIMEOUT_S
    ) -> NodeStatus:
        """Make ``model`` resident on ``node`` (the current call finishes first)."""
        (status,) = _get([self._node(node).switch_model.remote(model)], timeout_s, "switch")
        return status

    def drain(self, node: str, timeout_s: float | None = None) -> NodeStatus:
        """Stop ``node`` taking new work and wait until its queue is empty."""
        (status,) = _get([self._node(node).drain.remote()], timeout_s, "drain")
        return status

    def _node(self, name: str) -> ActorHandle:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r}; nodes: {', '.join(self._nodes)}") from None


def _get(refs: list[ray.ObjectRef], timeout_s: float | None, what: str) -> list[Any]:
    """``ray.get`` bounded in time; a node that died or does not answer is NodeLost."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise NodeLost(f"{what}: a node did not answer within {timeout_s:.0f} s") from None
    except ray.exceptions.RayActorError as exc:
        raise NodeLost(f"{what}: a node died: {exc}") from None
