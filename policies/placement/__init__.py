"""Placement of requests on nodes: filters, scorers, pickers and named policies."""

from policies.placement.base import NodeView, Placement, PlacementRequest
from policies.placement.filters import ShedBelowPriority
from policies.placement.registry import PLACEMENT_POLICIES, PlacementParams, make_placement

__all__ = [
    "PLACEMENT_POLICIES",
    "NodeView",
    "Placement",
    "PlacementParams",
    "PlacementRequest",
    "ShedBelowPriority",
    "make_placement",
]
