"""Placement of requests on nodes: filters, scorers, pickers and named policies."""

from policies.placement.base import NodeView, Placement, PlacementRequest, drain, row_cost
from policies.placement.filters import ShedBelowPriority
from policies.placement.registry import (
    PICKERS,
    POLICIES,
    SCORERS,
    PlacementParams,
    make_placement,
    placement_policies,
)

__all__ = [
    "PICKERS",
    "POLICIES",
    "SCORERS",
    "NodeView",
    "Placement",
    "PlacementParams",
    "PlacementRequest",
    "ShedBelowPriority",
    "drain",
    "make_placement",
    "placement_policies",
    "row_cost",
]
