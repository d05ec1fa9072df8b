"""A fleet in simulated time: the real node scheduler and the real placement.

Each simulated node runs :class:`actors.scheduler.LocalScheduler` (priorities,
admission and eviction, dedup, the batching window, deadlines, preemption, pause and
resume of generations, starvation bounds) on a simulated clock, with engine time taken
from a cost model instead of an engine. Above the nodes, one
:class:`cluster.dispatch.Dispatcher` places every request: the same pipeline, view
ageing, spill, shedding and re-placement a live caller runs, on node reports that
arrive every ``router.report_interval_s`` and are as old as the simulated network makes
them. Only the driving differs: events on a heap instead of Ray calls and threads.
Nodes fail and rejoin (:meth:`SimFleet.fail`), or, as pool members, leave and come back
as new members, what they held waiting until the head declares them dead
(:meth:`SimFleet.leave`, :meth:`SimFleet.join`).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import heapq
import itertools
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

from actors.metrics import NullSink
from actors.scheduler import (
    BUSY_WINDOW_S,
    LocalScheduler,
    Outcome,
    Plan,
    configured_batch_limit,
    rules_for,
)
from cluster.dispatch import Dispatcher, FleetView, NodeGone
from cluster.metrics import RouterMetrics
from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.messages import (
    MAX_REPORTED_SESSIONS,
    GenerationResult,
    ModelStatus,
    NodeState,
    NodeStatus,
    Reply,
)
from edgefleet.request import GenerateRequest, InferRequest, Request, RequestState, input_rows
from policies import call_cost
from policies.budget import TokenBudgets, token_limit

S = RequestState
SAMPLE_EVERY_S = 0.05  # queue length over time: one sample per this much simulated time
MEMBER_POOL = "devices"  # the pool of a churning fleet's simulated devices


# ---------------------------------------------------------------------------- events


class EventLoop:
    """Simulated time: callbacks on a heap, run in time order (ties in the order they
    were scheduled)."""

    def __init__(self) -> None:
        self.t = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def now(self) -> float:
        return self.t

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.t), next(self._seq), fn, args))

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.t, fn, *args)

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        heap = self._heap
        while heap and not until():
            t, _, fn, args = heapq.heappop(heap)
            self.t = t
            self.events += 1
            fn(*args)

    @property
    def pending(self) -> int:
        return len(self._heap)


class LoopExecutor(cf.Executor):
    """Runs the dispatcher's further attempts as events (where a live caller hands them
    to a thread)."""

    def __init__(self, loop: EventLoop) -> None:
        self._loop = loop

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        self._loop.soon(lambda: fn(*args, **kwargs))
        return cf.Future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


# ------------------------------------------------------------------------- engine time


class Drawn(NamedTuple):
    """One engine call's draw (:meth:`ModelCost.draw`), in seconds."""

    seconds: float  # its engine time
    outside_s: float | None  # its requests' time outside the node; None: not recorded
    handoff_s: float = 0.0  # the node's time from being ready for the call to its start


