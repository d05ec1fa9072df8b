"""The engine time per row assumed for a model before any of its calls was timed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UntimedRowCost:
    """Engine seconds per row assumed while nothing better is known.

    ``node_s``: a node's scheduler, for a model it has not run yet: the length it
    expects of a call (the running call's time left, preemption) and the retry-after
    it hints to a refused caller. ``caller_s``: a caller pricing the work on a node that
    has reported the engine time of none of its models (placement and the retry-after
    of a shed request); a node that reported some models prices the others at their
    mean (see :func:`policies.placement.row_cost`).
    """

    node_s: float = 0.01
    caller_s: float = 0.005


UNTIMED_ROW_COST = UntimedRowCost()
