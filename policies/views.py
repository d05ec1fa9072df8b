"""Read-only views that policies see. Policies never hold or mutate the queues themselves."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol


class QueuedView(Protocol):
    """What a policy may read of one queued request."""

    @property
    def id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival(self) -> float: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def group(self) -> Hashable: ...
    @property
    def isolate(self) -> bool: ...


@dataclass(frozen=True)
class ArrivalView:
    """Recent arrivals of one model at one priority: when the latest came, and the
    running estimate of the time between arrivals."""

    last: float
    gap: float
