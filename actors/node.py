"""The node: one engine, one scheduler, one asyncio loop. Ray wraps it as an actor.

The event loop only moves data and decisions; engine calls and model loads run on
the node's single engine thread. Every request that reaches ``infer`` gets exactly
one :class:`Reply`: its outputs or a typed error. Every generation that reaches
``generate`` streams its tokens and ends with exactly one :class:`GenerationResult`.

This file is intake, admission, the serve loop and settlement; the parts it composes
each have their own file: the scheduling core (``actors.scheduler``), the engine
thread (``actors.executor``), generations and their KV memory
(``actors.generations``), answers kept for retries (``actors.replies``), models
(``actors.models``), metrics and the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import replace

import numpy as np

from actors.decoder import Generation
from actors.engine import RunAborted, check_inputs
from actors.executor import EngineThread
from actors.generations import NodeGenerations
from actors.metrics import NodeMetrics
from actors.models import Loader, ModelManager, load_onnx
from actors.replies import RecentReplies
from actors.scheduler import LocalScheduler, ModelRules, Outcome, Plan
from actors.trace import NodeTrace
from edgefleet.clock import Clock, MonotonicClock
from edgefleet.config import NodeSpec
from edgefleet.errors import EdgeFleetError, EngineError, InvalidInput, Rejected
from edgefleet.messages import (
    NODE_COUNTERS,
    GenerationResult,
    ModelStatus,
    NodeStatus,
    Reply,
    RunningStatus,
    TokenChunk,
)
from edgefleet.request import GenerateRequest, InferRequest, Request, RequestState
from policies import QUEUE_ORDERS, BatchParams, PreemptionParams, QueueLimits

S = RequestState
log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.002  # tokens made within this interval travel together
MAX_REPORTED_SESSIONS = 256  # sessions named in a status report (most recent first)


class NodeRuntime:
    """An edge node. Create it, ``await start()``, then ``infer`` from many callers."""

    def __init__(
        self,
        spec: NodeSpec,
        *,
        clock: Clock | None = None,
        loader: Loader | None = None,
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.spec = spec
        self._metrics = metrics or NodeMetrics(spec.fleet, spec.name, spec.priorities)
        self._trace = None if spec.trace_dir is None else NodeTrace(spec.trace_dir, spec.name)
        self._clock = clock or MonotonicClock()
        self._models = ModelManager(spec.models, spec.memory_budget_mb, loader or load_onnx)
        self._sched = LocalScheduler(
            clock=self._clock,
            limits=QueueLimits(spec.queue.capacity, spec.queue.max_bytes),
            order=QUEUE_ORDERS[spec.order](),
            preemption=PreemptionParams(spec.preemption.enabled, spec.preemption.min_priority_gap),
        )
        self._counters: Counter[str] = Counter(dict.fromkeys(NODE_COUNTERS, 0))
        self._engine = EngineThread(spec.name, self._models, self._clock, self._model_loaded)
        self._gens = NodeGenerations(spec, self._clock, self._counters)
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._callers: Counter[str] = Counter()  # callers awaiting each request id
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._switches: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._state = "starting"
        self._failure = ""  # why the node is out of service ("failed")
        self._start_error: Exception | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self._recent = RecentReplies()  # answers that serve retries of known ids

    # --------------------------------------------------------------------- lifecycle

    async def start(self) -> NodeStatus:
        """Load, warm up and measure every model, then start serving. Idempotent: a
        router calls it again on a node Ray has restarted."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_future()
            try:
                await self._start()
            except Exception as exc:  # a later start() says so again; status says "failed"
                self._fail(f"start failed: {exc}")
                self._start_error = exc
            finally:
                self._starting.set_result(None)
        await self._starting
        if self._start_error is not None:
            raise self._start_error
        return self.status()

    async def _start(self) -> None:
        await self._engine.call(self._models.probe_all)
        infos = self._models.models()
        decoders = [i.name for i in infos if i.config.kind == "decoder"]
        self._gens.exact_models = {i.name for i in infos if i.exact_grouping}
        self._metrics.start([i.name for i in infos], decoders)
        for info in infos:
            if info.config.kind == "decoder":
                continue
            window = info.config.batching.window_ms / 1000.0
            self._sched.set_rules(
                info.name,
                ModelRules(BatchParams(window, info.batch_limit), info.config.dedup == "follow"),
            )
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task = asyncio.create_task(self._serve(), name=f"node-{self.spec.name}")
        self._task.add_done_callback(self._serve_ended)
        self._state = "serving"

    def _serve_ended(self, task: asyncio.Task[None]) -> None:
        """Supervision of the serve loop, which ends only when stopped: a loop that
        died is logged, and the node stops taking work and answers what it held."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("node %s: the serve loop failed", self.spec.name, exc_info=exc)
        self._fail(f"its serve loop stopped: {type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        """Out of service for good: status says ``failed`` and why (the router then
        counts the node lost); queued and paused work ends Cancelled naming the reason,
        so its callers can send it again (a retry under the same id runs elsewhere)."""
        self._failure = reason
        self._state = "failed"
        self._sched.draining = True
        self._end_all(f"node {self.spec.name} failed ({reason}); send it again")

    def _end_all(self, reason: str) -> None:
        """Cancel, naming ``reason``, everything queued or paused, and the call in
        progress when no serve loop is left to finish it."""
        plan = self._sched.running
        if plan is not None and (self._task is None or self._task.done()):
            self._settle(self._sched.finish(plan, aborted=True))  # requeued, then cancelled
        self._settle(self._sched.cancel_all(reason))

    async def stop(self) -> NodeStatus:
        """Cancel queued work, abort the running call, unload models."""
        self._sched.draining = True
        self._settle(self._sched.cancel_all(f"node {self.spec.name} stopped"))
        self._gens.kv.clear()
        self._engine.abort()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._end_all(f"node {self.spec.name} stopped")
        self._state = "stopped"
        if self._trace is not None:
            self._trace.close()
        await self._engine.close()
        return self.status()

    async def drain(self) -> NodeStatus:
        """Refuse new work, finish what is queued and running, then return."""
        assert self._idle is not None and self._wake is not None, "start() first"
        self._sched.draining = True
        self._state = "draining"
        self._wake.set()
        await self._idle.wait()
        self._state = "drained"
        return self.status()

    async def switch_model(self, model: str) -> NodeStatus:
        """Make ``model`` resident now: the current call finishes, new calls wait
        (they stay queued) while the model loads, then serving resumes."""
        self._models.info(model)  # ModelNotFound for a model this node does not serve
        assert self._wake is not None, "start() first"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._switches.append((model, done))
        self._wake.set()
        await done
        return self.status()

    # ------------------------------------------------------------------------ intake

    async def infer(
        self, request: InferRequest, inputs: Mapping[str, np.ndarray] | None = None
    ) -> Reply:
        """Admit, queue and eventually answer one request.

        ``inputs``, when given, replace ``request.inputs``: large inputs travel as a
        Ray object reference that Ray resolves here, on the node, not on the way.
        Request ids make retries safe (the contract callers rely on):

        - in flight: a retry with the same id waits for the same answer; the request
          runs once. A caller that goes away cancels it only if no other caller waits;
          ``cancel(id)`` ends it for every caller.
        - answered after running (outputs, or an engine failure): the same answer, for
          the last ``RECENT_REPLIES`` answers within ``RECENT_BYTES`` of outputs.
        - refused without running (rejected, evicted, superseded, expired, cancelled,
          invalid): nothing is kept; a retry is a new attempt.
        """
        existing = self._waiters.get(request.id)
        if existing is not None:
            return await self._wait(request.id, existing)
        if (known := self._recent.get(request.id)) is not None:
            return known
        if inputs is not None:
            request = replace(request, inputs=inputs)
        self._counters["received"] += 1
        try:
            req = self._make_request(request)
        except EdgeFleetError as exc:
            self._counters["invalid"] += 1
            exc.request_id = request.id
            return Reply(request.id, self.spec.name, error=exc)
        return await self._wait(req.id, self._admit(req))

    async def _wait(self, request_id: str, fut: asyncio.Future[Reply]) -> Reply:
        """Wait for the answer with every other caller of ``request_id``. A caller that
        goes away cancels the request only when it was the last one waiting: a retry
        under the same id still gets the answer."""
        self._callers[request_id] += 1
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if self._callers[request_id] == 1:  # nobody is left: do not run it for nobody
                self.cancel(request_id)
            raise
        finally:
            self._callers[request_id] -= 1
            if not self._callers[request_id]:
                del self._callers[request_id]

    def _admit(self, req: Request) -> asyncio.Future[Reply]:
        """Offer ``req`` to the scheduler; the future resolves with its one answer."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        self._waiters[req.id] = fut
        admission = self._sched.admit(req)
        self._settle(admission.settled)
        if admission.accepted:
            self._counters["admitted"] += 1
            self._metrics.admitted(req.priority, req.model)
            assert self._wake is not None and self._idle is not None
            self._idle.clear()
            if admission.preempt:
                self._engine.abort()
            if req.deadline is not None:
                delay = max(0.0, req.deadline - self._clock.now())
                self._timers[req.id] = loop.call_later(delay, self._expire, req.id)
            self._wake.set()
        return fut

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenChunk | GenerationResult]:
        """Admit one generation and stream its tokens as they are produced; the last
        item is its :class:`GenerationResult`. A consumer that stops listening cancels
        the generation."""
        if request.id in self._waiters:
            err = InvalidInput(f"request id {request.id} is already in flight on this node")
            yield GenerationResult(request.id, self.spec.name, error=err)
            return
        self._counters["received"] += 1
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        arrival = self._clock.now()
        times: list[float] = []

        def emitted(token: int) -> None:  # on the engine thread, as each token is made
            times.append(self._clock.now() - arrival)
            loop.call_soon_threadsafe(ready.set)

        try:
            req, gen = self._make_generation(request, emitted)
        except EdgeFleetError as exc:
            self._counters["invalid"] += 1
            exc.request_id = request.id
            yield GenerationResult(request.id, self.spec.name, error=exc)
            return
        self._gens.live[req.id] = gen
        fut = self._admit(req)
        fut.add_done_callback(lambda _: ready.set())
        sent = 0
        try:
            while True:
                await ready.wait()
                ready.clear()
                done = fut.done()
                new = gen.tokens[gen.prompt_len + sent :]
                if new:
                    sent += len(new)
                    yield TokenChunk(tuple(new))
                if done:
                    break
                if sent:  # after the first token, send what came meanwhile in one chunk
                    await asyncio.sleep(STREAM_INTERVAL_S)
            reply = fut.result()
        finally:
            if not fut.done():  # the consumer went away: stop generating for nobody
                self.cancel(req.id)
            self._gens.live.pop(req.id, None)
        cancelled = req.state is S.CANCELLED
        yield GenerationResult(
            req.id,
            self.spec.name,
            tokens=tuple(gen.generated),
            finish_reason="cancelled" if cancelled else gen.finish_reason,
            error=None if cancelled else reply.error,
            queue_s=reply.queue_s,
            first_token_s=times[0] if times else None,
            total_s=self._clock.now() - arrival,
            engine_s=gen.engine_s,
            engine_cpu_s=gen.engine_cpu_s,
            pauses=req.preemptions,
            reused_tokens=gen.reused,
            fed_tokens=gen.fed,
            token_times=tuple(times),
            arrival=arrival,
        )

    def _make_generation(
        self, request: GenerateRequest, emit: Callable[[int], None]
    ) -> tuple[Request, Generation]:
        self._check_serving()
        return self._gens.make(request, self._models.info(request.model), emit)

    def set_lifecycle(self, state: str) -> NodeStatus:
        """Set the node's lifecycle state; token budgets of running and paused
        generations change at their next token."""
        if self._gens.set_lifecycle(state):
            self._counters["lifecycle_changes"] += 1
        return self.status()

    def _check_serving(self) -> None:
        if self._failure:
            raise Rejected(
                f"node {self.spec.name} failed ({self._failure}); another node can take it",
                retry_after_s=1.0,
            )
        if self._wake is None:
            raise Rejected(f"node {self.spec.name} is still starting", retry_after_s=1.0)

    def _make_request(self, request: InferRequest) -> Request:
        self._check_serving()
        info = self._models.info(request.model)
        if info.config.kind == "decoder":
            raise InvalidInput(f"model {request.model!r} is a decoder: use generate()")
        checked = check_inputs(
            info.signature,
            request.model,
            request.inputs,
            info.config.max_input_bytes,
            finite=info.config.reject_non_finite,
        )
        priority = request.priority
        if not 0 <= priority <= 10:
            raise InvalidInput(f"priority must be 0-10, got {priority}")
        now = self._clock.now()
        deadline = None
        if request.deadline_unix is not None:
            deadline = now + (request.deadline_unix - time.time())
        return Request(
            id=request.id,
            model=request.model,
            inputs=request.inputs,
            priority=priority,
            arrival=now,
            deadline=deadline,
            key=request.key,
            nbytes=checked.nbytes,
            rows=checked.rows,
            group=checked.group if checked.group is not None else request.id,
        )

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request. False when it is not (or no longer) here."""
        outcome, abort = self._sched.cancel(request_id)
        if outcome is not None:
            self._settle([outcome])
            return True
        if abort:
            self._engine.abort()
        running = self._sched.running
        return running is not None and any(r.id == request_id for r in running.requests)

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        outcome = self._sched.expire(request_id)
        if outcome is not None:
            self._settle([outcome])

    # ------------------------------------------------------------------ the engine

    async def _serve(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            self._wake.clear()
            while self._switches:
                await self._switch(*self._switches.popleft())
            step = self._sched.next_work()
            self._settle(step.settled)
            if step.plan is not None:
                self._idle.clear()
                await self._execute(step.plan)
                continue
            if self._sched.idle:
                self._idle.set()
            timeout = None
            if step.wake_at is not None:
                timeout = max(0.0, step.wake_at - self._clock.now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _switch(self, model: str, done: asyncio.Future[None]) -> None:
        try:
            await self._engine.load(model)
        except EdgeFleetError as exc:
            if not done.done():
                done.set_exception(exc)
        else:
            if not done.done():
                done.set_result(None)

    def _model_loaded(self, model: str, seconds: float) -> None:
        self._counters["model_loads"] += 1
        self._metrics.model_loaded(model, seconds)

    async def _execute(self, plan: Plan) -> None:
        if plan.requests[0].pausable:
            await self._execute_generation(plan)
            return
        results: list[dict[str, np.ndarray]] | None = None
        t0 = self._clock.now()
        try:
            results = await self._engine.run(plan.model, [r.inputs for r in plan.requests])
        except RunAborted:
            requeued = sum(not r.cancel_requested for r in plan.requests)
            if requeued:  # aborted for a more urgent arrival, not (only) for a cancel
                self._counters["preemptions"] += 1
                self._counters["preempted"] += requeued
                self._metrics.preempted(plan)
            outcomes = self._sched.finish(plan, aborted=True)
        except EdgeFleetError as exc:
            outcomes = self._sched.finish(plan, error=exc)
        except Exception as exc:  # an engine bug must fail requests, never the node
            err = EngineError(f"model {plan.model!r}: {type(exc).__name__}: {exc}")
            outcomes = self._sched.finish(plan, error=err)
        else:
            outcomes = self._sched.finish(plan)
        service = self._clock.now() - t0
        self._counters["engine_calls"] += 1
        self._counters["batched_requests"] += len(plan.requests)
        self._metrics.engine_call(plan, service)
        by_id = {}
        if results is not None:
            by_id = {r.id: out for r, out in zip(plan.requests, results, strict=True)}
        self._settle(outcomes, by_id, plan=plan, service_s=service)

    async def _execute_generation(self, plan: Plan) -> None:
        """Run one generation until it ends or is paused at a token boundary."""
        req = plan.requests[0]
        gen = self._gens.live[req.id]
        t0 = self._clock.now()
        reason: str | None = None
        error: EdgeFleetError | None = None
        before = len(gen.tokens)

        def resident() -> None:  # the model is loaded: the generation starts or resumes
            if req.preemptions:
                self._counters["resumed"] += 1
                self._metrics.resumed(req.priority)
            self._gens.attach_cache(gen)
            self._gens.release(self._sched.paused, running=[gen])

        try:
            reason = await self._engine.advance(plan.model, gen, resident)
        except EdgeFleetError as exc:
            error = exc
        except Exception as exc:  # an engine bug must fail the request, never the node
            error = EngineError(f"model {plan.model!r}: {type(exc).__name__}: {exc}")
        self._counters["engine_calls"] += 1
        self._counters["tokens"] += len(gen.tokens) - before
        self._metrics.tokens(plan.model, req.priority, len(gen.tokens) - before)
        self._metrics.engine_call(plan, self._clock.now() - t0)
        if error is not None:
            outcomes = self._sched.finish(plan, error=error)
        elif reason is None:  # paused for more urgent work, or stopped by a cancel
            outcomes = self._sched.finish(plan, paused=True)
            if not req.cancel_requested:
                self._counters["preemptions"] += 1
                self._counters["paused"] += 1
                self._metrics.paused(req.priority)
                self._gens.release(self._sched.paused)
        else:
            gen.finish_reason = reason
            self._counters[f"finish_{reason}"] += 1
            if reason == "budget":
                self._metrics.budget_cut(req.priority)
            outcomes = self._sched.finish(plan)
            self._gens.keep(gen, self._sched.paused)
        self._settle(outcomes, plan=plan, service_s=self._clock.now() - t0)

    # ----------------------------------------------------------------- settlement

    def _settle(
        self,
        outcomes: Iterable[Outcome],
        results: Mapping[str, dict[str, np.ndarray]] | None = None,
        *,
        plan: Plan | None = None,
        service_s: float = 0.0,
    ) -> None:
        for o in outcomes:
            self._counters[o.state.value] += 1
            gen = self._gens.live.get(o.request.id)
            if gen is not None:
                gen.cache = None  # its caller keeps the tokens; the KV memory goes now
            self._metrics.settled(o, self._clock.now(), service_s)
            if self._trace is not None:
                ran = o.state is S.COMPLETED and (
                    gen is not None or o.request.id in (results or {})
                )
                self._trace.settled(
                    o.request,
                    o.state,
                    ran=ran,
                    service_s=gen.engine_s if gen is not None else service_s,
                    tokens=len(gen.generated) if gen is not None else 0,
                )
            timer = self._timers.pop(o.request.id, None)
            if timer is not None:
                timer.cancel()
            fut = self._waiters.pop(o.request.id, None)
            if fut is None or fut.done():
                continue
            r = o.request
            queue_s = (r.started - r.arrival) if r.started is not None else 0.0
            if o.follow is not None and o.follow in self._waiters:
                self._waiters[o.follow].add_done_callback(_forward(fut, r.id))
                continue
            reply = Reply(
                r.id,
                self.spec.name,
                outputs=results.get(r.id) if results and o.state is S.COMPLETED else None,
                error=o.error,
                queue_s=queue_s,
                service_s=service_s if plan is not None else 0.0,
                batch_size=len(plan.requests) if plan is not None else 0,
            )
            fut.set_result(reply)
            if o.state in (S.COMPLETED, S.FAILED) and r.started is not None:
                self._recent.remember(reply)  # it ran; a refusal is not kept (a retry runs)

    # --------------------------------------------------------------------- status

    def _running_generations(self) -> list[Generation]:
        plan = self._sched.running
        if plan is None:
            return []
        return [g for r in plan.requests if (g := self._gens.live.get(r.id)) is not None]

    def status(self) -> NodeStatus:
        running = self._sched.running
        now = self._clock.now()
        models = tuple(
            ModelStatus(
                name=i.name,
                loaded=i.name in self._models.loaded(),
                batchable=i.signature.batchable,
                batch_limit=i.batch_limit,
                cost_ms={k: v * 1000 for k, v in i.costs_s.items()},
                row_ms=None if (c := self._sched.row_cost(i.name)) is None else c * 1000,
                loads=i.loads,
                kind=i.config.kind,
                load_ms=i.load_s * 1000 if i.loads else None,
                exact_grouping=i.exact_grouping,
            )
            for i in self._models.models()
        )
        status = NodeStatus(
            name=self.spec.name,
            state=self._state,
            failure=self._failure,
            queued=self._sched.queued_by_priority(),
            queued_bytes=self._sched.queued_bytes,
            running=None
            if running is None
            else RunningStatus(
                running.model,
                tuple(r.id for r in running.requests),
                max(r.priority for r in running.requests),
                now - running.started,
                sum(r.rows for r in running.requests),
            ),
            models=models,
            counters=dict(self._counters),
            switching=self._engine.switching,
            rss_mb=_rss_mb(),
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            pid=os.getpid(),
            paused=self._sched.paused_by_priority(),
            lifecycle=self._gens.lifecycle,
            kv_bytes=self._gens.kv_bytes(self._sched.paused, self._running_generations()),
            sessions=tuple(self._gens.kv.sessions()[:MAX_REPORTED_SESSIONS]),
            metrics=self._metrics.summary(),
            queued_rows=self._sched.queued_rows(),
            busy=self._sched.busy_share(),
            at=now,
        )
        self._metrics.observe(status)
        return status


def _forward(
    target: asyncio.Future[Reply], request_id: str
) -> Callable[[asyncio.Future[Reply]], None]:
    """Give a superseded caller the answer of the request that replaced it."""

    def copy(source: asyncio.Future[Reply]) -> None:
        if not target.done():
            target.set_result(replace(source.result(), request_id=request_id))

    return copy


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / (1024 * 1024)
    except OSError:
        return 0.0
