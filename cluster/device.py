"""The device side of a fleet: ``edgefleet join`` runs ``ray start --address ... --block``
on a device and starts it again whenever it exits, paced by :mod:`cluster.rejoin`.

:func:`supervise` is the loop; :class:`RayStart` starts one attempt's ``ray start`` and
stops exactly the processes it started (by process tree: this process adopts those
whose parent dies, so none escapes it), and nothing else on the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import psutil

from cluster.head import reachable
from cluster.rejoin import Next, Rejoin

DEVICE_LABEL = "edgefleet.io/device"  # the device's name, for the fleet's label selectors
REASON_CHARS = 300  # of the line that says why an attempt ended
POLL_S = 0.5  # how often the loop looks at `ray start` and at a stop request


@dataclass(frozen=True)
class JoinSpec:
    """What ``ray start`` is asked for: the head's ``address`` (HOST:PORT), the node's
    ``labels`` (the device's name under :data:`DEVICE_LABEL` among them), its
    ``resources`` and ``num_cpus``, the ``node_ip`` it is reached at (None: Ray's choice,
    the address this machine reaches the head from), its ``temp_dir`` (None: Ray's) and
    whether the cluster uses token authentication."""

    address: str
    labels: Mapping[str, str]
    resources: Mapping[str, float] = field(default_factory=dict)
    num_cpus: int | None = None
    node_ip: str | None = None
    temp_dir: str | None = None
    token_auth: bool = True

    @property
    def device(self) -> str:
        return self.labels.get(DEVICE_LABEL, "")

    def command(self, ray_cli: str) -> list[str]:
        cmd = [ray_cli, "start", f"--address={self.address}", "--block"]
        cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in self.labels.items()))
        if self.resources:
            cmd.append(f"--resources={json.dumps(dict(self.resources))}")
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        if self.node_ip is not None:
            cmd.append(f"--node-ip-address={self.node_ip}")
        if self.temp_dir is not None:
            cmd.append(f"--temp-dir={self.temp_dir}")
        # No usage reports from devices; plain lines for a journal, not colour codes.
        return cmd + ["--disable-usage-stats", "--log-color=false"]

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the cluster's authentication mode (the token itself comes from
        ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and Ray's
        multi-machine mode on, which ``ray start --address`` needs: a process that pinned
        Ray to loopback (``cluster.deploy.pin_loopback``) turns it off."""
        auth = "token" if self.token_auth else "disabled"
        return dict(base, RAY_AUTH_MODE=auth, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")


@dataclass(frozen=True)
class Exit:
    """How an attempt ended: ``status``, that of ``ray start`` (negative: the signal that
    killed it; None: it never started), and ``reason``, one line saying why."""

    status: int | None
    reason: str

    def describe(self) -> str:
        if self.status is None:
            return f"error: {self.reason}"
        how = f"exited with status {self.status}"
        if self.status < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-self.status).name}"
        return f"ray start {how}" + (f": {self.reason}" if self.reason else "")


class Attempt(Protocol):
    """One attempt to join, as :func:`supervise` sees it."""

    pid: int | None  # of `ray start`; None when the attempt ended before it started one

    def poll(self) -> Exit | None:
        """How it ended, or None while it runs. MUST NOT block for long."""
        ...

    def stop(self) -> int:
        """Stop every process it started that still runs (``ray start`` in Ray's orderly
        way first, then whatever is left, forcibly); returns how many there were."""
        ...


class StopRequest(Protocol):
    """Set when the command is asked to stop (``threading.Event`` is one)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for it to be set; whether it is."""
        ...


def supervise(
    launch: Callable[[], Attempt],
    rejoin: Rejoin,
    stop: StopRequest,
    *,
    joining: str,
    note: Callable[[str], None],
    warn: Callable[[str], None],
) -> int:
    """Start an attempt (``launch``), watch it, and when it ends start another after the
    wait ``rejoin`` gives, until ``stop`` is set (returns 0, having stopped what the
    running attempt started) or ``rejoin`` gives up (returns 1). One line per start
    (``note``: "attempt 3: joining {joining} (ray start pid 1234)") and per end
    (``warn``: how it ended, for how long it ran, what comes next)."""
    while not stop.is_set():
        number = rejoin.start()
        attempt = launch()
        if attempt.pid is not None:
            note(f"attempt {number}: joining {joining} (ray start pid {attempt.pid})")
        ended = attempt.poll()
        while ended is None and not stop.wait(POLL_S):
            ended = attempt.poll()
        left = attempt.stop()
        if ended is None:
            note(f"attempt {number}: stopped the {left} processes it started; exiting")
            return 0
        after = rejoin.ended()
        leftovers = f" (stopped {left} processes it left)" if left else ""
        warn(f"attempt {number}: {ended.describe()}{leftovers}; {_what_next(after, attempt)}")
        if after.delay_s is None:
            return 1
        if stop.wait(after.delay_s):
            note("stopped while waiting to join again; exiting")
            return 0
    return 0


def _what_next(after: Next, attempt: Attempt) -> str:
    if after.delay_s is None:
        return f"giving up after {after.failures} failed attempts in a row"
    ran = f"up {_duration(after.up_s)}, " if attempt.pid is not None else ""
    if after.failures == 0:
        ran = f"{ran}long enough that the backoff starts over, "
    return f"{ran}next attempt in {after.delay_s:.1f} s"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    return f"{minutes} min" if minutes < 120 else f"{minutes // 60} h {minutes % 60} min"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+[A-Z]+ \S+ -- ")


class Tail:
    """What an attempt's ``ray start`` said last, to say why it ended: the process whose
    death stopped it when Ray names one ("raylet [exit code=-9]", before the tail of that
    process's log), else its last line (an error's, after a traceback); without colour
    codes and Ray's time and source prefix."""

    def __init__(self) -> None:
        self._last = ""
        self._died = ""
        self._lock = threading.Lock()  # fed by a thread per stream

    def add(self, line: str) -> None:
        line = _RAY_RECORD.sub("", _ANSI.sub("", line)).strip()
        if not line:
            return
        with self._lock:
            self._last = line
            if "[exit code=" in line and "-----" not in line:
                self._died = line

    def reason(self) -> str:
        with self._lock:
            line = self._died or self._last
        return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


def ray_target(address: str) -> str:
    """The address ``ray start --address`` really joins: Ray swaps a loopback host
    (127.0.0.1, localhost) for this machine's routable address."""
    from ray._common.network_utils import is_localhost, node_ip_address_from_perspective

    host, _, port = address.rpartition(":")
    return f"{node_ip_address_from_perspective(None)}:{port}" if is_localhost(host) else address


def unreachable(address: str) -> str | None:
    """Why ``ray start --address`` cannot reach a head at ``address``, in one line; None
    when something answers there."""
    target = ray_target(address)
    if reachable(target):
        return None
    if target != address and reachable(address):
        return (
            f"the head at {address} listens on loopback only, and `ray start` swaps a loopback "
            f"address for this machine's ({target}); give the head's address as a host name "
            "that resolves to 127.0.0.1 here"
        )
    return f"no Ray head answers at {address}" + (f" ({target})" if target != address else "")


def become_subreaper() -> bool:
    """Make this process adopt its descendants whose parent dies (Linux), so that what
    ``ray start`` started stays in this process's tree after a raylet dies; whether it
    could. ctypes, for one system call: no small library does only this."""
    if not sys.platform.startswith("linux"):
        return False
    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)) == 0


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


