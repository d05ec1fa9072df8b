"""Placement plugins by the names used in YAML (``router.placement``), and the named
policies: presets of scorers and a picker.

A pipeline is always the filters ``serves_model``, ``healthy`` and ``shed`` (with the
configured shedding limits), then the weighted scorers, then one picker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgefleet.priorities import DEFAULT_PRIORITIES
from policies.placement.base import Filter, Picker, Placement, Scorer
from policies.placement.filters import Healthy, ServesModel, ShedBelowPriority
from policies.placement.pickers import Best, NearBest, PowerOfTwo, RoundRobin, Uniform
from policies.placement.scorers import ExpectedCompletion, ModelLoad, SessionAffinity

SCORERS: Mapping[str, Callable[[PlacementParams], Scorer]] = {
    "expected_completion": lambda p: ExpectedCompletion(p.lower_share),
    "model_load": lambda p: ModelLoad(p.load_default_s),
    "session_affinity": lambda p: SessionAffinity(p.affinity_penalty_s),
}

PICKERS: Mapping[str, Callable[[PlacementParams], Picker]] = {
    "best": lambda p: Best(),
    "near_best": lambda p: NearBest(p.tie_s, p.tie_ratio, p.crowd_ratio),
    "power_of_two": lambda p: PowerOfTwo(),
    "round_robin": lambda p: RoundRobin(),
    "random": lambda p: Uniform(),
}

_LOAD_AWARE = {"expected_completion": 1.0, "model_load": 1.0, "session_affinity": 1.0}

# policy name -> (scorer weights, picker), as ``router.placement.policy`` names them
POLICIES: Mapping[str, tuple[Mapping[str, float], str]] = {
    "expected_completion": (_LOAD_AWARE, "near_best"),
    "power_of_two": (_LOAD_AWARE, "power_of_two"),
    "round_robin": ({}, "round_robin"),
    "random": ({}, "random"),
}
DEFAULT_POLICY = "expected_completion"


def placement_policies() -> tuple[str, ...]:
    """The names of the placement policies, as ``router.placement.policy`` (and
    ``FleetClient.with_placement(policy=...)``) takes them; the default first."""
    return tuple(POLICIES)


def _one_of(names: Iterable[str]) -> str:
    """``a, b or c``."""
    *first, last = names
    return f"{', '.join(first)} or {last}" if first else last


# Priority class -> the largest queue occupancy that work of that class or lower may
# fill on a node (``router.placement.shed``), unless the configuration says otherwise.
DEFAULT_SHED: Mapping[str, float] = {"background": 0.75, "offline": 0.5}


class PipelineParams(BaseModel):
    """A placement pipeline's plugins and their parameters, as YAML gives them
    (``router.placement``; checked when the YAML loads).

    ``policy`` is a preset of scorers and picker; ``scorers`` (name -> weight) and
    ``picker`` replace the preset's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(
        DEFAULT_POLICY,
        description=f"a preset of scorers and picker: {_one_of(placement_policies())}",
    )
    scorers: dict[str, float] | None = Field(
        None,
        description=f"scorer -> weight ({', '.join(SCORERS)}); default: the policy's",
    )
    picker: str | None = Field(
        None,
        description=f"{_one_of(PICKERS)}; default: the policy's "
        f"({DEFAULT_POLICY}: {POLICIES[DEFAULT_POLICY][1]})",
    )
    lower_share: float = Field(
        0.25,
        ge=0,
        le=1,
        description="expected_completion: share of lower-priority queued work counted "
        "(the delay a request adds to the work it overtakes)",
    )
    tie_s: float = Field(0.001, ge=0, description="near_best: nodes this close to the best tie")
    tie_ratio: float = Field(0.05, ge=0, description="near_best: ...or this share of the best")
    crowd_ratio: float = Field(
        0.3,
        ge=0,
        description="near_best: the share of the best added to the band when other callers "
        "made all the recent placements at the request's priority or above (in proportion "
        "to their share)",
    )
    affinity_penalty_s: float = Field(
        0.5, ge=0, description="session_affinity: cost of moving a session from its KV cache"
    )
    load_default_s: float = Field(
        1.0, ge=0, description="model_load: load time assumed before a node has measured it"
    )
    candidates: int = Field(
        16,
        ge=1,
        description="nodes weighed per request: every node serving the model when they are "
        "at most this many, else this many drawn at random (plus the nodes holding the "
        "request's session), so placing costs the same in a fleet of any size",
    )

    @model_validator(mode="after")
    def _known(self) -> PipelineParams:
        check_names(self.policy, self.scorers, self.picker)
        return self

    def resolved(self) -> tuple[dict[str, float], str]:
        """The scorer weights and the picker this pipeline uses."""
        preset_scorers, preset_picker = POLICIES[self.policy]
        scorers = dict(preset_scorers) if self.scorers is None else dict(self.scorers)
        return scorers, self.picker or preset_picker


class PlacementParams(PipelineParams):
    """The pipeline's parameters with shedding limits by integer priority."""

    shed: dict[int, float] = Field(
        default_factory=lambda: {DEFAULT_PRIORITIES[c]: f for c, f in DEFAULT_SHED.items()},
        description="priority -> largest queue occupancy work at or below it may fill",
    )


def check_names(policy: str, scorers: Mapping[str, float] | None, picker: str | None) -> None:
    """Raise ValueError naming the unknown plugin and the known ones."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; known: {', '.join(POLICIES)}")
    for name, weight in (scorers or {}).items():
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; known: {', '.join(SCORERS)}")
        if weight < 0:
            raise ValueError(f"scorer {name!r} has weight {weight}; allowed: >= 0")
    if picker is not None and picker not in PICKERS:
        raise ValueError(f"unknown picker {picker!r}; known: {', '.join(PICKERS)}")


def make_placement(params: PlacementParams | str | None = None) -> Placement:
    """The pipeline ``params`` describe (a policy name alone: that preset)."""
    if params is None or isinstance(params, str):
        params = PlacementParams(policy=params or DEFAULT_POLICY)
    scorers, picker = params.resolved()
    filters: tuple[Filter, ...] = (ServesModel(), Healthy(), ShedBelowPriority(params.shed))
    return Placement(
        filters,
        tuple((SCORERS[name](params), w) for name, w in scorers.items() if w > 0),
        PICKERS[picker](params),
    )
