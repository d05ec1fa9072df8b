"""Dispatch: place a request on a node and get its one answer, in the caller's process.

The payload goes caller -> node -> caller in one hop; no router sits on the data path.
Placement runs the pipeline of ``policies.placement`` on a fleet view the router
publishes (node reports and health), aged to now and corrected with the work this
caller sent since each report. A node that refuses (``Rejected``) or evicts
(``Evicted``) a request is followed by the next candidate; a node that dies takes
none of its requests with it: they are placed again elsewhere, under the same id.

One attempt loop (:class:`_Attempt`) decides spill, re-placement, continuation and
the final refusal for both inference and generation; :meth:`Dispatcher.submit` drives
it from completion callbacks (no thread or event loop per request),
:meth:`Dispatcher.pipeline` (and :meth:`Dispatcher.call`, a pipeline of one) on the
caller's thread, waiting for many answers at once, and :meth:`Dispatcher.stream` from
the caller's iteration.

With ``router.record_dir`` set, each dispatcher appends a line per request to its own
call record when the request's final answer is known (``cluster/record.py``), which the
simulator replays.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import logging
import math
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from cluster.limits import TIMED_OUT, UNRESPONSIVE, CallWatch, Flight
from cluster.metrics import RouterMetrics
from cluster.record import CallRecord
from edgefleet.artifacts import split_version
from edgefleet.clock import Clock, MonotonicClock
from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.errors import (
    Cancelled,
    EdgeFleetError,
    Evicted,
    ModelNotFound,
    NodeLost,
    Rejected,
    TimedOut,
)
from edgefleet.messages import GenerationResult, NodeState, NodeStatus, Reply, TokenChunk
from edgefleet.request import GenerateRequest, InferRequest, input_rows
from policies.costs import UNTIMED_ROW_COST
from policies.placement import (
    NodeView,
    PlacementRequest,
    ShedBelowPriority,
    drain,
    make_placement,
    row_cost,
)
from policies.placement.scorers import ExpectedCompletion, ModelLoad

log = logging.getLogger(__name__)

Request = InferRequest | GenerateRequest
VIEW_REUSE_S = 0.001  # a node's view ages by less than this between two placements
# The other callers' sends a view estimates since its report stop growing at this many
# report intervals: a report that old is late, not a sign of ever more unseen work.
UNSEEN_INTERVALS = 2.0
UNREACHABLE_FIRST_WAIT_S = 0.05  # asking a node out of reach again: first wait...
UNREACHABLE_MAX_WAIT_S = 1.0  # ...doubling up to this, with jitter
PIPELINE_WAIT_S = 1.0  # Dispatcher.pipeline waits for answers in slices of at most this
TIMEOUT_POLL_S = 0.01  # ...and past a request's timeout_s, for the watch to give it up
STREAM_TIMEOUT_SLICE_S = 0.1  # a stream with a timeout_s waits for its items in these
# A node in one of these states refuses new work: placement passes it over.
_TAKES_NO_WORK = frozenset(
    {NodeState.DRAINING, NodeState.DRAINED, NodeState.STOPPED, NodeState.STARTING, NodeState.STUCK}
)
# Every node serving a model drains: come back no sooner (nor before the next report
# could show one back in service); a draining node refuses with the same hint.
DRAINING_RETRY_S = 1.0
Final = Reply | GenerationResult


class NodeGone(Exception):
    """The node's actor died or cannot be reached."""


class NodeUnavailable(NodeGone):
    """The node's actor is restarting or out of reach for now: a call may or may not
    have run there. A request is asked again of the same node, under the same id
    (the node answers an id it knows once), before it is placed elsewhere."""