@dataclass(frozen=True)
class ModelCost:
    """Engine time of one model on a node of speed 1: ``call_ms`` by batch rows
    (linear between the sizes given, the last size's cost per row beyond it); for a
    decoder, prefill per prompt token and one decode step by generations decoding
    together.

    ``samples_ms``, when given, are engine times of calls a live fleet ran (ms, by
    batch size, as a call record has them): each call then takes one of them drawn at
    random (:meth:`draw_s`), the spread and tail of the recorded run included, where
    ``call_ms`` stays the table nodes report and price calls by. With ``window_s`` and
    ``samples_at_s`` (when each recorded call started, seconds into the recorded run,
    ascending) a call draws among the calls recorded within ``window_s`` of its own
    time into the run (the recorded run repeating when the simulation is longer), so
    the stretches in which the recorded machine ran slow come back together instead of
    spread over the run. ``samples_outside_ms`` (NaN where unknown), when given, is the
    time each recorded call's request spent outside its node; a drawn call's answers
    spend that time (:meth:`draw`), for on a busy machine a slow call and a slow way
    back come together. ``samples_handoff_ms`` (NaN where unknown), when given, is each
    recorded call's hand-off: the node's time from being ready for the call (the call
    before it ended, or it was planned) to starting it, its own bookkeeping and thread
    hand-over; a drawn call starts that much later, the node doing nothing else
    meanwhile. ``abort_ms``, when given, are the recorded waits for an aborted call to
    stop (``abort_ms`` of the lines of the calls that ran next, one per request): a node
    that aborts a call for a more urgent arrival or a cancel lets it run on for one of
    them, drawn at random (:meth:`abort_s`), as a live engine stops only at its next
    look at the abort flag. ``by_node``, when given, holds the same for each recorded
    node alone: a node of that name draws its own device's calls first (:meth:`draw`),
    for a machine that runs slow often runs slow for one node and not the others."""

    call_ms: Mapping[int, float] = field(default_factory=dict)
    prefill_ms_per_token: float = 0.0
    step_ms: Mapping[int, float] = field(default_factory=dict)
    samples_ms: Mapping[int, Sequence[float]] = field(default_factory=dict)
    samples_at_s: Mapping[int, Sequence[float]] = field(default_factory=dict)
    samples_outside_ms: Mapping[int, Sequence[float]] = field(default_factory=dict)
    samples_handoff_ms: Mapping[int, Sequence[float]] = field(default_factory=dict)
    abort_ms: Sequence[float] = ()
    window_s: float = 0.0
    by_node: Mapping[str, ModelCost] = field(default_factory=dict)
    # A decoder's recorded generations' times outside their nodes (ms), by the tokens
    # each made: an answer spends one drawn at random among those that made the
    # nearest count (generation_outside_s); none: the network's hop.
    generation_outside_ms: Mapping[int, Sequence[float]] = field(default_factory=dict)

    def call_s(self, rows: int) -> float:
        return _interpolate(self.call_ms, rows) / 1000.0

    def draw_s(self, rows: int, rng: random.Random, now: float = 0.0) -> float:
        """Engine seconds of one call of ``rows`` starting ``now`` (see :meth:`draw`)."""
        return self.draw(rows, rng, now)[0]

    def draw(
        self, rows: int, rng: random.Random, now: float = 0.0, node: str | None = None
    ) -> Drawn:
        """Engine seconds of one call of ``rows`` starting ``now``, the seconds its
        answers spend outside the node (None: not recorded) and its hand-off (0: not
        recorded): a recorded call of that batch size drawn uniformly from ``rng``
        (within ``window_s`` of ``now`` when in time, any when none was recorded
        there); of the nearest recorded size (the smaller at a tie) scaled by the ratio
        of the two sizes' ``call_ms`` when none was recorded; the table's
        (:meth:`call_s`, no draw) without recorded calls. A ``node`` of ``by_node``
        draws among the calls it ran itself of that size (within the window when in
        time) when it ran any, else as any node does."""
        if not self.samples_ms:
            return Drawn(self.call_s(rows), None)
        own = self.by_node.get(node) if node is not None else None
        if own is not None and rows in own.samples_ms:
            drawn = own._pick(rows, rng, self._into_run(rows, now), anywhere=False)
            if drawn is not None:
                return drawn
        size = rows
        if size not in self.samples_ms:
            size = min(self.samples_ms, key=lambda n: (abs(n - rows), n))
        drawn = self._pick(size, rng, self._into_run(size, now), anywhere=True)
        assert drawn is not None
        if size != rows:
            base = _interpolate(self.call_ms, size)
            scale = _interpolate(self.call_ms, rows) / base if base > 0 else rows / size
            drawn = drawn._replace(seconds=drawn.seconds * scale)
        return drawn

    def abort_s(self, rng: random.Random, node: str | None = None) -> float:
        """Seconds an aborted call runs on before it stops: one of ``abort_ms`` drawn
        from ``rng`` (those of ``node`` when it has any), 0 when none was recorded."""
        own = self.by_node.get(node) if node is not None else None
        waits = own.abort_ms if own is not None and own.abort_ms else self.abort_ms
        return waits[rng.randrange(len(waits))] / 1000.0 if waits else 0.0

    def _into_run(self, size: int, now: float) -> float:
        """``now`` as a time into the recorded run of ``size``-row calls, which repeats."""
        starts = self.samples_at_s.get(size)
        return now % starts[-1] if starts and starts[-1] > 0 else now

    def _pick(self, size: int, rng: random.Random, t: float, anywhere: bool) -> Drawn | None:
        """One recorded call of ``size`` rows (which there are): within the window of
        ``t`` into the recorded run when in time; when none is there, any
        (``anywhere``) or None."""
        samples = self.samples_ms[size]
        starts = self.samples_at_s.get(size) if self.window_s > 0 else None
        if starts:
            lo = bisect.bisect_left(starts, t - self.window_s)
            hi = bisect.bisect_right(starts, t + self.window_s)
            if hi > lo:
                i = lo + int(rng.random() * (hi - lo))
            elif anywhere:
                i = rng.randrange(len(samples))
            else:
                return None
        else:
            i = rng.randrange(len(samples))
        outside = self.samples_outside_ms.get(size)
        outside_s = outside[i] / 1000.0 if outside and not math.isnan(outside[i]) else None
        handoff = self.samples_handoff_ms.get(size)
        handoff_s = handoff[i] / 1000.0 if handoff and not math.isnan(handoff[i]) else 0.0
        return Drawn(samples[i] / 1000.0, outside_s, handoff_s)

    def step_s(self, rows: int) -> float:
        return _interpolate(self.step_ms, rows) / 1000.0

    def generation_outside_s(self, made: int, rng: random.Random) -> float | None:
        """The time outside its node of a generation that made ``made`` tokens (its
        tokens stream back): one of ``generation_outside_ms`` of the nearest count made
        (the smaller at a tie), drawn from ``rng``; None when none was recorded."""
        if not self.generation_outside_ms:
            return None
        near = min(self.generation_outside_ms, key=lambda n: (abs(n - made), n))
        times = self.generation_outside_ms[near]
        return times[rng.randrange(len(times))] / 1000.0

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_ms_per_token / 1000.0

    def table_s(self, max_rows: int) -> dict[int, float]:
        """Cost per call by batch size, as a node measures it at warm-up (powers of two)."""
        sizes = sorted({1, *(2**i for i in range(1, 8) if 2**i <= max_rows), max_rows})
        return {n: self.call_s(n) for n in sizes}


def _interpolate(table: Mapping[int, float], rows: int) -> float:
    """``table`` (ms by rows) at ``rows``, as the scheduler prices calls; 0 for none."""
    return call_cost(tuple(sorted(table.items())), rows) if table else 0.0


