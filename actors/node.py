"""The node: one engine, one scheduler, one asyncio loop. Ray wraps it as an actor.

The event loop only moves data and decisions; engine calls and model loads run on
the node's single engine thread. Between inference calls the engine thread takes the
next call from the scheduler itself (under the lock that serialises every scheduler
call) and hands what ended to the loop, which answers the callers. Every request that
reaches ``infer`` gets exactly one :class:`Reply`: its outputs or a typed error. Every
generation that reaches ``generate`` streams its tokens and ends with exactly one
:class:`GenerationResult`.

This file is intake, admission, the serve loop and settlement; the parts it composes
each have their own file: the scheduling core (``actors.scheduler``), the engine
thread (``actors.executor``), generations and their KV memory
(``actors.generations``), answers kept for retries (``actors.replies``), models
(``actors.models``), metrics and the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from actors.cache import ArtifactError, ModelCache, StoreSource, in_tree
from actors.decoder import Generation
from actors.engine import RunAborted, check_inputs, device_providers
from actors.executor import Call, EngineThread, Outputs, Waker
from actors.generations import NodeGenerations
from actors.metrics import NodeMetrics
from actors.models import Loader, ModelInfo, ModelManager, load_onnx
from actors.replies import RecentReplies
from actors.scheduler import LocalScheduler, Outcome, Plan, rules_for
from actors.trace import NodeTrace
from edgefleet.artifacts import ModelArtifact
from edgefleet.clock import Clock, MonotonicClock
from edgefleet.config import MiB, ModelConfig, NodeSpec
from edgefleet.errors import (
    Cancelled,
    EdgeFleetError,
    EngineError,
    EngineTimeout,
    InvalidInput,
    Rejected,
    VersionFailed,
)
from edgefleet.messages import (
    MAX_REPORTED_SESSIONS,
    NODE_COUNTERS,
    NODE_MOVES,
    GenerationResult,
    ModelStatus,
    NodeState,
    NodeStatus,
    Reply,
    TokenChunk,
)
from edgefleet.priorities import MAX_PRIORITY, check_priority
from edgefleet.request import (
    GenerateRequest,
    IllegalTransition,
    InferRequest,
    Request,
    RequestState,
)

S = RequestState
log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.002  # tokens made within this interval travel together...
# ...and within this one for work the top class may preempt (it is not waiting on each
# token): 4 background generations decoding together then stream a tenth as many chunks,
# and the CPU streaming took goes back to the engine (2.3x -> 2.7x the tokens/s of one
# at a time through a node, on 2 cores).
BULK_STREAM_INTERVAL_S = 0.02
LINGER_S = 0.002  # an engine thread with nothing to run waits this long for an arrival
# The watchdog looks this many times per shortest time limit (a model's max_call_s, or
# stuck_after_s): a call is terminated within a tenth of its limit past it. It never
# looks more often than every WATCH_MIN_S, whatever the limits.
WATCH_STEPS = 10
WATCH_MIN_S = 0.01


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
        self._fetched: Counter[str] = Counter()  # bytes fetched into the cache, by model
        self._models = ModelManager(
            spec.models,
            spec.memory_budget_mb,
            loader or load_onnx,
            node=spec.name,
            resolve=self._from_cache if spec.artifacts else None,
        )
        self._artifacts = dict(spec.artifacts)  # the files each model loads, as published
        self._cache: ModelCache | None = None  # opened at the first load
        self._cache_lock = threading.Lock()  # a fetch for a rollout runs beside loads
        self._updating: dict[str, str] = {}  # model -> the version it is moving to
        self._versioning: asyncio.Lock | None = None  # one version change at a time
        self._sched = LocalScheduler.for_node(spec, self._clock)
        self._counters: Counter[str] = Counter(dict.fromkeys(NODE_COUNTERS, 0))
        self._engine = EngineThread(spec.name, self._models, self._clock, self._model_loaded)
        # The loop and the engine thread (starting the next call itself) both drive the
        # scheduler: every scheduler call holds this lock, and nothing else does.
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # an idle engine thread waits on it
        self._lingering = False  # ... now (under the lock: notify only then, it is not free)
        self._call: Call | None = None  # the running inference call (under the lock)
        self._waker: Waker | None = None  # the engine thread's way to wake the loop
        self._ended: deque[_Ended] = deque()  # calls the engine ended, for the loop to settle
        self._settling = False  # the loop has been asked to settle them
        self._gens = NodeGenerations(spec, self._clock, self._counters)
        self._preempted: set[str] = set()  # generations paused for more urgent work
        # Generations below this priority are ones the top class may preempt: bulk work
        self._bulk_below = max(spec.priorities.values(), default=MAX_PRIORITY) - (
            spec.preemption.min_priority_gap - 1
        )
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._callers: Counter[str] = Counter()  # callers awaiting each request id
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._switches: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._state = NodeState.STARTING  # moved only by _move
        self._failure = ""  # why the node is out of service (failed, stuck)
        self._device = device_providers()  # this device's ONNX Runtime build
        self._start_error: Exception | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._watch_s = 1.0  # the watchdog's period (set at start from the time limits)
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
            except Exception as exc:  # a later start() says so again; status says failed
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
        with self._lock:
            for info in infos:
                rules = rules_for(info.config, info.batch_limit, info.costs_s)
                self._sched.set_rules(info.name, rules)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task = asyncio.create_task(self._serve(), name=f"node-{self.spec.name}")
        self._task.add_done_callback(self._supervised("serve loop"))
        limits = [self._call_limit_s(i.name, 1) for i in infos]
        shortest = min([*limits, self.spec.stuck_after_s])
        self._watch_s = max(WATCH_MIN_S, shortest / WATCH_STEPS)
        self._watchdog = asyncio.create_task(self._watch(), name=f"watch-{self.spec.name}")
        self._watchdog.add_done_callback(self._supervised("watchdog"))
        self._move(NodeState.SERVING)

    def _move(self, to: NodeState) -> None:
        """Change the service state, along an edge of ``NODE_MOVES`` only."""
        if to not in NODE_MOVES[self._state]:
            raise IllegalTransition(f"node {self.spec.name}: {self._state.name} -> {to.name}")
        self._state = to

    def _from_cache(self, name: str, config: ModelConfig) -> tuple[ModelConfig, ModelArtifact]:
        """``name``'s config loading from this device's model cache, its files fetched
        from the fleet's store first where the cache lacks them (engine thread)."""
        artifact = self._artifacts[name]
        return in_tree(config, artifact, self._fetch(name, artifact)), artifact

    def _fetch(self, name: str, artifact: ModelArtifact) -> Path:
        """Fetch what the cache lacks of ``artifact`` (``name``'s files); its tree."""
        if self.spec.store is None:
            raise ArtifactError(f"model {name!r}: the node was given no store to fetch from")
        source = StoreSource.named(self.spec.store)
        with self._cache_lock:
            if self._cache is None:
                limit = int(self.spec.model_cache_mb * MiB)
                self._cache = ModelCache(self.spec.model_cache, limit)
            keep = [a.digest for a in self._artifacts.values()]
            done = self._cache.ensure(artifact, source, [*keep, artifact.digest])
        if done.bytes_fetched:
            self._fetched[name] += done.bytes_fetched
            log.info(
                "node %s: fetched %d file(s) of %s, %.1f MiB, into %s",
                self.spec.name,
                done.files_fetched,
                artifact.describe(),
                done.bytes_fetched / MiB,
                self._cache.root,
            )
        return done.tree

    def _supervised(self, what: str) -> Callable[[asyncio.Task[None]], None]:
        """Supervision of a task that ends only when the node stops (the serve loop,
        the watchdog): one that died is logged, and the node fails: it stops taking
        work and answers what it held."""

        def ended(task: asyncio.Task[None]) -> None:
            if task.cancelled() or task.exception() is None:
                return
            exc = task.exception()
            log.error("node %s: the %s failed", self.spec.name, what, exc_info=exc)
            self._fail(f"its {what} stopped: {type(exc).__name__}: {exc}")

        return ended

    def _fail(self, reason: str) -> None:
        """Out of service for good: status says ``failed`` and why (the router then
        counts the node lost); queued and paused work ends Cancelled naming the reason,
        so its callers can send it again (a retry under the same id runs elsewhere). A
        stopped node stays stopped."""
        self._failure = reason
        if self._state not in (NodeState.FAILED, NodeState.STOPPED):
            self._move(NodeState.FAILED)
        with self._lock:
            self._sched.draining = True
        self._end_all(f"node {self.spec.name} failed ({reason}); send it again")

    def _end_all(self, reason: str) -> None:
        """Cancel, naming ``reason``, everything queued or paused, and the call in
        progress when no serve loop is left to finish it."""
        with self._lock:
            plan = self._sched.running
            ended: tuple[Outcome, ...] = ()
            if plan is not None and (self._task is None or self._task.done()):
                ended = self._sched.finish(plan, aborted=True)  # requeued, then cancelled
                self._call = None
            ended += self._sched.cancel_all(reason)
        self._settle(ended)

    async def stop(self) -> NodeStatus:
        """Cancel queued work, abort the running call, unload models. Idempotent."""
        if self._state is NodeState.STOPPED:
            return self.status()
        stuck = self._state is NodeState.STUCK
        if self._watchdog is not None:
            self._watchdog.cancel()
        with self._lock:
            self._sched.draining = True
            cancelled = self._sched.cancel_all(f"node {self.spec.name} stopped")
            self._abort_running()
            if self._lingering:
                self._arrived.notify()
        self._settle(cancelled)
        self._gens.kv.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._end_all(f"node {self.spec.name} stopped")
        self._move(NodeState.STOPPED)
        if self._trace is not None:
            self._trace.close()
        # A call that does not stop holds the engine thread: wait for it no longer.
        await self._engine.close(0.0 if stuck else self.spec.stuck_after_s)
        return self.status()

    async def drain(self) -> NodeStatus:
        """Refuse new work, finish what is queued and running, then return. A node that
        is not serving has nothing to drain (a stuck one is drained when its call
        returns)."""
        assert self._idle is not None and self._wake is not None, "start() first"
        with self._lock:
            self._sched.draining = True
        if self._state is NodeState.SERVING:
            self._move(NodeState.DRAINING)
            self._wake.set()
        if self._state is NodeState.DRAINING:
            await self._idle.wait()
            if self._state is NodeState.DRAINING:
                self._move(NodeState.DRAINED)
        return self.status()

    async def switch_model(self, model: str) -> NodeStatus:
        """Make ``model`` resident now: the current call finishes, new calls wait
        (they stay queued) while the model loads, then serving resumes."""
        self._models.info(model)  # ModelNotFound for a model this node does not serve
        self._check_serving()
        assert self._wake is not None, "start() first"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._switches.append((model, done))
        self._wake.set()
        await done
        return self.status()

    async def set_version(
        self, model: str, config: ModelConfig, artifact: ModelArtifact, drain_s: float = 60.0
    ) -> NodeStatus:
        """Serve ``model`` from another version of its files (``config`` and ``artifact``,
        as published to the fleet's store): fetch them into the cache while serving on,
        then refuse new work for the model (Rejected: callers place it on other nodes),
        let what the node holds of it finish (at most ``drain_s``), load the new version,
        warm it up and measure it, and admit again. VersionFailed when the new version
        does not load or warm up: the old one serves again. Idempotent."""
        self._models.info(model)  # ModelNotFound for a model this node does not serve
        self._check_serving()
        if self.spec.store is None:
            raise InvalidInput(f"node {self.spec.name} serves unpublished models")
        if self._versioning is None:
            self._versioning = asyncio.Lock()
        async with self._versioning:
            if self._artifacts[model].digest == artifact.digest:
                return self.status()
            old = self._artifacts[model]
            restore = functools.partial(self._artifacts.__setitem__, model, old)

            def swap() -> ModelInfo:  # on the engine thread, where loads happen
                self._artifacts[model] = artifact
                try:
                    return self._models.replace(model, config, restore)
                except BaseException:
                    restore()
                    raise

            try:
                await asyncio.to_thread(self._fetch, model, artifact)  # serving on meanwhile
                self._updating[model] = artifact.version
                held_since = self._clock.now()
                while True:
                    with self._lock:
                        held = self._sched.holds(model)
                    if not held:
                        break
                    if self._clock.now() - held_since > drain_s:
                        raise VersionFailed(
                            f"node {self.spec.name}: {held} request(s) for {model} did not "
                            f"finish within {drain_s:g} s; it serves @{old.version} on"
                        )
                    await asyncio.sleep(0.01)
                for entry in self._gens.kv.entries(model):  # the old version's KV
                    self._gens.kv.drop(entry.key)
                info = await self._engine.call(swap)
            finally:
                self._updating.pop(model, None)
        assert isinstance(info, ModelInfo)
        with self._lock:
            self._sched.set_rules(model, rules_for(info.config, info.batch_limit, info.costs_s))
        if info.exact_grouping:
            self._gens.exact_models.add(model)
        else:
            self._gens.exact_models.discard(model)
        self._counters["model_loads"] += 1
        log.info("node %s: %s now serves @%s", self.spec.name, model, artifact.version)
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
        except EdgeFleetError as exc:  # refused (not serving) or invalid
            self._counters["rejected" if isinstance(exc, Rejected) else "invalid"] += 1
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
        with self._lock:
            admission = self._sched.admit(req)
            if admission.preempt:
                self._abort_running()
            elif admission.join:  # a generation that decodes with the running ones
                self._engine.stop_at_boundary()
            if admission.accepted and self._lingering:
                self._arrived.notify()
        self._settle(admission.settled)
        if admission.accepted:
            self._counters["admitted"] += 1
            self._metrics.admitted(req.priority, req.model)
            assert self._wake is not None and self._idle is not None
            self._idle.clear()
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
        # Set while the stream waits for a token: only then is the loop woken, once, not
        # for every token (each wake costs the engine thread the GIL).
        listening = threading.Event()

        def emitted(token: int) -> None:  # on the engine thread, as each token is made
            now = self._clock.now()
            times.append(now - arrival)
            self._engine.progressed(now)
            if listening.is_set():
                listening.clear()
                loop.call_soon_threadsafe(ready.set)

        try:
            req, gen = self._make_generation(request, emitted)
        except EdgeFleetError as exc:  # refused (not serving) or invalid
            self._counters["rejected" if isinstance(exc, Rejected) else "invalid"] += 1
            exc.request_id = request.id
            yield GenerationResult(request.id, self.spec.name, error=exc)
            return
        self._gens.live[req.id] = gen
        interval = STREAM_INTERVAL_S if req.priority >= self._bulk_below else BULK_STREAM_INTERVAL_S
        fut = self._admit(req)
        fut.add_done_callback(lambda _: ready.set())
        sent = 0
        try:
            while True:
                listening.set()  # before looking, so a token made meanwhile wakes us
                if len(gen.tokens) - gen.prompt_len <= sent and not fut.done():
                    await ready.wait()
                listening.clear()
                ready.clear()
                done = fut.done()
                new = gen.tokens[gen.prompt_len + sent :]
                if new:
                    sent += len(new)
                    yield TokenChunk(tuple(new))
                if done:
                    break
                if sent:  # after the first token, send what came meanwhile in one chunk
                    await asyncio.wait([fut], timeout=interval)
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
        self._check_version(request.model, request.version)
        return self._gens.make(request, self._models.info(request.model), emit)

    def _check_version(self, model: str, version: str | None) -> None:
        """Rejected (another node may serve it) while the node moves ``model`` to another
        version, or for a request pinned to a version other than the one it serves."""
        moving_to = self._updating.get(model)
        if moving_to is not None:
            raise Rejected(
                f"node {self.spec.name} is moving {model} to @{moving_to}; another node may "
                "take it",
                retry_after_s=1.0,
            )
        if version is None:
            return
        info = self._models.info(model)  # ModelNotFound for a model not served here
        here = info.artifact.version if info.artifact else None
        if here != version:
            raise Rejected(
                f"node {self.spec.name} serves {model}@{here or 'unversioned'}, not "
                f"@{version}; another node may",
                retry_after_s=1.0,
            )

    def set_lifecycle(self, state: str) -> NodeStatus:
        """Set the node's lifecycle state; token budgets of running and paused
        generations change at their next token."""
        if self._gens.set_lifecycle(state):
            self._counters["lifecycle_changes"] += 1
        return self.status()

    def _check_serving(self) -> None:
        if self._state in (NodeState.FAILED, NodeState.STUCK):
            what = "failed" if self._state is NodeState.FAILED else "is stuck"
            raise Rejected(
                f"node {self.spec.name} {what} ({self._failure}); another node can take it",
                retry_after_s=1.0,
            )
        if self._wake is None:
            raise Rejected(f"node {self.spec.name} is still starting", retry_after_s=1.0)

    def _make_request(self, request: InferRequest) -> Request:
        self._check_serving()
        self._check_version(request.model, request.version)
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
        priority = check_priority(request.priority)
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
        with self._lock:
            outcome, abort = self._sched.cancel(request_id)
            running = self._sched.running
            if abort:
                self._abort_running()
            elif (
                outcome is None
                and running is not None
                and running.requests[0].pausable
                and any(r.id == request_id for r in running.requests)
            ):
                self._engine.stop_at_boundary()  # the others decode on without it
        if outcome is not None:
            self._settle([outcome])
            return True
        return running is not None and any(r.id == request_id for r in running.requests)

    def probe(self, request_ids: Sequence[str] = ()) -> dict[str, bool]:
        """Whether this node holds each request (queued, running, paused, or answered
        and kept for a retry): a caller whose answer is overdue asks. Answered on the
        event loop, so a node whose engine is busy answers at once; one that does not
        answer is frozen or out of reach."""
        return {r: r in self._waiters or self._recent.get(r) is not None for r in request_ids}

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        with self._lock:
            outcome = self._sched.expire(request_id)
        if outcome is not None:
            self._settle([outcome])

    # ------------------------------------------------------------------ the engine

    async def _serve(self) -> None:
        assert self._wake is not None and self._idle is not None
        self._waker = Waker(asyncio.get_running_loop(), self._settle_ended)
        try:
            while True:
                self._wake.clear()
                while self._switches:
                    await self._switch(*self._switches.popleft())
                with self._lock:
                    step = self._sched.next_work()
                    if step.plan is not None and not step.plan.requests[0].pausable:
                        self._call = Call(step.plan)
                    idle = self._sched.idle
                self._settle(step.settled)
                if step.plan is not None:
                    self._idle.clear()
                    await self._execute(step.plan)
                    continue
                if idle:
                    self._idle.set()
                timeout = None
                if step.wake_at is not None:
                    timeout = max(0.0, step.wake_at - self._clock.now())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
        finally:
            self._waker.close()

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
        call = self._call
        assert call is not None and call.plan is plan, "an inference plan runs as a Call"
        while call is not None:
            try:
                await self._engine.load(call.plan.model)
            except Exception as exc:  # the model cannot be made resident: the call fails
                call = self._finished(call, exc, 0.0, linger=False)
                continue
            call = await self._engine.chain(call, self._finished)

    def _abort_running(self) -> None:
        """Abort the running call, or the call taken but not started yet (under the lock:
        the engine thread cannot move on to another call meanwhile)."""
        if self._call is not None:
            self._call.stop.set()  # first: a call about to start sees it and never runs
        self._engine.abort()

    def _call_limit_s(self, model: str, rows: int) -> float:
        spec = self.spec
        info = self._models.info(model)
        return info.max_call_s(rows, spec.call_timeout_factor, spec.call_timeout_floor_s)

    async def _watch(self) -> None:
        """The watchdog, for as long as the node runs: terminate an engine call that
        runs past its time limit (its requests get EngineTimeout, the node goes on);
        when one does not stop, the node is stuck until it does."""
        while True:
            await asyncio.sleep(self._watch_s)
            with self._lock:  # the engine thread cannot move on to another call meanwhile
                stuck = self._engine.watch(
                    self._clock.now(), self._call_limit_s, self.spec.stuck_after_s
                )
            if stuck is not None:
                if self._state in (NodeState.SERVING, NodeState.DRAINING):
                    self._stuck(stuck)
            elif self._state is NodeState.STUCK:
                log.warning("node %s: the stuck engine call returned", self.spec.name)
                self._failure = ""
                with self._lock:
                    draining = self._sched.draining
                self._move(NodeState.DRAINED if draining else NodeState.SERVING)

    def _stuck(self, reason: str) -> None:
        """An engine call that does not stop holds the engine thread: refuse new work
        (callers place it on another node), evict what is queued (it never ran), end the
        held call's requests with EngineTimeout, and report ``stuck`` and why, for the
        router to restart the node. Serving resumes if the call ever returns."""
        log.error("node %s is stuck: %s", self.spec.name, reason)
        self._move(NodeState.STUCK)
        self._failure = reason
        gone = f"node {self.spec.name} is stuck ({reason}); send it to another node"
        with self._lock:
            ended: tuple[Outcome, ...] = ()
            plan = self._sched.running
            if plan is not None:  # when the call returns, the node has ended it already
                err = EngineTimeout(
                    f"model {plan.model!r}: the engine call ran past its max_call_s and did "
                    f"not stop when terminated; node {self.spec.name} is stuck. If its calls "
                    f"may take longer, raise models.{plan.model}.max_call_s"
                )
                ended = self._sched.finish(plan, error=err)
                self._call = None
            ended += self._sched.evict_all(gone) + self._sched.cancel_all(gone)
        self._settle(ended)
        while self._switches:
            _, done = self._switches.popleft()
            if not done.done():
                done.set_exception(Rejected(gone, retry_after_s=1.0))
        assert self._idle is not None
        self._idle.set()  # nothing is left to drain

    def _may_pipeline(self) -> bool:
        """Whether the engine thread may take the next call itself. Generations, model
        switches, draining and stopping go through the serve loop."""
        return not (self._sched.draining or self._switches or self._gens.live)

    def _finished(
        self, call: Call, result: Outputs | Exception, service_s: float, *, linger: bool = True
    ) -> Call | None:
        """A call ended (on the engine thread, or on the loop when its model could not
        load, then without ``linger``): finish it in the scheduler, hand its settlement to
        the loop and, when the engine may go straight on, take the next call."""
        plan = call.plan
        with self._lock:
            if self._sched.running is not plan:  # the node ended it meanwhile (stopping)
                return None
            self._call = None
            outputs: Outputs | None = None
            requeued = 0
            if isinstance(result, RunAborted):
                # aborted for a more urgent arrival, not (only) for a cancel
                requeued = sum(not r.cancel_requested for r in plan.requests)
                outcomes = self._sched.finish(plan, aborted=True)
            elif isinstance(result, EdgeFleetError):
                outcomes = self._sched.finish(plan, error=result)
            elif isinstance(result, Exception):  # an engine bug fails requests, never the node
                err = EngineError(f"model {plan.model!r}: {type(result).__name__}: {result}")
                outcomes = self._sched.finish(plan, error=err)
            else:
                outputs = result
                outcomes = self._sched.finish(plan)
            self._post(_Ended(call, outcomes, outputs, requeued, service_s))
            return self._next_call(LINGER_S if linger else 0.0)

    def _next_call(self, linger_s: float) -> Call | None:
        """Under the lock: the next call the engine may start at once, if any. When
        nothing is queued, wait up to ``linger_s`` for an arrival (``_admit`` notifies)
        rather than hand the engine back to the loop: restarting it costs the loop a
        turn and the engine thread a wake-up, for a third of a small model's calls under
        load. What needs the loop (a generation, a switch, draining) ends the chain at
        the next call, or once the wait is over."""
        for waited in (False, True):
            if not self._may_pipeline():
                return None
            step = self._sched.next_work()  # a scheduler bug raises: the serve loop fails
            if step.settled:
                self._post(_Ended(None, step.settled))
            if step.plan is not None:
                self._call = Call(step.plan)
                return self._call
            if waited or step.wake_at is not None or linger_s <= 0:
                return None  # a batching window or a deadline: the loop keeps the time
            self._lingering = True
            try:
                self._arrived.wait(linger_s)
            finally:
                self._lingering = False
        return None

    def _post(self, ended: _Ended) -> None:
        """Hand what a call ended to the loop; one wake-up settles all that ended by then."""
        self._ended.append(ended)
        if not self._settling:
            self._settling = True
            assert self._waker is not None
            self._waker.wake()

    def _settle_ended(self) -> None:
        """On the loop: count and answer what the calls ended since the last time. A
        settlement that fails (a bug) fails the node, as a serve loop that dies does,
        and the callers of that call hear so instead of waiting forever."""
        self._settling = False  # first: a call ended from now on asks again
        while self._ended:
            ended = self._ended.popleft()
            try:
                self._settle_call(ended)
            except Exception as exc:
                log.error("node %s: answering a call failed", self.spec.name, exc_info=exc)
                reason = f"answering a call failed: {type(exc).__name__}: {exc}"
                self._fail(reason)
                for o in ended.outcomes:
                    fut = self._waiters.pop(o.request.id, None)
                    if fut is not None and not fut.done():
                        err = Cancelled(
                            f"node {self.spec.name} failed ({reason}); send it again",
                            request_id=o.request.id,
                        )
                        fut.set_result(Reply(o.request.id, self.spec.name, error=err))

    def _settle_call(self, ended: _Ended) -> None:
        if ended.call is None:  # requests whose deadline passed while the engine took the next
            self._settle(ended.outcomes)
            return
        plan = ended.call.plan
        if ended.requeued:
            self._counters["preemptions"] += 1
            self._counters["preempted"] += ended.requeued
            self._metrics.preempted(plan)
        self._counters["engine_calls"] += 1
        self._counters["batched_requests"] += len(plan.requests)
        self._metrics.engine_call(plan, ended.service_s)
        by_id = {}
        if ended.outputs is not None:
            by_id = {r.id: out for r, out in zip(plan.requests, ended.outputs, strict=True)}
        self._settle(ended.outcomes, by_id, service_s=ended.service_s, call=ended.call)

    async def _execute_generation(self, plan: Plan) -> None:
        """Decode the plan's generations together until each ends or the call stops at
        a token boundary: paused for more urgent work, or regrouped (a generation joins,
        a cancelled one leaves) and resumed at once."""
        gens = {r.id: self._gens.live[r.id] for r in plan.requests}
        before = {rid: len(g.tokens) for rid, g in gens.items()}
        t0 = self._clock.now()
        reasons: dict[str, str | None] = {}
        error: EdgeFleetError | None = None

        def resident() -> None:  # the model is loaded: the generations start or resume
            for r in plan.requests:
                if r.id in self._preempted:  # paused for more urgent work, now resumed
                    self._preempted.discard(r.id)
                    self._counters["resumed"] += 1
                    self._metrics.resumed(r.priority)
                self._gens.attach_cache(gens[r.id])
            with self._lock:
                paused = self._sched.paused
            self._gens.release(paused, running=gens.values())

        try:
            reasons = await self._engine.advance(plan.model, list(gens.values()), resident)
        except EdgeFleetError as exc:
            error = exc
        except Exception as exc:  # an engine bug must fail the requests, never the node
            error = EngineError(f"model {plan.model!r}: {type(exc).__name__}: {exc}")
        self._counters["engine_calls"] += 1
        for r in plan.requests:
            made = len(gens[r.id].tokens) - before[r.id]
            self._counters["tokens"] += made
            self._metrics.tokens(plan.model, r.priority, made)
        self._metrics.engine_call(plan, self._clock.now() - t0)
        for rid, reason in reasons.items():
            if reason is not None:
                gens[rid].finish_reason = reason
                self._counters[f"finish_{reason}"] += 1
        with self._lock:
            if self._sched.running is not plan:  # the node ended it meanwhile (stuck)
                return
            preempted = self._sched.preempting
            if error is not None:
                outcomes = self._sched.finish(plan, error=error)
            else:
                pause = [rid for rid, reason in reasons.items() if reason is None]
                outcomes = self._sched.finish(plan, paused=pause, preempted=preempted)
            paused = self._sched.paused
        held = [r for r in plan.requests if r.state is S.PAUSED]
        if held and preempted:
            self._counters["preemptions"] += 1
            self._counters["paused"] += len(held)
            for r in held:
                self._preempted.add(r.id)
                self._metrics.paused(r.priority)
        completed = [r for r in plan.requests if r.state is S.COMPLETED]
        for r in completed:
            if gens[r.id].finish_reason == "budget":
                self._metrics.budget_cut(r.priority)
            self._gens.keep(gens[r.id])
        if completed or held:  # once for the whole call, after every cache it keeps
            self._gens.release(paused)
        self._settle(outcomes, plan=plan, service_s=self._clock.now() - t0)

    # ----------------------------------------------------------------- settlement

    def _settle(
        self,
        outcomes: Iterable[Outcome],
        results: Mapping[str, dict[str, np.ndarray]] | None = None,
        *,
        plan: Plan | None = None,
        service_s: float = 0.0,
        call: Call | None = None,
    ) -> None:
        """Count and answer ``outcomes``; ``plan`` (a generation's) or ``call`` (an
        inference's: its start, hand-off and abort wait) served them and took
        ``service_s`` of engine time."""
        if call is not None:
            plan = call.plan
        ran_at = call.ran_at if call is not None else None  # None: no inference call ran
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
            started = ran_at if ran_at is not None else r.started  # ran_at: its call ran
            queue_s = (started - r.arrival) if started is not None else 0.0
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
                call_rows=plan.rows if plan is not None else 0,
                handoff_s=call.handoff_s if call is not None else 0.0,
                abort_s=call.abort_s if call is not None else 0.0,
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
        with self._lock:  # the engine thread may be taking the next call meanwhile
            status = self._status()
        self._metrics.observe(status)
        return status

    def _status(self) -> NodeStatus:
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
                providers=i.providers,
                version=i.artifact.version if i.artifact else "",
                digest=i.artifact.digest if i.artifact else "",
                fetched_bytes=self._fetched.get(i.name, 0),
                failed=(served := self._metrics.served(i.name))[0],
                service=served[1],
                signature=i.signature.text,
                moving=i.name in self._updating,
            )
            for i in self._models.models()
        )
        return NodeStatus(
            name=self.spec.name,
            state=self._state,
            failure=self._failure,
            device=self._device,
            queued=self._sched.queued_by_priority(),
            queued_bytes=self._sched.queued_bytes,
            running=None if running is None else running.status(now),
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


@dataclass(frozen=True)
class _Ended:
    """What one inference call ended, for the loop to settle (no call: requests that
    expired while the engine thread took the next call)."""

    call: Call | None
    outcomes: tuple[Outcome, ...]
    outputs: Outputs | None = None  # one dict per request, when the call succeeded
    requeued: int = 0  # requests sent back to the queue by a preemption
    service_s: float = 0.0


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