class NodeHandle(Protocol):
    """How a dispatcher talks to one node (a Ray actor in production, a fake in tests)."""

    def infer(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        """Send one request; the future MUST fail with NodeGone when the node died and
        otherwise resolve with the node's Reply."""
        ...

    def send(self, request: InferRequest, inputs: Any = None) -> Any:
        """Send one request for :meth:`wait` to collect; MAY raise NodeGone at once."""
        ...

    def wait(self, calls: Sequence[Any], timeout_s: float) -> list[tuple[Any, Reply | Exception]]:
        """The calls of :meth:`send` (this handle's or another node's of the same
        kind) that are answered, waiting at most ``timeout_s`` for the first, with each
        one's Reply or error: NodeGone when its node died. Waited for on the calling
        thread."""
        ...

    def generate(
        self, request: GenerateRequest, wait_s: float | None = None
    ) -> Iterator[TokenChunk | GenerationResult | None]:
        """Stream a generation; MUST raise NodeGone when the node died. With ``wait_s``,
        MUST yield None after each ``wait_s`` in which nothing came (the caller looks at
        the time meanwhile)."""
        ...

    def probe(self, request_ids: Sequence[str], timeout_s: float) -> Mapping[str, bool] | None:
        """Whether the node holds each of ``request_ids``; None when it does not answer
        within ``timeout_s`` (frozen, out of reach) or is dead. MUST NOT wait longer."""
        ...

    def forget(self, request_id: str) -> None:
        """Cancel ``request_id`` on the node, best effort, without waiting (a request
        given up there); MUST NOT raise."""
        ...


class FutureCalls:
    """:meth:`NodeHandle.send` and :meth:`NodeHandle.wait` for a handle whose
    ``infer`` futures complete by themselves (fakes in tests), and a node that always
    answers probes."""

    def probe(self, request_ids: Sequence[str], timeout_s: float) -> Mapping[str, bool] | None:
        return dict.fromkeys(request_ids, True)

    def forget(self, request_id: str) -> None:
        pass

    def infer(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        raise NotImplementedError

    def send(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        return self.infer(request, inputs)

    def wait(
        self, calls: Sequence[cf.Future[Reply]], timeout_s: float
    ) -> list[tuple[cf.Future[Reply], Reply | Exception]]:
        done, _ = cf.wait(calls, timeout_s, return_when=cf.FIRST_COMPLETED)
        out: list[tuple[cf.Future[Reply], Reply | Exception]] = []
        for f in done:
            exc = f.exception()
            out.append((f, f.result() if exc is None else exc))  # type: ignore[arg-type]
        return out


@dataclass(frozen=True)
class NodeReport:
    """What the router publishes of one node: its latest status, whether it is in
    service, and how old the status was when published."""

    status: NodeStatus | None
    healthy: bool
    age_s: float


@dataclass(frozen=True)
class FleetView:
    """The router's view of its nodes, as callers receive it. What the fleet's other
    callers last reported (None: not part of this view): ``shed_waiting``, the requests
    they shed and told to come back later that had not come back yet; ``placed``, the
    requests they placed in their last report interval, by priority."""

    nodes: Mapping[str, NodeReport]
    shed_waiting: int | None = None
    placed: Mapping[int, int] | None = None
    # The pool members in the fleet now (None: as in the last view that carried them),
    # and the version of that list a caller hands back to the router.
    members: Sequence[NodeSpec] | None = None
    members_version: int = 0


@dataclass(frozen=True)
class _Sent:
    priority: int
    cost_s: float
    at: float


@dataclass
class _Base:
    """The parts of a node's view that change only with a new report."""

    loaded: frozenset[str]
    draining: bool = False
    work: dict[int, int] = field(default_factory=dict)
    backlog_s: dict[int, float] = field(default_factory=dict)
    running_left_s: float = 0.0
    running: tuple[int, int] | None = None  # the call in progress: (priority, requests)
    row_cost_s: dict[str, float] = field(default_factory=dict)
    load_cost_s: dict[str, float] = field(default_factory=dict)
    sessions: frozenset[str] = frozenset()
    busy: dict[int, float] = field(default_factory=dict)
    moving: frozenset[str] = frozenset()  # models it takes no work for: a new version loads


class _Entry:
    """One node as this caller sees it: the router's last report and the requests this
    caller has in flight there."""

    def __init__(self, spec: NodeSpec, handle: NodeHandle, unseen_for_s: float = 0.0) -> None:
        self.spec = spec
        self.name = spec.name
        self.handle = handle
        self.unseen_for_s = unseen_for_s  # the longest a view counts others' sends for
        self.models = frozenset(spec.models)
        # The version of each model's files it serves: as deployed, then as reported.
        self.versions = {m: a.version for m, a in spec.artifacts.items()}
        self.capacity = spec.queue.capacity
        p = spec.preemption
        self.preempt_gap = p.min_priority_gap if p.enabled else None
        self.guaranteed = spec.starvation.params(spec.priorities).guaranteed()
        self.healthy = True  # until the router or a call says otherwise
        self.lost_at: float | None = None
        self.answered_at = float("-inf")  # when the node last answered this caller
        self.report_at = float("-inf")  # when the report was taken, on this caller's clock
        self.made_at = float("-inf")  # when the node made it, on the node's clock
        self.base = _Base(loaded=self.models)
        self.inflight: dict[str, _Sent] = {}
        # By priority, [count, engine seconds]: requests sent after the report was taken,
        # and every request this caller has in flight here.
        self.since: dict[int, list[float]] = {}
        self.mine: dict[int, list[float]] = {}
        self._view: NodeView | None = None  # the last view built, while nothing changed
        self._view_at = 0.0
        # The report aged to _aged_at (work, backlog, running call left): sending or
        # answering a request changes the view but not this.
        self._aged: tuple[dict[int, int], dict[int, float], float] | None = None
        self._aged_at = 0.0

    @property
    def heard_at(self) -> float:
        """When this caller last heard the node live: an answer, or a report of its."""
        return self.answered_at if self.answered_at > self.report_at else self.report_at

    def report(self, status: NodeStatus | None, taken_at: float) -> None:
        self._view = self._aged = None
        self.report_at = taken_at
        if status is not None:
            self.made_at = status.at
            self.base = _base(status)
            self.versions.update({m.name: m.version for m in status.models if m.version})
        self.since = {}
        for sent in self.inflight.values():
            if sent.at >= taken_at:  # sent as it was taken: not in it
                _add(self.since, sent, 1)

    def lose(self, now: float) -> None:
        self.healthy = False
        self.lost_at = now
        self._view = None

    def left(self, now: float) -> None:
        """Out of the fleet for good (a pool member whose Ray node Ray declared dead):
        nothing more will come from it, so its calls are given up at once."""
        self.lose(now)
        self.answered_at = self.report_at = float("-inf")

    def sent(self, request_id: str, sent: _Sent) -> None:
        self._view = None
        self.inflight[request_id] = sent
        _add(self.since, sent, 1)
        _add(self.mine, sent, 1)

    def done(self, request_id: str) -> None:
        sent = self.inflight.pop(request_id, None)
        if sent is not None:
            self._view = None
            _add(self.mine, sent, -1)
            if sent.at >= self.report_at:
                _add(self.since, sent, -1)

    def view(self, now: float, unseen_per_s: float = 0.0) -> NodeView:
        """The node as placement sees it ``now`` (the same view within VIEW_REUSE_S
        while nothing changed, and for as long as nothing changes once the node looks
        idle: placing a request is the hot path). ``unseen_per_s``: the requests per
        second the other callers send here, as their placements suggest; while the node
        is still busy with the work it reported, those they sent since (at most
        ``unseen_for_s`` worth) wait there too; once that work is done, the node
        serves what comes as it comes and the view counts none."""
        if self._view is not None and now - self._view_at < VIEW_REUSE_S:
            return self._view
        b = self.base
        if self._aged is None or now - self._aged_at >= VIEW_REUSE_S:
            if b.work or b.running_left_s > 0:
                aged = drain(b.work, b.backlog_s, b.running_left_s, now - self.report_at)
                if b.running is not None and aged[2] > 0:  # the call in progress, until it ends
                    aged[0][b.running[0]] = aged[0].get(b.running[0], 0) + b.running[1]
            else:  # an idle node's report stays idle
                aged = ({}, {}, 0.0)
            self._aged, self._aged_at = aged, now
        work, backlog, running = self._aged
        since, mine = self.since, self.mine
        unseen = 0.0
        if work or running > 0:
            idle = False
            if unseen_per_s:
                unseen = unseen_per_s * min(max(0.0, now - self.report_at), self.unseen_for_s)
        else:
            # Idle, and nothing left to age: the view holds until a report, a send or an
            # answer changes it (most nodes of a large fleet, most of the time).
            idle = not (since or mine)
        if since or mine:  # a view's dicts are its own: the aged ones are kept
            work, backlog = dict(work), dict(backlog)
            for p, (n, s) in since.items():
                work[p] = work.get(p, 0) + round(n)
                backlog[p] = backlog.get(p, 0.0) + s
            # What this caller itself has in flight there is known exactly: the node
            # holds at least that, however old the report (conditionals, not max(): a
            # view is built for every candidate of every request).
            for p, (n, s) in mine.items():
                had, sent = work.get(p, 0), round(n)
                work[p] = had if had >= sent else sent
                held = backlog.get(p, 0.0)
                backlog[p] = held if held >= s else s
        self._view_at = math.inf if idle else now
        # Positional, in NodeView's field order: matching 17 keywords takes three times
        # as long as building the view.
        self._view = NodeView(
            self.name,
            self.models - b.moving if b.moving else self.models,
            b.loaded,
            self.healthy,
            b.draining,
            self.capacity,
            work,
            backlog,
            b.row_cost_s,
            b.load_cost_s,
            running,
            None if b.running is None or running <= 0 else b.running[0],  # running_priority
            b.sessions,
            self.preempt_gap,
            b.busy,
            unseen,
            self.guaranteed,
        )
        return self._view


def _draw(rng: random.Random, population: Sequence[_Entry], k: int) -> list[_Entry]:
    """``k`` distinct members of ``population`` (more than ``k``), drawn uniformly:
    ``random.sample``'s method for a few of many (an index of the population's bit
    length, drawn again when too large or already drawn), without its per-call set-up,
    which takes as long as the draws (placing a request draws its candidates)."""
    n = len(population)
    bits = n.bit_length()
    getrandbits = rng.getrandbits
    drawn: set[int] = set()
    out: list[_Entry] = []
    while len(out) < k:
        i = getrandbits(bits)
        if i < n and i not in drawn:
            drawn.add(i)
            out.append(population[i])
    return out


def _add(agg: dict[int, list[float]], sent: _Sent, sign: int) -> None:
    counts = agg.setdefault(sent.priority, [0.0, 0.0])
    counts[0] += sign
    counts[1] += sign * sent.cost_s
    if counts[0] <= 0:
        del agg[sent.priority]


def _base(report: NodeStatus) -> _Base:
    row_cost_s: dict[str, float] = {}
    load_cost_s: dict[str, float] = {}
    for m in report.models:
        ms = m.row_ms if m.row_ms is not None else m.cost_ms.get(1)
        if ms is not None:
            row_cost_s[m.name] = ms / 1000
        if m.load_ms is not None:
            load_cost_s[m.name] = m.load_ms / 1000
    probe = NodeView(name=report.name, models=frozenset(), row_cost_s=row_cost_s)
    backlog: dict[int, float] = {}
    for p, by_model in report.queued_rows.items():
        for model, rows in by_model.items():
            backlog[p] = backlog.get(p, 0.0) + rows * row_cost(probe, model)
    running_left = 0.0
    r = report.running
    if r is not None:
        expected = row_cost(probe, r.model) * max(r.rows, len(r.request_ids))
        running_left = max(0.0, expected - r.elapsed_s)
    return _Base(
        loaded=frozenset(m.name for m in report.models if m.loaded),
        draining=report.state in _TAKES_NO_WORK,
        work=dict(report.queued),
        backlog_s=backlog,
        running_left_s=running_left,
        running=None if r is None else (r.priority, len(r.request_ids)),
        row_cost_s=row_cost_s,
        load_cost_s=load_cost_s,
        sessions=frozenset(report.sessions),
        busy=dict(report.busy),
        moving=frozenset(m.name for m in report.models if m.moving),
    )


class Dispatcher:
    """Places requests on a fleet's nodes from one process and returns their answers.

    Thread-safe: callers on any thread, completions on Ray's threads. Counters
    (received, completed, spilled, replaced, shed, ...) accumulate here; the caller
    hands all of them (:meth:`counted`) to the router, which adds up every caller's
    for the fleet's status (``Router._merge`` says how a delivery counts once).
    """

    def __init__(
        self,
        config: FleetConfig,
        handles: Mapping[str, NodeHandle],
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        metrics: RouterMetrics | None = None,
        executor: Executor | None = None,
        specs: Sequence[NodeSpec] | None = None,
        watch: bool = False,
        member_handle: Callable[[NodeSpec], NodeHandle] | None = None,
    ) -> None:
        """``executor`` runs further attempts after a node's answer (default: a thread
        of this dispatcher's own; the simulator runs them in simulated time); ``specs``
        replaces the config's nodes (the simulator grows a fleet to any size);
        ``watch`` gives every call a limit (:mod:`cluster.limits`; real nodes can
        freeze, the simulator's cannot); ``member_handle`` makes the handle of a pool
        member the router's view brings (without it, pool members are not used)."""
        self.config = config
        pc = config.router.placement
        params = pc.params(config.priorities)
        self._placement = make_placement(params)
        self._candidates = params.candidates
        self._shed = ShedBelowPriority(params.shed)
        self._rng = rng or random.Random(pc.seed)
        self._clock = clock or MonotonicClock()
        self._metrics = metrics or RouterMetrics(config.fleet.name, config.priorities)
        self._metrics.start()
        specs = config.node_specs() if specs is None else specs
        self._unseen_for_s = UNSEEN_INTERVALS * config.router.report_interval_s
        self._nodes = {s.name: _Entry(s, handles[s.name], self._unseen_for_s) for s in specs}
        self._member_handle = member_handle
        self._members_version = 0  # of the pool members this caller holds
        self._serving: dict[str, list[_Entry]] = {}  # model -> the nodes that serve it
        self._index()
        # A pool's models are served even while none of its devices has joined yet.
        self._served = set(self._serving) | config.served_models()
        self._sessions: dict[str, set[str]] = {}  # session -> nodes reporting its KV
        self._batchable: dict[str, bool] = {}  # model -> batches, as its nodes report
        self._lock = threading.Lock()
        self._counted: Counter[str] = Counter()  # everything counted since it was made
        self._shed_waiting: list[float] = []  # heap: when each shed request was told to retry
        self._shed_elsewhere = 0  # shed requests of other callers still to come back
        # Placements by priority: this caller's since it last reported them, its own in
        # the interval it reported last, and the other callers' in theirs.
        self._placed: Counter[int] = Counter()
        self._placed_last: Mapping[int, int] = {}
        self._placed_elsewhere: Mapping[int, int] = {}
        self._crowds: dict[int, float] = {}  # priority -> crowd, until the counts change
        self._unseen_per_s = 0.0  # the other callers' sends per node and second
        self._retries: Executor = executor or ThreadPoolExecutor(
            1, thread_name_prefix="edgefleet-dispatch"
        )
        self.closed = False
        self._jitter = random.Random()
        directory = config.router.record_dir
        self._record = None if directory is None else CallRecord(directory)
        self._quiet_s = config.router.lost_after_s  # see _report
        self._watch = None
        if watch:
            r = config.router
            self._watch = CallWatch(r.probe_timeout_s, r.lost_after_s, self._clock)
        self._expected = (ExpectedCompletion(), ModelLoad())

    # -------------------------------------------------------------------- the view

    def _index(self) -> None:
        """Which nodes serve each model (again after the pool members changed)."""
        serving: dict[str, list[_Entry]] = {}
        for e in self._nodes.values():
            for m in e.models:
                serving.setdefault(m, []).append(e)
        self._serving = serving

    def members_version(self) -> int:
        """The version of the pool members this caller holds (for the router: see
        :attr:`FleetView.members`)."""
        return self._members_version

    def update(self, view: FleetView) -> None:
        """Take the router's latest view. A report older than the one held is ignored
        (a view fetched before a fresher status call); a node this caller found dead
        stays out of service until a report taken after that comes in. Pool members
        that joined are added, and those that left removed (see :meth:`_members`)."""
        now = self._clock.now()
        with self._lock:
            if view.members is not None and self._member_handle is not None:
                self._members(view.members, view.members_version, now)
            for name, r in view.nodes.items():
                self._report(name, r.status, r.healthy, now - r.age_s)
            if view.shed_waiting is not None:
                self._shed_elsewhere = view.shed_waiting
            if view.placed is not None:
                self._placed_elsewhere = view.placed
                self._crowds = {}
                # a view held while its node is idle counts none: no view to refresh
                nodes = max(1, len(self._nodes))
                interval = self.config.router.report_interval_s
                self._unseen_per_s = sum(view.placed.values()) / interval / nodes

    def _members(self, members: Sequence[NodeSpec], version: int, now: float) -> None:
        """The pool members now (under the lock). A member that left (or came back as a
        new Ray node, under the same name) is lost to this caller: the calls it holds
        are given up now (when calls are watched; else they end with its actor), and
        placed again as after a node loss."""
        assert self._member_handle is not None
        now_in = {spec.name: spec for spec in members}
        changed = False
        for name, entry in list(self._nodes.items()):
            spec = now_in.get(name)
            if entry.spec.pool is not None and (
                spec is None or spec.ray_node != entry.spec.ray_node
            ):
                del self._nodes[name]
                entry.left(now)
                if self._watch is not None:
                    self._watch.expedite(name)
                for session in entry.base.sessions:
                    holders = self._sessions.get(session)
                    if holders is not None:
                        holders.discard(name)
                        if not holders:
                            del self._sessions[session]
                changed = True
        for name, spec in now_in.items():
            if name not in self._nodes:
                handle = self._member_handle(spec)
                self._nodes[name] = _Entry(spec, handle, self._unseen_for_s)
                changed = True
        if changed:
            self._index()
        self._members_version = version

    def shed_waiting(self) -> int:
        """Requests this caller shed and told to come back later, not due yet (the
        router adds up every caller's for the others: :attr:`FleetView.shed_waiting`)."""
        now = self._clock.now()
        with self._lock:
            self._drop_due(now)
            return len(self._shed_waiting)

    def take_placed(self) -> dict[int, int]:
        """The requests this caller placed since the last call, by priority (for the
        router, which hands every caller the sum of the others': :attr:`FleetView.placed`)."""
        with self._lock:
            placed, self._placed = dict(self._placed), Counter()
            self._placed_last = placed
            self._crowds = {}
            return placed

    def crowd(self, priority: int) -> float:
        """The share of the recent placements at ``priority`` or above that the fleet's
        other callers made (0 when this caller is alone): the more of them, the less
        this caller's view knows of what was sent since a report."""
        with self._lock:
            return self._crowd(priority)

    def _crowd(self, priority: int) -> float:
        crowd = self._crowds.get(priority)
        if crowd is None:
            others = sum(n for p, n in self._placed_elsewhere.items() if p >= priority)
            mine = sum(n for p, n in self._placed_last.items() if p >= priority)
            crowd = self._crowds[priority] = others / (others + mine) if others else 0.0
        return crowd

    def report(self, name: str, status: NodeStatus | None, healthy: bool, taken_at: float) -> None:
        """One node's report, taken at ``taken_at`` on this dispatcher's clock."""
        with self._lock:
            self._report(name, status, healthy, taken_at)

    def _report(self, name: str, status: NodeStatus | None, healthy: bool, taken: float) -> None:
        entry = self._nodes.get(name)
        if entry is None:
            return
        if status is not None and status.at < entry.made_at:
            return  # older than the report this caller holds (a view in transit)
        if status is None and not healthy:
            return  # the router has no report of it (it restarted): nothing to go by
        if entry.lost_at is not None:
            if not (healthy and taken > entry.lost_at):
                return
            entry.lost_at = None
        if not healthy and self._clock.now() - entry.answered_at < self._quiet_s:
            healthy = entry.healthy  # silent to the router, not to this caller: it decides
        if entry.healthy and not healthy and self._watch is not None:
            self._watch.expedite(name)  # its calls are given up now, not at their limits
        entry.healthy = healthy
        if status is not None:
            for m in status.models:
                self._batchable[m.name] = m.batchable
        before = entry.base.sessions
        entry.report(status, taken)
        after = entry.base.sessions
        if before is not after:
            for s in before - after:
                holders = self._sessions.get(s)
                if holders is not None:
                    holders.discard(name)
                    if not holders:
                        del self._sessions[s]
            for s in after - before:
                self._sessions.setdefault(s, set()).add(name)

    def close(self) -> None:
        """No further attempts: requests not yet answered end Cancelled. Closes the call
        record (requests answered after this are not recorded)."""
        self.closed = True
        self._retries.shutdown(wait=False)
        if self._watch is not None:
            self._watch.close()
        self._metrics.flush()
        if self._record is not None:
            self._record.close()

    def flush(self) -> None:
        """Record the metrics kept back and write out the call record's buffered lines
        (the client's view feed calls it every report interval)."""
        self._metrics.flush()
        if self._record is not None:
            self._record.flush()

    def views(self) -> list[NodeView]:
        now = self._clock.now()
        with self._lock:
            return [e.view(now, self._unseen_per_s) for e in self._nodes.values()]

    def rank(self, request: PlacementRequest) -> list[str]:
        """The order in which ``request`` would try the nodes now (nothing is sent)."""
        now = self._clock.now()
        with self._lock:
            views = [e.view(now, self._unseen_per_s) for e in self._nodes.values()]
            ranked = self._placement.rank(views, request, self._rng, self._crowd(request.priority))
            return [v.name for v in ranked]

    def rows(self, request: Request) -> int:
        """The rows ``request`` is priced at: as its node will count them (a model no
        node reported yet is taken to batch)."""
        if isinstance(request, GenerateRequest):
            return 1
        return input_rows(request.inputs, self._batchable.get(request.model, True))

    def handle(self, name: str) -> NodeHandle | None:
        """The handle of node ``name`` (None: no such node now)."""
        with self._lock:
            entry = self._nodes.get(name)
        return None if entry is None else entry.handle

    def revive(self) -> list[str]:
        """Probe the nodes this caller took out of service and take back those that
        answer (each probe bounded by ``router.probe_timeout_s``); their names. For when
        the router cannot say so (its head is down): a node lost to a missed probe
        otherwise comes back only with a router report taken after the loss."""
        with self._lock:
            lost = [e for e in self._nodes.values() if e.lost_at is not None]
        back = []
        for entry in lost:
            if entry.handle.probe([], self.config.router.probe_timeout_s) is not None:
                with self._lock:
                    if entry.lost_at is not None:
                        entry.lost_at = None
                        entry.healthy = True
                        entry.answered_at = self._clock.now()
                        back.append(entry.name)
        return back

    def healthy(self) -> dict[str, bool]:
        with self._lock:
            return {n: e.healthy for n, e in self._nodes.items()}

    def counted(self) -> Counter[str]:
        """Everything this dispatcher counted since it was made (a copy)."""
        with self._lock:
            return Counter(self._counted)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counted[key] += n

    # ------------------------------------------------------------------- requests

    def submit(
        self, request: InferRequest, inputs: Any = None, timeout_s: float | None = None
    ) -> cf.Future[Reply]:
        """Place ``request`` and return a future of its one :class:`Reply`.

        ``inputs`` optionally replaces ``request.inputs`` on the node (a Ray object
        reference of them for a large request, resolved on the node): the request is
        priced by the rows of ``request.inputs`` and sent without them. ``timeout_s``:
        the longest the request may take in all; past it, it ends :class:`TimedOut` and
        is cancelled where it was. The future never fails: every outcome, unexpected
        ones included, is a Reply.
        """
        out: cf.Future[Reply] = cf.Future()
        self._try(_Attempt(self, request, inputs, timeout_s), out, inputs)
        return out

    def _try(
        self, attempt: _Attempt, out: cf.Future[Reply], inputs: Any, entry: _Entry | None = None
    ) -> None:
        """Send the request (see :meth:`_send`); its answer comes to :meth:`_done`, or,
        first, the watch's verdict on it to :meth:`_overdue`."""
        sent = self._send(attempt, inputs, entry, "infer")
        if isinstance(sent, tuple):
            entry, call = sent
            flight = attempt.watch(entry, partial(self._overdue, attempt, out, inputs, entry))
            call.add_done_callback(partial(self._done, attempt, out, inputs, entry, flight))
        else:
            _resolve(out, sent)  # type: ignore[arg-type]

    @staticmethod
    def _send(
        attempt: _Attempt, inputs: Any, entry: _Entry | None, how: str
    ) -> tuple[_Entry, Any] | Final:
        """Send the request to ``entry`` (a node out of reach, asked again under the
        same id) or to the next candidate, until a node takes the call (the handle's
        ``how``: ``infer`` or ``send``): that node and its call, or the final answer
        when no node is left to try (or sending failed: never leave a caller waiting)."""
        try:
            while True:
                entry = entry or attempt.next_node()
                if entry is None:
                    return attempt.give_up()
                try:
                    return entry, getattr(entry.handle, how)(attempt.request_now, inputs)
                except NodeGone:
                    attempt.lost(entry, sent=False)
                    entry = None
        except Exception as exc:
            log.exception("dispatch of %s failed", attempt.request.id)
            return attempt.broken(exc)

    def _done(
        self,
        attempt: _Attempt,
        out: cf.Future[Reply],
        inputs: Any,
        entry: _Entry,
        flight: Flight | None,
        call: cf.Future[Reply],
    ) -> None:
        """A node answered (on whatever thread completed the call). Further attempts
        go to the dispatcher's own thread: completion threads may belong to Ray."""
        if flight is not None and not attempt.claim(flight):
            return  # given up by the watch already: the request went on without it
        try:
            outcome = self._outcome(attempt, entry, call.exception() or call.result())
        except Exception as exc:
            log.exception("answer to %s failed", attempt.request.id)
            outcome = attempt.broken(exc)
        self._then(attempt, out, inputs, entry, outcome)

    def _overdue(
        self, attempt: _Attempt, out: cf.Future[Reply], inputs: Any, entry: _Entry, why: str
    ) -> None:
        """The watch gave up the call on ``entry`` (on its thread)."""
        try:
            outcome = attempt.overdue(entry, why)
        except Exception as exc:
            log.exception("giving up %s failed", attempt.request.id)
            outcome = attempt.broken(exc)
        self._then(attempt, out, inputs, entry, outcome)

    def _then(
        self,
        attempt: _Attempt,
        out: cf.Future[Reply],
        inputs: Any,
        entry: _Entry,
        outcome: Final | float | None,
    ) -> None:
        """Act on what a call's end means (see :meth:`_outcome`)."""
        if isinstance(outcome, float):  # out of reach: ask the same node again later
            again = threading.Timer(outcome, self._try, (attempt, out, inputs, entry))
            again.daemon = True
            again.start()
        elif outcome is None:
            try:
                self._retries.submit(self._try, attempt, out, inputs)
            except RuntimeError:  # closed: _try ends it Cancelled, sending nothing
                self._try(attempt, out, inputs)
        else:
            _resolve(out, outcome)  # type: ignore[arg-type]

    @staticmethod
    def _outcome(
        attempt: _Attempt, entry: _Entry, answer: Reply | BaseException
    ) -> Final | float | None:
        """What ``entry``'s answer to an inference means: the final answer; seconds to
        wait before asking the same node again (out of reach for now); or None: place
        it on the next node (refused, evicted, or its node lost)."""
        if isinstance(answer, NodeUnavailable):
            delay = attempt.wait_same(entry)
            return attempt.lost(entry) if delay is None else delay
        if isinstance(answer, NodeGone):
            return attempt.lost(entry)
        if isinstance(answer, BaseException):
            raise answer
        return attempt.settle(entry, answer)

    def call(
        self, request: InferRequest, inputs: Any = None, timeout_s: float | None = None
    ) -> Reply:
        """Place ``request`` and wait for its one :class:`Reply` on this thread: the
        same attempts as :meth:`submit`, without handing the reply between threads
        (what a sequential caller waits for)."""
        ((_, reply),) = self.pipeline([(request, inputs)], 1, timeout_s)
        return reply

    def pipeline(
        self,
        requests: Iterable[tuple[InferRequest, Any] | Reply],
        in_flight: int,
        timeout_s: float | None = None,
    ) -> Iterator[tuple[int, Reply]]:
        """Place each of ``requests`` (a request and its ``inputs``, as :meth:`submit`
        takes them) with at most ``in_flight`` unanswered, and yield each one's index
        and its one :class:`Reply` as the answers come, in that order. An item that is
        a Reply already (a request the caller could not even build) is answered so.

        The answers are waited for on the calling thread, many at a time, and nothing
        runs on another thread (where :meth:`submit` hands each reply over from Ray's):
        for a caller that keeps many requests in flight. Requests are drawn from
        ``requests`` only as answers make room. A consumer that stops early leaves the
        requests it sent to finish on their nodes, unread. ``timeout_s``: the longest
        each request may take, from when it is drawn (see :meth:`submit`).
        """
        if in_flight < 1:  # at the call, not at the first answer
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        return self._pipeline(requests, in_flight, timeout_s)

    def _pipeline(
        self,
        requests: Iterable[tuple[InferRequest, Any] | Reply],
        in_flight: int,
        timeout_s: float | None,
    ) -> Iterator[tuple[int, Reply]]:
        source = enumerate(requests)
        # call -> its request: (index, attempt, node, inputs, the watch's flight)
        flying: dict[Any, tuple[int, _Attempt, _Entry, Any, Flight | None]] = {}
        later: list[tuple[float, int, _Attempt, _Entry, Any]] = []  # heap: asking again
        # (when, the request's index, ...): a request is in ``later`` at most once
        overdue: deque[tuple[Any, str]] = deque()  # calls the watch gave up, and why
        answered: list[tuple[int, Reply]] = []
        unanswered = 0
        more = True

        def send(i: int, attempt: _Attempt, inputs: Any, entry: _Entry | None = None) -> None:
            sent = self._send(attempt, inputs, entry, "send")
            if isinstance(sent, tuple):
                entry, call = sent
                flight = attempt.watch(entry, lambda why: overdue.append((call, why)))
                flying[call] = (i, attempt, entry, inputs, flight)
            else:
                answered.append((i, sent))  # type: ignore[arg-type]

        def act(i: int, attempt: _Attempt, entry: _Entry, inputs: Any, outcome: Any) -> None:
            if isinstance(outcome, float):
                due = self._clock.now() + outcome
                heapq.heappush(later, (due, i, attempt, entry, inputs))
            elif outcome is None:
                send(i, attempt, inputs)
            else:
                answered.append((i, outcome))

        try:
            while True:
                while more and unanswered < in_flight:
                    try:
                        i, item = next(source)
                    except StopIteration:
                        more = False
                        break
                    unanswered += 1
                    if isinstance(item, Reply):
                        answered.append((i, item))
                    else:
                        request, inputs = item
                        send(i, _Attempt(self, request, inputs, timeout_s), inputs)
                while overdue:
                    call, why = overdue.popleft()
                    i, attempt, entry, inputs, _ = flying.pop(call)
                    outcome: Final | float | None
                    try:
                        outcome = attempt.overdue(entry, why)
                    except Exception as exc:
                        log.exception("giving up %s failed", attempt.request.id)
                        outcome = attempt.broken(exc)
                    act(i, attempt, entry, inputs, outcome)
                if answered:
                    unanswered -= len(answered)
                    ready, answered[:] = answered[:], []
                    yield from ready
                    continue
                if not unanswered:
                    return
                now = self._clock.now()
                while later and later[0][0] <= now:
                    _, i, attempt, entry, inputs = heapq.heappop(later)
                    send(i, attempt, inputs, entry)
                wait_s = min(later[0][0] - now, PIPELINE_WAIT_S) if later else PIPELINE_WAIT_S
                if not flying:
                    time.sleep(max(0.0, wait_s))
                    continue
                if timeout_s is not None:  # a request the watch gives up is answered then
                    first = min(attempt.give_up_at for _, attempt, _, _, _ in flying.values())
                    wait_s = min(wait_s, max(TIMEOUT_POLL_S, first - now + TIMEOUT_POLL_S))
                handle = next(iter(flying.values()))[2].handle
                for call, answer in handle.wait(list(flying), wait_s):
                    i, attempt, entry, inputs, flight = flying[call]
                    if flight is not None and not attempt.claim(flight):
                        continue  # given up by the watch: ``overdue`` has it
                    del flying[call]
                    try:
                        outcome = self._outcome(attempt, entry, answer)
                    except Exception as exc:
                        log.exception("answer to %s failed", attempt.request.id)
                        outcome = attempt.broken(exc)
                    act(i, attempt, entry, inputs, outcome)
        finally:  # the consumer stopped early (or failed): stop counting what is left
            for _, attempt, entry, _, flight in flying.values():
                if flight is not None:
                    attempt.claim(flight)  # the watch lets it be
                attempt.abandoned(entry)
            for _, _, attempt, entry, _ in later:
                attempt.abandoned(entry)

    def stream(
        self, request: GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[TokenChunk | GenerationResult]:
        """Place a generation and yield its tokens; the last item is its result.

        A refusal spills to the next node. When the node dies mid-stream, or stays
        silent past the stream's limit and does not answer a probe, the generation
        continues on another node from the tokens already sent (prompt plus output so
        far), so the caller sees each token once. ``timeout_s``: the longest the whole
        generation may take; past it, it ends :class:`TimedOut` with the tokens sent.
        """
        attempt = _Attempt(self, request, timeout_s=timeout_s)
        while True:
            entry = attempt.next_node()
            if entry is None:
                yield attempt.give_up()  # type: ignore[misc]
                return
            final: Final | None = None
            try:
                for item in self._items(attempt, entry):
                    if isinstance(item, TokenChunk):
                        attempt.tokens.extend(item.tokens)
                        yield item
                    else:
                        final = item
            except _Overdue as given_up:
                final = attempt.overdue(entry, given_up.why)
            except NodeGone:
                final = attempt.lost(entry)
            except Exception as exc:  # a typed answer, never a raw error (as call() gives)
                log.exception("stream of %s failed", request.id)
                final = attempt.broken(exc)
            except BaseException:  # the consumer went away, or worse: stop counting it
                attempt.abandoned(entry)
                raise
            else:
                final = attempt.settle(entry, final)
            if final is not None:
                yield final  # type: ignore[misc]
                return

    def _items(self, attempt: _Attempt, entry: _Entry) -> Iterator[TokenChunk | GenerationResult]:
        """A generation's stream from ``entry``; with calls watched, a stream silent past
        its limit (its budget, the request's deadline before the first token) has its
        node probed, and raises :class:`_Overdue` past the request's timeout (silent or
        not: a slow node's tokens do not stretch it) or when the node does not answer
        (the probe waits no longer than the timeout leaves)."""
        request = attempt.request_now
        if self._watch is None:
            yield from entry.handle.generate(request)  # type: ignore[misc,arg-type]
            return
        budget = attempt.budget_s()
        due = self._clock.now() + budget
        deadline = request.deadline_unix
        if deadline is not None:
            due = min(due, self._clock.now() + max(0.0, deadline - time.time()))
        wait_s = min(PIPELINE_WAIT_S, budget)
        if attempt.give_up_at != math.inf:  # a silence past the timeout ends it promptly
            wait_s = min(wait_s, STREAM_TIMEOUT_SLICE_S)
        for item in entry.handle.generate(request, wait_s):  # type: ignore[arg-type]
            now = self._clock.now()
            if now >= attempt.give_up_at:
                raise _Overdue(TIMED_OUT)
            if item is not None:
                entry.answered_at = now
                due = now + budget
                yield item
            elif now >= due:  # as CallWatch judges a call (cluster/limits.py)
                r = self.config.router
                probe_s = min(r.probe_timeout_s, attempt.give_up_at - now)
                answer = None
                if entry.healthy:
                    answer = entry.handle.probe([request.id], probe_s)
                after = self._clock.now()
                if answer is None and after - entry.heard_at >= r.lost_after_s:
                    raise _Overdue(TIMED_OUT if after >= attempt.give_up_at else UNRESPONSIVE)
                due = self._clock.now() + budget

    # -------------------------------------------------------------------- helpers

    def _pick(
        self, request: PlacementRequest, tried: set[str], request_id: str
    ) -> tuple[_Entry, float] | None:
        """The best node not tried yet, and the seconds the request is expected to take
        there (when calls are watched: their limits follow from it); counts the request
        in flight there."""
        now = self._clock.now()
        with self._lock:
            views = [e.view(now, self._unseen_per_s) for e in self._considered(request, tried)]
            crowd = self._crowd(request.priority)
            ranked = self._placement.rank(views, request, self._rng, crowd)
            if not ranked:
                return None
            self._placed[request.priority] += 1
            best = ranked[0]
            tried.add(best.name)
            entry = self._nodes[best.name]
            cost = request.rows * row_cost(best, request.model)
            entry.sent(request_id, _Sent(request.priority, cost, now))
            expected = 0.0
            if self._watch is not None:
                expected = sum(scorer.cost(best, request) for scorer in self._expected)
            return entry, expected

    def _considered(self, request: PlacementRequest, tried: set[str]) -> list[_Entry]:
        """The nodes placement weighs for ``request``: every node serving its model that
        it has not tried, or, when there are more than ``candidates``, that many drawn at
        random, plus the nodes holding its session (a large fleet is never scanned)."""
        serving = self._serving.get(request.model, ())
        if request.version is not None:
            serving = [e for e in serving if e.versions.get(request.model) == request.version]
        k = self._candidates
        if len(serving) <= k + len(tried):
            return [e for e in serving if e.name not in tried]
        picked = _draw(self._rng, serving, k + len(tried))
        if tried:
            picked = [e for e in picked if e.name not in tried]
            del picked[k:]
        if request.session is not None:
            names = {e.name for e in picked}
            # in name order: a set's order changes with the process (string hashing),
            # and the picker may choose by position
            for name in sorted(self._sessions.get(request.session, ())):
                if name not in names and name not in tried:
                    picked.append(self._nodes[name])
        return picked

    def _release(self, entry: _Entry, request_id: str) -> None:
        with self._lock:
            entry.done(request_id)

    def _lose(self, entry: _Entry) -> None:
        with self._lock:
            if entry.healthy:
                entry.lose(self._clock.now())

    def unknown_model(self, model: str, request_id: str | None = None) -> ModelNotFound | None:
        """None when some node serves ``model`` (or a pool member will, once one joins),
        at its version when it names one (``name@version``), else the error that says
        which models, or versions, the fleet serves."""
        name, version = split_version(model)
        if name not in self._served:
            known = ", ".join(sorted(self._served)) or "none"
            return ModelNotFound(
                f"no node serves model {name!r}; the fleet serves: {known}", request_id=request_id
            )
        if version is None:
            return None
        with self._lock:
            versions = {e.versions.get(name) for e in self._serving.get(name, ())}
        if version in versions or not versions:  # no member yet: one may come with it
            return None
        served = ", ".join(sorted(v or "unversioned" for v in versions))
        return ModelNotFound(
            f"no node serves model {name!r} at version {version!r}; it serves: {served}",
            request_id=request_id,
        )

    def refusal(
        self, request: Request, refusals: list[Rejected], tried: set[str]
    ) -> EdgeFleetError:
        if refusals:
            return Rejected(
                f"every node refused the request ({len(refusals)} tried): {refusals[-1]}",
                retry_after_s=min(
                    (r.retry_after_s for r in refusals if r.retry_after_s > 0), default=1.0
                ),
                request_id=request.id,
            )
        with self._lock:
            serving = list(self._serving.get(request.model, ()))
        healthy = [e for e in serving if e.healthy and e.name not in tried]
        if not healthy:
            return NodeLost(
                f"no healthy node serves model {request.model!r} right now",
                request_id=request.id,
            )
        with self._lock:
            open_ = [
                e for e in healthy if not e.base.draining and request.model not in e.base.moving
            ]
        if not open_:
            wait_s = max(DRAINING_RETRY_S, self.config.router.report_interval_s)
            return Rejected(
                f"every node serving {request.model!r} is draining, starting or moving it to "
                f"another version, and takes no new work for it; try again in {wait_s:g} s",
                retry_after_s=wait_s,
                request_id=request.id,
            )
        limit = self._shed.limit(request.priority)
        self._count("shed")
        self._metrics.shed(request.priority)
        return Rejected(
            f"shed: every node serving {request.model!r} is over {limit:.0%} full, the share "
            f"priority-{request.priority} work may use; capacity is kept for urgent work",
            retry_after_s=self._shed_retry_after(open_, limit),
            request_id=request.id,
        )

    def _shed_retry_after(self, entries: list[_Entry], limit: float) -> float:
        """When a shed request should come back: after the node drains below ``limit``
        *and* the requests shed before it, still waiting, have had their turn: this
        caller's and, as the router last told, every other caller's. Without that queue
        of waiters every shed client would retry at the same moment; without the other
        callers' waiters, N callers would each send theirs back N times too early."""
        now = self._clock.now()
        with self._lock:
            self._drop_due(now)
            waits = []
            for e in entries:
                view = e.view(now, self._unseen_per_s)
                per_row = max(view.row_cost_s.values(), default=UNTIMED_ROW_COST.caller_s)
                excess = sum(view.work.values()) + view.unseen + 1 - int(limit * view.capacity)
                waits.append((view.running_left_s + max(1, excess) * per_row, per_row))
            first, per_row = min(waits)
            # The nodes take the waiters in turn, in parallel.
            waiting = len(self._shed_waiting) + self._shed_elsewhere
            delay = first + waiting * per_row / len(entries)
            heapq.heappush(self._shed_waiting, now + delay)
        return max(0.001, delay)

    def _drop_due(self, now: float) -> None:
        while self._shed_waiting and self._shed_waiting[0] <= now:
            heapq.heappop(self._shed_waiting)


class _Overdue(Exception):
    """A stream given up (see :mod:`cluster.limits`: ``why`` is TIMED_OUT or
    UNRESPONSIVE)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Attempt:
    """One request's way through the fleet: which nodes it tried, what they said, what
    it has streamed so far. The single place that decides spill, re-placement,
    continuation after a node loss and the final refusal."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        request: Request,
        inputs: Any = None,
        timeout_s: float | None = None,
    ) -> None:
        self.d = dispatcher
        self.error: EdgeFleetError | None = dispatcher.unknown_model(request.model, request.id)
        name, version = split_version(request.model)
        if version is not None:  # `name@version`: the node checks the version it serves
            request = replace(request, model=name, version=version)
        session = request.session if isinstance(request, GenerateRequest) else None
        rows = dispatcher.rows(request) if self.error is None else 1
        self.preq = PlacementRequest(
            request.model, request.priority, rows, session, request.version
        )
        if inputs is not None and isinstance(request, InferRequest):
            # The inputs travel apart (an object reference): priced above, not sent twice.
            request = replace(request, inputs={})
        self.request = request
        self.request_now: Request = request  # a continuation after a node loss differs
        self.started = dispatcher._clock.now()
        self.timeout_s = timeout_s
        self.give_up_at = math.inf if timeout_s is None else self.started + timeout_s
        self.expected_s = 0.0  # on the node it was sent to last, as placement expected
        # Wall-clock arrival, for the call record: the dispatcher's clock may be monotonic.
        self.arrived = time.time() if dispatcher._record is not None else 0.0
        self.tried: set[str] = set()
        self.refusals: list[Rejected] = []
        self.evicted: Final | None = None
        self.tokens: list[int] = []  # streamed to the caller so far
        self.attempts = 0
        self.unreachable: tuple[str, float, int] | None = None  # node, since, retries
        dispatcher._count("received")

    def next_node(self) -> _Entry | None:
        if self.error is None:
            if self.d.closed:
                self.error = Cancelled("the client was closed", request_id=self.request.id)
            elif self.d._clock.now() >= self.give_up_at:
                self.error = self.timed_out()
        if self.error is not None or self.attempts >= self.d.config.router.max_attempts:
            return None
        picked = self.d._pick(self.preq, self.tried, self.request.id)
        if picked is None:
            return None
        entry, self.expected_s = picked
        return entry

    def timed_out(self) -> TimedOut:
        return TimedOut(
            f"no answer within timeout_s={self.timeout_s:g}; the request was cancelled "
            f"where it was (tried: {', '.join(sorted(self.tried)) or 'none'})",
            request_id=self.request.id,
        )

    def budget_s(self) -> float:
        """How long a call may stay unanswered before its node is asked about it."""
        cfg = self.d.config.router
        return cfg.call_limit_factor * self.expected_s + cfg.call_grace_s

    def watch(self, entry: _Entry, on_overdue: Callable[[str], None]) -> Flight | None:
        """Give the call just sent to ``entry`` its limit: the request's deadline or its
        budget (:meth:`budget_s`), whichever comes first; None when calls are not
        watched."""
        w = self.d._watch
        if w is None:
            return None
        budget = self.budget_s()
        due = self.d._clock.now() + budget
        deadline = self.request.deadline_unix
        if deadline is not None:
            due = min(due, self.d._clock.now() + max(0.0, deadline - time.time()))
        return w.add(entry, self.request.id, due, budget, self.give_up_at, on_overdue)

    def claim(self, flight: Flight) -> bool:
        """See :meth:`cluster.limits.CallWatch.claim`."""
        assert self.d._watch is not None
        return self.d._watch.claim(flight)

    def overdue(self, entry: _Entry, why: str) -> Final | None:
        """The watch gave up the call on ``entry``: past the request's timeout, its final
        answer; its node unresponsive, as after a node loss (None: the next node). The
        node is told to drop it, best effort."""
        entry.handle.forget(self.request.id)
        if why == TIMED_OUT:
            return self.fail(self.timed_out())
        return self.lost(
            entry,
            how=f"did not answer within {self.d.config.router.probe_timeout_s:g} s while it "
            "held the request",
        )

    def release(self, entry: _Entry) -> None:
        self.d._release(entry, self.request.id)

    def wait_same(self, entry: _Entry) -> float | None:
        """How long to wait before asking ``entry``'s node again, out of reach as it
        is; None once it has been so for ``router.lost_after_s`` (place elsewhere), or
        at once for an at-most-once request (a restarted node would run it again)."""
        if self.request.at_most_once:
            return None
        now = self.d._clock.now()
        name = entry.name
        if self.unreachable is None or self.unreachable[0] != name:
            self.unreachable = (name, now, 0)
        _, since, tries = self.unreachable
        if now - since >= self.d.config.router.lost_after_s:
            return None
        self.unreachable = (name, since, tries + 1)
        backoff = min(UNREACHABLE_MAX_WAIT_S, UNREACHABLE_FIRST_WAIT_S * 2**tries)
        return backoff * (0.5 + self.d._jitter.random())

    def lost(
        self, entry: _Entry, *, sent: bool = True, how: str = "was lost while it held the request"
    ) -> Final | None:
        """``entry``'s node died with the request (or stopped answering: ``how``):
        place it again (a generation goes on from the tokens sent). None: try the next
        node. An at-most-once request the node may have run (it was ``sent``) ends
        NodeLost instead."""
        self.release(entry)
        self.d._lose(entry)
        r = self.request
        if r.at_most_once and sent:
            return self.fail(
                NodeLost(
                    f"node {entry.name} {how}, which may have run there; an at_most_once "
                    "request is not sent again",
                    request_id=r.id,
                )
            )
        self.d._count("replaced")
        self.d._metrics.replaced(self.request.priority, "node_lost")
        if isinstance(r, GenerateRequest) and self.tokens:
            left = r.max_new_tokens - len(self.tokens)
            if left <= 0:
                return self.finish(GenerationResult(r.id, "", finish_reason="length"))
            self.request_now = replace(
                r, prompt_ids=(*r.prompt_ids, *self.tokens), continued=len(self.tokens)
            )
        return None

    def settle(self, entry: _Entry, answer: Final | None) -> Final | None:
        """The node answered. None: try the next node (it refused or evicted, and
        nothing was streamed yet)."""
        entry.answered_at = self.d._clock.now()
        self.release(entry)
        self.attempts += 1
        if answer is None:  # cannot happen with a live node: its stream ends with one
            err = NodeLost(f"node {entry.name} ended the stream without a result")
            answer = GenerationResult(self.request.id, entry.name, error=err)
        if not self.tokens:
            if isinstance(answer.error, Rejected):
                self.refusals.append(answer.error)
                self.d._count("spilled")
                self.d._metrics.spilled(self.request.priority)
                return None
            if isinstance(answer.error, Evicted):
                self.evicted = answer
                self.d._count("replaced")
                self.d._metrics.replaced(self.request.priority, "evicted")
                return None
        return self.finish(answer)

    def give_up(self) -> Final:
        """No node left to try: the eviction, or a refusal naming why."""
        if self.evicted is not None:
            return self.finish(self.evicted)
        error = self.error or self.d.refusal(self.request, self.refusals, self.tried)
        return self.finish(_failure(self.request, error))

    def broken(self, exc: Exception) -> Reply:
        err = NodeLost(f"dispatch failed: {type(exc).__name__}: {exc}", request_id=self.request.id)
        return self.fail(err)  # type: ignore[return-value]

    def fail(self, error: EdgeFleetError) -> Final:
        """End the request with ``error``; it is no longer in flight anywhere."""
        for name in self.tried:
            entry = self.d._nodes.get(name)  # a pool member may have left since
            if entry is not None:
                self.d._release(entry, self.request.id)
        return self.finish(_failure(self.request, error))

    def finish(self, answer: Final) -> Final:
        """The request's final answer: counted, measured and recorded, once."""
        if isinstance(answer, GenerationResult):
            answer = replace(answer, tokens=tuple(self.tokens))
        kind = _kind(answer.error)
        latency_s = self.d._clock.now() - self.started
        self.d._count(kind)
        self.d._metrics.answered(self.request, answer.error, latency_s)
        self.record(kind, latency_s, answer.node, answer)
        return answer

    def abandoned(self, entry: _Entry) -> None:
        """The caller stopped reading the generation before its end: it gets no answer,
        and its line in the call record says cancelled."""
        self.release(entry)
        self.record("cancelled", self.d._clock.now() - self.started, entry.name)

    def record(
        self, outcome: str, latency_s: float, node: str, answer: Final | None = None
    ) -> None:
        """Append the request's line to the dispatcher's call record, if it keeps one
        (with the node's figures of ``answer``, the final answer, when there is one)."""
        record = self.d._record
        if record is not None:
            record.answered(
                self.request,
                at=self.arrived,
                rows=self.preq.rows,
                outcome=outcome,
                latency_s=latency_s,
                node=node,
                answer=answer,
            )


def _failure(request: Request, error: EdgeFleetError) -> Final:
    if isinstance(request, GenerateRequest):
        return GenerationResult(request.id, "", error=error)
    return Reply(request.id, "", error=error)


def _kind(error: EdgeFleetError | None) -> str:
    return "completed" if error is None else type(error).__name__.lower()


def _resolve(out: cf.Future[Reply], reply: Reply) -> None:
    if not out.done():
        out.set_result(reply)