# ------------------------------------------------------------------------------ nodes


class Host:
    """Simulated nodes sharing one machine's cores: while more engine calls run than it
    has cores, each inference call progresses at ``cores / running`` of its speed
    (processor sharing); a decode call takes the share of the moment it plans its next
    steps."""

    def __init__(self, loop: EventLoop, cores: float) -> None:
        self.loop = loop
        self.cores = cores
        self._running: dict[SimNode, _Call] = {}
        self._since = 0.0
        self._share = 1.0

    def share(self) -> float:
        n = len(self._running)
        return 1.0 if n <= self.cores else self.cores / n

    def start(self, node: SimNode, call: _Call) -> None:
        self._progress()
        self._running[node] = call
        self._reschedule()

    def stop(self, node: SimNode) -> None:
        if node in self._running:
            self._progress()
            del self._running[node]
            self._reschedule()

    def _progress(self) -> None:
        now = self.loop.t
        for call in self._running.values():
            if not call.gens:
                call.left_s -= (now - self._since) * self._share
        self._since = now

    def _reschedule(self) -> None:
        self._share = self.share()
        for node, call in self._running.items():
            if not call.gens:
                call.token = next(node._token)
                self.loop.at(self.loop.t + call.left_s / self._share, node._ended, call.token)


class _NodeClock:
    """A node's clock: simulated time, or the time a report is made at."""

    def __init__(self, loop: EventLoop) -> None:
        self._loop = loop
        self.fixed: float | None = None

    def now(self) -> float:
        return self._loop.t if self.fixed is None else self.fixed


@dataclass
class _Gen:
    request: GenerateRequest
    limit: int
    made: int = 0
    prefilled: bool = False


@dataclass
class _Call:
    plan: Plan
    token: int  # the call's end event carries it; a stale event finds another token
    started: float
    gens: list[_Gen] = field(default_factory=list)
    step_s: float = 0.0  # decode: one step of the generations still running
    steps_from: float = 0.0  # decode: when the current run of steps began
    stop: bool = False  # decode: stop at the next token boundary
    left_s: float = 0.0  # inference on a shared host: engine work still to do
    outside_s: float | None = None  # inference: its requests' time outside the node, if drawn
    handoff_s: float = 0.0  # inference: from being planned to its engine start
    aborting: bool = False  # inference: aborted, it stops at its end event or the abort's


