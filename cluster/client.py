"""FleetClient: the Python entry point to a fleet (services, dashboards, scripts)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import contextlib
import logging
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorHandle
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from cluster.deploy import (
    connect_ray,
    deploy_nodes,
    deploy_router,
    find_fleet,
    node_handles,
    router_name,
    say_pools,
    start_local_ray,
    teardown,
)
from cluster.dispatch import Dispatcher, FleetView, NodeGone, NodeReport
from cluster.names import NAMESPACE, actor_name, node_actor_name
from cluster.nodes import RayNode
from cluster.rollout import Rollout, prepare
from cluster.store import publish
from cluster.text import (
    ChatTemplate,
    Message,
    Tokenizer,
    chat_template_for,
    is_conversation,
    tokenizer_for,
)
from edgefleet.artifacts import split_version
from edgefleet.config import FleetConfig, load_config
from edgefleet.errors import InvalidInput, NodeLost, RolloutRefused, TimedOut
from edgefleet.messages import FleetStatus, GenerationResult, NodeStatus, Reply, TokenChunk
from edgefleet.priorities import resolve_priority
from edgefleet.request import GenerateRequest, InferRequest, check_text, new_request_id, token_ids
from policies.rollout import DEFAULT_GATES, parse_gates, parse_share

__all__ = ["Chat", "FleetClient", "FleetStatus", "TokenStream"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
CONTROL_TIMEOUT_S = 30.0
LARGE_INPUT_BYTES = 1024 * 1024
SWITCH_TIMEOUT_S = 300.0
ROLLOUT_POLL_S = 0.5


class FleetClient:
    """Send inference to a fleet and watch it.

    Use :meth:`local` to run a fleet inside an embedded Ray cluster on loopback.
    The client places each request itself, on the node where it would finish soonest
    at its priority (the fleet's placement pipeline, on the view the router publishes),
    sends it there directly and spills to the next node when one refuses; a request
    every node refuses raises :class:`Rejected` with a retry-after hint. Thread-safe.
    """

    def __init__(
        self,
        config: FleetConfig,
        router: ActorHandle,
        nodes: Mapping[str, ActorHandle],
        *,
        owns_fleet: bool = False,
        owns_ray: bool = False,
    ) -> None:
        self.config = config
        self._router = router
        self._nodes = dict(nodes)
        self._owns_fleet = owns_fleet
        self._owns_ray = owns_ray
        fleet = config.fleet.name
        handles = {
            name: RayNode(actor_name(fleet, name), NAMESPACE, actor)
            for name, actor in self._nodes.items()
        }
        caller = self._caller = new_request_id()
        # Each caller's random choices differ (callers that chose alike would herd).
        rng = random.Random(f"{config.router.placement.seed}/{caller}")
        self._dispatcher = Dispatcher(
            config,
            handles,
            rng=rng,
            watch=True,
            member_handle=lambda spec: RayNode(node_actor_name(fleet, spec), NAMESPACE),
        )
        self._feed = _ViewFeed(router, self._dispatcher, config, caller)
        self._closed = False
        self._fetched_text: dict[str, Path] = {}  # model -> its tokenizer files, fetched
        # A script that ends without close(): its feed thread must stop before Ray's own
        # exit handler shuts Ray down (registered at ray.init, so it runs after this
        # one), or its next call to a shut-down Ray ends the process with status 1.
        client = weakref.ref(self)

        def at_exit() -> None:
            alive = client()
            if alive is not None:
                alive.close()

        self._at_exit = at_exit
        atexit.register(at_exit)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def local(
        cls, config: str | Path | FleetConfig, *, progress: Progress | None = None
    ) -> FleetClient:
        """Deploy ``config``'s nodes on an embedded Ray cluster bound to loopback.

        Reuses the Ray instance this process is already connected to, if any. Use it
        as a context manager, or call :meth:`close`, to tear the fleet down. Built-in
        models the config names are written first when their files are missing, as
        ``edgefleet up`` does.
        """
        from edgefleet.modelgen import make_missing_models  # onnx: only when deploying

        cfg = config if isinstance(config, FleetConfig) else load_config(config)
        make_missing_models(cfg, progress)
        cfg.require_models()
        owns_ray = not ray.is_initialized()
        if owns_ray:
            if progress:
                progress("starting an embedded Ray cluster on 127.0.0.1")
            start_local_ray(cfg)
        nodes: dict[str, ActorHandle] = {}
        router: ActorHandle | None = None
        try:
            cfg = publish(cfg, progress)
            nodes = deploy_nodes(cfg, progress)
            router = deploy_router(cfg)
            if progress:
                progress(f"router {router_name(cfg.fleet.name)} ready")
                say_pools(cfg, router, progress)
            return cls(cfg, router, nodes, owns_fleet=True, owns_ray=owns_ray)
        except BaseException:  # nothing this call started outlives its failure
            teardown(nodes, router, fleet=cfg.fleet.name)
            if owns_ray:
                ray.shutdown()
            raise

    @classmethod
    def connect(cls, address: str = "auto", fleet: str = "edgefleet") -> FleetClient:
        """Attach to a fleet running on a Ray cluster (e.g. from a dashboard process).

        ``address`` is a Ray address; ``auto`` finds the head ``edgefleet up --detach``
        started for ``fleet``, else ``RAY_ADDRESS`` or the cluster on this machine.
        Closing this client leaves the fleet running.
        """
        if not ray.is_initialized():
            connect_ray(address, fleet)
        router, config = find_fleet(fleet)
        return cls(config, router, node_handles(config))

    def with_placement(self, **placement: Any) -> FleetClient:
        """Another caller on the same fleet that places with other ``router.placement``
        settings (e.g. ``policy="round_robin"``), to compare policies on a live fleet.
        Settings not given keep this client's. Closing it leaves the fleet running."""
        return FleetClient(self.config.with_placement(**placement), self._router, self._nodes)

    def close(self) -> None:
        """Tear down what this client started (nodes, and Ray if it started it)."""
        atexit.unregister(self._at_exit)
        if self._closed:
            return
        self._closed = True
        self._feed.stop()
        self._dispatcher.close()
        if self._owns_fleet and self._router is not None:
            teardown(self._nodes, self._router, fleet=self.config.fleet.name)
            self._nodes = {}
            self._owns_fleet = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inference

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
        at_most_once: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one inference and return its outputs, or raise a typed EdgeFleetError.

        A request whose node is lost while holding it, or stops answering, is placed
        again under the same id (inference is idempotent); ``at_most_once=True``
        answers NodeLost instead, for a caller that must never have it run twice.
        ``timeout_s`` bounds the whole wait: past it, :class:`TimedOut`, and the request
        is cancelled where it was (``deadline_s`` bounds only the wait to start)."""
        return self.infer_reply(
            model,
            inputs,
            priority=priority,
            deadline_s=deadline_s,
            key=key,
            request_id=request_id,
            at_most_once=at_most_once,
            timeout_s=timeout_s,
        ).unwrap()

    def infer_reply(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout_s: float | None = None,
        **kw: Any,
    ) -> Reply:
        """Like :meth:`infer`, but returns the :class:`Reply` (outputs or error, node,
        queue and service time, batch size) without raising."""
        request, inputs_ref = self._request(model, inputs, **kw)
        return self._dispatcher.call(request, inputs_ref, _timeout(timeout_s))

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
        at_most_once: bool = False,
        timeout_s: float | None = None,
    ) -> cf.Future[Reply]:
        """Send one request without waiting; returns a future of its :class:`Reply`.

        For pipelining many requests from one thread (``concurrent.futures.wait``).
        The future never raises: errors are in ``Reply.error`` (:class:`TimedOut`
        past ``timeout_s``). Inputs larger than 1 MiB are put in Ray's object store
        once and the node reads them from there. A retry with the same ``request_id``
        is answered once by the node holding it.
        """
        request, inputs_ref = self._request(
            model,
            inputs,
            priority=priority,
            deadline_s=deadline_s,
            key=key,
            request_id=request_id,
            at_most_once=at_most_once,
        )
        return self._dispatcher.submit(request, inputs_ref, _timeout(timeout_s))

    def map_unordered(
        self,
        model: str,
        inputs: Iterable[Mapping[str, np.ndarray]],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        in_flight: int = 32,
        timeout_s: float | None = None,
    ) -> Iterator[tuple[int, Reply]]:
        """Run ``model`` on each of ``inputs`` with up to ``in_flight`` requests
        outstanding; yields ``(index of the input, its Reply)`` as the answers come.

        For a caller that keeps a fleet busy from one thread (a camera feed, a batch
        job): the same placement, spill and re-placement as :meth:`submit`, but the
        replies are waited for and read on the calling thread, many at a time, instead
        of handed over one by one from Ray's thread: less CPU per request. ``inputs``
        is read lazily, as answers make room. Each reply is the one answer of its input
        (errors in ``Reply.error``, an input that is not a mapping of arrays included);
        stopping early leaves the requests already sent to finish on their nodes, unread.
        ``timeout_s`` bounds each request from when it is sent (:class:`TimedOut`).
        An unknown model, priority, deadline or timeout raises at the call.
        """
        self._check_model(model)
        level = resolve_priority(priority, self.config.priorities)
        InferRequest.deadline_from_timeout(deadline_s)  # a bad one fails here, not per input
        timeout_s = _timeout(timeout_s)

        def requests() -> Iterator[tuple[InferRequest, Any] | Reply]:
            for x in inputs:
                try:
                    yield self._request(model, x, priority=level, deadline_s=deadline_s)
                except InvalidInput as exc:  # this input alone fails
                    yield Reply(new_request_id(), "", error=exc)

        return self._dispatcher.pipeline(requests(), in_flight, timeout_s)

    def _request(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
        at_most_once: bool = False,
    ) -> tuple[InferRequest, Any]:
        """The request, and an object reference of its inputs when they are large (the
        dispatcher prices the request by its inputs and sends it without them)."""
        self._check_model(model)
        if not isinstance(inputs, Mapping):
            raise InvalidInput(
                f"inputs must map input names to arrays, got {type(inputs).__name__}"
            )
        request = InferRequest(
            model=model,
            inputs=inputs,
            priority=resolve_priority(priority, self.config.priorities),
            id=check_text(request_id, "request_id") or new_request_id(),
            deadline_unix=InferRequest.deadline_from_timeout(deadline_s),
            key=check_text(key, "key"),
            at_most_once=bool(at_most_once),
        )
        if sum(getattr(v, "nbytes", 0) for v in inputs.values()) > LARGE_INPUT_BYTES:
            return request, ray.put(dict(inputs))
        return request, None

    @staticmethod
    def gather(futures: Iterable[cf.Future[Reply]], timeout_s: float | None = None) -> list[Reply]:
        """The replies of :meth:`submit` futures, in order; waits at most ``timeout_s``
        for all of them (:class:`TimedOut`, a TimeoutError, when some are still out)."""
        futures = list(futures)
        _, pending = cf.wait(futures, timeout=timeout_s)
        if pending:
            raise TimedOut(f"{len(pending)} of {len(futures)} replies not in {timeout_s} s")
        return [f.result() for f in futures]

    async def infer_async(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
        at_most_once: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Awaitable :meth:`infer`, for asyncio services."""
        future = self.submit(
            model,
            inputs,
            priority=priority,
            deadline_s=deadline_s,
            key=key,
            request_id=request_id,
            at_most_once=at_most_once,
            timeout_s=timeout_s,
        )
        reply: Reply = await asyncio.wrap_future(future)
        return reply.unwrap()

    def generate(
        self,
        model: str,
        prompt: str | Iterable[int] | Sequence[Message],
        *,
        max_new_tokens: int = 64,
        priority: str | int = "foreground",
        session: str | None = None,
        prefix_len: int = 0,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_ids: Iterable[int] = (),
        deadline_s: float | None = None,
        request_id: str | None = None,
        at_most_once: bool = False,
        timeout_s: float | None = None,
    ) -> TokenStream:
        """Generate with a decoder model; iterate the result for token ids as they
        are produced (or its :meth:`TokenStream.texts` for text). Afterwards
        ``finish_reason`` is ``stop``, ``length``, ``budget`` or ``cancelled``; a
        request that never ran raises its typed error instead.

        ``prompt`` is token ids, or text where the model's folder has a
        ``tokenizer.json`` (read here, in the caller: see :mod:`cluster.text`), or a
        conversation, ``[{"role": "system" | "user" | "assistant", "content": text}]``,
        where its ``tokenizer_config.json`` has a chat template too: rendered with it,
        ready for the assistant's answer (:meth:`chat` keeps a conversation going).

        ``session`` lets follow-up turns of a chat reuse the KV of earlier ones on the
        node that holds it; ``prefix_len`` marks a shared system prompt. ``deadline_s``
        bounds the wait before the first step, ``timeout_s`` the whole generation
        (:class:`TimedOut`, with the tokens sent). A generation whose node is lost, or
        stops answering, goes on on another node from the tokens sent;
        ``at_most_once=True`` ends it NodeLost.
        """
        self._check_model(model)
        ids: Iterable[int]
        if isinstance(prompt, str):
            ids = self.tokenizer(model).encode(prompt)
        elif is_conversation(prompt):
            tokenizer = self.tokenizer(model)  # none: the model takes token ids, says so
            text = self.chat_template(model).render(prompt)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = cast(Iterable[int], prompt)  # checked as ids just below
        request = GenerateRequest(
            model=model,
            prompt_ids=token_ids(ids, "prompt"),
            max_new_tokens=max_new_tokens,
            priority=resolve_priority(priority, self.config.priorities),
            id=check_text(request_id, "request_id") or new_request_id(),
            session=check_text(session, "session"),
            prefix_len=prefix_len,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            stop_ids=token_ids(stop_ids, "stop_ids"),
            deadline_unix=InferRequest.deadline_from_timeout(deadline_s),
            at_most_once=bool(at_most_once),
        )
        stream = self._dispatcher.stream(request, _timeout(timeout_s))
        return TokenStream(request.id, stream, lambda: self.tokenizer(model))

    def tokenizer(self, model: str) -> Tokenizer:
        """The tokenizer of ``model`` (its folder's ``tokenizer.json``); InvalidInput
        saying it takes token ids when it has none."""
        self._check_model(model)
        name, _ = split_version(model)
        return tokenizer_for(name, self._text_files(name))

    def chat_template(self, model: str) -> ChatTemplate:
        """The chat template of ``model`` (its folder's ``tokenizer_config.json``);
        InvalidInput saying it has none."""
        self._check_model(model)
        name, _ = split_version(model)
        return chat_template_for(name, self._text_files(name))

    def _text_files(self, name: str) -> Path:
        """Where ``name``'s tokenizer files are read from: beside its file, as the fleet
        file gives it, or, where this machine has no copy, from the fleet's store into
        this machine's model cache (the deploy published them)."""
        path = self.config.models[name].path
        artifact = self.config.artifacts.get(name)
        side = artifact.side_files() if artifact is not None else None
        if path.parent.is_dir() or side is None or self.config.store is None:
            return path
        from actors.cache import ModelCache, StoreSource, default_cache_dir

        fetched = self._fetched_text.get(name)
        if fetched is None:  # once per client: ensure() checks every file's sha256
            limit = int(self.config.node_defaults.model_cache_mb) << 20
            tree = (
                ModelCache(default_cache_dir(), limit)
                .ensure(side, StoreSource.named(self.config.store))
                .tree
            )
            fetched = self._fetched_text[name] = tree / side.path
        return fetched

    def chat(
        self,
        model: str,
        *,
        system: str | None = None,
        session: str | None = None,
        **options: Any,
    ) -> Chat:
        """A conversation with ``model``: :meth:`Chat.send` a user's text, get the
        answer; each turn is the whole conversation rendered with the model's chat
        template, under one ``session`` (a new one by default), so the node holding it
        prefills only what is new. ``system``: the system message, the turns' shared
        prefix. ``options``: :meth:`generate`'s (``max_new_tokens``, ``priority``,
        ``temperature``...), for every turn. InvalidInput at once for a model without
        a tokenizer or a chat template."""
        self.tokenizer(model)
        self.chat_template(model)
        unknown = sorted(set(options) - CHAT_OPTIONS)
        if unknown:
            raise InvalidInput(
                f"chat takes no {', '.join(unknown)}; it takes {', '.join(sorted(CHAT_OPTIONS))}"
            )
        name = check_text(session, "session") or f"chat-{new_request_id()}"
        return Chat(self, model, name, system, options)

    # -------------------------------------------------------------------- control

    def set_lifecycle(
        self, node: str, state: str, timeout_s: float = CONTROL_TIMEOUT_S
    ) -> NodeStatus:
        """Tell ``node`` its lifecycle state changed ("foreground" or "background"):
        token budgets of its generations follow at their next token."""
        self._node(node)
        status: NodeStatus = self._ask_router("set_lifecycle", timeout_s, node, state)
        return status

    def counters(self) -> dict[str, int]:
        """What this client counted since it was made: requests received, completed,
        spilled, replaced, shed, and each other outcome (``status().router`` adds up
        every caller's, for the whole fleet)."""
        return dict(self._dispatcher.counted())

    def status(self, timeout_s: float = CONTROL_TIMEOUT_S) -> FleetStatus:
        """Fresh reports from every reachable node, with the fleet-wide counters (this
        client's included)."""
        counted = dict(self._dispatcher.counted())
        status: FleetStatus = self._ask_router("status", timeout_s, self._caller, counted)
        fresh = {
            n.name: NodeReport(n, status.healthy.get(n.name, False), 0.0) for n in status.nodes
        }
        self._dispatcher.update(FleetView(fresh))  # place on these fresh reports too
        return status

    def cancel(self, request_id: str, timeout_s: float = CONTROL_TIMEOUT_S) -> bool:
        """Cancel a request wherever it is queued or running; True if a node had it."""
        check_text(request_id, "request_id")
        return bool(self._ask_router("cancel", timeout_s, request_id))

    def switch_model(
        self, node: str, model: str, timeout_s: float = SWITCH_TIMEOUT_S
    ) -> NodeStatus:
        """Make ``model`` resident on ``node`` (the current call finishes first)."""
        (status,) = _get([self._node(node).switch_model.remote(model)], timeout_s, "switch")
        return status

    def drain(self, node: str, timeout_s: float | None = None) -> NodeStatus:
        """Stop ``node`` taking new work and wait until its queue is empty."""
        (status,) = _get([self._node(node).drain.remote()], timeout_s, "drain")
        return status

    # -------------------------------------------------------------------- rollouts

    def rollout(
        self,
        model: str,
        to: str | Path,
        *,
        version: str | None = None,
        canary: str | int = 1,
        step: str | int = "25%",
        bake_s: float = 60.0,
        gates: str = DEFAULT_GATES,
        allow_signature_change: bool = False,
        wait: bool = True,
        timeout_s: float | None = None,
        progress: Progress | None = None,
    ) -> Rollout:
        """Move ``model`` to the ONNX file ``to`` (its files beside it as for a deploy),
        node by node: ``canary`` nodes first (a count, or a share such as "10%"), then
        ``step`` at a time; after each step the moved nodes serve for ``bake_s`` while
        ``gates`` (e.g. "error_rate<=0.01,p99<=1.5x") compare them with the nodes still
        on the old version. A failed gate, or a node where the new version does not load
        or warm up, moves every moved node back. ``version``: its name (default: its
        digest's first 12 hex digits). RolloutRefused, before any node is touched, for a
        file that is not ONNX, does not load, or takes or returns other tensors than the
        version served (unless ``allow_signature_change``), or while another rollout of
        the model runs. Returns the rollout, ended when ``wait`` (see
        :meth:`wait_rollout`)."""
        try:
            shares = parse_share(canary, "canary"), parse_share(step, "step")
            parse_gates(gates)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        # The router refuses it too; asked first, nothing is uploaded for a refusal.
        running = next((r for r in self.rollouts() if r.model == model and r.active), None)
        if running is not None:
            raise RolloutRefused(f"a rollout of {model} is running: {running.summary()}")
        served = next(
            (m.signature for n in self.status().nodes for m in n.models if m.name == model),
            None,
        )
        new = prepare(
            self.config,
            model,
            Path(to),
            version=version,
            serving_signature=served,
            allow_signature_change=allow_signature_change,
            progress=progress,
        )
        started: Rollout = self._ask_router(
            "rollout", CONTROL_TIMEOUT_S, model, new, *shares, bake_s, gates
        )
        if progress is not None:
            progress(f"rollout: {started.summary()}")
        if not wait:
            return started
        return self.wait_rollout(model, timeout_s, progress)

    def rollouts(self, timeout_s: float = CONTROL_TIMEOUT_S) -> list[Rollout]:
        """Each model's last rollout, running or ended."""
        return cast(list[Rollout], self._ask_router("rollouts", timeout_s))

    def wait_rollout(
        self, model: str, timeout_s: float | None = None, progress: Progress | None = None
    ) -> Rollout:
        """Wait until ``model``'s rollout ended (done, rolled back or aborted), saying
        each of its events to ``progress``; TimedOut after ``timeout_s`` (it runs on)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        said = 0
        while True:
            r = next((r for r in self.rollouts() if r.model == model), None)
            if r is None:
                raise InvalidInput(f"no rollout of {model}")
            if progress is not None:
                for event in r.events[said:]:
                    progress(event)
                said = len(r.events)
            if not r.active:
                return r
            if deadline is not None and time.monotonic() > deadline:
                raise TimedOut(f"the rollout of {model} runs on: {r.summary()}")
            time.sleep(ROLLOUT_POLL_S)

    def abort_rollout(self, model: str, timeout_s: float = CONTROL_TIMEOUT_S) -> Rollout:
        """Stop ``model``'s rollout: every node moved so far goes back to the old version."""
        return cast(Rollout, self._ask_router("rollout_abort", timeout_s, model))

    def pin(
        self, target: str, model: str, version: str | None, timeout_s: float = CONTROL_TIMEOUT_S
    ) -> None:
        """Make a node or every node of a pool (``target``) serve ``model``@``version``, a
        version the fleet knows (deployed or rolled out), whatever rollouts do; None
        unpins it."""
        self._ask_router("rollout_pin", timeout_s, target, model, version)

    def _ask_router(self, method: str, timeout_s: float, *args: Any) -> Any:
        """Call the router, waiting out a restart (Ray restarts it after a crash) with
        exponential backoff and jitter, for at most ``timeout_s`` in all. Control calls
        are idempotent, so asking again after "may or may not have run" is safe."""
        deadline = time.monotonic() + timeout_s
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type(ray.exceptions.ActorUnavailableError),
                stop=stop_after_delay(timeout_s),
                wait=wait_exponential_jitter(initial=0.05, max=2.0),
                reraise=True,
            ):
                with attempt:
                    ref = getattr(self._router, method).remote(*args)
                    return ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise NodeLost(
                f"{method}: the router did not answer within {timeout_s:.0f} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise NodeLost(f"{method}: the router is not reachable: {exc}") from None
        raise AssertionError("unreachable")

    def _check_model(self, model: str) -> None:
        error = self._dispatcher.unknown_model(model)
        if error is not None:
            raise error

    def _node(self, name: str) -> ActorHandle:
        """A node's actor: one of ``nodes:``, or a pool member in the fleet now."""
        actor = self._nodes.get(name) if isinstance(name, str) else None
        handle = self._dispatcher.handle(name) if actor is None and isinstance(name, str) else None
        if isinstance(handle, RayNode):
            with contextlib.suppress(NodeGone):
                actor = handle.actor()
        if actor is None:
            known = ", ".join(self._dispatcher.healthy())
            raise InvalidInput(f"no node {name!r}; nodes: {known}")
        return actor


class TokenStream(Iterator[int]):
    """Token ids of one generation as the node produces them.

    Iterating raises the typed error of a generation that never ran (``Rejected``,
    ``InvalidInput``, ...). After the last token, :attr:`result` holds the
    :class:`GenerationResult` (finish reason, node, timings). Closing the stream (or
    dropping it) before the end cancels the generation.
    """

    def __init__(
        self,
        request_id: str,
        items: Iterator[TokenChunk | GenerationResult],
        tokenizer: Callable[[], Tokenizer] | None = None,
    ) -> None:
        self.request_id = request_id
        self.tokens: list[int] = []
        self.result: GenerationResult | None = None
        self._items = items
        self._ready: deque[int] = deque()
        self._tokenizer = tokenizer

    def texts(self) -> Iterator[str]:
        """The generation as text, in pieces as its tokens come: each piece whole
        characters (a character split over tokens comes with its last token).
        InvalidInput when the model has no tokenizer."""
        if self._tokenizer is None:
            raise InvalidInput("this stream has no tokenizer: iterate it for token ids")
        decoder = self._tokenizer().decoder()
        for token in self:
            piece = decoder.push((token,))
            if piece:
                yield piece
        rest = decoder.finish()
        if rest:
            yield rest

    def __next__(self) -> int:
        while not self._ready:
            if self.result is not None:
                raise StopIteration
            try:
                item = next(self._items)
            except StopIteration:
                raise NodeLost("the generation stream ended without a result") from None
            if isinstance(item, TokenChunk):
                self._ready.extend(item.tokens)
                self.tokens.extend(item.tokens)
            else:
                self.result = item
                if item.error is not None:
                    raise item.error
        return self._ready.popleft()

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:
            close()

    def collect(self) -> list[int]:
        """Wait for the whole generation; its token ids."""
        for _ in self:
            pass
        return self.tokens

    @property
    def finish_reason(self) -> str | None:
        return self.result.finish_reason if self.result is not None else None

    @property
    def node(self) -> str | None:
        return self.result.node if self.result is not None else None


CHAT_OPTIONS = frozenset(
    {"max_new_tokens", "priority", "temperature", "top_k", "seed", "stop_ids", "deadline_s",
     "timeout_s", "at_most_once"}
)  # fmt: skip


class Chat:
    """A conversation with a chat model (:meth:`FleetClient.chat`): the messages so
    far, and the session their KV is kept under on the node that answered last.

    Each turn sends the whole conversation, rendered with the model's chat template:
    the node reuses the KV its session has of the start they share (the earlier turns,
    as far as the answer's text tokenizes to the ids the model generated), and any
    other node can take the turn from scratch. A system message's tokens are the
    turns' ``prefix_len``: kept when a paused cache is trimmed, and shared by chats
    that start alike. A turn that fails or is stopped midway is not kept.
    """

    def __init__(
        self,
        client: FleetClient,
        model: str,
        session: str,
        system: str | None,
        options: Mapping[str, Any],
    ) -> None:
        self.model = model
        self.session = session
        self.messages: list[dict[str, str]] = []
        self.last: TokenStream | None = None  # the latest turn's: its result, tokens
        self._client = client
        self._options = dict(options)
        self._prefix: tuple[int, ...] = ()
        if system is not None:
            if not isinstance(system, str):
                raise InvalidInput(f"system must be text, got {system!r:.80}")
            self.messages.append({"role": "system", "content": system})
            try:  # the system message alone, as the template starts every turn with it
                self._prefix = self._ids(add_generation_prompt=False)
            except InvalidInput:  # a template that wants a user turn too: no shared prefix
                self._prefix = ()

    def send(self, text: str) -> str:
        """The answer to the user's ``text``, whole (the conversation keeps both)."""
        return "".join(self.stream(text))

    def stream(self, text: str) -> Generator[str, None, None]:
        """The answer to the user's ``text`` as it comes, in pieces of whole
        characters; the conversation keeps both once the answer is whole."""
        if not isinstance(text, str):
            raise InvalidInput(f"a chat turn is text, got {text!r:.80}")
        turn = {"role": "user", "content": text}
        ids = self._ids([turn])
        shared = len(self._prefix) if ids[: len(self._prefix)] == self._prefix else 0
        stream = self.last = self._client.generate(
            self.model, ids, session=self.session, prefix_len=shared, **self._options
        )
        pieces = []
        try:
            for piece in stream.texts():
                pieces.append(piece)
                yield piece
        finally:
            stream.close()  # stopped before the end: cancels the generation on its node
        self.messages += [turn, {"role": "assistant", "content": "".join(pieces)}]

    def _ids(
        self, more: Sequence[Message] = (), *, add_generation_prompt: bool = True
    ) -> tuple[int, ...]:
        client, model = self._client, self.model
        text = client.chat_template(model).render(
            [*self.messages, *more], add_generation_prompt=add_generation_prompt
        )
        return client.tokenizer(model).encode(text, add_special_tokens=False)


class _ViewFeed:
    """Keeps a dispatcher's fleet view fresh: fetches the router's view every
    ``report_interval_s``, handing over every counter counted so far, the shed
    requests still to come back and the requests placed, by priority (and flushes the
    dispatcher's metrics and call record as often). A router that does not answer
    (restarting, say) is asked again with exponential backoff and jitter; meanwhile
    requests are placed on the last view and the caller's own accounting. The first
    view is fetched before the client is returned."""

    def __init__(
        self, router: ActorHandle, dispatcher: Dispatcher, config: FleetConfig, caller: str
    ) -> None:
        self._router = router
        self._dispatcher = dispatcher
        self._interval = config.router.report_interval_s
        self._timeout = max(2.0, config.router.lost_after_s)
        self._caller = caller
        self._stop = threading.Event()
        self.failures = 0
        self._fetch()
        self._thread = threading.Thread(target=self._run, name="edgefleet-view", daemon=True)
        self._thread.start()

    def _fetch(self, last: bool = False) -> None:
        counted = dict(self._dispatcher.counted())  # all of them: the router counts each once
        waiting = 0 if last else self._dispatcher.shed_waiting()  # closing: none come back
        placed = self._dispatcher.take_placed()
        placed = {} if last else placed
        seen = self._dispatcher.members_version()
        ref = self._router.fleet_view.remote(self._caller, counted, waiting, placed, seen)
        (view,) = _get([ref], self._timeout, "fleet view", who="the router")
        self._dispatcher.update(view)

    def _run(self) -> None:
        jitter = random.Random()
        delay = self._interval
        while not self._stop.wait(delay):
            if not ray.is_initialized():  # shut down under this client: Ray ends a process
                return  # that calls it after its shutdown, so nothing more is asked
            self._dispatcher.flush()  # metrics and recorded calls go out while idle too
            try:
                self._fetch()
            except Exception as exc:  # supervised: the feed keeps going, with backoff
                self.failures += 1
                if self.failures == 1:
                    log.warning("the fleet view could not be refreshed (%s); retrying", exc)
                self._dispatcher.revive()  # no router to say a lost node is back: ask it
                backoff = min(self._timeout, self._interval * 2**self.failures)
                delay = backoff * (0.5 + jitter.random())
                continue
            if self.failures:
                log.info("the fleet view is fresh again after %d failures", self.failures)
            self.failures = 0
            delay = self._interval

    def stop(self) -> None:
        """Stop refreshing; hand the last counters to the router (bounded, best effort)."""
        self._stop.set()
        self._thread.join(self._timeout)
        try:
            self._fetch(last=True)
        except Exception:  # the router is gone or busy: its counts miss this caller's last
            log.debug("could not hand over the last counters", exc_info=True)


def _timeout(timeout_s: float | None) -> float | None:
    """A request's ``timeout_s``, checked: None (no bound) or a positive number."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise InvalidInput(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise InvalidInput(f"timeout_s must be positive and finite, got {timeout_s!r}")
    return float(timeout_s)


def _get(
    refs: list[ray.ObjectRef], timeout_s: float | None, what: str, who: str = "a node"
) -> list[Any]:
    """``ray.get`` bounded in time; an actor that died, is out of reach or does not
    answer is NodeLost."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise NodeLost(f"{what}: {who} did not answer within {timeout_s:.0f} s") from None
    except ray.exceptions.ActorUnavailableError as exc:
        raise NodeLost(f"{what}: {who} is out of reach for now: {exc}") from None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as exc:
        raise NodeLost(f"{what}: {who} died: {exc}") from None
