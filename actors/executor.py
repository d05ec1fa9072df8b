"""The node's engine thread: model loads and engine calls, one at a time, abortable.

The node's event loop never blocks: it hands every load and every call to the one
engine thread here and awaits it. ``abort`` stops the call in progress (an inference
call through ONNX Runtime's terminate flag, a generation at its next token boundary),
or, when it comes first, the call that is about to start. ``watch`` does the same to a
call that runs past its time limit, and tells when such a call does not stop.

Inference calls can run back to back (``chain``): after each call the engine thread
asks the node for the next one and starts it at once, so the engine does not idle
while the event loop turns around; the node settles the finished call on its loop
meanwhile, woken by a :class:`Waker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from actors.decoder import DecoderEngine, Generation
from actors.engine import Engine, RunAborted
from actors.models import ModelManager
from edgefleet.clock import Clock
from edgefleet.errors import EngineTimeout

if TYPE_CHECKING:
    from actors.scheduler import Plan

LoadHook = Callable[[str, float], None]  # (model, seconds) after each load
Outputs = list[dict[str, np.ndarray]]


@dataclass(eq=False)
class Call:
    """One inference call of a plan. Setting ``stop`` aborts it: before it starts (it
    then never runs) or while it runs, together with the engine's ``abort``."""

    plan: Plan
    stop: threading.Event = field(default_factory=threading.Event)
    ran_at: float | None = None  # when the engine started it (node clock); None: never ran
    handoff_s: float = 0.0  # from the engine being ready for it to its start (see _chain)
    abort_s: float = 0.0  # the last call aborted before it on this engine: abort to its end


# After each chained call, on the engine thread: (the call, its outputs or the exception
# it raised, its engine seconds) -> the call to start next, or None to stop.
Follow = Callable[[Call, "Outputs | Exception", float], "Call | None"]
# (model, rows) -> the seconds one engine call of that model and size may run
CallLimit = Callable[[str, int], float]


def _gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc's ``write`` called without releasing the GIL (ctypes.PyDLL), where there is one."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError, TypeError):  # no C library to call this way
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


_WRITE = _gil_holding_write() if os.name == "posix" else None


