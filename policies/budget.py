"""The token budget governor: how many tokens a generation may produce right now.

A node's lifecycle state ("foreground" or "background") is set by events, never by
timers. Per state and priority class the configuration gives a fraction of each
request's ``max_new_tokens``; a change applies to running generations at their next
token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from edgefleet.priorities import DEFAULT_CLASSES, MIN_PRIORITY, class_of

Lifecycle = Literal["foreground", "background"]
LIFECYCLE_STATES: tuple[Lifecycle, ...] = get_args(Lifecycle)


@dataclass(frozen=True)
class TokenBudgets:
    """``fractions[state][class_priority]``: the share of ``max_new_tokens`` that work of
    that class may use while the node is in ``state``. A priority belongs to the class
    (of ``classes``) with the highest priority not above it; classes and states not
    listed get 1.0."""

    fractions: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    classes: tuple[int, ...] = DEFAULT_CLASSES

    @classmethod
    def of_classes(
        cls, shares: Mapping[Any, Mapping[str, float]], priorities: Mapping[str, int]
    ) -> TokenBudgets:
        """Budgets from ``shares[state][class name]`` (as the YAML gives them)."""
        return cls(
            {
                state: {priorities[c]: share for c, share in by_class.items()}
                for state, by_class in shares.items()
            },
            classes=tuple(priorities.values()),
        )

    def fraction(self, state: str, priority: int) -> float:
        owner = class_of(priority, self.classes)
        return self.fractions.get(state, {}).get(MIN_PRIORITY if owner is None else owner, 1.0)


def token_limit(max_new_tokens: int, priority: int, state: str, budgets: TokenBudgets) -> int:
    """New tokens a generation of ``priority`` may produce in lifecycle ``state``."""
    fraction = budgets.fraction(state, priority)
    if fraction >= 1.0:
        return max_new_tokens
    return max(0, math.floor(fraction * max_new_tokens))
