"""Preemption of a running call by a much more urgent arrival."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionParams:
    enabled: bool = True
    min_priority_gap: int = 5


def should_preempt(running_rank: int, arrival_rank: int, params: PreemptionParams) -> bool:
    """Abort the running call only when the arrival outranks it by at least the gap.

    The gap keeps near-equal work from thrashing: aborting wastes the engine time
    already spent, which only pays when the arrival is much more urgent.
    """
    return params.enabled and arrival_rank - running_rank >= params.min_priority_gap
