"""Starvation bounds: when queued lower-priority work runs ahead of higher work.

Strict priority starves a class for as long as higher work keeps coming. Per priority
class the configuration may give a minimum share of engine time and a maximum wait. A
class below its share with work queued, or a queued request that has waited longer
than its class's maximum, is promoted: it leads the next engine call, ahead of higher
classes, except protected ones, which promoted work never delays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from edgefleet.priorities import DEFAULT_CLASSES, PRIORITIES, class_of
from policies.views import QueuedView


@dataclass(frozen=True)
class ClassBound:
    """What one priority class is guaranteed."""

    min_share: float = 0.0  # of recent engine time; 0: no share
    max_wait_s: float | None = None  # queued longer than this: promoted; None: never


@dataclass(frozen=True)
class StarvationParams:
    """``bounds`` and ``protected`` are keyed by class priority. A priority belongs to
    the class (of ``classes``) with the highest priority not above it."""

    bounds: Mapping[int, ClassBound] = field(default_factory=dict)
    protected: frozenset[int] = frozenset()
    classes: tuple[int, ...] = DEFAULT_CLASSES

    @property
    def enabled(self) -> bool:
        return bool(self.bounds)

    def class_of(self, priority: int) -> int:
        owner = class_of(priority, self.classes)
        return priority if owner is None else owner

    def is_protected(self, priority: int) -> bool:
        return self.class_of(priority) in self.protected

    def guaranteed(self) -> dict[int, int]:
        """Priority -> its class, for the priorities whose class has a bound."""
        return {p: c for p in PRIORITIES if (c := self.class_of(p)) in self.bounds}


# A request is promoted while its class's maximum wait is still this many engine calls
# away. Promotion happens at a call boundary, up to one call late; then one protected
# call may still delay it: queued ahead of it, or arriving and preempting it (which also
# loses the part of its call already run).
SPARE_CALLS = 3


def promote(
    lanes: Sequence[Sequence[QueuedView]],
    served_s: Mapping[int, float],
    now: float,
    params: StarvationParams,
    call_s: float = 0.0,
) -> str | None:
    """The queued request that should lead the next engine call instead of the head of
    the first lane, or None to keep the service order.

    ``lanes`` MUST be the queued requests of each non-empty lane, oldest first, lanes in
    service order (highest first). ``served_s`` is the engine seconds recently spent on
    each priority's rows; ``call_s`` how long one engine call is expected to take. A
    lane is overdue when, served one call after another from its head, one of its
    requests would start less than ``SPARE_CALLS`` calls before its class's
    ``max_wait_s``: the maximum then bounds the wait instead of merely starting the
    promotion. The head of the first overdue lane goes first; else the head of the
    first lane whose class is below its ``min_share``. Nothing below a queued protected
    request is promoted.
    """
    if not params.enabled or len(lanes) < 2:
        return None
    total = sum(served_s.values())
    share: dict[int, float] = {}
    for priority, seconds in served_s.items():
        owner = params.class_of(priority)
        share[owner] = share.get(owner, 0.0) + (seconds / total if total > 0 else 0.0)
    overdue: QueuedView | None = None
    starved: QueuedView | None = None
    for lane in lanes:
        head = lane[0]
        owner = params.class_of(head.priority)
        if owner in params.protected:
            break  # everything further down would delay protected work
        bound = params.bounds.get(owner)
        if bound is None:
            continue
        if overdue is None and bound.max_wait_s is not None:
            latest = now + SPARE_CALLS * call_s - bound.max_wait_s  # arrived by then: due
            if any(r.arrival <= latest + i * call_s for i, r in enumerate(lane)):
                overdue = head
        if starved is None and bound.min_share > 0 and share.get(owner, 0.0) < bound.min_share:
            starved = head
    chosen = overdue or starved
    return None if chosen is None or chosen is lanes[0][0] else chosen.id
