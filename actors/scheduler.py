"""The node's local scheduler: a synchronous core the node's event loop drives.

``admit`` takes arrivals, ``next_work`` says what the engine runs next (or when to
look again), ``finish`` takes the engine's outcome. A preempted generation is paused,
not requeued: it keeps its place (and, on the node, its KV cache) and resumes before
queued work of its own priority. Every method returns the
requests it settled as :class:`Outcome` values; the caller delivers them. The core
never sleeps, never touches an engine or Ray, and reads time only from its clock,
so tests drive it exactly with a fake clock. Decisions come from ``policies``; the
core keeps what they decide on: the arrival rate of each model by priority (for the
adaptive batching window) and recent engine time by priority (for starvation bounds).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from edgefleet.clock import Clock
from edgefleet.errors import (
    Cancelled,
    DeadlineExceeded,
    EdgeFleetError,
    EngineTimeout,
    Evicted,
    Rejected,
    Superseded,
)
from edgefleet.messages import RunningStatus
from edgefleet.priorities import MAX_PRIORITY, MIN_PRIORITY
from edgefleet.request import Request, RequestState
from policies import (
    QUEUE_ORDERS,
    Admit,
    BatchParams,
    Candidate,
    PreemptionParams,
    QueueLimits,
    QueueLoad,
    QueueOrder,
    batch_limit,
    decide_admission,
    plan_batch,
    should_preempt,
)
from policies.admission import retry_after
from policies.batching import STOPPED_AFTER_GAPS, preemptible_rows
from policies.costs import UNTIMED_ROW_COST
from policies.starvation import StarvationParams, promote
from policies.views import ArrivalView

if TYPE_CHECKING:
    from edgefleet.config import ModelConfig, NodeSpec

S = RequestState
DRAIN_RETRY_S = 1.0  # a draining node will not take work again soon: try elsewhere
# Weight of each call in the running per-row cost: small, so one call slowed by a busy
# machine does not make the node look slow to placement (noise steers placement badly).
# The first 1 / ROW_COST_WEIGHT calls of a model are averaged instead, each with the same
# weight: seeded by its first call alone, the running cost kept that call (often the
# slowest: a cold session, a busy machine) at 0.95^(n-1) of its weight after n calls,
# 63 % after the ten calls of a warm-up.
ROW_COST_WEIGHT = 0.05
BUSY_WINDOW_S = 2.0  # engine time by priority is reported (and shares kept) over this window
# Weight of each gap in the running inter-arrival estimate: recent enough to follow a
# change of rate within a few arrivals, smooth enough that one odd gap does not decide.
ARRIVAL_WEIGHT = 0.2
# Gaps are counted as at most this many windows: any longer gap says the same (no
# companion in time), and capping it lets the estimate recover within a few arrivals
# when a burst follows a quiet spell.
GAP_CAP_WINDOWS = 2.0


@dataclass(frozen=True)
class ModelRules:
    """Per-model scheduling rules: how to batch and what a superseded caller receives."""

    batching: BatchParams = BatchParams()
    follow_dedup: bool = False
    decode_rows: int = 1  # decoders: generations of one priority decoded together


_NO_RULES = ModelRules()  # a model without rules of its own


def configured_batch_limit(
    config: ModelConfig, batchable: bool, costs_s: Mapping[int, float]
) -> int:
    """The batch size a model is run at: 1 when it cannot batch; with ``only_if_faster``
    the size its measured costs say pays; else the configured maximum."""
    params = config.batching
    if not batchable:
        return 1
    if params.only_if_faster:
        return batch_limit(costs_s, params.max_batch_size, params.min_gain)
    return params.max_batch_size


def rules_for(config: ModelConfig, batch_limit: int, costs_s: Mapping[int, float]) -> ModelRules:
    """The scheduling rules of a model: the batch size worth waiting for, the cost per
    call by batch size (which bounds lower-priority rows in a call) and the window; for
    a decoder, how many generations decode together."""
    batching = config.batching
    if config.kind == "decoder":
        return ModelRules(decode_rows=config.generation.decode_batch)
    return ModelRules(
        BatchParams(
            window_s=batching.window_ms / 1000.0,
            max_rows=batch_limit,
            costs=tuple(sorted(costs_s.items())),
            lower_cost_bound=batching.lower_priority_cost_bound,
            adaptive=batching.adaptive_window,
        ),
        follow_dedup=config.dedup == "follow",
    )


@dataclass
class _Arrivals:
    """Running estimate of the gap between arrivals of one model at one priority."""

    last: float
    gap: float | None = None  # EWMA of gaps, each capped (the batching window's view)
    mean_gap: float | None = None  # EWMA of gaps as they were (the arrival rate)

    def observe(self, now: float, cap_s: float) -> None:
        raw = now - self.last
        gap = min(raw, cap_s)
        w = ARRIVAL_WEIGHT
        self.gap = gap if self.gap is None else (1 - w) * self.gap + w * gap
        self.mean_gap = raw if self.mean_gap is None else (1 - w) * self.mean_gap + w * raw
        self.last = now


@dataclass(frozen=True)
class Outcome:
    """A request reached a terminal state. ``follow`` names the request whose result a
    superseded caller receives instead of an error (dedup in 'follow' mode)."""

    request: Request
    state: RequestState
    error: EdgeFleetError | None = None
    follow: str | None = None


@dataclass(frozen=True)
class Plan:
    """One engine call: requests of one model that share a batch."""

    model: str
    requests: tuple[Request, ...]
    rank: int
    started: float

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.requests)

    def status(self, now: float) -> RunningStatus:
        """The call as a node reports it."""
        return RunningStatus(
            self.model,
            tuple(r.id for r in self.requests),
            max(r.priority for r in self.requests),
            now - self.started,
            self.rows,
        )


@dataclass(frozen=True)
class Step:
    """What ``next_work`` decided: run ``plan``, or call again at ``wake_at`` (None: on
    the next arrival)."""

    plan: Plan | None = None
    wake_at: float | None = None
    settled: tuple[Outcome, ...] = ()


@dataclass(frozen=True)
class Admission:
    accepted: bool
    settled: tuple[Outcome, ...] = ()  # the arrival itself when refused, evictions, duplicates
    preempt: bool = False  # the caller should abort the running call
    join: bool = False  # a generation that may join the running decode: stop it at a token


class LocalScheduler:
    """Priority lanes, bounded admission, dedup, batching, deadlines, preemption and
    starvation bounds.

    ``starvation`` (default: none) promotes queued lower-priority work that is below its
    class's share of engine time or has waited past its class's maximum."""

    def __init__(
        self,
        *,
        clock: Clock,
        limits: QueueLimits,
        order: QueueOrder,
        preemption: PreemptionParams,
        rules: Mapping[str, ModelRules] | None = None,
        starvation: StarvationParams | None = None,
    ) -> None:
        self._clock = clock
        self._limits = limits
        self._order = order
        self._preemption = preemption
        self._starvation = starvation or StarvationParams()
        # A discipline that ignores priorities has no lower-priority rows to bound.
        self._ranked = order.rank(MIN_PRIORITY) != order.rank(MAX_PRIORITY)
        self._arrivals: dict[str, dict[int, _Arrivals]] = {}  # model -> priority -> gaps
        self._rules: dict[str, ModelRules] = dict(rules or {})
        self._lanes: dict[int, deque[Request]] = {}  # rank -> FIFO lane
        self._ranks: list[int] = []  # lane ranks, highest first
        self._queued: dict[str, Request] = {}
        self._paused: dict[str, Request] = {}  # preempted generations, waiting to resume
        self._keys: dict[tuple[str, str], Request] = {}
        self._bytes = 0
        self._with_deadline = 0
        self._seq = 0
        self._running: Plan | None = None
        self._preempting = False
        self._row_cost: dict[str, float] = {}
        self._row_calls: dict[str, int] = {}  # calls timed into _row_cost, by model
        self._busy: deque[tuple[float, int, float]] = deque()  # (end, priority, seconds)
        # Engine seconds by the priority of the rows they served (a call's time split by
        # rows), for the classes' shares; aborted calls served nobody.
        self._served: deque[tuple[float, int, float]] = deque()  # (end, priority, seconds)
        self._served_sum: dict[int, float] = {}  # the sums of ``_served`` by priority
        self.draining = False

    @classmethod
    def for_node(
        cls, spec: NodeSpec, clock: Clock, rules: Mapping[str, ModelRules] | None = None
    ) -> LocalScheduler:
        """The scheduler of the node ``spec`` describes (its queue limits and order,
        preemption and starvation bounds), on ``clock``: the node's and the simulated
        node's alike."""
        return cls(
            clock=clock,
            limits=QueueLimits(spec.queue.capacity, spec.queue.max_bytes),
            order=QUEUE_ORDERS[spec.order](),
            preemption=PreemptionParams(spec.preemption.enabled, spec.preemption.min_priority_gap),
            rules=rules,
            starvation=spec.starvation.params(spec.priorities),
        )

    # ----------------------------------------------------------------- configuration

    def set_rules(self, model: str, rules: ModelRules) -> None:
        self._rules[model] = rules

    def rules(self, model: str) -> ModelRules:
        rules = self._rules.get(model)
        return _NO_RULES if rules is None else rules

    # ------------------------------------------------------------------------ intake

    def admit(self, req: Request) -> Admission:
        """Queue ``req`` (state NEW), evicting or superseding others, or refuse it."""
        now = self._clock.now()
        if self.draining:
            return self._refuse(req, "node is draining and takes no new work", retry=DRAIN_RETRY_S)
        if req.deadline is not None and req.deadline <= now:
            req.move(S.EXPIRED)
            late = DeadlineExceeded("deadline had passed on arrival", request_id=req.id)
            return Admission(False, (Outcome(req, S.EXPIRED, late),))
        rank = self._order.rank(req.priority)
        dup = self._keys.get((req.model, req.key)) if req.key is not None else None
        load = QueueLoad(
            items=len(self._queued) - (dup is not None),
            nbytes=self._bytes - (dup.nbytes if dup else 0),
        )
        decision = decide_admission(rank, req.nbytes, load, self._limits, self._victims(dup))
        if not isinstance(decision, Admit):
            return self._refuse(req, decision.reason, retry=self._retry_after(rank))
        settled: list[Outcome] = []
        if dup is not None:
            self._remove(dup, S.SUPERSEDED)
            follow = self.rules(req.model).follow_dedup
            err = Superseded(
                f"replaced by newer request {req.id} with the same key {req.key!r}",
                request_id=dup.id,
            )
            settled.append(Outcome(dup, S.SUPERSEDED, err, follow=req.id if follow else None))
        for victim_id in decision.evict:
            victim = self._queued[victim_id]
            self._remove(victim, S.EVICTED)
            evicted = Evicted(
                f"evicted from a full queue by a priority-{req.priority} request; "
                "retry later or at a higher priority",
                request_id=victim.id,
            )
            settled.append(Outcome(victim, S.EVICTED, evicted))
        req.seq = self._seq
        self._seq += 1
        req.move(S.QUEUED)
        self._enqueue(req, at_head=False)
        self._observe_arrival(req, now)
        preempt = (
            self._running is not None
            and not self._preempting
            and should_preempt(self._running.rank, rank, self._preemption)
        )
        self._preempting |= preempt
        return Admission(True, tuple(settled), preempt, join=not preempt and self._joins(req))

    def _joins(self, req: Request) -> bool:
        """Whether generation ``req`` could decode with the running generations: same
        model and rank, and room for it."""
        plan = self._running
        return (
            req.pausable
            and plan is not None
            and plan.requests[0].pausable
            and plan.model == req.model
            and plan.rank == self._order.rank(req.priority)
            and len(plan.requests) < self.rules(req.model).decode_rows
        )

    def _refuse(self, req: Request, reason: str, *, retry: float) -> Admission:
        req.move(S.REJECTED)
        err = Rejected(reason, retry_after_s=retry, request_id=req.id)
        return Admission(False, (Outcome(req, S.REJECTED, err),))

    def _victims(self, skip: Request | None) -> Iterator[Candidate]:
        """Queued requests, lowest rank first and newest first within a rank."""
        for rank in reversed(self._ranks):
            for r in reversed(self._lanes[rank]):
                if r is not skip:
                    yield Candidate(r.id, rank, r.nbytes)

    # ------------------------------------------------------------------- the engine

    def next_work(self) -> Step:
        """Expire overdue requests, then pick the next engine call (or when to look again)."""
        now = self._clock.now()
        settled = self._expire_overdue(now)
        if self._running is not None:
            return Step(settled=settled)
        lanes = [lane for rank in self._ranks if (lane := self._lanes[rank])]
        natural = lanes[0][0] if lanes else None
        promoted = None
        if natural is not None and self._starvation.enabled and len(lanes) > 1:
            call_s = self._call_estimate(natural)
            promoted_id = promote(lanes, self._served_s(now), now, self._starvation, call_s)
            promoted = self._queued[promoted_id] if promoted_id is not None else None
        resume = self._next_paused()
        if (
            resume is not None
            and (
                natural is None
                or self._order.rank(resume.priority) >= self._order.rank(natural.priority)
            )
            and (promoted is None or self._starvation.is_protected(resume.priority))
        ):
            return Step(plan=self._decode(resume, now), settled=settled)
        leader = promoted or natural
        if leader is None:
            return Step(settled=settled)
        if leader.pausable:
            return Step(plan=self._decode(leader, now), settled=settled)
        params = self.rules(leader.model).batching
        if not self._ranked:
            params = replace(params, lower_cost_bound=None)
        if promoted is not None:
            params = replace(params, window_s=0.0)  # it has waited long enough already
        if params.max_rows > 1:
            rate = self._preempting_rate(self._order.rank(leader.priority), now)
            if rate > 0:
                rows = preemptible_rows(params.costs, params.max_rows, rate)
                params = replace(params, max_rows=rows)
        if leader.isolate or params.max_rows <= 1:
            candidates = [leader]
        else:
            candidates = [leader] + [
                r
                for rank in self._ranks
                for r in self._lanes[rank]
                if r is not leader and r.model == leader.model and r.group == leader.group
            ]
        plan = plan_batch(candidates, now, params, self._arrival_views(leader.model))
        if not plan.ids:
            return Step(wake_at=self._earliest(plan.wait_until), settled=settled)
        chosen = {rid: self._queued[rid] for rid in plan.ids}
        requests = tuple(chosen.values())
        for r in requests:
            self._remove(r, S.RUNNING)
            r.started = now
        rank = max(self._order.rank(r.priority) for r in requests)
        self._running = Plan(leader.model, requests, rank, now)
        return Step(plan=self._running, settled=settled)

    def _decode(self, first: Request, now: float) -> Plan:
        """A decode call led by generation ``first`` (paused or queued), with up to the
        model's ``decode_rows`` generations of the same model and rank: paused ones
        first (they resume in arrival order), then queued ones. Lower ranks never join:
        they would slow the leader's every token."""
        rank = self._order.rank(first.priority)
        chosen = [first]
        limit = self.rules(first.model).decode_rows
        if limit > 1 and not first.isolate:
            paused = sorted(
                (
                    r
                    for r in self._paused.values()
                    if r is not first
                    and r.model == first.model
                    and self._order.rank(r.priority) == rank
                ),
                key=lambda r: r.seq,
            )
            queued = (
                r
                for r in self._lanes.get(rank, ())
                if r is not first and r.pausable and r.model == first.model and not r.isolate
            )
            chosen += itertools.islice(itertools.chain(paused, queued), limit - 1)
        for r in chosen:
            if self._paused.pop(r.id, None) is not None:
                r.move(S.RUNNING)
            else:
                self._remove(r, S.RUNNING)
                r.started = now
        self._running = Plan(first.model, tuple(chosen), rank, now)
        return self._running

    def _next_paused(self) -> Request | None:
        """The paused generation to resume first: highest rank, then earliest arrival."""
        if not self._paused:
            return None
        return max(self._paused.values(), key=lambda r: (self._order.rank(r.priority), -r.seq))

    def finish(
        self,
        plan: Plan,
        *,
        error: EdgeFleetError | None = None,
        aborted: bool = False,
        paused: bool | Collection[str] = False,
        preempted: bool = True,
    ) -> tuple[Outcome, ...]:
        """Settle a finished engine call.

        Success completes every request. An aborted call goes back to the head of its
        priority. Paused generations (``paused``: all of the call's, or these ids; the
        others completed) wait, with their state, to resume; a pause counts as a
        preemption unless ``preempted`` is False (stopped to let another generation
        join). A failed batch of several is split: each request is requeued to run
        alone, so only the request that is really bad fails; not a call that ran past
        its time limit (EngineTimeout): running its requests again would hold the
        engine as long again, so they all fail.
        """
        pause = {r.id for r in plan.requests} if paused is True else set(paused or ())
        assert plan is self._running, "finish() must get the plan next_work() returned"
        self._running = None
        self._preempting = False
        now = self._clock.now()
        elapsed = now - plan.started
        self._busy.append((now, max(r.priority for r in plan.requests), elapsed))
        if self._starvation.enabled and not aborted:
            rows = max(1, plan.rows)
            for r in plan.requests:
                seconds = elapsed * r.rows / rows
                self._served.append((now, r.priority, seconds))
                self._served_sum[r.priority] = self._served_sum.get(r.priority, 0.0) + seconds
            self._served_s(now)  # drop what fell out of the window
        settled: list[Outcome] = []
        requeue: list[Request] = []
        for r in plan.requests:
            if r.cancel_requested:
                r.move(S.CANCELLED)
                settled.append(Outcome(r, S.CANCELLED, Cancelled("cancelled", request_id=r.id)))
            elif r.id in pause:
                r.move(S.PAUSED)
                r.preemptions += preempted
                self._paused[r.id] = r
            elif aborted or (
                error is not None
                and len(plan.requests) > 1
                and not isinstance(error, EngineTimeout)
            ):
                r.move(S.QUEUED)
                r.preemptions += aborted
                r.isolate |= not aborted
                requeue.append(r)
            elif error is not None:
                r.move(S.FAILED)
                settled.append(Outcome(r, S.FAILED, error))
            else:
                r.move(S.COMPLETED)
                settled.append(Outcome(r, S.COMPLETED))
        for r in reversed(requeue):
            self._enqueue(r, at_head=True)
        if error is None and not aborted and not pause and plan.requests[0].preemptions == 0:
            self._observe(plan.model, (now - plan.started) / max(1, plan.rows))
        return tuple(settled)

    @property
    def running(self) -> Plan | None:
        return self._running

    @property
    def preempting(self) -> bool:
        """An arrival asked for the running call to be aborted for it."""
        return self._preempting

    # ------------------------------------------------------------ cancel and expire

    def cancel(self, request_id: str) -> tuple[Outcome | None, bool]:
        """Cancel a queued, paused or running request.

        Returns the outcome when the request was queued or paused, and whether the
        running call should be aborted (every request in it is cancelled). A request
        running in a batch with others is marked; its result is dropped when the call
        ends.
        """
        req = self._queued.get(request_id)
        if req is not None:
            self._remove(req, S.CANCELLED)
            return Outcome(req, S.CANCELLED, Cancelled("cancelled", request_id=req.id)), False
        req = self._paused.pop(request_id, None)
        if req is not None:
            req.move(S.CANCELLED)
            return Outcome(req, S.CANCELLED, Cancelled("cancelled", request_id=req.id)), False
        plan = self._running
        if plan is None or all(r.id != request_id for r in plan.requests):
            return None, False
        for r in plan.requests:
            if r.id == request_id:
                r.cancel_requested = True
        return None, all(r.cancel_requested for r in plan.requests)

    def expire(self, request_id: str) -> Outcome | None:
        """Fail a still-queued request whose deadline has passed (a timer fired)."""
        req = self._queued.get(request_id)
        if req is None or req.deadline is None or req.deadline > self._clock.now():
            return None
        return self._expire(req)

    def evict_all(self, reason: str) -> tuple[Outcome, ...]:
        """Evict everything queued (it never ran: its callers can place it elsewhere)."""
        outcomes = []
        for r in list(self._queued.values()):
            self._remove(r, S.EVICTED)
            outcomes.append(Outcome(r, S.EVICTED, Evicted(reason, request_id=r.id)))
        return tuple(outcomes)

    def cancel_all(self, reason: str) -> tuple[Outcome, ...]:
        """Cancel everything queued or paused (the node is stopping)."""
        outcomes = []
        for r in list(self._queued.values()):
            self._remove(r, S.CANCELLED)
            outcomes.append(Outcome(r, S.CANCELLED, Cancelled(reason, request_id=r.id)))
        for r in self._paused.values():
            r.move(S.CANCELLED)
            outcomes.append(Outcome(r, S.CANCELLED, Cancelled(reason, request_id=r.id)))
        self._paused.clear()
        return tuple(outcomes)

    def _expire(self, req: Request) -> Outcome:
        self._remove(req, S.EXPIRED)
        late = self._clock.now() - (req.deadline or 0.0)
        err = DeadlineExceeded(
            f"deadline passed {late * 1000:.1f} ms ago while queued; the engine was not used",
            request_id=req.id,
        )
        return Outcome(req, S.EXPIRED, err)

    def _expire_overdue(self, now: float) -> tuple[Outcome, ...]:
        if not self._with_deadline:
            return ()
        overdue = [r for r in self._queued.values() if r.deadline is not None and r.deadline <= now]
        return tuple(self._expire(r) for r in overdue)

    def _earliest(self, wake_at: float | None) -> float | None:
        deadlines = [r.deadline for r in self._queued.values() if r.deadline is not None]
        times = [t for t in (wake_at, *deadlines) if t is not None]
        return min(times) if times else None

    # ------------------------------------------------------------------ bookkeeping

    def _enqueue(self, req: Request, *, at_head: bool) -> None:
        rank = self._order.rank(req.priority)
        lane = self._lanes.get(rank)
        if lane is None:
            lane = self._lanes[rank] = deque()
            self._ranks = sorted(self._lanes, reverse=True)
        if at_head:
            lane.appendleft(req)
        else:
            lane.append(req)
        self._queued[req.id] = req
        if req.key is not None:
            self._keys.setdefault((req.model, req.key), req)
        self._bytes += req.nbytes
        self._with_deadline += req.deadline is not None

    def _remove(self, req: Request, new_state: RequestState) -> None:
        self._lanes[self._order.rank(req.priority)].remove(req)
        del self._queued[req.id]
        if req.key is not None and self._keys.get((req.model, req.key)) is req:
            del self._keys[(req.model, req.key)]
        self._bytes -= req.nbytes
        self._with_deadline -= req.deadline is not None
        req.move(new_state)

    def _observe_arrival(self, req: Request, now: float) -> None:
        by_priority = self._arrivals.setdefault(req.model, {})
        gaps = by_priority.get(req.priority)
        if gaps is None:
            by_priority[req.priority] = _Arrivals(now)
        else:
            window = self.rules(req.model).batching.window_s
            gaps.observe(now, GAP_CAP_WINDOWS * window if window > 0 else math.inf)

    def _arrival_views(self, model: str) -> dict[int, ArrivalView]:
        return {
            p: ArrivalView(a.last, a.gap)
            for p, a in self._arrivals.get(model, {}).items()
            if a.gap is not None
        }

    def _preempting_rate(self, rank: int, now: float) -> float:
        """Arrivals a second, of every model, that would abort a call of ``rank`` (from
        the recent gaps of the streams still arriving)."""
        rate = 0.0
        for by_priority in self._arrivals.values():
            for priority, a in by_priority.items():
                if (
                    a.mean_gap
                    and now < a.last + STOPPED_AFTER_GAPS * a.mean_gap
                    and should_preempt(rank, self._order.rank(priority), self._preemption)
                ):
                    rate += 1.0 / a.mean_gap
        return rate

    def _served_s(self, now: float) -> dict[int, float]:
        """Engine seconds spent on each priority's rows over the last ``BUSY_WINDOW_S``."""
        while self._served and self._served[0][0] < now - BUSY_WINDOW_S:
            _, priority, seconds = self._served.popleft()
            self._served_sum[priority] -= seconds
        return self._served_sum

    def _call_estimate(self, leader: Request) -> float:
        """Seconds a call led by ``leader`` may take: its model's rows at most, at the
        observed cost per row."""
        rows = max(leader.rows, self.rules(leader.model).batching.max_rows)
        return rows * self._row_cost.get(leader.model, UNTIMED_ROW_COST.node_s)

    def _observe(self, model: str, row_cost: float) -> None:
        """Time one call into the model's running cost per row: the mean of the calls
        so far, then an exponential average of weight ``ROW_COST_WEIGHT``."""
        n = self._row_calls[model] = self._row_calls.get(model, 0) + 1
        w = max(ROW_COST_WEIGHT, 1.0 / n)
        self._row_cost[model] = (1 - w) * self._row_cost.get(model, 0.0) + w * row_cost

    def _retry_after(self, rank: int) -> float:
        ahead = sum(
            r.rows for lane_rank in self._ranks if lane_rank >= rank for r in self._lanes[lane_rank]
        )
        cost = max(self._row_cost.values(), default=UNTIMED_ROW_COST.node_s)
        left = 0.0
        if self._running is not None:
            expected = self._running.rows * self._row_cost.get(self._running.model, cost)
            left = max(0.0, expected - (self._clock.now() - self._running.started))
        return retry_after(ahead, left, cost)

    # ---------------------------------------------------------------------- queries

    def queued_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for r in self._queued.values():
            counts[r.priority] = counts.get(r.priority, 0) + 1
        return counts

    def busy_share(self) -> dict[int, float]:
        """Share of the last ``BUSY_WINDOW_S`` the engine spent on each priority (the
        priority a call ran at): how much of the node later arrivals of a priority take."""
        now = self._clock.now()
        while self._busy and self._busy[0][0] < now - BUSY_WINDOW_S:
            self._busy.popleft()
        out: dict[int, float] = {}
        for _, priority, seconds in self._busy:
            out[priority] = out.get(priority, 0.0) + seconds / BUSY_WINDOW_S
        return out

    def queued_rows(self) -> dict[int, dict[str, int]]:
        """Rows waiting, by priority and model (what placement prices queued work by)."""
        out: dict[int, dict[str, int]] = {}
        for r in self._queued.values():
            by_model = out.setdefault(r.priority, {})
            by_model[r.model] = by_model.get(r.model, 0) + r.rows
        return out

    def holds(self, model: str) -> int:
        """Requests of ``model`` queued, paused or in the running call."""
        held = sum(1 for r in (*self._queued.values(), *self._paused.values()) if r.model == model)
        if self._running is not None and self._running.model == model:
            held += len(self._running.requests)
        return held

    def paused_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for r in self._paused.values():
            counts[r.priority] = counts.get(r.priority, 0) + 1
        return counts

    @property
    def paused(self) -> tuple[Request, ...]:
        return tuple(self._paused.values())

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    @property
    def idle(self) -> bool:
        return not self._queued and not self._paused and self._running is None

    def row_cost(self, model: str) -> float | None:
        return self._row_cost.get(model)
