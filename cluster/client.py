"""FleetClient: the Python entry point to a fleet (services, dashboards, scripts)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle

from actors.node import NodeStatus, Reply
from cluster.deploy import deploy_nodes, start_local_ray, teardown
from edgefleet.config import FleetConfig, load_config
from edgefleet.errors import ModelNotFound, NodeLost, Rejected
from edgefleet.request import InferRequest, new_request_id, resolve_priority

Progress = Callable[[str], None]
CONTROL_TIMEOUT_S = 30.0
SWITCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class FleetStatus:
    """A snapshot of every node; ``totals`` adds their counters up."""

    fleet: str
    nodes: tuple[NodeStatus, ...]

    @property
    def totals(self) -> dict[str, int]:
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
    Requests go to a node that serves the model and spill to the next one when a
    node refuses; a request every node refuses raises :class:`Rejected`.
    """

    def __init__(
        self,
        config: FleetConfig,
        nodes: Mapping[str, ActorHandle],
        *,
        owns_nodes: bool = False,
        owns_ray: bool = False,
    ) -> None:
        self.config = config
        self._nodes = dict(nodes)
        self._owns_nodes = owns_nodes
        self._owns_ray = owns_ray
        self._serving: dict[str, list[str]] = {}
        for spec in config.node_specs():
            for model in spec.models:
                self._serving.setdefault(model, []).append(spec.name)
        self._turn = itertools.count()

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
        missing = [f"{m}: {c.path}" for m, c in cfg.models.items() if not c.path.is_file()]
        if missing:
            raise ModelNotFound(
                "model files missing: " + "; ".join(missing) + ". Generate the built-in "
                "test models with `edgefleet models make DIR`."
            )
        owns_ray = not ray.is_initialized()
        if owns_ray:
            if progress:
                progress("starting an embedded Ray cluster on 127.0.0.1")
            start_local_ray(cfg)
        try:
            nodes = deploy_nodes(cfg, progress)
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        return cls(cfg, nodes, owns_nodes=True, owns_ray=owns_ray)

    def close(self) -> None:
        """Tear down what this client started (nodes, and Ray if it started it)."""
        if self._owns_nodes and self._nodes:
            teardown(self._nodes)
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
        """Like :meth:`infer`, but returns the node's :class:`Reply` (outputs or error,
        node, queue and service time, batch size) without raising."""
        request, candidates = self._prepare(model, inputs, **kw)
        reply: Reply | None = None
        for node in candidates:
            (reply,) = _get([self._nodes[node].infer.remote(request)], None, "infer")
            if not isinstance(reply.error, Rejected):
                return reply
        assert reply is not None
        return reply

    def submit(self, model: str, inputs: Mapping[str, np.ndarray], **kw: Any) -> ray.ObjectRef:
        """Send one request without waiting; returns a Ray reference to its :class:`Reply`.

        For pipelining many requests from one process (``ray.wait`` / ``ray.get`` on the
        references). No spill: the request goes to one node, which may refuse it.
        """
        request, candidates = self._prepare(model, inputs, **kw)
        return self._nodes[candidates[0]].infer.remote(request)

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
        request, candidates = self._prepare(
            model, inputs, priority=priority, deadline_s=deadline_s, key=key, request_id=request_id
        )
        reply: Reply | None = None
        for node in candidates:
            reply = await self._nodes[node].infer.remote(request)
            if not isinstance(reply.error, Rejected):
                break
        assert reply is not None
        return reply.unwrap()

    def _prepare(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> tuple[InferRequest, list[str]]:
        nodes = [n for n in self._serving.get(model, []) if n in self._nodes]
        if not nodes:
            known = ", ".join(sorted(self._serving)) or "none"
            raise ModelNotFound(f"no node serves model {model!r}; the fleet serves: {known}")
        start = next(self._turn) % len(nodes)
        request = InferRequest(
            model=model,
            inputs=inputs,
            priority=resolve_priority(priority, self.config.priorities),
            id=request_id or new_request_id(),
            deadline_unix=InferRequest.deadline_from_timeout(deadline_s),
            key=key,
        )
        return request, nodes[start:] + nodes[:start]

    # -------------------------------------------------------------------- control

    def status(self, timeout_s: float = CONTROL_TIMEOUT_S) -> FleetStatus:
        names = list(self._nodes)
        snaps = _get([self._nodes[n].status.remote() for n in names], timeout_s, "status")
        return FleetStatus(self.config.fleet.name, tuple(snaps))

    def cancel(self, request_id: str, timeout_s: float = CONTROL_TIMEOUT_S) -> bool:
        """Cancel a request wherever it is queued or running; True if a node had it."""
        refs = [h.cancel.remote(request_id) for h in self._nodes.values()]
        return any(_get(refs, timeout_s, "cancel"))

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