class NotStarted:
    """An attempt that ended before ``ray start`` ran (the head did not answer)."""

    pid: int | None = None

    def __init__(self, why: str) -> None:
        self._exit = Exit(None, why)

    def poll(self) -> Exit:
        return self._exit

    def stop(self) -> int:
        return 0


class RunningRayStart:
    """A ``ray start --block`` this process started, and the processes it starts."""

    def __init__(
        self, proc: subprocess.Popen[bytes], grace_s: float, out: IO[str], err: IO[str]
    ) -> None:
        self._proc = proc
        self.pid: int | None = proc.pid
        self._grace_s = grace_s
        self._seen: dict[int, psutil.Process] = {}
        self._tail = Tail()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, echo), daemon=True)
            for stream, echo in ((proc.stdout, out), (proc.stderr, err))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[bytes], echo: IO[str]) -> None:
        """Pass a stream of its output on, line by line, noting what it says last."""
        for raw in stream:
            line = raw.decode(errors="replace")
            self._tail.add(line)
            with contextlib.suppress(OSError, ValueError):
                echo.write(line)
                echo.flush()

    def _watch(self) -> list[psutil.Process]:
        """Note the processes of its tree (this process's descendants: the command starts
        nothing else) and reap those that died after their parent (adopted here)."""
        found = _descendants()
        self._seen.update((p.pid, p) for p in found)
        for p in found:
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if p.pid != self._proc.pid and p.ppid() == os.getpid() and not _alive(p):
                    os.waitpid(p.pid, os.WNOHANG)
        return found

    def poll(self) -> Exit | None:
        self._watch()
        status = self._proc.poll()
        if status is None:
            return None
        for reader in self._readers:  # its last lines (a pipe ends when its whole tree does)
            reader.join(timeout=1.0)
        return Exit(status, self._tail.reason())

    def stop(self) -> int:
        procs = {p.pid: p for p in [*self._seen.values(), *self._watch()] if _alive(p)}
        if self._proc.poll() is None:
            self._proc.terminate()  # Ray's own stop: the raylet, then the rest
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(self._grace_s)
        left = [p for p in [*procs.values(), *_descendants()] if _alive(p)]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=self._grace_s)  # reaps those that are children here
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(self._grace_s)
        return len(procs)


class RayStart:
    """Starts one attempt's ``ray start --block`` per call, after checking that the head
    answers. The command's only source of processes: it takes every descendant of this
    process for one of the attempt's."""

    def __init__(
        self,
        spec: JoinSpec,
        *,
        stop_grace_s: float = 10.0,
        environ: Mapping[str, str] | None = None,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
    ) -> None:
        self.spec = spec
        self._cmd = spec.command(str(Path(sys.executable).with_name("ray")))
        self._env = spec.environment(os.environ if environ is None else environ)
        self._grace_s = stop_grace_s
        self._out = out if out is not None else sys.stdout
        self._err = err if err is not None else sys.stderr
        become_subreaper()

    def __call__(self) -> Attempt:
        why = unreachable(self.spec.address)
        if why is not None:
            return NotStarted(why)
        proc = subprocess.Popen(
            self._cmd,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # passed on, and read for why it ends
            stderr=subprocess.PIPE,
            # Its own session: Ctrl-C in a terminal reaches this command only, which
            # stops Ray's processes in order.
            start_new_session=True,
        )
        return RunningRayStart(proc, self._grace_s, self._out, self._err)
