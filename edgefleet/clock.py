"""Injected time. Scheduling code asks a clock for ``now()``; tests use :class:`FakeClock`."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class MonotonicClock:
    """The real clock (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to, so scheduling tests are exact."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        return self._now

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError("a clock cannot go backwards")
        self._now = t
