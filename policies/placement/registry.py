"""Placement policies by the names used in YAML (``router.placement.policy``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from policies.placement.base import Filter, Placement, Scorer
from policies.placement.filters import Healthy, ServesModel, ShedBelowPriority
from policies.placement.pickers import Best, PowerOfTwo, RoundRobin, Uniform
from policies.placement.scorers import ExpectedCompletion, ModelLoad, SessionAffinity


class PlacementParams(BaseModel):
    """Parameters every placement policy accepts (checked when the YAML loads)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load_weight: float = Field(1.0, ge=0, description="weight of the model-load cost")
    affinity_penalty_s: float = Field(
        0.5, ge=0, description="cost of sending a session away from the node holding it"
    )
    shed: dict[int, float] = Field(
        default_factory=lambda: {3: 0.75, 0: 0.5},
        description="priority -> largest queue occupancy work at or below it may fill",
    )


def _base_filters(p: PlacementParams) -> tuple[Filter, ...]:
    return (ServesModel(), Healthy(), ShedBelowPriority(p.shed))


def _scorers(p: PlacementParams) -> tuple[tuple[Scorer, float], ...]:
    return (
        (ExpectedCompletion(), 1.0),
        (ModelLoad(), p.load_weight),
        (SessionAffinity(p.affinity_penalty_s), 1.0),
    )


PLACEMENT_POLICIES: Mapping[str, Callable[[PlacementParams], Placement]] = {
    "expected_completion": lambda p: Placement(_base_filters(p), _scorers(p), Best()),
    "power_of_two": lambda p: Placement(_base_filters(p), _scorers(p), PowerOfTwo()),
    "round_robin": lambda p: Placement(_base_filters(p), (), RoundRobin()),
    "random": lambda p: Placement(_base_filters(p), (), Uniform()),
}


def make_placement(name: str, params: PlacementParams | None = None) -> Placement:
    try:
        factory = PLACEMENT_POLICIES[name]
    except KeyError:
        known = ", ".join(PLACEMENT_POLICIES)
        raise ValueError(f"unknown placement policy {name!r}; known: {known}") from None
    return factory(params or PlacementParams())
