"""Names of a fleet's actors in Ray (one namespace for every fleet)."""

from __future__ import annotations

NAMESPACE = "edgefleet"


def actor_name(fleet: str, node: str) -> str:
    return f"{fleet}/node/{node}"


def router_name(fleet: str) -> str:
    return f"{fleet}/router"