class Waker:
    """Runs ``callback`` on an event loop, asked from another thread (the engine thread).

    ``loop.call_soon_threadsafe`` wakes the loop through a socket send that lets go of
    the GIL: the loop thread, woken by that very send, takes it, and the engine thread
    then waits until the loop lets it go again before it can start its next call
    (0.2-0.5 ms per call measured on a busy 2-core machine: 10-20 % of a 1 ms model's
    engine time). Here the wake-up byte goes through libc's ``write`` with the GIL held,
    so the loop takes the GIL only once the engine thread is back in ONNX Runtime.
    Without such a ``write`` (not POSIX), once closed, and for a byte that could not be
    written (a full pipe, an error), it is ``call_soon_threadsafe``: a wake-up is never
    lost.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._lock = threading.Lock()  # a wake never writes to a closed (reused) descriptor
        self._fds: tuple[int, int] | None = None
        if _WRITE is not None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            loop.add_reader(read_fd, self._woken)
            self._fds = (read_fd, write_fd)

    def wake(self) -> None:
        """Run the callback on the loop soon; from any thread, MUST NOT block."""
        with self._lock:
            if self._fds is not None and _WRITE is not None and _WRITE(self._fds[1], b"w", 1) == 1:
                return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left
            self._loop.call_soon_threadsafe(self._callback)

    def _woken(self) -> None:
        assert self._fds is not None
        with contextlib.suppress(BlockingIOError):
            os.read(self._fds[0], 4096)
        self._callback()

    def close(self) -> None:
        """On the loop: give the descriptors back (later wakes use call_soon_threadsafe)
        and run the callback once more, for a wake-up that was still in the pipe."""
        with self._lock:
            fds, self._fds = self._fds, None
        if fds is not None:
            self._loop.remove_reader(fds[0])
            os.close(fds[0])
            os.close(fds[1])
            self._loop.call_soon(self._callback)


class EngineThread:
    """Runs a node's loads and engine calls on its single engine thread."""

    def __init__(self, name: str, models: ModelManager, clock: Clock, loaded: LoadHook) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{name}")
        self._models = models
        self._clock = clock
        self._loaded = loaded
        self._engine: Engine | None = None  # the engine running a call now
        self._stop: threading.Event | None = None  # set to abort the call in progress
        self.switching: str | None = None  # the model being loaded now
        self._loaded_at = -math.inf  # when the last load ended (node clock)
        self._abort_at: float | None = None  # when the call in progress was asked to abort
        self._aborted_s = 0.0  # the last aborted call's wait to stop, for the next call
        # The call in progress, as the watchdog sees it: its model and rows (generations),
        # when it began or (a generation) last made a token, None when no call runs; and,
        # once it ran past its limit, when it was terminated and what its requests get.
        self._model = ""
        self._rows = 0
        self._since: float | None = None
        self._terminated_at: float | None = None
        self._timeout: EngineTimeout | None = None

    async def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread (probing, closing)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def load(self, model: str) -> Engine:
        """``model``'s engine, loading it first (and evicting others) when not resident."""
        engine = self._models.resident(model)
        if engine is not None:
            return engine
        self.switching = model
        t0 = self._clock.now()
        try:
            loop = asyncio.get_running_loop()
            engine = await loop.run_in_executor(self._pool, self._models.ensure, model)
        finally:
            self.switching = None
            self._loaded_at = self._clock.now()
        self._loaded(model, self._loaded_at - t0)
        return engine

    async def chain(self, first: Call, follow: Follow) -> Call | None:
        """Run ``first``, then every call ``follow`` returns, back to back on the engine
        thread, until ``follow`` returns None. ``follow`` runs on the engine thread after
        each call, with the call's outputs (RunAborted when aborted, or the exception it
        raised); the engine does nothing else meanwhile, so it MUST only wait briefly.
        Returns a call whose model is not resident: it has not run; load its model, then
        chain again from it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._chain, first, follow)

    def _chain(self, call: Call, follow: Follow) -> Call | None:
        # Each call's hand-off: from the engine being ready for it (for the first of the
        # chain, once it was planned and its model loaded; for the next, once the call
        # before it ended and its requests had arrived) to its start: the node's
        # bookkeeping between calls and the hand-over to this thread, time in which the
        # engine runs nothing (the simulator spends it too). A call aborted while it ran
        # (for a more urgent arrival, or a cancel) stops only at ONNX Runtime's next look
        # at its terminate flag: the next call to run carries that wait as ``abort_s``.
        ready = max(call.plan.started, self._loaded_at)
        while True:
            engine = self._models.resident(call.plan.model)
            if engine is None:
                return call
            self._abort_at = None  # first: abort() sets it only once the engine is set
            self._terminated_at = self._timeout = None
            self._engine, self._stop = engine, call.stop
            t0 = self._clock.now()
            call.ran_at, call.handoff_s = t0, max(0.0, t0 - ready)
            call.abort_s, self._aborted_s = self._aborted_s, 0.0
            self._model, self._rows, self._since = call.plan.model, call.plan.rows, t0
            result: Outputs | Exception
            try:
                result = engine.run([r.inputs for r in call.plan.requests], call.stop)
            except Exception as exc:  # the node sorts aborts, input and engine failures
                result = exc
            finally:
                self._engine = self._stop = self._since = None
            ended = self._clock.now()
            if isinstance(result, RunAborted) and self._abort_at is not None:
                self._aborted_s = max(0.0, ended - self._abort_at)
            if isinstance(result, RunAborted) and self._timeout is not None:
                result = self._timeout  # terminated by the watchdog
            following = follow(call, result, ended - t0)
            if following is None:
                return None
            call = following
            ready = max(ended, *(r.arrival for r in call.plan.requests))

    async def advance(
        self, model: str, gens: Sequence[Generation], before: Callable[[], None]
    ) -> dict[str, str | None]:
        """Decode ``gens`` together until each ends (its finish reason, by request id)
        or the call is stopped (None: paused at a token boundary). ``before`` runs once
        the model is resident. EngineTimeout when the watchdog terminated the call: it
        went longer than its limit without a token (see ``progressed``)."""
        stop = self._stop = threading.Event()
        try:
            engine = await self.load(model)
            assert isinstance(engine, DecoderEngine), f"{model} is not a decoder"
            self._engine = engine
            before()
            self._terminated_at = self._timeout = None
            self._model, self._rows, self._since = model, len(gens), self._clock.now()
            loop = asyncio.get_running_loop()
            reasons = await loop.run_in_executor(self._pool, engine.advance_batch, gens, stop)
            if self._timeout is not None:
                raise self._timeout
            return reasons
        finally:
            self._engine = self._stop = self._since = None

    def progressed(self, now: float) -> None:
        """A generation made a token (on the engine thread): its call's time limit
        counts from here."""
        self._since = now

    def watch(self, now: float, limit_s: CallLimit, grace_s: float) -> str | None:
        """The watchdog's look at the call in progress (on the loop, under the lock
        that keeps the engine thread from moving on to another call): terminate it
        once it has run past ``limit_s(model, rows)``; its requests then get
        EngineTimeout. Returns why the engine is stuck once the call has not stopped
        ``grace_s`` after that; None otherwise."""
        since = self._since
        if since is None:
            return None
        model = self._model
        if self._terminated_at is None:
            limit = limit_s(model, self._rows)
            if now - since > limit:
                self._terminated_at = now
                self._timeout = EngineTimeout(
                    f"model {model!r}: the engine call ran past its max_call_s of {limit:g} s "
                    f"and was terminated; if its calls may take longer, raise "
                    f"models.{model}.max_call_s"
                )
                self.abort()
            return None
        if now - self._terminated_at < grace_s:
            return None
        return (
            f"an engine call of model {model!r} ran past its max_call_s and has not "
            f"stopped {now - self._terminated_at:.0f} s after it was terminated"
        )

    def stop_at_boundary(self) -> None:
        """End a decode call at its next token boundary, letting a prefill in progress
        finish (generations regroup: one joins, or a cancelled one leaves)."""
        stop = self._stop
        if stop is not None:
            stop.set()

    def abort(self) -> None:
        # The stop event first: a call the engine thread has not entered yet sees it
        # and never starts; a call in progress is interrupted by abort().
        stop, engine = self._stop, self._engine  # the engine thread clears them
        if engine is not None and self._abort_at is None:
            self._abort_at = self._clock.now()  # before the abort: the run ends after it
        if stop is not None:
            stop.set()
        if engine is not None:
            engine.abort()

    async def close(self, timeout_s: float) -> None:
        """Unload every model, then let the thread go. A thread a call still holds
        after ``timeout_s`` (it did not stop when aborted) is let go as it is: its
        models are unloaded if that call ever ends."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.call(self._models.close), timeout_s)
        self._pool.shutdown(wait=False)
