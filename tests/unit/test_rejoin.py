"""`edgefleet join` decides on a fake clock: the backoff between attempts, when it starts
over, when it gives up (cluster/rejoin.py), and the loop that runs the attempts
(cluster/device.py's ``supervise``) over a fake launcher whose attempts end when told."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cluster.device import DEVICE_LABEL, Exit, JoinSpec, Tail, supervise
from cluster.rejoin import Phase, Rejoin, RejoinPolicy
from edgefleet.clock import FakeClock


class Draws:
    """A random generator whose draws are scripted (``random()`` only)."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0) if self.values else 0.0


def rejoin(policy: RejoinPolicy, clock: FakeClock, *draws: float) -> Rejoin:
    return Rejoin(policy, clock, Draws(*draws))  # type: ignore[arg-type]


def run_for(r: Rejoin, clock: FakeClock, up_s: float):
    r.start()
    clock.advance(up_s)
    return r.ended()


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (RejoinPolicy(jitter=0), [1, 2, 4, 8, 16, 30, 30]),
        (RejoinPolicy(first_delay_s=0.5, max_delay_s=3, jitter=0), [0.5, 1, 2, 3, 3]),
        (RejoinPolicy(factor=3, max_delay_s=100, jitter=0), [1, 3, 9, 27, 81, 100]),
        (RejoinPolicy(factor=1, jitter=0), [1, 1, 1]),
    ],
)
def test_failed_attempts_in_a_row_wait_longer_up_to_the_cap(policy, expected):
    clock = FakeClock()
    r = rejoin(policy, clock)
    delays = []
    for _ in expected:
        after = run_for(r, clock, 0.5)
        delays.append(after.delay_s)
        clock.advance(after.delay_s)
    assert delays == expected
    assert after.failures == len(expected) and after.up_s == 0.5


def test_jitter_takes_up_to_its_share_off_each_wait():
    clock = FakeClock()
    r = rejoin(RejoinPolicy(jitter=0.5), clock, 0.0, 1.0, 0.5, 0.999)
    delays = [run_for(r, clock, 1).delay_s for _ in range(4)]
    assert delays == pytest.approx([1.0, 1.0, 3.0, 4.004])


def test_with_jitter_at_most_half_no_wait_is_shorter_than_the_one_before_short_of_the_cap():
    import random

    clock = FakeClock()
    r = Rejoin(RejoinPolicy(jitter=0.5, max_delay_s=1000), clock, random.Random(7))
    delays = [run_for(r, clock, 0.1).delay_s or 0 for _ in range(10)]
    assert delays == sorted(delays) and delays[-1] <= 512


def test_an_attempt_that_stayed_up_starts_the_backoff_over():
    clock = FakeClock()
    r = rejoin(RejoinPolicy(jitter=0, steady_s=60, max_attempts=3), clock)
    assert [run_for(r, clock, 5).delay_s for _ in range(2)] == [1, 2]
    after = run_for(r, clock, 60)  # up a minute, then dropped out
    assert (after.failures, after.delay_s, after.attempt) == (0, 1, 3)
    assert [run_for(r, clock, 59.9).delay_s for _ in range(2)] == [1, 2]
    assert not after.gave_up and r.phase is Phase.WAITING


def test_it_gives_up_after_max_attempts_failed_in_a_row():
    clock = FakeClock()
    r = rejoin(RejoinPolicy(max_attempts=3, steady_s=10), clock)
    assert [run_for(r, clock, 1).gave_up for _ in range(3)] == [False, False, True]
    assert r.phase is Phase.GAVE_UP and r.attempt == 3
    with pytest.raises(RuntimeError, match="gave up"):
        r.start()


def test_one_attempt_means_no_second():
    clock = FakeClock()
    r = rejoin(RejoinPolicy(max_attempts=1), clock)
    after = run_for(r, clock, 1000)  # even one that stayed up
    assert after.gave_up is False and after.failures == 0
    assert run_for(r, clock, 1).gave_up


