"""Traffic against a fleet: a closed-loop flood of lanes and an open-loop driver of arrivals.

:class:`ClosedLoop` keeps ``lanes`` requests outstanding: each lane sends one request and
the next when its reply returns. A refused request (``Rejected``) is sent again after the
reply's ``retry_after_s`` hint, clamped by a :class:`Backoff`; an eviction or another
error ends the request, and the lane pauses before its next one. :class:`OpenLoop` sends
arrivals (:meth:`sim.workload.Workload.arrivals`: model, priority, rows, deadline, dedup
key) at their times, whatever the replies do, and collects the replies. Both count what
came back (:class:`Counts`) and hand every reply to an optional callback (:class:`Answer`).

Both run on asyncio: on a Ray actor's event loop, under ``asyncio.run``, or from
synchronous code on a :class:`LoopThread` (:func:`in_background`). They send to a
:class:`Client`: a ``FleetClient``, or anything that submits and cancels like it. Their
stop is bounded: it ends every task within a timeout and cancels on the fleet what is
still in flight. The clock and the sleep are injectable, so tests run on virtual time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from edgefleet.errors import Evicted, Rejected
from edgefleet.messages import Reply
from edgefleet.request import new_request_id
from sim.workload import Arrival

T = TypeVar("T")
Inputs = Mapping[str, np.ndarray]
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]


class TrafficError(RuntimeError):
    """A traffic driver failed: a request it could not send, a reply that did not come
    in time, an arrival it cannot send, or a driver used out of order."""


class Client(Protocol):
    """Where traffic goes: a ``FleetClient``, or anything that submits and cancels like it.

    ``submit`` returns a concurrent future of the request's :class:`Reply` (as
    ``FleetClient.submit`` does) or an awaitable of it (a Ray object reference of a node
    actor's reply); either must deliver every outcome as a Reply, not raise it. The open
    loop sends generations to a client that also has ``submit_generation`` (see
    :class:`Generations`): the same, for a whole generation.
    """

    def submit(
        self,
        model: str,
        inputs: Inputs,
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> cf.Future[Reply] | Awaitable[Reply]: ...

    def cancel(self, request_id: str, timeout_s: float = 10.0) -> bool: ...


class Generations(Protocol):
    """A client that also sends generations: ``submit_generation`` returns a future of a
    :class:`Reply` that stands for the whole generation (its node, its error, its queue
    and engine time), as ``submit`` does for an inference."""

    def submit_generation(
        self,
        model: str,
        prompt_ids: tuple[int, ...],
        *,
        max_new_tokens: int,
        priority: str | int,
        deadline_s: float | None,
        session: str | None,
        request_id: str,
    ) -> cf.Future[Reply] | Awaitable[Reply]: ...


def prompt_ids(n: int) -> tuple[int, ...]:
    """The prompt of an arrival of ``n`` prompt tokens: ids 1 to 64 in turn (any
    vocabulary has them; what the model makes of them does not matter to a load)."""
    return tuple(1 + i % 64 for i in range(n))


@dataclass
class Counts:
    """What a driver's requests came to. Every attempt counts: a refused request sent
    again counts once as rejected and twice as submitted."""

    completed: int = 0
    rejected: int = 0
    evicted: int = 0
    other_errors: int = 0
    submitted: int = 0
    engine_s: float = 0.0  # engine time of completed requests (a call's time / its rows)
    calls: float = 0.0  # engine calls of completed requests (1 / batch size each)

    def add(self, reply: Reply) -> None:
        """Count one reply."""
        if reply.error is None:
            self.completed += 1
            self.engine_s += reply.service_s / max(1, reply.batch_size)
            self.calls += 1 / max(1, reply.batch_size)
        elif isinstance(reply.error, Rejected):
            self.rejected += 1
        elif isinstance(reply.error, Evicted):
            self.evicted += 1
        else:
            self.other_errors += 1

    def copy(self) -> Counts:
        return replace(self)

    def minus(self, then: Counts) -> Counts:
        """What was counted since ``then`` (an earlier copy)."""
        return Counts(
            **{f.name: getattr(self, f.name) - getattr(then, f.name) for f in fields(self)}
        )

    @classmethod
    def total(cls, counts: Iterable[Counts]) -> Counts:
        out = cls()
        for c in counts:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(c, f.name))
        return out


@dataclass(frozen=True)
class Backoff:
    """How long a closed-loop lane waits before it sends again.

    After a refusal: the reply's ``retry_after_s``, at least ``min_retry_s`` and at most
    ``max_retry_s`` (None: the hint as given). After an eviction or another error:
    ``error_pause_s``. The defaults keep a lane facing a full fleet from becoming a busy
    loop.
    """

    min_retry_s: float = 0.002
    max_retry_s: float | None = 1.0
    error_pause_s: float = 0.005

    def __post_init__(self) -> None:
        if self.min_retry_s < 0 or self.error_pause_s < 0:
            raise ValueError("min_retry_s and error_pause_s must be >= 0")
        if self.max_retry_s is not None and self.max_retry_s < self.min_retry_s:
            raise ValueError(
                f"max_retry_s ({self.max_retry_s}) must be >= min_retry_s ({self.min_retry_s})"
            )

    def after_refusal(self, error: Rejected) -> float:
        """Seconds to wait before sending a refused request again."""
        delay = max(self.min_retry_s, error.retry_after_s)
        return delay if self.max_retry_s is None else min(self.max_retry_s, delay)


@dataclass(frozen=True, slots=True)
class Answer:
    """One reply a driver got, with its times on the driver's clock."""

    reply: Reply
    sent: float  # this attempt was submitted
    done: float  # its reply arrived
    first_sent: float  # the request's first attempt (refusals sent again are one request)
    final: bool = True  # False: a refusal the closed loop sends again
    arrival: Arrival | None = None  # the open loop's arrival
    due: float | None = None  # when the open loop's arrival was due

    @property
    def latency_s(self) -> float:
        """This attempt, from submit to reply."""
        return self.done - self.sent

    @property
    def total_s(self) -> float:
        """The request, from its first attempt to this reply (retries included)."""
        return self.done - self.first_sent


OnAnswer = Callable[[Answer], None]


@dataclass(frozen=True, slots=True)
class _Flight:
    request_id: str
    sent: float
    reply: asyncio.Future[Reply]


class Driver:
    """What both drivers share: sending under ids it can cancel, counting, pausing until
    a stop, and the bounded stop."""

    what = "traffic"

    def __init__(
        self,
        client: Client,
        *,
        on_answer: OnAnswer | None,
        reply_timeout_s: float | None,
        clock: Clock,
        sleep: Sleep,
    ) -> None:
        if reply_timeout_s is not None and reply_timeout_s <= 0:
            raise ValueError(f"reply_timeout_s must be > 0, got {reply_timeout_s}")
        self._client = client
        self._on_answer = on_answer
        self._reply_timeout_s = reply_timeout_s
        self._clock = clock
        self._sleep = sleep
        self.counts = Counts()
        self.error: BaseException | None = None  # the first failure of one of its tasks
        self._live: set[str] = set()  # ids of the requests in flight
        self._tasks: set[asyncio.Future[None]] = set()
        self._stopping: asyncio.Event | None = None
        self._discard = False  # a stop that cancels: replies from now on are not counted

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._live)

    @property
    def stopping(self) -> bool:
        return self._stopping is not None and self._stopping.is_set()

    async def start(self) -> None:
        """Start on the running event loop."""
        raise NotImplementedError

    async def run(self) -> Counts:
        """Start, and wait until the driver ends by itself (or a stop)."""
        await self.start()
        return await self.wait()

    def _begin(self) -> asyncio.Event:
        if self._stopping is not None:
            raise TrafficError(f"the {self.what} was started already; a driver runs once")
        self._stopping = asyncio.Event()
        return self._stopping

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def check(self) -> None:
        """Raise TrafficError when a task of the driver failed."""
        if self.error is not None:
            raise TrafficError(f"the {self.what} failed: {self.error!r}") from self.error

    def _submit(
        self,
        model: str,
        inputs: Inputs,
        priority: str | int,
        deadline_s: float | None,
        key: str | None,
    ) -> _Flight:
        rid = new_request_id()
        sent = self._clock()
        pending = self._client.submit(
            model, inputs, priority=priority, deadline_s=deadline_s, key=key, request_id=rid
        )
        return self._flight(rid, sent, pending)

    def _submit_generation(self, arrival: Arrival) -> _Flight:
        submit = getattr(self._client, "submit_generation", None)
        if submit is None:
            raise TrafficError(
                f"an arrival of {arrival.model!r} at {arrival.at:.3f} s is a generation; "
                "this client sends inferences only (it has no submit_generation)"
            )
        rid = new_request_id()
        sent = self._clock()
        pending = submit(
            arrival.model,
            prompt_ids(arrival.prompt_tokens),
            max_new_tokens=arrival.max_new_tokens,
            priority=arrival.priority,
            deadline_s=arrival.deadline_s,
            session=arrival.session,
            request_id=rid,
        )
        return self._flight(rid, sent, pending)

    def _flight(
        self, rid: str, sent: float, pending: cf.Future[Reply] | Awaitable[Reply]
    ) -> _Flight:
        self.counts.submitted += 1
        self._live.add(rid)
        reply = asyncio.ensure_future(
            asyncio.wrap_future(pending) if isinstance(pending, cf.Future) else pending
        )
        reply.add_done_callback(_ignore_outcome)  # a reply no one waits for any more
        return _Flight(rid, sent, reply)

    async def _reply(self, flight: _Flight) -> tuple[Reply, float] | None:
        """The reply and when it came; None when a stop that cancels came first. The
        wait is shielded: cancelling it leaves the client's future alone (the fleet is
        told to cancel by request id)."""
        try:
            waiting = asyncio.shield(flight.reply)
            if self._reply_timeout_s is None:
                reply = await waiting
            else:
                try:
                    reply = await asyncio.wait_for(waiting, self._reply_timeout_s)
                except TimeoutError:
                    raise TrafficError(
                        f"no reply to request {flight.request_id} in {self._reply_timeout_s:g} s"
                    ) from None
            done = self._clock()
        finally:
            self._live.discard(flight.request_id)
        if self._discard:
            return None
        self.counts.add(reply)
        return reply, done

    def _answer(self, answer: Answer) -> None:
        if self._on_answer is not None:
            self._on_answer(answer)

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` on the driver's clock, or until a stop."""
        if seconds <= 0 or self._stopping is None or self._stopping.is_set():
            return
        nap = asyncio.ensure_future(self._sleep(seconds))
        halt = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((nap, halt), return_when=asyncio.FIRST_COMPLETED)
        finally:
            nap.cancel()
            halt.cancel()

    async def wait(self) -> Counts:
        """Wait until every task has ended; the counts. Raises TrafficError when a task
        failed."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
        self.check()
        return self.counts.copy()

    async def stop(self, timeout_s: float, *, drain: bool = False) -> Counts:
        """Stop sending and end every task within about ``timeout_s``; the counts.

        Without ``drain`` the requests in flight are cancelled on the fleet at once, and
        their replies are neither counted nor handed on. With ``drain`` their replies are
        waited for (and counted) until ``timeout_s``; those still out then are cancelled.
        Either way, tasks still waiting at the end are cancelled. Does not raise a
        task's failure: :meth:`check` does.
        """
        if self._stopping is None:
            return self.counts.copy()
        self._stopping.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        if not drain:
            self._discard = True
            self._cancel_live(timeout_s)
        while self._tasks and loop.time() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - loop.time())
        if self._tasks:
            self._discard = True
            if drain:
                self._cancel_live(timeout_s)
            left = list(self._tasks)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        return self.counts.copy()

    def _cancel_live(self, timeout_s: float) -> None:
        """Ask the fleet to cancel every request in flight, each on a thread of the loop's
        executor (a cancel waits for an answer); nothing waits for these calls."""
        loop = asyncio.get_running_loop()
        for rid in list(self._live):
            call = loop.run_in_executor(None, self._client.cancel, rid, timeout_s)
            call.add_done_callback(_ignore_outcome)


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    """Mark a future's failure as seen: one that nobody awaits is not worth a log line."""
    if not future.cancelled():
        future.exception()


class ClosedLoop(Driver):
    """``lanes`` requests of one kind kept outstanding: each lane sends one request and the
    next when its reply returns.

    A refusal is sent again (a new attempt under a new id) after ``backoff`` says, while
    ``give_up_s`` has not passed since the request's first attempt (None: always); then
    the refusal is its answer. After a request is answered the lane pauses ``think_s``
    if it completed, ``backoff.error_pause_s`` if it failed, then sends the next. With
    ``requests`` the loop ends after that many requests (over all lanes); otherwise it
    runs until :meth:`stop`. Every reply, refusals sent again included, goes to
    ``on_answer`` (``Answer.final`` tells which). ``reply_timeout_s`` bounds each wait
    for a reply (a lane that waits longer fails with TrafficError). A lane whose send
    fails ends, its error kept in ``error``; the other lanes go on.
    """

    what = "closed loop"

    def __init__(
        self,
        client: Client,
        model: str,
        inputs: Inputs,
        *,
        lanes: int,
        priority: str | int = "background",
        deadline_s: float | None = None,
        key: str | None = None,
        backoff: Backoff | None = None,
        think_s: float = 0.0,
        requests: int | None = None,
        give_up_s: float | None = None,
        on_answer: OnAnswer | None = None,
        reply_timeout_s: float | None = None,
        clock: Clock = time.perf_counter,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        if requests is not None and requests < 0:
            raise ValueError(f"requests must be >= 0, got {requests}")
        if think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {think_s}")
        super().__init__(
            client, on_answer=on_answer, reply_timeout_s=reply_timeout_s, clock=clock, sleep=sleep
        )
        self._model = model
        self._inputs = inputs
        self._lanes = lanes
        self._priority = priority
        self._deadline_s = deadline_s
        self._key = key
        self._backoff = backoff or Backoff()
        self._think_s = think_s
        self._left = requests
        self._give_up_s = give_up_s

    async def start(self) -> None:
        """Start the lanes on the running event loop."""
        self._begin()
        for _ in range(self._lanes):
            self._spawn(self._lane())

    def _next(self) -> bool:
        """Take a request to send; False when the loop has sent all it should."""
        if self._left is None:
            return True
        if self._left <= 0:
            return False
        self._left -= 1
        return True

    async def _lane(self) -> None:
        try:
            while not self.stopping and self._next():
                pause = await self._request()
                if pause is None:
                    return
                await self._pause(pause)
        except Exception as exc:  # kept for check(); this lane ends, the others go on
            self._fail(exc)

    async def _request(self) -> float | None:
        """Send one request until it is answered; the pause before the lane's next one,
        None when the loop is stopping."""
        first: float | None = None
        while True:
            flight = self._submit(
                self._model, self._inputs, self._priority, self._deadline_s, self._key
            )
            got = await self._reply(flight)
            if got is None:
                return None
            reply, done = got
            first = flight.sent if first is None else first
            error = reply.error
            again = (
                isinstance(error, Rejected)
                and not self.stopping
                and (self._give_up_s is None or done - first <= self._give_up_s)
            )
            self._answer(Answer(reply, flight.sent, done, first, final=not again))
            if self.stopping:
                return None
            if not isinstance(error, Rejected) or not again:
                return self._think_s if error is None else self._backoff.error_pause_s
            await self._pause(self._backoff.after_refusal(error))
            if self.stopping:
                return None


InputsFor = Mapping[str, Inputs] | Callable[[Arrival], Inputs]


class OpenLoop(Driver):
    """Sends ``arrivals`` at their times (``Arrival.at`` seconds after the start), each
    once, whatever the replies do, and hands every reply to ``on_answer``.

    Each request carries the arrival's model, priority, deadline and dedup key; its
    inputs come from ``inputs``: a callable given the arrival, or a mapping from model to
    the inputs of one row (an arrival of ``rows`` rows repeats them along the first
    axis). A refusal is an answer like any other: an open loop does not retry. When
    sending falls behind, an arrival goes as soon as it can (``max_lag_s`` says how late
    the latest was). A generation (``prompt_tokens`` > 0) goes through the client's
    ``submit_generation`` (:class:`Generations`), its prompt ``prompt_ids``, in its
    chat session when it has one; to a client without it, the first one fails the loop
    with TrafficError.
    """

    what = "open loop"

    def __init__(
        self,
        client: Client,
        arrivals: Iterable[Arrival],
        inputs: InputsFor,
        *,
        on_answer: OnAnswer | None = None,
        reply_timeout_s: float | None = None,
        clock: Clock = time.perf_counter,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        super().__init__(
            client, on_answer=on_answer, reply_timeout_s=reply_timeout_s, clock=clock, sleep=sleep
        )
        self._arrivals = arrivals
        self._inputs = inputs
        self._rows: dict[tuple[str, int], Inputs] = {}
        self.max_lag_s = 0.0

    async def start(self) -> None:
        """Start sending on the running event loop; the clock's now is time 0."""
        self._begin()
        self._spawn(self._send_all(self._clock()))

    async def _send_all(self, start: float) -> None:
        try:
            for arrival in self._arrivals:
                due = start + arrival.at
                now = self._clock()
                if now < due:
                    await self._pause(due - now)
                if self.stopping:
                    return
                if arrival.prompt_tokens > 0:
                    flight = self._submit_generation(arrival)
                else:
                    flight = self._submit(
                        arrival.model,
                        self._inputs_of(arrival),
                        arrival.priority,
                        arrival.deadline_s,
                        arrival.key,
                    )
                self.max_lag_s = max(self.max_lag_s, flight.sent - due)
                self._spawn(self._answered(arrival, due, flight))
        except Exception as exc:  # kept for check(); nothing more is sent
            self._fail(exc)

    async def _answered(self, arrival: Arrival, due: float, flight: _Flight) -> None:
        try:
            got = await self._reply(flight)
            if got is not None:
                reply, done = got
                self._answer(Answer(reply, flight.sent, done, flight.sent, True, arrival, due))
        except Exception as exc:  # kept for check()
            self._fail(exc)

    def _inputs_of(self, arrival: Arrival) -> Inputs:
        if callable(self._inputs):
            return self._inputs(arrival)
        if arrival.model not in self._inputs:
            known = ", ".join(sorted(self._inputs)) or "none"
            raise TrafficError(f"no inputs for model {arrival.model!r}; inputs for: {known}")
        one = self._inputs[arrival.model]
        if arrival.rows == 1:
            return one
        key = (arrival.model, arrival.rows)
        if key not in self._rows:
            self._rows[key] = _repeat_rows(arrival.model, one, arrival.rows)
        return self._rows[key]


def _repeat_rows(model: str, one: Inputs, rows: int) -> Inputs:
    out = {}
    for name, array in one.items():
        if array.ndim == 0 or array.shape[0] != 1:
            raise TrafficError(
                f"an arrival of {model!r} asks for {rows} rows, but input {name!r} of shape "
                f"{tuple(array.shape)} is not one row on a first axis; pass inputs as a "
                "callable that builds them"
            )
        out[name] = np.repeat(array, rows, axis=0)
    return out


# ------------------------------------------------------------ from synchronous code


class LoopThread:
    """An asyncio event loop on a daemon thread of its own, to drive traffic from
    synchronous code; closing it (or leaving its ``with`` block) cancels what still
    runs on it."""

    def __init__(self, name: str = "edgefleet-traffic") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Start ``coro`` on the loop; its future."""
        if self._closed:
            coro.close()
            raise TrafficError("the loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout_s`` (then
        it is cancelled and TrafficError raised)."""
        future = self.spawn(coro)
        try:
            return future.result(timeout_s)
        except cf.TimeoutError:
            future.cancel()
            raise TrafficError(f"not done on the traffic loop in {timeout_s:g} s") from None

    def call(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run ``fn`` on the loop's thread (where the drivers' callbacks run) and return
        what it returns."""

        async def call() -> T:
            return fn()

        return self.run(call(), timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every task on the loop, stop it and join its thread (bounded)."""
        if self._closed:
            return

        async def cancel_the_rest() -> None:
            here = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not here]
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=timeout_s)

        with contextlib.suppress(TrafficError, cf.CancelledError):
            self.run(cancel_the_rest(), timeout_s + 1.0)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


@contextlib.contextmanager
def in_background(
    driver: Driver, stop_timeout_s: float, *, drain: bool = False, name: str = "edgefleet-traffic"
) -> Iterator[Driver]:
    """Run ``driver`` on a :class:`LoopThread` of its own while the block runs. At the end
    it is stopped (``drain`` as in :meth:`Driver.stop`, within about
    ``stop_timeout_s``) and its thread closed; then TrafficError is raised when one of
    its tasks failed."""
    with LoopThread(name) as thread:
        thread.run(driver.start(), stop_timeout_s)
        try:
            yield driver
        finally:
            thread.run(driver.stop(stop_timeout_s, drain=drain), 2 * stop_timeout_s + 5.0)
    driver.check()


__all__ = [
    "Answer",
    "Backoff",
    "Client",
    "ClosedLoop",
    "Counts",
    "Driver",
    "LoopThread",
    "OpenLoop",
    "TrafficError",
    "in_background",
]
