"""Names of a fleet's actors in Ray (one namespace for every fleet)."""

from __future__ import annotations

from edgefleet.config import NodeSpec

NAMESPACE = "edgefleet"
RAY_NODE_CHARS = 16  # of the Ray node id in a pool member's actor name
# The node actor's concurrency group for probes (NodeRuntime.probe): its own thread, so
# that a node whose event loop is flooded with calls still answers whether it lives.
PROBE_GROUP = "probe"


def actor_name(fleet: str, node: str) -> str:
    return f"{fleet}/node/{node}"


def node_actor_name(fleet: str, spec: NodeSpec) -> str:
    """The actor of a node of ``nodes:`` is named after the node; a pool member's after
    the node and the Ray node it is pinned to (``cams/cam-7@3f2a...``), so a device
    that comes back as a new Ray node gets a new actor, and a restarted router finds
    the actor of each member by name."""
    if spec.ray_node is None:
        return actor_name(fleet, spec.name)
    return actor_name(fleet, f"{spec.name}@{spec.ray_node[:RAY_NODE_CHARS]}")


def node_actor_prefix(fleet: str) -> str:
    """Every node actor of ``fleet`` (those of pool members included) starts with this."""
    return actor_name(fleet, "")


def router_name(fleet: str) -> str:
    return f"{fleet}/router"
