"""Names of a fleet's actors in Ray (one namespace for every fleet)."""

from __future__ import annotations

NAMESPACE = "edgefleet"
# The node actor's concurrency group for probes (NodeRuntime.probe): its own thread, so
# that a node whose event loop is flooded with calls still answers whether it lives.
PROBE_GROUP = "probe"


def actor_name(fleet: str, node: str) -> str:
    return f"{fleet}/node/{node}"


def router_name(fleet: str) -> str:
    return f"{fleet}/router"
