"""Ctrl-C for the commands that start or join a Ray: it ends them within a second or
two, even while Ray holds the main thread, and stops what they started."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


class StopAtOnce:
    """Within it, Ctrl-C stops the processes this command started and exits at once
    (status 130): for a step that must not be interrupted half-way, such as ``ray.init``
    starting a cluster (raised into, it leaves processes behind, or crashes)."""

    active = False

    def __enter__(self) -> None:
        StopAtOnce.active = True

    def __exit__(self, *exc: object) -> None:
        StopAtOnce.active = False


class AfterThis:
    """Within it, Ctrl-C waits for the step to end and is raised then: for a short step
    that must not be cut half-way, such as ``ray.init`` connecting to a cluster (raised
    into, it leaves this process to crash as it exits)."""

    active = False
    pending = False

    def __enter__(self) -> None:
        AfterThis.active, AfterThis.pending = True, False

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        AfterThis.active = False
        if AfterThis.pending and kind is None:
            raise KeyboardInterrupt


def exit_on_stuck_interrupt(grace_s: float = 1.0) -> None:
    """Make Ctrl-C end the command even while Ray holds the main thread in native code,
    where Python cannot raise KeyboardInterrupt (``ray.init`` waiting for the processes
    it started, say): an interrupt Python has not begun to handle after ``grace_s``
    (outside :class:`AfterThis`), or one within :class:`StopAtOnce`, stops the
    processes this command started and exits with status 130. Any other raises
    KeyboardInterrupt, as usual."""
    import signal
    import threading

    from cluster.head import stop_children

    handled = [0]

    def stop_now() -> None:  # at once: Ray's threads here may crash as its processes go
        stop_children(grace_s=0)
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    def on_interrupt(signum: int, frame: Any) -> None:
        if StopAtOnce.active:
            stop_now()
        handled[0] += 1
        if AfterThis.active:
            AfterThis.pending = True
            return
        raise KeyboardInterrupt

    def watch(wakeup: int) -> None:
        seen = 0
        while True:  # Python writes each signal's number here at once, whatever holds it
            seen += os.read(wakeup, 64).count(signal.SIGINT)
            deadline = time.monotonic() + grace_s
            while handled[0] < seen and (time.monotonic() < deadline or AfterThis.active):
                time.sleep(0.05)
            if handled[0] < seen:
                stop_now()

    wakeup, notify = os.pipe()
    os.set_blocking(notify, False)
    signal.signal(signal.SIGINT, on_interrupt)
    signal.set_wakeup_fd(notify, warn_on_full_buffer=False)
    threading.Thread(target=watch, args=(wakeup,), name="interrupt", daemon=True).start()