class SimNode:
    """One edge node: the real scheduler, a simulated engine.

    ``receive`` takes a request as the node actor's ``infer``/``generate`` would;
    ``answer(request_id, reply, outside_s)`` is called with each request's one answer,
    at the simulated time the node gives it; ``outside_s`` is the request's time outside
    the node in all (both hops, the caller's own work) when its engine call's draw gave
    one (a recorded call's, see :meth:`ModelCost.draw`), else None.
    """

    def __init__(
        self,
        loop: EventLoop,
        spec: NodeSpec,
        costs: Mapping[str, ModelCost],
        answer: Callable[[str, Reply | GenerationResult, float | None], None],
        *,
        speed: float = 1.0,
        host: Host | None = None,
        on_busy: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``rng`` draws the engine times of models with recorded calls (default: one
        seeded from the node's name)."""
        self.loop = loop
        self._rng = rng if rng is not None else random.Random(f"engine/{spec.name}")
        self.spec = spec
        self.speed = speed
        self.host = host
        self.alive = True
        self.lifecycle: str = spec.lifecycle
        self._answer = answer
        self._on_busy = on_busy
        self._costs = {m: costs[m] for m in spec.models if m in costs}  # the models it runs
        self.clock = _NodeClock(loop)
        self._budgets = TokenBudgets.of_classes(spec.token_budget, spec.priorities)
        self._model_status: dict[str, ModelStatus] = {}
        self._rules = {}
        for name, cfg in spec.models.items():
            cost = self._costs.get(name, ModelCost())
            table = {}  # what this node measures at warm-up: its own speed
            if cfg.kind == "tensor":
                table = {n: c / speed for n, c in cost.table_s(cfg.batching.max_batch_size).items()}
            batchable = cfg.kind == "tensor"  # no signature here: every tensor model batches
            limit = configured_batch_limit(cfg, batchable, table)
            self._rules[name] = rules_for(cfg, limit, table)
            self._model_status[name] = ModelStatus(
                name,
                True,
                batchable,
                limit,
                {k: v * 1000 for k, v in table.items()},
                None,
                1,
                kind=cfg.kind,
            )
        self._token = itertools.count()
        self._reset()

    def _reset(self) -> None:
        spec = self.spec
        self.sched = LocalScheduler.for_node(spec, self.clock, self._rules)
        self._call: _Call | None = None
        self._gens: dict[str, _Gen] = {}
        self._held: set[str] = set()  # requests here that have not been answered
        self._sessions: OrderedDict[str, None] = OrderedDict()  # chats held, oldest first
        self._followers: dict[str, list[str]] = {}  # dedup 'follow': newer id -> older ids
        self._wake_at: float | None = None
        self.last_change = self.loop.t

    # ------------------------------------------------------------------- intake

    def receive(self, request: InferRequest | GenerateRequest) -> None:
        """A request arrives (the simulated network's delay is the caller's to add)."""
        if not self.alive:
            return
        self.last_change = self.loop.t
        now = self.loop.t
        deadline = request.deadline_unix  # simulated time throughout
        if isinstance(request, GenerateRequest):
            limit = token_limit(
                request.max_new_tokens, request.priority, self.lifecycle, self._budgets
            )
            self._gens[request.id] = _Gen(request, max(0, limit - request.continued))
            req = Request.generation(request, now, deadline)
        else:
            model = self._model_status.get(request.model)
            rows = input_rows(request.inputs, model is None or model.batchable)
            req = Request(
                id=request.id,
                model=request.model,
                inputs=request.inputs,
                priority=request.priority,
                arrival=now,
                deadline=deadline,
                key=request.key,
                nbytes=4 * rows,
                rows=rows,
                group=request.model,
            )
        self._held.add(req.id)
        admission = self.sched.admit(req)
        if admission.preempt:
            self._abort(request.model)
        elif admission.join:
            self._stop_at_boundary()
        self._settle(admission.settled)
        if admission.accepted and deadline is not None:
            self.loop.at(deadline, self._expire, req.id)
        self._serve()

    def cancel(self, request_id: str) -> None:
        if not self.alive:
            return
        outcome, abort = self.sched.cancel(request_id)
        if abort:
            self._abort()
        elif (
            outcome is None
            and self._call is not None
            and any(g.request.id == request_id for g in self._call.gens)
        ):
            self._stop_at_boundary()
        if outcome is not None:
            self._settle([outcome])
        self._serve()

    def _expire(self, request_id: str) -> None:
        if not self.alive:
            return
        outcome = self.sched.expire(request_id)
        if outcome is not None:
            self._settle([outcome])
            self._serve()

    # ------------------------------------------------------------------- engine

    def _serve(self) -> None:
        """As the node's serve loop: run the next call, or look again when told to."""
        if self._call is not None or not self.alive:
            return
        step = self.sched.next_work()
        self._settle(step.settled)
        if step.plan is None:
            if step.wake_at is not None and step.wake_at != self._wake_at:
                self._wake_at = step.wake_at
                self.loop.at(step.wake_at, self._wake, step.wake_at)
            return
        plan = step.plan
        token = next(self._token)
        call = _Call(plan, token, self.loop.t)
        self._call = call
        if plan.requests[0].pausable:
            call.gens = [self._gens[r.id] for r in plan.requests]
            prefill = sum(
                self._costs[plan.model].prefill_s(len(g.request.prompt_ids))
                for g in call.gens
                if not g.prefilled
            )
            for g in call.gens:
                g.prefilled = True
            if self.host is not None:
                self.host.start(self, call)
            call.steps_from = self.loop.t + prefill / self._speed()
            self._next_finish(call)
        else:
            drawn = self._costs[plan.model].draw(plan.rows, self._rng, self.loop.t, self.spec.name)
            call.outside_s = drawn.outside_s
            call.handoff_s = drawn.handoff_s / self.speed  # the engine starts it after that
            seconds = call.handoff_s + drawn.seconds / self.speed
            if self.host is not None:
                call.left_s = seconds
                self.host.start(self, call)  # schedules the end
            else:
                self.loop.at(self.loop.t + seconds, self._ended, token)

    def _speed(self) -> float:
        return self.speed * (1.0 if self.host is None else self.host.share())

    def _wake(self, at: float) -> None:
        if self._wake_at == at:
            self._wake_at = None
            self._serve()

    def _ended(self, token: int) -> None:
        call = self._call
        if call is None or call.token != token or not self.alive:
            return  # aborted, or the node died meanwhile
        self._call = None
        self.last_change = self.loop.t
        self._busy(call)
        self._settle(
            self.sched.finish(call.plan),
            call.plan,
            call.outside_s,
            self.loop.t - call.started - call.handoff_s,
            call.handoff_s,
        )
        self._serve()

    def _abort(self, model: str | None = None) -> None:
        """Abort the running inference call for a more urgent arrival of ``model`` or a
        cancel (a generation is paused at its next token instead). It stops after a wait
        drawn from the recorded ones of the next call's model (:meth:`ModelCost.abort_s`),
        or at its own end when that comes first."""
        call = self._call
        if call is None or call.aborting:
            return
        if call.gens:
            self._stop_at_boundary()
            return
        cost = self._costs[model or call.plan.model]
        wait = cost.abort_s(self._rng, self.spec.name) / self.speed
        if wait > 0:
            call.aborting = True
            self.loop.at(self.loop.t + wait, self._aborted, call.token)
        else:
            self._aborted(call.token, serve=False)

    def _aborted(self, token: int, *, serve: bool = True) -> None:
        """An aborted call stops (unless it ended meanwhile); its requests go back to
        the queue."""
        call = self._call
        if call is None or call.token != token or not self.alive:
            return
        self._call = None
        self.last_change = self.loop.t
        self._busy(call)
        self._settle(self.sched.finish(call.plan, aborted=True))
        if serve:
            self._serve()

    # ------------------------------------------------------------------ decoding

    def _next_finish(self, call: _Call) -> None:
        """Schedule the decode call's next event: the first generation to reach its
        limit, or the next token boundary once a stop is asked for."""
        running = [g for g in call.gens if g.made < g.limit]
        if not running:
            self.loop.at(max(self.loop.t, call.steps_from), self._decoded, call.token)
            return
        call.step_s = self._costs[call.plan.model].step_s(len(running)) / self._speed()
        steps = min(g.limit - g.made for g in running)
        if call.stop:
            done = max(0.0, self.loop.t - call.steps_from)
            steps = min(steps, max(1, math.ceil(done / call.step_s - 1e-9)))
        self.loop.at(call.steps_from + steps * call.step_s, self._decoded, call.token)

    def _stop_at_boundary(self) -> None:
        call = self._call
        if call is None or not call.gens or call.stop:
            return
        call.stop = True
        self._advance(call)
        self._next_finish(call)

    def _advance(self, call: _Call) -> None:
        """Count the tokens made up to now into each running generation."""
        if self.loop.t <= call.steps_from or call.step_s <= 0:
            return
        steps = int((self.loop.t - call.steps_from) / call.step_s + 1e-9)
        running = [g for g in call.gens if g.made < g.limit]
        steps = min([steps, *(g.limit - g.made for g in running)])
        for g in running:
            g.made += steps
        call.steps_from += steps * call.step_s

    def _decoded(self, token: int) -> None:
        call = self._call
        if call is None or call.token != token or not self.alive:
            return
        self._advance(call)
        running = [g for g in call.gens if g.made < g.limit]
        if running and not call.stop:
            self._next_finish(call)  # one ended; the others decode on without it
            return
        self._call = None
        self.last_change = self.loop.t
        self._busy(call)
        preempted = self.sched.preempting
        pause = [g.request.id for g in running]
        outcomes = self.sched.finish(call.plan, paused=pause, preempted=preempted)
        self._settle(outcomes, call.plan)
        self._serve()

    # --------------------------------------------------------------- settlement

    def _busy(self, call: _Call) -> None:
        """A call ended (done, aborted or stopped)."""
        if self.host is not None:
            self.host.stop(self)
        if self._on_busy is not None:
            self._on_busy(self.loop.t - call.started)

    def _settle(
        self,
        outcomes: Sequence[Outcome],
        plan: Plan | None = None,
        outside_s: float | None = None,
        service_s: float = 0.0,
        handoff_s: float = 0.0,
    ) -> None:
        """Answer the requests ``outcomes`` settled; ``plan``, the call that served
        them, started ``handoff_s`` after it was planned and took ``service_s`` of
        engine time."""
        if plan is None:
            service_s = handoff_s = 0.0
        for o in outcomes:
            r = o.request
            if r.id not in self._held:
                continue
            if o.follow is not None and o.follow in self._held:
                # dedup 'follow': answered with the newer request's answer, when it comes
                self._followers.setdefault(o.follow, []).append(r.id)
                continue
            self._held.discard(r.id)
            gen = self._gens.pop(r.id, None)
            if gen is not None:
                if o.state is S.COMPLETED and gen.request.session is not None:
                    self._sessions[gen.request.session] = None  # its KV stays here
                    self._sessions.move_to_end(gen.request.session)
                    while len(self._sessions) > MAX_REPORTED_SESSIONS:
                        self._sessions.popitem(last=False)
                cost = self._costs.get(r.model)
                outside = None if cost is None else cost.generation_outside_s(gen.made, self._rng)
                self._give(r.id, _generation_result(r, self.spec.name, o, gen), outside)
            else:
                queue_s = (r.started - r.arrival) if r.started is not None else 0.0
                self._give(
                    r.id,
                    Reply(
                        r.id,
                        self.spec.name,
                        error=o.error,
                        queue_s=queue_s + handoff_s,
                        service_s=service_s,
                        batch_size=len(plan.requests) if plan is not None else 0,
                        call_rows=plan.rows if plan is not None else 0,
                        handoff_s=handoff_s,
                    ),
                    outside_s,
                )

    def _give(
        self, request_id: str, answer: Reply | GenerationResult, outside_s: float | None = None
    ) -> None:
        """Answer ``request_id``, then the requests it superseded in 'follow' mode (the
        same answer under their own ids, as a live node forwards it)."""
        self._answer(request_id, answer, outside_s)
        for older in self._followers.pop(request_id, ()):
            self._held.discard(older)
            self._give(older, replace(answer, request_id=older), outside_s)

    # -------------------------------------------------------------- the outside

    def fail(self) -> list[str]:
        """The node dies: everything it held is lost (ids returned)."""
        lost = sorted(self._held)
        self.alive = False
        if self.host is not None:
            self.host.stop(self)
        self._reset()
        return lost

    def rejoin(self) -> None:
        self.alive = True
        self._reset()

    def set_lifecycle(self, state: str) -> None:
        """Budgets of running and paused generations change now: a running decode call
        ends where its generations reach their new limits."""
        self.lifecycle = state
        call = self._call if self._call is not None and self._call.gens else None
        if call is not None:
            self._advance(call)  # the tokens made so far, before the limits move
        for gen in self._gens.values():
            r = gen.request
            limit = token_limit(r.max_new_tokens, r.priority, state, self._budgets)
            gen.limit = max(gen.made, limit - r.continued)
        if call is not None:
            self._next_finish(call)

    def status(self, at: float) -> NodeStatus:
        """The node's report as the router would receive it, made at ``at``."""
        self.clock.fixed = at
        try:
            sched = self.sched
            running = sched.running
            models = tuple(
                replace(m, row_ms=None if (c := sched.row_cost(m.name)) is None else c * 1000)
                for m in self._model_status.values()
            )
            return NodeStatus(
                name=self.spec.name,
                state=NodeState.SERVING if self.alive else NodeState.STOPPED,
                queued=sched.queued_by_priority(),
                queued_bytes=sched.queued_bytes,
                running=None if running is None else running.status(at),
                models=models,
                paused=sched.paused_by_priority(),
                lifecycle=self.lifecycle,
                sessions=tuple(reversed(self._sessions)),
                queued_rows=sched.queued_rows(),
                busy=sched.busy_share(),
                at=at,
            )
        finally:
            self.clock.fixed = None

    @property
    def queued(self) -> int:
        return self.sched.queued


def _generation_result(r: Request, node: str, o: Outcome, gen: _Gen) -> GenerationResult:
    reason = None
    if o.state is S.COMPLETED:
        reason = "length" if gen.limit >= gen.request.max_new_tokens else "budget"
    return GenerationResult(r.id, node, error=o.error, finish_reason=reason)


# ------------------------------------------------------------------------------ fleet


class _Handle:
    """How the dispatcher reaches a simulated node: the request arrives after one hop,
    the answer after another; a dead node's calls fail NodeGone."""

    def __init__(self, fleet: SimFleet, index: int) -> None:
        self._fleet = fleet
        self._index = index

    def infer(self, request: Any, inputs: Any = None) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        self._fleet.send(self._index, request, fut)
        return fut

    def send(self, request: Any, inputs: Any = None) -> Any:
        raise NotImplementedError("the simulator places with submit()")

    def wait(self, calls: Any, timeout_s: float) -> Any:
        raise NotImplementedError("the simulator places with submit()")

    def generate(self, request: Any, wait_s: float | None = None) -> Iterator[Any]:
        raise NotImplementedError("the simulator places generations with submit()")

    def probe(self, request_ids: Any, timeout_s: float) -> Any:
        raise NotImplementedError("simulated nodes do not freeze: calls are not watched")

    def forget(self, request_id: str) -> None:
        raise NotImplementedError("simulated nodes do not freeze: calls are not watched")


@dataclass(frozen=True)
class Network:
    """Simulated delays: each hop between a caller and a node, and how much older
    a report is when it reaches the callers than when the node made it.

    ``round_trip_s``, when given, are measured times a request spent outside its node
    (both hops and the caller's own work, as a recorded run shows them); each answer
    then comes back after one of them drawn at random, less the hop out, so the
    simulation carries the measured spread, its tail included."""

    hop_s: float = 0.0005
    report_delay_s: float = 0.0
    round_trip_s: tuple[float, ...] = ()


class SimFleet:
    """Nodes, the callers placing requests on them (each a dispatcher with its own view
    of the fleet, as each live ``FleetClient`` has), reports and failures, in simulated
    time."""

    def __init__(
        self,
        config: FleetConfig,
        costs: Mapping[str, ModelCost],
        *,
        loop: EventLoop | None = None,
        specs: Sequence[NodeSpec] | None = None,
        speeds: Sequence[float] | None = None,
        network: Network = Network(),
        seed: int = 0,
        callers: int = 1,
        shared_cores: float | None = None,
        on_busy: Callable[[int, float], None] | None = None,
        members: bool = False,
        on_capacity: Callable[[float, int], None] | None = None,
        on_first_served: Callable[[float], None] | None = None,
        node_costs: Sequence[Mapping[str, ModelCost] | None] | None = None,
    ) -> None:
        """``node_costs``: each node's own costs (None: ``costs``), by node.
        ``shared_cores``: every node runs on one machine with that many cores (see
        :class:`Host`); default: each node is a device of its own. ``members``: every
        node is a pool member, which can leave and come back as a new member
        (:meth:`leave`, :meth:`join`); the callers learn who is in the fleet from the
        router's view, as live callers do. ``on_capacity(t, serving)`` is told the
        number of serving devices whenever it changes (and at 0); ``on_first_served``
        the seconds from a device coming back to its first completed answer."""
        self.loop = loop or EventLoop()
        host = None if shared_cores is None else Host(self.loop, shared_cores)
        if config.router.record_dir is not None:  # simulated callers record nothing
            config = config.model_copy(
                update={"router": config.router.model_copy(update={"record_dir": None})}
            )
        self.config = config
        self.network = network
        self._net_rng = random.Random(f"{seed}/network")
        specs = list(specs if specs is not None else config.node_specs())
        if members:  # each on a Ray node of its own: NAME@incarnation
            specs = [
                s.model_copy(update={"pool": s.pool or MEMBER_POOL, "ray_node": f"{s.name}@0"})
                for s in specs
            ]
        speeds = list(speeds) if speeds is not None else [1.0] * len(specs)
        self.nodes = [
            SimNode(
                self.loop,
                spec,
                (node_costs[i] if node_costs is not None else None) or costs,
                self._answered_by(i),
                speed=speeds[i],
                host=host,
                on_busy=None if on_busy is None else partial(on_busy, i),
                rng=random.Random(f"{seed}/engine/{spec.name}"),
            )
            for i, spec in enumerate(specs)
        ]
        self.index = {s.name: i for i, s in enumerate(specs)}
        handles = {s.name: _Handle(self, i) for i, s in enumerate(specs)}
        metrics = RouterMetrics(config.fleet.name, config.priorities, sink=NullSink())
        self.dispatchers = [
            Dispatcher(
                config,
                handles,
                clock=self.loop,
                rng=random.Random(f"{seed}/{c}"),
                metrics=metrics,
                executor=LoopExecutor(self.loop),
                specs=specs,
                member_handle=(lambda spec: handles[spec.name]) if members else None,
            )
            for c in range(callers)
        ]
        self.dispatcher = self.dispatchers[0]
        self._waiting: dict[str, cf.Future[Any]] = {}  # request id -> the caller's call
        self._where: dict[str, int] = {}  # request id -> node holding it
        self.interval = config.router.report_interval_s
        self.lost_after = config.router.lost_after_s
        # churn: each device's incarnation and state, the members the callers are told of
        self._incarnation = [0] * len(specs)
        self._departed: dict[int, float] = {}  # left, not declared dead yet: when it left
        self._silent: dict[int, NodeStatus] = {}  # a departed device's last report
        self._unresponsive: set[int] = set()  # departed, and reported so to the callers
        self._stranded: dict[int, list[str]] = {}  # requests a departed device holds
        self._starting: set[int] = set()  # came back, loading its models
        self._joined_at: dict[int, float] = {}  # came back, no completed answer yet
        self._members: dict[str, NodeSpec] | None = {s.name: s for s in specs} if members else None
        self._members_version = 0
        self._members_told = 0
        # what churn did: stranded (requests a departed device held, or was sent while
        # gone) and declared_dead
        self.churned: Counter[str] = Counter()
        self.serving = len(specs)
        self._on_capacity = on_capacity
        self._on_first_served = on_first_served
        if on_capacity is not None:
            on_capacity(0.0, self.serving)
        first = [(node.spec.name, node.status(0.0), True) for node in self.nodes]
        self._deliver(first, 0.0, [])
        self._reported = [0.0] * len(specs)
        self.loop.at(self.interval, self._poll)

    # ----------------------------------------------------------------- requests

    def submit(self, request: InferRequest | GenerateRequest, caller: int = 0) -> cf.Future[Any]:
        """Place ``request`` now from caller number ``caller``; the future resolves with
        its one answer."""
        return self.dispatchers[caller].submit(request)  # type: ignore[arg-type]

    def send(self, index: int, request: Any, fut: cf.Future[Any]) -> None:
        self.loop.at(self.loop.t + self.network.hop_s, self._arrive, index, request, fut)

    def _arrive(self, index: int, request: Any, fut: cf.Future[Any]) -> None:
        node = self.nodes[index]
        stranded = self._stranded.get(index)
        if stranded is not None:  # gone, not declared dead: the call waits for that
            self._waiting[request.id] = fut
            self._where[request.id] = index
            stranded.append(request.id)
            self.churned["stranded"] += 1
            return
        if not node.alive:
            self._back(fut, NodeGone(f"node {node.spec.name} is down"))
            return
        self._waiting[request.id] = fut
        self._where[request.id] = index
        node.receive(request)

    def _answered_by(
        self, index: int
    ) -> Callable[[str, Reply | GenerationResult, float | None], None]:
        def answered(
            request_id: str, answer: Reply | GenerationResult, outside_s: float | None
        ) -> None:
            fut = self._waiting.pop(request_id, None)
            self._where.pop(request_id, None)
            if fut is not None:
                self._back(fut, answer, outside_s)
            if self._joined_at and answer.error is None and index in self._joined_at:
                back = self._joined_at.pop(index)
                if self._on_first_served is not None:
                    self._on_first_served(self.loop.t - back)

        return answered

    def _back(self, fut: cf.Future[Any], answer: Any, outside_s: float | None = None) -> None:
        """Resolve ``fut`` with ``answer`` after its way back: what is left of
        ``outside_s`` (the request's time outside its node, when its engine call's draw
        gave one) after the hop out, else one drawn from the network's, else one hop."""
        net = self.network
        delay = net.hop_s
        if outside_s is not None:
            delay = max(0.0, outside_s - net.hop_s)
        elif net.round_trip_s:
            delay = max(0.0, self._net_rng.choice(net.round_trip_s) - net.hop_s)
        self.loop.at(self.loop.t + delay, _resolve, fut, answer)

    # ------------------------------------------------------------------- reports

    def _poll(self) -> None:
        """Every report interval: nodes that changed report (what the router polls),
        and the reports reach the callers ``report_delay_s`` later, with what the other
        callers reported (what the router's view carries): their shed requests still to
        come back and the requests they placed, by priority."""
        now = self.loop.t
        reports = []
        departed = self._departed
        for i, node in enumerate(self.nodes):
            if departed and i in departed:  # silent; unresponsive after lost_after_s
                if i not in self._unresponsive and now - departed[i] >= self.lost_after:
                    self._unresponsive.add(i)
                    reports.append((node.spec.name, self._silent[i], False))
                continue
            if node.last_change >= self._reported[i] - BUSY_WINDOW_S:
                reports.append((node.spec.name, node.status(now), node.alive))
                self._reported[i] = now
        callers: list[tuple[int, dict[int, int]]] = []
        if len(self.dispatchers) > 1:
            callers = [(d.shed_waiting(), d.take_placed()) for d in self.dispatchers]
        members = None
        if self._members is not None and self._members_told != self._members_version:
            members = (tuple(self._members.values()), self._members_version)
            self._members_told = self._members_version
        if reports or callers or members:
            self.loop.at(
                now + self.network.report_delay_s, self._deliver, reports, now, callers, members
            )
        self.loop.at(now + self.interval, self._poll)

    def _deliver(
        self,
        reports: list[tuple[str, NodeStatus, bool]],
        taken: float,
        callers: list[tuple[int, dict[int, int]]],
        members: tuple[tuple[NodeSpec, ...], int] | None = None,
    ) -> None:
        if members is not None:  # who is in the fleet first, then their reports
            view = FleetView({}, members=members[0], members_version=members[1])
            for d in self.dispatchers:
                d.update(view)
        waiting = sum(w for w, _ in callers)
        placed: Counter[int] = Counter()
        for _, p in callers:
            placed.update(p)
        for i, d in enumerate(self.dispatchers):
            for name, status, alive in reports:
                d.report(name, status, alive, taken)
            if callers:
                mine_waiting, mine_placed = callers[i]
                others = dict(placed - Counter(mine_placed))
                d.update(FleetView({}, waiting - mine_waiting, others))

    # -------------------------------------------------------------- fleet events

    def fail(self, index: int) -> None:
        """Node ``index`` dies: callers waiting on it learn so (NodeGone) one hop later,
        and re-place what it held."""
        node = self.nodes[index]
        if not node.alive:
            return
        for rid in node.fail():
            fut = self._waiting.pop(rid, None)
            self._where.pop(rid, None)
            if fut is not None:
                self._back(fut, NodeGone(f"node {node.spec.name} died"))

    def rejoin(self, index: int) -> None:
        node = self.nodes[index]
        if not node.alive:
            node.rejoin()

    def leave(self, index: int, declared_dead_after_s: float) -> None:
        """Device ``index`` (a pool member, see ``members``) leaves the fleet: it stops
        serving now, and what it held is lost to it. Nobody is told: it stops reporting
        (after ``router.lost_after_s`` the callers are told it is unresponsive and send
        it nothing new), and calls to it wait until the head declares it dead,
        ``declared_dead_after_s`` from now; then they fail NodeGone, as a dead actor's
        calls do (the callers place them again, or answer NodeLost), and the member
        leaves the fleet the callers see. A device still loading its models when it
        leaves never serves."""
        if self._members is None:
            raise ValueError("only a fleet of pool members (members=True) has devices leave")
        node = self.nodes[index]
        if index in self._starting:
            self._starting.discard(index)
            self._incarnation[index] += 1  # its start is called off
            return
        if not node.alive or index in self._departed:
            return
        now = self.loop.t
        self._silent[index] = node.status(now)
        held = node.fail()
        self._departed[index] = now
        self._stranded[index] = held
        self.churned["stranded"] += len(held)
        self._joined_at.pop(index, None)
        self._capacity(-1)
        self.loop.at(
            now + declared_dead_after_s, self._declare_dead, index, self._incarnation[index]
        )

    def join(self, index: int, start_s: float = 0.0) -> None:
        """Device ``index`` comes back as a new member (a new Ray node under its name),
        serving ``start_s`` from now. A device back before its old self was declared
        dead has that one declared dead now: the newest Ray node of a device counts."""
        if self._members is None:
            raise ValueError("only a fleet of pool members (members=True) has devices join")
        if self.nodes[index].alive or index in self._starting:
            return
        if index in self._departed:
            self._declare_dead(index, self._incarnation[index])
        self._incarnation[index] += 1
        self._starting.add(index)
        self.loop.at(self.loop.t + start_s, self._serve, index, self._incarnation[index])

    def _serve(self, index: int, incarnation: int) -> None:
        if self._incarnation[index] != incarnation or index not in self._starting:
            return
        assert self._members is not None
        self._starting.discard(index)
        node = self.nodes[index]
        node.spec = node.spec.model_copy(update={"ray_node": f"{node.spec.name}@{incarnation}"})
        node.rejoin()
        self._members[node.spec.name] = node.spec
        self._members_version += 1
        self._joined_at[index] = self.loop.t
        self._capacity(+1)

    def _declare_dead(self, index: int, incarnation: int) -> None:
        if self._incarnation[index] != incarnation or index not in self._departed:
            return
        assert self._members is not None
        node = self.nodes[index]
        del self._departed[index]
        self._silent.pop(index, None)
        self._unresponsive.discard(index)
        self._members.pop(node.spec.name, None)
        self._members_version += 1
        self.churned["declared_dead"] += 1
        for rid in self._stranded.pop(index, ()):
            fut = self._waiting.pop(rid, None)
            self._where.pop(rid, None)
            if fut is not None:
                self._back(fut, NodeGone(f"node {node.spec.name} left the fleet"))

    def _capacity(self, change: int) -> None:
        self.serving += change
        if self._on_capacity is not None:
            self._on_capacity(self.loop.t, self.serving)

    def set_lifecycle(self, index: int, state: str) -> None:
        self.nodes[index].set_lifecycle(state)

    @property
    def queued(self) -> int:
        return sum(n.queued for n in self.nodes)

    @property
    def in_flight(self) -> int:
        return len(self._waiting)


def _resolve(fut: cf.Future[Any], answer: Any) -> None:
    if fut.done():
        return
    if isinstance(answer, BaseException):
        fut.set_exception(answer)
    else:
        fut.set_result(answer)


def grow(specs: Sequence[NodeSpec], n: int) -> list[NodeSpec]:
    """``n`` nodes made from ``specs`` in turn (named ``<name>-<i>`` when repeated)."""
    if n <= len(specs):
        return list(specs[:n])
    out = []
    for i in range(n):
        base = specs[i % len(specs)]
        out.append(base.model_copy(update={"name": f"{base.name}-{i // len(specs)}"}))
    return out
