"""When a device joins its fleet's Ray cluster again (``edgefleet join``): the delay
before each attempt, when the backoff starts over, when to give up.

Pure: no processes and no I/O; the clock and the random generator are injected, so a
test drives it with a fake clock and scripted draws. ``cluster/device.py`` runs the
attempts around it.

Not tenacity's ``Retrying``, though the project uses it for calls: that retries a call
until it succeeds, while here an attempt that succeeded (a device that served for
days) ends too, and must start the backoff over; and its jitter draws from the
``random`` module, which a test cannot script.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from edgefleet.clock import Clock


@dataclass(frozen=True)
class RejoinPolicy:
    """How a device paces its attempts to join.

    After ``n`` failed attempts in a row the next waits ``first_delay_s * factor**(n-1)``,
    at most ``max_delay_s``, less a random part of up to ``jitter`` of it (devices that
    lost the same head do not all come back at once; with ``jitter`` at most 1 - 1/factor
    no wait is shorter than the one before, short of the cap). An attempt that stayed up
    ``steady_s`` succeeded: the count starts over and the next waits ``first_delay_s``
    (with its jitter). ``max_attempts`` failed attempts in a row give up; None never does.
    """

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5
    steady_s: float = 60.0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(
                f"delays must be 0 < first_delay_s ({self.first_delay_s:g}) <= max_delay_s "
                f"({self.max_delay_s:g})"
            )
        if self.factor < 1:
            raise ValueError(f"factor must be at least 1, not {self.factor:g}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), not {self.jitter:g}")
        if self.steady_s <= 0:
            raise ValueError(f"steady_s must be positive, not {self.steady_s:g}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 (or None), not {self.max_attempts}")

    def base_delay_s(self, failures: int) -> float:
        """The wait before the next attempt after ``failures`` failed attempts in a row
        (0: after one that stayed up), before jitter."""
        return min(self.max_delay_s, self.first_delay_s * self.factor ** max(0, failures - 1))


class Phase(enum.Enum):
    WAITING = "waiting"  # for the next attempt (or the first)
    RUNNING = "running"  # an attempt started and has not ended
    GAVE_UP = "gave up"  # terminal: max_attempts failed attempts in a row


@dataclass(frozen=True)
class Next:
    """What follows an attempt that ended."""

    attempt: int  # the attempt that ended: 1, 2, ...
    up_s: float  # how long it ran
    failures: int  # failed attempts in a row, this one included; 0: it stayed up
    delay_s: float | None  # wait this long, then start the next attempt; None: give up

    @property
    def gave_up(self) -> bool:
        return self.delay_s is None


class Rejoin:
    """Attempts to join, one at a time: :meth:`start` when one begins, :meth:`ended` when
    it ends (however it ended); the answer says how long to wait before the next, or
    to give up. Callers MUST alternate the two, and MUST NOT start after giving up."""

    def __init__(
        self, policy: RejoinPolicy, clock: Clock, rng: random.Random | None = None
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.phase = Phase.WAITING
        self.attempt = 0
        self.failures = 0
        self._started_at = 0.0

    def start(self) -> int:
        """An attempt begins now; returns its number (1 for the first)."""
        if self.phase is not Phase.WAITING:
            raise RuntimeError(f"cannot start an attempt while {self.phase.value}")
        self.phase = Phase.RUNNING
        self.attempt += 1
        self._started_at = self._clock.now()
        return self.attempt

    def ended(self) -> Next:
        """The running attempt ended now: whether and when to try again."""
        if self.phase is not Phase.RUNNING:
            raise RuntimeError(f"no attempt is running ({self.phase.value})")
        policy = self.policy
        up_s = self._clock.now() - self._started_at
        self.failures = 0 if up_s >= policy.steady_s else self.failures + 1
        if policy.max_attempts is not None and self.failures >= policy.max_attempts:
            self.phase = Phase.GAVE_UP
            return Next(self.attempt, up_s, self.failures, None)
        self.phase = Phase.WAITING
        base = policy.base_delay_s(self.failures)
        delay_s = base * (1.0 - policy.jitter * self._rng.random())
        return Next(self.attempt, up_s, self.failures, delay_s)