def test_starts_and_ends_alternate():
    r = rejoin(RejoinPolicy(), FakeClock())
    with pytest.raises(RuntimeError, match="no attempt is running"):
        r.ended()
    assert r.start() == 1
    with pytest.raises(RuntimeError, match="while running"):
        r.start()


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"first_delay_s": 0}, "0 < first_delay_s"),
        ({"first_delay_s": 5, "max_delay_s": 2}, "<= max_delay_s"),
        ({"factor": 0.5}, "factor"),
        ({"jitter": 1}, "jitter"),
        ({"steady_s": 0}, "steady_s"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_a_policy_refuses_values_that_make_no_sense(kwargs, complaint):
    with pytest.raises(ValueError, match=complaint):
        RejoinPolicy(**kwargs)


# The loop, over a fake launcher.


class FakeStop:
    """A stop request on the fake clock: waiting advances the clock; set at ``at``."""

    def __init__(self, clock: FakeClock, at: float | None = None) -> None:
        self.clock, self.at = clock, at
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return self.at is not None and self.clock.now() >= self.at

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None and timeout > 0, "a wait without a bound, or a busy loop"
        self.waits.append(timeout)
        end = self.clock.now() + timeout
        if self.at is not None and self.at <= end:
            self.clock.set(max(self.clock.now(), self.at))
            return True
        self.clock.set(end)
        return False


@dataclass
class FakeAttempt:
    """Ends (``exit``) ``up_s`` after it started, or never (``up_s`` None)."""

    clock: FakeClock
    up_s: float | None
    exit: Exit
    pid: int | None = 100
    processes: int = 3
    started_at: float = 0.0
    stopped: list[float] = field(default_factory=list)

    def poll(self) -> Exit | None:
        if self.up_s is None or self.clock.now() < self.started_at + self.up_s:
            return None
        return self.exit

    def stop(self) -> int:
        self.stopped.append(self.clock.now())
        return 0 if self.poll() is not None else self.processes


class FakeLauncher:
    """Hands out scripted attempts in order, noting when each started."""

    def __init__(self, clock: FakeClock, *attempts: FakeAttempt) -> None:
        self.clock, self.attempts = clock, list(attempts)
        self.started: list[FakeAttempt] = []

    def __call__(self) -> FakeAttempt:
        attempt = self.attempts.pop(0)
        attempt.started_at = self.clock.now()
        self.started.append(attempt)
        return attempt


def ended(clock: FakeClock, up_s: float | None, status: int | None = 1, why: str = "", **kw):
    return FakeAttempt(clock, up_s, Exit(status, why), **kw)


def run_loop(launcher, policy, clock, stop):
    notes: list[str] = []
    warnings: list[str] = []
    code = supervise(
        launcher,
        Rejoin(policy, clock, Draws()),  # type: ignore[arg-type]
        stop,
        joining="head:6379 as device cam-7",
        note=notes.append,
        warn=warnings.append,
    )
    return code, notes, warnings


def test_the_loop_restarts_what_exits_after_the_backoff_and_stops_on_request():
    clock = FakeClock()
    launcher = FakeLauncher(
        clock,
        ended(clock, 0.0, pid=None, status=None, why="no Ray head answers at head:6379"),
        ended(clock, 2.0, why="AuthenticationError: token is missing or incorrect"),
        ended(clock, 3600.0, status=-9, why="raylet [exit code=-9]"),
        ended(clock, None, pid=104),  # runs until the stop
    )
    stop = FakeStop(clock, at=3600 + 2 + 1 + 2 + 1 + 100)
    code, notes, warnings = run_loop(launcher, RejoinPolicy(jitter=0), clock, stop)

    assert code == 0
    assert [a.started_at for a in launcher.started] == [0, 1, 1 + 2 + 2, 3600 + 2 + 1 + 2 + 1]
    assert warnings == [
        "attempt 1: error: no Ray head answers at head:6379; next attempt in 1.0 s",
        "attempt 2: ray start exited with status 1: AuthenticationError: token is missing or "
        "incorrect; up 2.0 s, next attempt in 2.0 s",
        "attempt 3: ray start was killed by SIGKILL: raylet [exit code=-9]; up 60 min, long "
        "enough that the backoff starts over, next attempt in 1.0 s",
    ]
    assert notes == [
        "attempt 2: joining head:6379 as device cam-7 (ray start pid 100)",
        "attempt 3: joining head:6379 as device cam-7 (ray start pid 100)",
        "attempt 4: joining head:6379 as device cam-7 (ray start pid 104)",
        "attempt 4: stopped the 3 processes it started; exiting",
    ]
    assert launcher.started[-1].stopped == [stop.at]  # at once, not a poll later
    assert all(a.stopped for a in launcher.started)  # each attempt's leftovers too
    assert max(stop.waits) <= 2.0 and min(stop.waits) > 0


def test_the_loop_gives_up_after_max_attempts_and_says_so():
    clock = FakeClock()
    attempts = [ended(clock, 0.0, status=None, pid=None, why="no Ray head answers") for _ in "abc"]
    launcher = FakeLauncher(clock, *attempts)
    code, notes, warnings = run_loop(
        launcher, RejoinPolicy(jitter=0, max_attempts=3), clock, FakeStop(clock)
    )
    assert code == 1 and notes == [] and len(launcher.started) == 3
    assert warnings[-1] == (
        "attempt 3: error: no Ray head answers; giving up after 3 failed attempts in a row"
    )
    assert clock.now() == 1 + 2  # waited between attempts, not after the last


def test_a_stop_while_waiting_to_join_again_starts_nothing_more():
    clock = FakeClock()
    launcher = FakeLauncher(clock, ended(clock, 5.0), ended(clock, 5.0))
    code, notes, _ = run_loop(launcher, RejoinPolicy(jitter=0), clock, FakeStop(clock, at=5.5))
    assert code == 0 and len(launcher.started) == 1
    assert notes[-1] == "stopped while waiting to join again; exiting"
    assert clock.now() == 5.5


def test_a_stop_before_anything_started_starts_nothing():
    clock = FakeClock()
    launcher = FakeLauncher(clock)
    assert run_loop(launcher, RejoinPolicy(), clock, FakeStop(clock, at=0))[0] == 0


# What `ray start` is asked for, and what it said.


def test_the_command_passes_labels_resources_and_settings_through():
    spec = JoinSpec(
        "head:6379",
        {"zone": "dock", DEVICE_LABEL: "cam-7"},
        resources={"cam-7": 1.0},
        num_cpus=2,
        temp_dir="/var/tmp/ray",
    )
    assert spec.command("ray") == [
        "ray",
        "start",
        "--address=head:6379",
        "--block",
        "--labels=zone=dock,edgefleet.io/device=cam-7",
        '--resources={"cam-7": 1.0}',
        "--num-cpus=2",
        "--temp-dir=/var/tmp/ray",
        "--disable-usage-stats",
        "--log-color=false",
    ]
    assert spec.device == "cam-7"
    env = spec.environment({"PATH": "/bin", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert env == {
        "PATH": "/bin",
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    }
    no_auth = JoinSpec("h:1", {}, token_auth=False, node_ip="10.0.0.7")
    assert no_auth.environment({})["RAY_AUTH_MODE"] == "disabled"
    assert "--node-ip-address=10.0.0.7" in no_auth.command("ray")


@pytest.mark.parametrize(
    ("lines", "why"),
    [
        (
            [
                "2026-12-01 19:59:06,410\tERR scripts.py:1307 -- Some Ray subprocesses exited\n",
                "2026-12-01 19:59:06,410\tERR scripts.py:87 -- raylet [exit code=-9]\n",
                "2026-12-01 19:59:06,422\tERR scripts.py:115 -- ----- BEGIN raylet.out tail "
                "(exit code(s)=-9 (signal 9)) -----\n",
                "[2026-12-01 19:54:17,604 I 17811 17811] (raylet) stats.h:176: shut down.\n",
                "2026-12-01 19:59:06,442\tERR scripts.py:128 -- ----- END raylet.out tail "
                "(exit code(s)=-9 (signal 9)) -----\n",
                "2026-12-01 19:59:06,443\tERR scripts.py:1315 -- Remaining processes will be "
                "killed.\n",
            ],
            "raylet [exit code=-9]",
        ),
        (
            [
                "Traceback (most recent call last):\n",
                '  File "node.py", line 996, in _init_gcs_client\n',
                "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken\n",
                "\n",
            ],
            "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken",
        ),
        (["\x1b[31mred\x1b[39m\n"], "red"),
        ([], ""),
        (["x" * 400], "x" * 297 + "..."),
    ],
)
def test_why_ray_start_ended_is_one_line_of_what_it_said(lines, why):
    tail = Tail()
    for line in lines:
        tail.add(line)
    assert tail.reason() == why
