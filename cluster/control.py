"""How the router, and pool membership, talk to one node: a protocol (a Ray actor in
production, :class:`cluster.nodes.RayNode`; a fake in tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from edgefleet.artifacts import ModelArtifact
from edgefleet.config import ModelConfig, NodeSpec
from edgefleet.messages import NodeStatus


class NodeControl(Protocol):
    """How the router talks to one node (a Ray actor in production, a fake in tests)."""

    async def status(self) -> NodeStatus:
        """MUST raise NodeGone when the node died."""
        ...

    async def start(self) -> NodeStatus: ...

    async def cancel(self, request_id: str) -> bool: ...

    async def set_lifecycle(self, state: str) -> NodeStatus: ...

    async def set_version(
        self, model: str, config: ModelConfig, artifact: ModelArtifact, drain_s: float
    ) -> NodeStatus:
        """Serve another version of ``model`` (see ``NodeRuntime.set_version``)."""
        ...

    async def restart(self) -> None:
        """Kill the node's process so that Ray starts the node again in place."""
        ...

    async def alive(self, timeout_s: float) -> bool:
        """Whether the node's process answers at all within ``timeout_s``, however busy;
        MUST raise NodeGone when the node died."""
        ...


@dataclass
class NodeEntry:
    spec: NodeSpec
    handle: NodeControl
    healthy: bool = False
    report: NodeStatus | None = None
    reported_at: float = 0.0
    out_since: float | None = None  # unresponsive or stuck since (router's clock)
