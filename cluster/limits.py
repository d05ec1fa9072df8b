"""Every call a caller has out on a node has a limit.

A node whose process is frozen (stopped, a stalled link, a wedged driver) holds the
calls sent to it forever: Ray declares an actor dead only when its process or its
machine dies. So a dispatcher gives each call a due time (its request's deadline, or
its expected completion x ``router.call_limit_factor`` + ``router.call_grace_s``) and
one thread, :class:`CallWatch`, looks at the calls that are due:

- a call past its request's ``timeout_s`` is given up (``TIMED_OUT``);
- otherwise its node is asked whether it holds the request (one probe per node at a
  time for all of its due calls, bounded by ``router.probe_timeout_s``, on a thread of
  its own: a node slow to answer delays no other call, and a timeout that passes
  meanwhile still acts on time). A node that answers is alive and busy: the call gets
  another limit. So does one the caller heard live within ``router.lost_after_s`` (an
  answer to any of its calls, or a report the router took): a node flooded with calls
  answers probes late, but it answers. A node that does neither gives up its calls
  (``UNRESPONSIVE``): the dispatcher places them again elsewhere, or ends them as its
  rules say. A node known to be out of service is not asked.

A call given up is *claimed*: whichever comes first, its answer or the watch, decides
it, once; an answer that comes later is dropped. The watch's thread runs while calls
are out; after :meth:`CallWatch.close` it ends once the last is answered or given up.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from edgefleet.clock import Clock

log = logging.getLogger(__name__)

TIMED_OUT = "timed out"  # the request's own timeout_s passed
UNRESPONSIVE = "unresponsive"  # its node did not answer a probe in time
MAX_SLEEP_S = 1.0  # the watch looks at least this often (a due time is never missed)


class Prober(Protocol):
    def probe(self, request_ids: Sequence[str], timeout_s: float) -> Mapping[str, bool] | None:
        """See :meth:`cluster.dispatch.NodeHandle.probe`."""
        ...


class Watched(Protocol):
    """A node as the watch needs it."""

    @property
    def name(self) -> str: ...

    @property
    def handle(self) -> Prober: ...

    @property
    def healthy(self) -> bool:
        """False once it is known to be out of service: its calls are given up unasked."""
        ...

    @property
    def heard_at(self) -> float:
        """When the caller last heard the node live: an answer to one of its calls, or
        the router's report of it (on the watch's clock)."""
        ...


@dataclass(eq=False)
class Flight:
    """One call of one request on one node, until it is answered or given up."""

    node: Watched
    request_id: str
    budget_s: float  # how long each limit runs
    give_up_at: float  # the request's timeout: math.inf without one
    on_overdue: Callable[[str], None]  # called once, on the watch's thread, with why
    due: float = 0.0
    done: bool = field(default=False)


class CallWatch:
    """Gives each call a limit and acts on the calls past it (see the module's text).
    Thread-safe; its thread starts with the first call."""

    def __init__(self, probe_timeout_s: float, quiet_s: float, clock: Clock) -> None:
        """``quiet_s``: how long a node must have answered nothing before a probe it
        does not answer gives its calls up."""
        self.probe_timeout_s = probe_timeout_s
        self.quiet_s = quiet_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Flight]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._probing: dict[str, list[Flight]] = {}  # node -> calls its probe settles
        self.probes = 0  # probes sent (for tests and diagnostics)

    def add(
        self,
        node: Watched,
        request_id: str,
        due: float,
        budget_s: float,
        give_up_at: float,
        on_overdue: Callable[[str], None],
    ) -> Flight:
        """Watch a call sent to ``node``: first looked at ``due`` (or at ``give_up_at``,
        when sooner), then every ``budget_s`` while its node answers probes."""
        flight = Flight(node, request_id, budget_s, give_up_at, on_overdue)
        with self._lock:
            self._push(flight, min(due, give_up_at))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="edgefleet-limits", daemon=True
                )
                self._thread.start()
        return flight

    def claim(self, flight: Flight) -> bool:
        """True for the first caller only: the call's answer, or the watch giving it up."""
        with self._lock:
            if flight.done:
                return False
            flight.done = True
            return True

    def expedite(self, node: str) -> None:
        """``node`` is out of service: look at its calls now, not at their limits."""
        now = self._clock.now()
        with self._lock:
            for _, _, flight in list(self._heap):
                if flight.node.name == node and not flight.done and flight.due > now:
                    self._push(flight, now)

    def close(self) -> None:
        """The caller sends nothing more: the thread ends once the calls still out are
        answered or given up."""
        with self._lock:
            self._closed = True
            self._wake.notify()

    def _push(self, flight: Flight, due: float) -> None:  # under the lock
        flight.due = due
        if not self._heap or due < self._heap[0][0]:
            self._wake.notify()
        heapq.heappush(self._heap, (due, next(self._seq), flight))

    # ------------------------------------------------------------------- the thread

    def _run(self) -> None:
        """Supervised: an unexpected error is logged and the watch goes on."""
        while True:
            try:
                if not self._tick():
                    return
            except Exception:
                log.exception("the call watch failed; it goes on")
                with self._lock:
                    self._wake.wait(MAX_SLEEP_S)

    def _tick(self) -> bool:
        """Act on the calls due now; False when the thread should end (closed, and
        nothing left out)."""
        with self._lock:
            while True:
                if self._closed and not self._probing and all(f.done for _, _, f in self._heap):
                    self._heap.clear()
                    self._thread = None
                    return False
                now = self._clock.now()
                if self._heap and self._heap[0][0] <= now:
                    break
                wait = self._heap[0][0] - now if self._heap else MAX_SLEEP_S
                self._wake.wait(min(wait, MAX_SLEEP_S))
            due: dict[str, list[Flight]] = {}
            while self._heap and self._heap[0][0] <= now:
                at, _, flight = heapq.heappop(self._heap)
                if not flight.done and at == flight.due:  # else answered, or moved
                    due.setdefault(flight.node.name, []).append(flight)
        for flights in due.values():
            self._look(flights, now)
        return True

    def _look(self, flights: list[Flight], now: float) -> None:
        """The due calls of one node: give up those past their timeout, and have the
        node probed for the others on a thread of its own, so that a node slow to answer
        delays no other call (calls that fall due while it is probed wait for that
        probe's answer)."""
        waiting = []
        for flight in flights:
            if now >= flight.give_up_at:
                self._give_up(flight, TIMED_OUT)
            else:
                waiting.append(flight)
        if not waiting:
            return
        node = waiting[0].node
        with self._lock:
            for flight in waiting:  # its timeout still acts while the probe runs
                if flight.give_up_at != math.inf:
                    self._push(flight, flight.give_up_at)
            probing = self._probing.get(node.name)
            if probing is not None:
                probing.extend(waiting)
                return
            self._probing[node.name] = list(waiting)
            if node.healthy:  # one known to be out of service is not asked again
                self.probes += 1
        if not node.healthy:
            self._settle(node, None)
            return
        ids = [f.request_id for f in waiting]
        name = f"edgefleet-probe-{node.name}"
        threading.Thread(target=self._probe, args=(node, ids), name=name, daemon=True).start()

    def _probe(self, node: Watched, ids: list[str]) -> None:
        """Probe ``node`` about ``ids``, then settle its calls waiting on the probe."""
        answer = None
        try:
            answer = node.handle.probe(ids, self.probe_timeout_s)
        except Exception:
            log.exception("probing node %s failed", node.name)
        self._settle(node, answer)

    def _settle(self, node: Watched, answer: Mapping[str, bool] | None) -> None:
        """Every call of ``node`` waiting on its probe: another limit when the node
        answered or was heard live lately, else given up (past its timeout by now, or
        unresponsive)."""
        after = self._clock.now()
        alive = answer is not None or after - node.heard_at < self.quiet_s
        with self._lock:
            waiting = self._probing.pop(node.name, [])
            if alive:
                for flight in waiting:
                    if not flight.done:
                        self._push(flight, min(after + flight.budget_s, flight.give_up_at))
            self._wake.notify()
        if not alive:
            for flight in waiting:
                self._give_up(flight, TIMED_OUT if after >= flight.give_up_at else UNRESPONSIVE)

    def _give_up(self, flight: Flight, why: str) -> None:
        if self.claim(flight):
            try:
                flight.on_overdue(why)
            except Exception:
                log.exception("giving up request %s failed", flight.request_id)
