"""Chaos soak: while nodes, the router and whole machines die or freeze and the head
restarts, every request ends with exactly one answer, in time.

    python -m bench.chaos --minutes N [--seed S] [--out FILE.md] [--kinds KIND ...]

Mixed load through :class:`FleetClient` (inference at every priority, chats, background
generations, lifecycle events) on the cluster of bench/chaos_cluster.py while its
controller kills and freezes parts of it. The report checks each request's answers
(exactly one, typed when an error, within max(deadline_s, timeout_s) + ANSWER_SLACK_S),
executions per id in the node traces, outputs against references, memory and leaks.
Exit status: 0 when every invariant holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from actors.decoder import DecoderEngine, Generation
from actors.engine import open_session
from actors.trace import read_traces
from bench import chaos_cluster as cc
from bench.chaos_cluster import CONTROL_TIMEOUT_S, KINDS, LM, NODES, Controller, Event, Fleet
from bench.common import EnvFacts, fmt, log, md_table, percentile, utc_now
from cluster.client import FleetClient
from cluster.head import LOOPBACK
from edgefleet.errors import EdgeFleetError
from edgefleet.messages import Reply
from edgefleet.modelgen import calibrate_slow, make_classifier, make_tiny_lm, random_inputs
from edgefleet.request import GenerateRequest

SLOW_MS = 4.0  # batch-1 cost the slow model is calibrated to
FEEDS = 8  # distinct inputs per tensor model, each with a reference output
SYSTEM = tuple(range(1, 17))  # the system prompt every generation starts with
CHAT_THREADS, CHAT_TURNS, CHAT_TOKENS = 3, 3, 16
SUMMARIES, SUMMARY_TOKENS = 4, 40
PRIORITIES = ("foreground", "inline", "background", "offline", 5, 1)
SUBMIT_RATE = 25.0  # submitted requests per second (plus bursts)
BURST = 24  # background requests submitted at once, now and then
AT_MOST_ONCE_SHARE = 0.5  # inference and summaries sent with at_most_once=True
TIMEOUT_S = (2.0, 30.0)  # every request's timeout_s: log-uniform between these
ANSWER_SLACK_S = 1.0  # an answer may come this long after max(deadline_s, timeout_s)
SAMPLE_EVERY_S = 2.0  # memory and health samples
PROGRESS_EVERY_S = 5.0
ROUTER_OWN = ("joined", "rejoined", "nodes_lost", "unresponsive", "restarted")  # not the callers'
LOSS_POLL_S = 0.05  # how often the caller's view of its nodes is looked at
GC_FREEZE_EVERY_S = 5.0
DRAIN_S = 45.0  # after the load: the longest wait for answers still out
RECOVER_S = 30.0  # then the longest wait for every node to serve again
PROMPT_RANGE = (20, 500)  # token ids of user turns (the tiny LM's vocabulary is 512)
FINISHED = ("stop", "length", "budget")  # a generation's successful ends


@dataclass(frozen=True)
class Options:
    minutes: float = 1.0
    seed: int = 0
    out: Path | None = None
    answers: Path | None = None  # every request and its answers, a JSON line each
    kill_every_s: float = 12.0  # mean interval between chaos events
    spare: tuple[str, ...] = ("edge-0",)  # nodes never hit: they live the whole run
    kinds: tuple[str, ...] = KINDS


def parse_options(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description="Chaos soak: mixed load through FleetClient on a multi-raylet Ray cluster "
        "on loopback while nodes, the router and raylets are killed or frozen and the head "
        "restarted; reports whether every request got exactly one answer, in time.",
        epilog="example: python -m bench.chaos --minutes 10 --seed 1 --out /tmp/chaos.md",
    )
    p.add_argument("--minutes", type=float, default=1.0, help="load duration (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the load and the chaos")
    p.add_argument("--out", type=Path, metavar="FILE", help="also write the report here")
    p.add_argument("--answers", type=Path, metavar="FILE", help="every request, a JSON line each")
    p.add_argument(
        "--kill-every", type=float, default=12.0, metavar="S", help="mean s between events"
    )
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, metavar="KIND")
    p.add_argument("--spare", nargs="*", default=["edge-0"], choices=NODES, metavar="NODE")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.kill_every <= 0:
        raise SystemExit("--minutes and --kill-every must be > 0")
    if set(args.spare) >= set(NODES):
        raise SystemExit("--spare: at least one node must be left to hit")
    kinds = tuple(k for k in KINDS if k in args.kinds)
    spare = tuple(args.spare)
    return Options(args.minutes, args.seed, args.out, args.answers, args.kill_every, spare, kinds)


# ------------------------------------------------------------------ the records


@dataclass(frozen=True)
class Answer:
    """One answer the public API delivered."""

    at: float  # unix time
    outcome: str  # ok (outputs, or a generation's end) | typed | untyped
    what: str  # the error's type, or a generation's finish reason
    node: str = ""
    detail: str = ""


@dataclass
class Sent:
    """One request and every answer it got."""

    id: str
    api: str  # submit | infer | generate
    model: str
    priority: int | str
    at: float
    ref: tuple[Any, ...]  # what its answer is compared with
    max_new_tokens: int = 0
    at_most_once: bool = False  # never placed again once sent: NodeLost instead
    timeout_s: float = math.inf
    deadline_s: float | None = None
    answers: list[Answer] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # delivered, in order (generation)
    after_end: int = 0  # tokens or errors delivered after the answer (must stay 0)
    wrong: str = ""  # why the answer's content is wrong ('' when it is right)

    def kw(self) -> dict[str, Any]:
        """What every call of the request passes to the client."""
        return {"priority": self.priority, "request_id": self.id, "timeout_s": self.timeout_s}

    @property
    def limit_s(self) -> float:
        """How long its caller was promised it may take: max(deadline_s, timeout_s)."""
        return max(self.deadline_s or 0.0, self.timeout_s)


class Ledger:
    """Every request sent and its answers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.sent: dict[str, Sent] = {}
        self.answered = 0

    def new(
        self, api: str, model: str, priority: int | str, ref: tuple[Any, ...], **kw: Any
    ) -> Sent:
        with self._lock:
            rid = f"{api[0]}{next(self._ids):07d}"
            sent = self.sent[rid] = Sent(rid, api, model, priority, time.time(), ref, **kw)
        return sent

    def answer(self, sent: Sent, answer: Answer) -> None:
        with self._lock:
            self.answered += not sent.answers
            sent.answers.append(answer)

    def outstanding(self) -> int:
        return len(self.sent) - self.answered

    def write(self, path: Path, t0: float) -> None:
        """Every request and its answers, a JSON line each (times in s from ``t0``)."""
        with self._lock, path.open("w") as out:
            for s in self.sent.values():
                answers = [
                    [round(a.at - t0, 3), a.outcome, a.what, a.node, a.detail] for a in s.answers
                ]
                line = {"id": s.id, "api": s.api, "at": round(s.at - t0, 3)}
                line |= {"timeout_s": round(s.timeout_s, 3), "deadline_s": s.deadline_s}
                out.write(
                    json.dumps(line | {"at_most_once": s.at_most_once, "answers": answers}) + "\n"
                )


@dataclass(frozen=True)
class Sample:
    at: float
    role: str  # a node's name, or "router"
    pid: int
    rss_mb: float


@dataclass
class References:
    """Inputs and the answers they must get: inference outputs computed in-process,
    greedy generations on the decoder engine uninterrupted."""

    feeds: dict[str, list[dict[str, np.ndarray]]]
    outputs: dict[str, list[dict[str, np.ndarray]]]
    chats: dict[tuple[int, int], tuple[tuple[int, ...], list[int]]]  # (thread, turn)
    summaries: list[tuple[tuple[int, ...], list[int]]]

    def expected(self, sent: Sent) -> list[int]:
        if sent.ref[0] == "chat":
            return self.chats[(sent.ref[1], sent.ref[2])][1]
        return self.summaries[sent.ref[1]][1]


def make_models(directory: Path) -> dict[str, Path]:
    return {
        "classifier": make_classifier(directory / "classifier.onnx"),
        "slow": calibrate_slow(directory / "slow.onnx", SLOW_MS)[0],
        LM: make_tiny_lm(directory / "tiny_lm.onnx"),
    }


def make_references(paths: Mapping[str, Path], seed: int) -> References:
    feeds: dict[str, list[dict[str, np.ndarray]]] = {}
    outputs: dict[str, list[dict[str, np.ndarray]]] = {}
    for model in ("classifier", "slow"):
        session = open_session(model, paths[model], threads=1)
        names = [o.name for o in session.get_outputs()]
        feeds[model] = [random_inputs(model, seed=seed * 100 + i) for i in range(FEEDS)]
        outputs[model] = [
            dict(zip(names, session.run(names, f), strict=True)) for f in feeds[model]
        ]
    engine = DecoderEngine("reference", paths[LM])

    def greedy(prompt: tuple[int, ...], n: int) -> list[int]:
        request = GenerateRequest("reference", prompt, max_new_tokens=n)
        gen = Generation(request, limit=n, emit=lambda _: None, max_context=engine.max_context)
        engine.advance(gen)
        return list(gen.generated)

    rng = random.Random(seed)
    chats: dict[tuple[int, int], tuple[tuple[int, ...], list[int]]] = {}
    for t in range(CHAT_THREADS):
        history = SYSTEM
        for k in range(CHAT_TURNS):
            prompt = history + tuple(rng.randrange(*PROMPT_RANGE) for _ in range(6 + 2 * k))
            chats[(t, k)] = (prompt, greedy(prompt, CHAT_TOKENS))
            history = prompt + tuple(chats[(t, k)][1])
    summaries = []
    for _ in range(SUMMARIES):
        prompt = SYSTEM + tuple(rng.randrange(*PROMPT_RANGE) for _ in range(24))
        summaries.append((prompt, greedy(prompt, SUMMARY_TOKENS)))
    engine.close()
    return References(feeds, outputs, chats, summaries)


def same_outputs(got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> str:
    """'' when ``got`` matches ``expected``; otherwise what differs."""
    if set(got) != set(expected):
        return f"outputs {sorted(got)}, expected {sorted(expected)}"
    for name, want in expected.items():
        have = np.asarray(got[name])
        if have.shape != want.shape:
            return f"{name}: shape {have.shape}, expected {want.shape}"
        if not np.allclose(have, want, rtol=1e-3, atol=1e-4):
            return f"{name}: values differ by up to {float(np.max(np.abs(have - want))):.3g}"
    return ""


def token_problem(delivered: Sequence[int], expected: Sequence[int], full: bool) -> str:
    """'' when ``delivered`` is ``expected`` (``full``) or a prefix of it."""
    n = len(delivered)
    if list(delivered) == list(expected[:n]) and (not full or n == len(expected)):
        return ""
    pairs = enumerate(zip(delivered, expected, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), min(n, len(expected)))
    return f"{n} tokens, expected {len(expected)}; first difference at {first}"


# ------------------------------------------------------------------------ the load


def _typed(exc: BaseException) -> tuple[str, str]:
    return ("typed" if isinstance(exc, EdgeFleetError) else "untyped"), type(exc).__name__


def _count_failure(calls: Counter[str], errors: list[str], what: str, exc: Exception) -> None:
    """Count a control call's failure; keep the text of an untyped one."""
    outcome, name = _typed(exc)
    calls[outcome] += 1
    if outcome == "untyped":
        errors.append(f"{what}: {name}: {exc}"[:300])


def _failed(exc: BaseException) -> Answer:
    outcome, what = _typed(exc)
    return Answer(time.time(), outcome, what, detail=str(exc)[:200])


def _timeout(rng: random.Random) -> float:
    """A request's timeout_s: log-uniform in TIMEOUT_S."""
    low, high = TIMEOUT_S
    return low * (high / low) ** rng.random()


class Load:
    """The mixed workload, on threads that end when ``stop`` is set."""

    def __init__(
        self,
        client: FleetClient,
        refs: References,
        ledger: Ledger,
        stop: threading.Event,
        seed: int,
    ) -> None:
        self.client, self.refs, self.ledger, self.stop, self.seed = client, refs, ledger, stop, seed
        self.control: Counter[str] = Counter()  # lifecycle events: ok / typed / untyped
        self.control_errors: list[str] = []
        self.failures: list[str] = []  # load threads that raised (a harness bug)
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        workers: list[tuple[str, Callable[[random.Random], None]]] = [
            ("submit", self._submitter),
            ("infer-0", self._caller),
            ("infer-1", self._caller),
            *((f"chat-{t}", partial(self._chat, t)) for t in range(CHAT_THREADS)),
            ("summaries", self._summaries),
            ("lifecycle", self._lifecycle),
        ]
        for i, (name, work) in enumerate(workers):
            rng = random.Random(f"{self.seed}/{i}")
            t = threading.Thread(target=self._guard, args=(name, work, rng), name=f"load-{name}")
            t.daemon = True
            t.start()
            self.threads.append(t)

    def join(self, deadline: float) -> list[str]:
        """Wait for the load threads until ``deadline``; the names still running."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def _guard(self, name: str, work: Callable[[random.Random], None], rng: random.Random) -> None:
        try:
            work(rng)
        except Exception:  # a harness bug: say so loudly, never hang the run
            self.failures.append(f"load thread {name}: {traceback.format_exc()}")
            log(self.failures[-1])

    def _submit_one(
        self, rng: random.Random, priority: int | str, deadline_s: float | None = None
    ) -> None:
        model = "classifier" if rng.random() < 0.7 else "slow"
        i, once = rng.randrange(FEEDS), rng.random() < AT_MOST_ONCE_SHARE
        kw = {"at_most_once": once, "timeout_s": _timeout(rng), "deadline_s": deadline_s}
        sent = self.ledger.new("submit", model, priority, (model, i), **kw)
        key = f"camera-{rng.randrange(2)}" if priority == "inline" and rng.random() < 0.3 else None
        try:
            feed = self.refs.feeds[model][i]
            kw = sent.kw() | {"deadline_s": deadline_s, "key": key, "at_most_once": once}
            future = self.client.submit(model, feed, **kw)
        except Exception as exc:
            self.ledger.answer(sent, _failed(exc))
            return
        future.add_done_callback(partial(self._replied, sent))

    def _replied(self, sent: Sent, future: Any) -> None:
        try:
            reply: Reply = future.result()
        except BaseException as exc:  # a future of the public API must never fail
            answer = Answer(time.time(), "untyped", type(exc).__name__, "", str(exc))
            self.ledger.answer(sent, answer)
            return
        if reply.error is None:
            self._check(sent, reply.outputs or {}, reply.request_id)
            self.ledger.answer(sent, Answer(time.time(), "ok", "completed", reply.node))
        else:
            outcome, what = _typed(reply.error)
            answer = Answer(time.time(), outcome, what, reply.node, str(reply.error)[:200])
            self.ledger.answer(sent, answer)

    def _check(self, sent: Sent, outputs: Mapping[str, np.ndarray], request_id: str) -> None:
        model, i = sent.ref
        sent.wrong = same_outputs(outputs, self.refs.outputs[model][i])
        if request_id != sent.id:
            sent.wrong = f"answer for request {request_id}"

    def _submitter(self, rng: random.Random) -> None:
        next_burst = time.monotonic() + rng.uniform(3, 6)
        while not self.stop.wait(rng.expovariate(SUBMIT_RATE)):
            priority = rng.choice(PRIORITIES)
            self._submit_one(
                rng, priority, rng.uniform(0.05, 1.0) if priority in ("background", 1) else None
            )
            if time.monotonic() >= next_burst:
                next_burst = time.monotonic() + rng.uniform(3, 6)
                for _ in range(BURST):
                    self._submit_one(rng, rng.choice(("background", "offline")))

    def _caller(self, rng: random.Random) -> None:
        while not self.stop.wait(rng.uniform(0.005, 0.03)):
            model = "classifier" if rng.random() < 0.7 else "slow"
            i, priority = rng.randrange(FEEDS), rng.choice(PRIORITIES)
            once, timeout_s = rng.random() < AT_MOST_ONCE_SHARE, _timeout(rng)
            sent = self.ledger.new(
                "infer", model, priority, (model, i), at_most_once=once, timeout_s=timeout_s
            )
            try:
                feed = self.refs.feeds[model][i]
                outputs = self.client.infer(model, feed, at_most_once=once, **sent.kw())
            except Exception as exc:
                self.ledger.answer(sent, _failed(exc))
            else:
                self._check(sent, outputs, sent.id)
                self.ledger.answer(sent, Answer(time.time(), "ok", "completed"))

    def _generate(self, sent: Sent, prompt: tuple[int, ...], **kw: Any) -> str | None:
        """Stream one generation; its finish reason, or None when it ended in an error."""
        try:
            kw |= {"at_most_once": sent.at_most_once, "deadline_s": sent.deadline_s}
            n = sent.max_new_tokens
            stream = self.client.generate(
                LM, prompt, max_new_tokens=n, prefix_len=len(SYSTEM), **kw | sent.kw()
            )
            sent.tokens.extend(stream)
            result = stream.result
        except Exception as exc:
            self.ledger.answer(sent, _failed(exc))
            return None
        assert result is not None  # the stream raises rather than end without one
        self.ledger.answer(sent, Answer(time.time(), "ok", result.finish_reason or "", result.node))
        try:  # nothing may come after the end
            sent.after_end += sum(1 for _ in stream)
        except Exception:
            sent.after_end += 1
        if list(result.tokens) != sent.tokens:
            sent.wrong = f"result lists {len(result.tokens)} tokens, {len(sent.tokens)} streamed"
        return result.finish_reason

    def _chat(self, thread: int, rng: random.Random) -> None:
        epoch, turn = 0, 0
        priority = ("foreground", "inline", "inline")[thread % 3]
        while not self.stop.is_set():
            prompt, expected = self.refs.chats[(thread, turn)]
            kw = {"max_new_tokens": CHAT_TOKENS, "timeout_s": _timeout(rng)}
            sent = self.ledger.new("generate", LM, priority, ("chat", thread, turn), **kw)
            reason = self._generate(sent, prompt, session=f"chat-{thread}-{epoch}")
            if reason == "length" and sent.tokens == expected and turn + 1 < CHAT_TURNS:
                turn += 1  # the next turn builds on this answer
            else:
                epoch, turn = epoch + 1, 0  # a new conversation
            self.stop.wait(rng.uniform(0.05, 0.4))

    def _summaries(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            j = rng.randrange(SUMMARIES)
            priority, once = (
                rng.choice(("background", "offline", 2)),
                rng.random() < AT_MOST_ONCE_SHARE,
            )
            kw = {
                "max_new_tokens": SUMMARY_TOKENS,
                "at_most_once": once,
                "timeout_s": _timeout(rng),
            }
            kw["deadline_s"] = rng.uniform(0.05, 1.0) if rng.random() < 0.25 else None
            sent = self.ledger.new("generate", LM, priority, ("summary", j), **kw)
            self._generate(sent, self.refs.summaries[j][0])
            self.stop.wait(rng.uniform(0.05, 0.3))

    def _lifecycle(self, rng: random.Random) -> None:
        while not self.stop.wait(rng.uniform(2.0, 5.0)):
            node, state = rng.choice(NODES), rng.choice(("background", "foreground"))
            try:
                self.client.set_lifecycle(node, state, timeout_s=CONTROL_TIMEOUT_S)
            except Exception as exc:
                _count_failure(self.control, self.control_errors, "set_lifecycle", exc)
            else:
                self.control["ok"] += 1


# --------------------------------------------------------------- the watchers


class Losses:
    """When the caller held each node out of service, polled every LOSS_POLL_S: the
    windows explain re-runs (see :func:`_rerun_cause`)."""

    def __init__(self, client: FleetClient, stop: threading.Event) -> None:
        self.client, self.stop = client, stop
        self.windows: dict[str, list[list[float]]] = defaultdict(list)  # [from, to]
        self.thread = threading.Thread(target=self._run, name="losses", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(LOSS_POLL_S):
            now = time.time()
            for name, healthy in self.client._dispatcher.healthy().items():
                held = self.windows[name]
                out = bool(held) and held[-1][1] == math.inf
                if not healthy and not out:
                    held.append([now - LOSS_POLL_S, math.inf])
                elif healthy and out:
                    held[-1][1] = now

    def snapshot(self) -> dict[str, list[tuple[float, float]]]:
        return {n: [(a, b) for a, b in w] for n, w in self.windows.items()}


class Sampler:
    """Every SAMPLE_EVERY_S: memory of the node actors (their status) and the router
    (psutil), which nodes are healthy; a progress line every PROGRESS_EVERY_S."""

    def __init__(
        self, fleet: Fleet, ledger: Ledger, controller: Controller, stop: threading.Event
    ) -> None:
        self.fleet, self.ledger, self.controller, self.stop = fleet, ledger, controller, stop
        self.samples: list[Sample] = []
        self.healthy: dict[str, bool] = {}
        self.status_calls: Counter[str] = Counter()  # ok / typed / untyped
        self.status_errors: list[str] = []  # untyped ones
        self.errors: list[str] = []  # the sampler's own failures
        self.routers: dict[int, dict[str, int]] = {}  # by router process: its last counters
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.t0 = time.monotonic()

    def _run(self) -> None:
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while not self.stop.wait(SAMPLE_EVERY_S):
            try:
                self.sample()
            except Exception as exc:  # a harness bug: say so, and sample on
                self.errors.append(f"sampler: {type(exc).__name__}: {exc}")
                log(f"sampler: {traceback.format_exc()}")
            if time.monotonic() >= next_progress:
                next_progress += PROGRESS_EVERY_S
                log(self.progress())

    def sample(self) -> None:
        client = self.fleet.client
        if client is None:
            return
        try:
            status = client.status(timeout_s=CONTROL_TIMEOUT_S)
        except Exception as exc:  # the router restarting: next time
            _count_failure(self.status_calls, self.status_errors, "status", exc)
        else:
            now = time.time()
            self.status_calls["ok"] += 1
            pid = self.fleet.router_pid()
            if pid is not None:  # counters per incarnation: a restarted router counts from 0
                self.routers[pid] = dict(status.router)
            self.healthy = dict(status.healthy)
            for node in status.nodes:
                if status.healthy.get(node.name) and node.pid:
                    self.samples.append(Sample(now, node.name, node.pid, node.rss_mb))
            self._serving_again(status, now)
        pid = self.fleet.router_pid()
        if pid is not None:
            now = time.time()
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss / (1024 * 1024)
                self.samples.append(Sample(now, "router", pid, rss))
                for e in self.controller.snapshot():
                    if e.kind == "router" and e.healthy_at is None and pid not in e.pids:
                        e.healthy_at = now

    def _serving_again(self, status: Any, now: float) -> None:
        """Date the events whose target serves again: a node healthy in a new process,
        or (a freeze) after its SIGCONT; the head once the router answers."""
        pids = {node.name: int(node.pid) for node in status.nodes}
        for event in self.controller.snapshot():
            if event.healthy_at is not None or event.kind == "router":
                continue
            if event.kind == "head":
                event.healthy_at = now if event.back_at is not None else None
                continue
            pid = pids.get(event.target, 0)
            thawed = event.freeze and event.back_at is not None
            if self.healthy.get(event.target) and (pid not in (0, *event.pids) or thawed):
                event.healthy_at = now

    def router_totals(self) -> Counter[str]:
        """The fleet-wide counters over the router's incarnations: the router's own
        (ROUTER_OWN) added up; the caller's the largest any incarnation held."""
        totals: Counter[str] = Counter()
        for counters in self.routers.values():
            for key, value in counters.items():
                totals[key] = totals[key] + value if key in ROUTER_OWN else max(totals[key], value)
        return totals

    def wait_healthy(self, deadline: float) -> list[str]:
        """Wait until every node serves again (bounded); the nodes that do not."""
        while (
            down := [n for n in NODES if not self.healthy.get(n)]
        ) and time.monotonic() < deadline:
            time.sleep(0.5)
        return down

    def progress(self) -> str:
        sent, answered = len(self.ledger.sent), self.ledger.answered
        kinds = Counter(e.kind for e in self.controller.snapshot())
        healthy = ",".join(n for n in NODES if self.healthy.get(n)) or "-"
        events = ", ".join(f"{k} {kinds[k]}" for k in self.controller.kinds)
        return (
            f"{time.monotonic() - self.t0:5.0f} s: {sent} sent, {answered} answered, "
            f"{sent - answered} out | {events} | healthy {healthy}"
        )


# ------------------------------------------------------------------ the figures


INVARIANTS = (  # (what, Figures attribute): checks that hold when it is 0
    ("inference answers with wrong outputs", "wrong_outputs"),
    ("completed generations with duplicated, missing or wrong tokens", "gen_token_errors"),
    ("other generations whose tokens are not a prefix of the reference", "gen_partial_errors"),
    ("tokens or errors delivered after a stream's end", "after_end"),
    ("successes without an execution in the traces", "success_without_run"),
    ("successes naming a node that has no execution of them", "wrong_node"),
    ("ids run more than once with no kill, freeze or loss to explain it", "reran_unexplained"),
    ("at_most_once ids run more than once", "reran_at_most_once"),
)


@dataclass
class Figures:
    """What the soak found (every count is of requests unless it says otherwise)."""

    options: Options
    seconds: float = 0.0  # of load
    t_start: float = 0.0  # unix time the load started
    interrupted: bool = False
    sent: int = 0
    by_api: Counter[str] = field(default_factory=Counter)
    no_answer: int = 0
    two_answers: int = 0
    ok: int = 0
    typed: Counter[str] = field(default_factory=Counter)
    untyped: Counter[str] = field(default_factory=Counter)
    wrong_outputs: int = 0
    examples: list[str] = field(default_factory=list)
    late: int = 0  # answered more than ANSWER_SLACK_S after max(deadline_s, timeout_s)
    worst_late_s: float = -math.inf  # the largest answer time minus that
    timed_out_late: int = 0  # of the late ones, answered TimedOut
    trace_lines: int = 0
    trace_files: int = 0
    truncated_lines: int = 0
    unknown_ids: int = 0
    ran_once: int = 0
    ran_more: int = 0
    reran_after_kill: int = 0
    reran_after_freeze: int = 0  # a node froze holding it; it ran elsewhere and after
    reran_after_loss: int = 0  # the caller held a node that ran it out of service
    reran_unexplained: int = 0
    reran_at_most_once: int = 0  # at_most_once ids run more than once (for any reason)
    at_most_once_sent: int = 0
    at_most_once_lost: int = 0  # at_most_once requests answered NodeLost
    success_without_run: int = 0
    wrong_node: int = 0  # successes naming a node that has no execution of them
    success_by_caller: int = 0  # generations the caller ended after their node died
    ran_but_error: int = 0
    generations: int = 0
    gen_completed: Counter[str] = field(default_factory=Counter)  # finish reason
    gen_exact: int = 0
    gen_token_errors: int = 0  # completed ones whose tokens are not the reference's
    gen_partial_errors: int = 0  # ended otherwise, tokens not a prefix of the reference
    gen_typed: int = 0
    after_end: int = 0
    control: Counter[str] = field(default_factory=Counter)
    events: list[Event] = field(default_factory=list)
    losses: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    controller_errors: list[str] = field(default_factory=list)
    fleet_counters: Counter[str] = field(default_factory=Counter)  # over router restarts
    routers: int = 0  # router incarnations seen
    status_calls: Counter[str] = field(default_factory=Counter)
    control_errors: list[str] = field(default_factory=list)
    latency: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # p50 p99 max
    # role, pid, lived s, first MB, warm MB, last MB, growth % after warm-up
    memory: list[tuple[str, int, float, float, float, float, float | None]] = field(
        default_factory=list
    )
    warmup_s: float = 0.0
    memory_over_time: list[tuple[str, float, list[float]]] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    still_running: list[str] = field(default_factory=list)  # load threads that never ended
    not_serving: list[str] = field(default_factory=list)  # nodes not back by the end
    error: str | None = None  # the soak could not run to the end

    @property
    def event_kinds(self) -> Counter[str]:
        return Counter(e.kind for e in self.events)

    def invariants(self) -> list[tuple[str, int, bool]]:
        """(what, value, holds) for every check the soak makes: each holds at 0."""
        late = f"requests answered later than max(deadline_s, timeout_s) + {ANSWER_SLACK_S:g} s"
        control = self.control["untyped"] + self.status_calls["untyped"]
        checks = [
            ("requests without an answer", self.no_answer),
            ("requests with two or more answers", self.two_answers),
            ("untyped errors (requests)", sum(self.untyped.values())),
            (late, self.late),
            ("untyped errors (lifecycle events and status calls)", control),
            *((what, getattr(self, attr)) for what, attr in INVARIANTS),
            ("actors (or their processes) alive after the client closed", len(self.leaked)),
            ("load threads that never ended", len(self.still_running)),
            (f"nodes not serving again {RECOVER_S:g} s after the load", len(self.not_serving)),
        ]
        return [(what, value, value == 0) for what, value in checks]

    @property
    def covered(self) -> bool:
        """Every kind of chaos event asked for happened at least once."""
        return all(self.event_kinds[kind] > 0 for kind in self.options.kinds)

    @property
    def passed(self) -> bool:
        return self.error is None and all(ok for _, _, ok in self.invariants())

    def example(self, text: str) -> None:
        if len(self.examples) < 12:
            self.examples.append(text)


def analyse(
    f: Figures,
    ledger: Ledger,
    refs: References,
    traces: Path,
    samples: Sequence[Sample],
    t_start: float,
    t_end: float,
) -> None:
    """Fill ``f`` from the ledger, the references, the node traces and the samples."""
    sent = list(ledger.sent.values())
    f.sent, f.by_api = len(sent), Counter(s.api for s in sent)
    _answers(f, sent)
    _generations(f, sent, refs)
    _executions(f, ledger, traces, t_start)
    _memory(f, samples, t_start, t_end)


def _answers(f: Figures, sent: Sequence[Sent]) -> None:
    """Exactly one answer each, typed when an error, with the right outputs, in time."""
    waits: dict[str, list[float]] = defaultdict(list)
    for s in sent:
        f.at_most_once_sent += s.at_most_once
        f.after_end += s.after_end
        if not s.answers:
            f.no_answer += 1
            f.example(f"{s.id} ({s.api} {s.model} p={s.priority}): no answer")
            continue
        if len(s.answers) > 1:
            f.two_answers += 1
            f.example(f"{s.id}: {len(s.answers)} answers: {[a.what for a in s.answers]}")
        a = s.answers[0]
        f.at_most_once_lost += s.at_most_once and a.what == "NodeLost"
        if a.outcome == "ok":
            f.ok += 1
        elif a.outcome == "typed":
            f.typed[a.what] += 1
        else:
            f.untyped[a.what] += 1
            f.example(f"{s.id}: untyped {a.what}: {a.detail[:160]}")
        if s.api != "generate" and s.wrong:
            f.wrong_outputs += 1
            f.example(f"{s.id}: wrong outputs: {s.wrong}")
        took = a.at - s.at
        waits[s.api].append(took)
        f.worst_late_s = max(f.worst_late_s, took - s.limit_s)
        if took - s.limit_s > ANSWER_SLACK_S:
            f.late += 1
            f.timed_out_late += a.what == "TimedOut"
            f.example(
                f"{s.id} ({s.api}, sent at {s.at - f.t_start:.1f} s): answered {a.what} after "
                f"{took:.2f} s, {took - s.limit_s:.2f} s past max(deadline_s, timeout_s) = "
                f"{s.limit_s:.2f} s"
            )
    f.latency = {api: (percentile(w, 50), percentile(w, 99), max(w)) for api, w in waits.items()}


def _generations(f: Figures, sent: Sequence[Sent], refs: References) -> None:
    """Generations against the references."""
    for s in sent:
        if s.api != "generate" or not s.answers:
            continue
        f.generations += 1
        a = s.answers[0]
        expected = refs.expected(s)[: s.max_new_tokens]
        if a.outcome == "ok":
            f.gen_completed[a.what] += 1  # a finish reason, or cancelled
        if a.outcome == "ok" and a.what in FINISHED:
            problem = token_problem(s.tokens, expected, full=a.what == "length") or s.wrong
            f.gen_exact += not problem
            if problem:
                f.gen_token_errors += 1
                f.example(f"{s.id} (generate, {a.what}): {problem}")
            continue
        f.gen_typed += a.outcome != "ok"
        if problem := token_problem(s.tokens, expected, full=False):
            f.gen_partial_errors += 1
            f.example(f"{s.id} (generate, ended {a.what}): {problem}")


def _rerun_cause(
    ran: Sequence[dict[str, Any]],
    s: Sent,
    events: Sequence[Event],
    losses: Mapping[str, Sequence[tuple[float, float]]],
) -> str:
    """Why ``s`` ran more than once (its runs ``ran``, in time order): "kill" when each
    run but the last was on a process killed after it ran there, before the next run
    and before the answer; "freeze" when a run was on a process frozen while the
    request was out; "loss" when the caller held the node of a run but the last out of
    service after the request was sent and before the next run; "" otherwise."""
    killed: dict[int, float] = {}
    frozen: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        for pid in e.pids:
            if e.freeze:
                frozen[pid].append(e)
            else:
                killed.setdefault(pid, e.at)
    answered = s.answers[0].at if s.answers else None

    def by_kill(first: dict[str, Any], then: dict[str, Any]) -> bool:
        died = killed.get(int(first["pid"]))
        return not (
            died is None
            or died < float(first["t"]) - 0.5  # killed before it ran there: not this
            or float(then["t"]) < died  # ran again before the first node died
            or (answered is not None and answered < died)  # answered before the kill
        )

    if all(by_kill(a, b) for a, b in itertools.pairwise(ran)):
        return "kill"
    for run in ran:
        for e in frozen.get(int(run["pid"]), ()):
            if s.at < (e.back_at or math.inf) and (answered is None or e.at < answered):
                return "freeze"
    for run, then in itertools.pairwise(ran):
        for start, end in losses.get(str(run["node"]), ()):
            if start <= float(then["t"]) and end >= s.at:
                return "loss"
    return ""


def _executions(f: Figures, ledger: Ledger, traces: Path, t_start: float) -> None:
    """Executions per id from the node traces; a success must have run, on its node."""
    lines, f.truncated_lines = read_traces(traces)
    f.trace_lines, f.trace_files = len(lines), len(list(traces.glob("trace-*.jsonl")))
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        rid = str(line.get("id"))
        if rid not in ledger.sent:
            f.unknown_ids += 1
        elif line.get("ran"):
            runs[rid].append(line)
    for rid, ran in runs.items():
        if len(ran) == 1:
            f.ran_once += 1
            continue
        f.ran_more += 1
        s = ledger.sent[rid]
        f.reran_at_most_once += s.at_most_once
        cause = _rerun_cause(ran, s, f.events, f.losses) or "unexplained"
        name = cause if cause == "unexplained" else f"after_{cause}"
        setattr(f, f"reran_{name}", getattr(f, f"reran_{name}") + 1)
        if cause == "unexplained":
            where = ", ".join(f"{r['node']}/{r['pid']}@{float(r['t']) - t_start:.2f}s" for r in ran)
            f.example(f"{rid}: ran {len(ran)} times with nothing to explain it: {where}")
    for s in ledger.sent.values():
        if not s.answers:
            continue
        a = s.answers[0]
        success = a.outcome == "ok" and (s.api != "generate" or a.what in FINISHED)
        if success and s.id not in runs:
            if s.api == "generate" and a.node == "":
                f.success_by_caller += 1  # every token sent before its node died
            else:
                f.success_without_run += 1
                f.example(f"{s.id} ({s.api}): a success without an execution in the traces")
        elif success and a.node and a.node not in {line["node"] for line in runs[s.id]}:
            f.wrong_node += 1
            f.example(f"{s.id}: answered by {a.node}, which has no execution of it")
        elif not success and s.id in runs and a.outcome != "ok":
            f.ran_but_error += 1


def _memory(f: Figures, samples: Sequence[Sample], t_start: float, t_end: float) -> None:
    """Memory of the long-lived processes: growth after the warm-up."""
    f.warmup_s = max(10.0, 0.2 * (t_end - t_start))
    by_process: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for sample in samples:
        by_process[(sample.role, sample.pid)].append(sample)
    for (role, pid), series in sorted(by_process.items(), key=lambda kv: (kv[0][0], kv[1][0].at)):
        head, last = series[0], series[-1]
        warm = next((x for x in series if x.at >= head.at + f.warmup_s), None)
        growth = None
        if warm is not None and last.at - warm.at >= 10.0 and warm.rss_mb > 0:
            growth = 100.0 * (last.rss_mb - warm.rss_mb) / warm.rss_mb
            step = max(10.0, (last.at - head.at) / 10)
            marks, due = [], head.at
            for x in series:
                if x.at >= due:
                    marks.append(x.rss_mb)
                    due = x.at + step
            f.memory_over_time.append((f"{role} (pid {pid})", step, marks))
        warm_mb = warm.rss_mb if warm is not None else math.nan
        f.memory.append((role, pid, last.at - head.at, head.rss_mb, warm_mb, last.rss_mb, growth))


# ------------------------------------------------------------------------ the soak


@dataclass
class Parts:
    """What a soak started, for the figures whatever happened."""

    fleet: Fleet
    load: Load | None = None
    controller: Controller | None = None
    sampler: Sampler | None = None
    losses: Losses | None = None


def _load_and_chaos(parts: Parts, f: Figures, ledger: Ledger, refs: References) -> float:
    """Start the fleet, run the load and the chaos, wait for the answers still out and
    for every node to serve again, close the client; the unix time the load stopped."""
    options, stop, stop_sampling = f.options, threading.Event(), threading.Event()
    t0 = time.perf_counter()
    client = parts.fleet.start()
    log(f"cluster and fleet up in {time.perf_counter() - t0:.1f} s")
    load = parts.load = Load(client, refs, ledger, stop, options.seed)
    controller = parts.controller = Controller(
        parts.fleet, options.kinds, options.spare, options.seed
    )
    sampler = parts.sampler = Sampler(parts.fleet, ledger, controller, stop_sampling)
    parts.losses = Losses(client, stop_sampling)
    f.t_start, began = time.time(), time.monotonic()
    load.start()
    controller.start(began, options.minutes * 60, options.kill_every_s)
    sampler.thread.start()
    parts.losses.thread.start()
    next_freeze = began
    try:
        while time.monotonic() < began + options.minutes * 60:
            controller.tick()
            if time.monotonic() >= next_freeze:
                # The ledger only grows: keep it out of the collector's full passes, which
                # would stall this process (the caller being measured) longer and longer.
                gc.freeze()
                next_freeze += GC_FREEZE_EVERY_S
            time.sleep(0.1)
    except KeyboardInterrupt:
        f.interrupted = True
        log("interrupted: stopping the load, then reporting")
    stop.set()
    t_end = time.time()
    f.seconds = t_end - f.t_start
    drain_until = time.monotonic() + DRAIN_S
    try:
        controller.finish()  # what is down or frozen comes back
        f.still_running = load.join(drain_until)
        while ledger.outstanding() and time.monotonic() < drain_until:
            time.sleep(0.2)
        log(f"load stopped; {ledger.outstanding()} answers still out")
        f.not_serving = sampler.wait_healthy(time.monotonic() + RECOVER_S)
    except KeyboardInterrupt:
        f.interrupted = True
    stop_sampling.set()
    sampler.thread.join(SAMPLE_EVERY_S + CONTROL_TIMEOUT_S)
    sampler.sample()  # the last counters of the router
    f.leaked = parts.fleet.close()
    return t_end


def _gather(parts: Parts, f: Figures) -> list[Sample]:
    """Copy what the soak's parts recorded into ``f``; the memory samples."""
    if parts.controller is not None:
        f.events = parts.controller.snapshot()
        f.controller_errors = list(parts.controller.errors)
    samples: list[Sample] = []
    if parts.sampler is not None:
        samples = list(parts.sampler.samples)
        f.fleet_counters = parts.sampler.router_totals()
        f.routers = len(parts.sampler.routers)
        f.status_calls = Counter(parts.sampler.status_calls)
        f.controller_errors += parts.sampler.errors
        f.control_errors += parts.sampler.status_errors
    if parts.losses is not None:
        f.losses = parts.losses.snapshot()
    if parts.load is not None:
        f.control = Counter(parts.load.control)
        f.control_errors += parts.load.control_errors
        if parts.load.failures and f.error is None:
            f.error = "\n".join(parts.load.failures)
    return samples


def soak(options: Options, argv: Sequence[str] = ()) -> tuple[Figures, str]:
    """Run the soak; its figures and the Markdown report."""
    started, facts = utc_now(), EnvFacts.collect()
    redis = shutil.which("redis-server") is not None
    if not redis and "head" in options.kinds:
        log("no redis-server: head restarts are left out (Debian: apt-get install redis-server)")
        options = replace(options, kinds=tuple(k for k in options.kinds if k != "head"))
    f, ledger, t_end = Figures(options), Ledger(), time.time()
    with tempfile.TemporaryDirectory(prefix="edgefleet-chaos-") as tmp:
        root = Path(tmp)
        log(f"chaos soak: {options.minutes:g} min, seed {options.seed}; {facts.line()}")
        refs = make_references(make_models(root), options.seed)
        parts = Parts(
            Fleet(root, root / "trace", redis="head" in options.kinds, spare=options.spare)
        )
        try:
            t_end = _load_and_chaos(parts, f, ledger, refs)
        except BaseException as exc:
            f.error = f"{type(exc).__name__}: {exc}"
            log(f"the soak failed: {f.error}")
            if not isinstance(exc, Exception | KeyboardInterrupt):
                raise
        finally:
            if parts.load is not None:
                parts.load.stop.set()
            parts.fleet.shutdown()
            gc.unfreeze()
        samples = _gather(parts, f)
        if options.answers is not None:
            ledger.write(options.answers, f.t_start)
        analyse(f, ledger, refs, root / "trace", samples, f.t_start or t_end, t_end)
    return f, render(f, facts, started, argv)


def run(argv: Sequence[str] | None = None) -> Figures:
    """Parse ``argv``, soak, write the report (stdout and ``--out``); the figures."""
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse_options(args)
    figures, report = soak(options, args)
    print(report, end="" if report.endswith("\n") else "\n", flush=True)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(report)
        log(f"report written to {options.out}")
    log("PASS: every invariant holds" if figures.passed else "FAIL: see the report")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    return 0 if run(argv).passed else 1


# ---------------------------------------------------------------------- the report

EVENT_NAMES = {
    "node": "node process killed",
    "router": "router killed",
    "raylet": "raylet killed",
    "node-freeze": "node process frozen",
    "raylet-freeze": "raylet frozen",
    "head": "head killed and restarted",
}


def _figures(title: str, rows: list[list[object]], *after: str) -> list[str]:
    """A report section of (figure, value) rows."""
    return [f"## {title}", "", md_table(["figure", "value"], rows), "", *after]


def render(f: Figures, facts: EnvFacts, started: str, argv: Sequence[str]) -> str:
    """The report: header, invariants, requests, executions, generations, the chaos
    events, memory and leaks."""
    out = _md_header(f, facts, started, argv)
    if f.error:
        out += ["**The soak did not run to the end:**", "", "```", f.error, "```", ""]
    checks = [[what, value, "ok" if ok else "**FAIL**"] for what, value, ok in f.invariants()]
    out += ["## Invariants", "", md_table(["check", "value", "result"], checks), ""]
    out += _md_requests(f) + _md_executions(f) + _md_generations(f) + _md_events(f) + _md_memory(f)
    leaked = f"{len(f.leaked)}" + (f" ({', '.join(f.leaked)})" if f.leaked else "")
    alive = f"Actors (or processes of the fleet's actors) alive after the client closed: {leaked}."
    out += ["## Leaks", "", alive, ""]
    if f.still_running:
        out += [f"Load threads still running at the end: {', '.join(f.still_running)}.", ""]
    if f.not_serving:
        out += [f"Nodes not serving again at the end: {', '.join(f.not_serving)}.", ""]
    if f.examples:
        out += ["## Examples of failures", "", *(f"- {e}" for e in f.examples), ""]
    return "\n".join(out)


def _md_counts(f: Figures) -> str:
    return ", ".join(f"{EVENT_NAMES[k]} {f.event_kinds[k]}" for k in f.options.kinds)


def _md_header(f: Figures, facts: EnvFacts, started: str, argv: Sequence[str]) -> list[str]:
    o = f.options
    period_s = int(cc.HEALTH_CHECKS["RAY_health_check_period_ms"]) / 1000
    home = f"{o.spare[0]}'s raylet" if o.spare else "a raylet of its own"
    verdict = "**PASS** (every invariant below holds)" if f.passed else "**FAIL**"
    short = ")" if f.covered else "; not every kind: the run was too short or cut short)"
    return [
        "# edgefleet chaos soak",
        "",
        f"- Date: {started}; this report: `python -m bench.chaos{''.join(' ' + a for a in argv)}`",
        f"- Machine: {facts.line()}",
        f"- Load: {f.seconds:.0f} s{' (interrupted by Ctrl-C)' if f.interrupted else ''}; "
        f"seed {o.seed}; a chaos event every {0.6 * o.kill_every_s:.1f}-"
        f"{1.4 * o.kill_every_s:.1f} s (none in the last {cc.QUIET_END_S:g} s); never hit: "
        f"{', '.join(o.spare) or 'none'}; every request with a timeout_s drawn "
        f"log-uniformly from {TIMEOUT_S[0]:g}-{TIMEOUT_S[1]:g} s",
        f"- Cluster: a Ray head (GCS state in Redis: {'yes' if 'head' in o.kinds else 'no'}), "
        f"{len(NODES)} raylets with one edge node pinned to each (the harness's driver on "
        f"{home}), on {LOOPBACK}; the router on the head; GCS health checks every "
        f"{period_s:g} s; router reports every {cc.REPORT_INTERVAL_S:g} s, a node lost "
        f"(unresponsive) after {cc.LOST_AFTER_S:g} s, restarted after "
        f"{cc.RESTART_AFTER_S:g} s more",
        f"- Verdict: {verdict}",
        f"- Chaos events: {len(f.events)} ({_md_counts(f)}{short}",
        f"- Answer time: every request answered within max(deadline_s, timeout_s) + "
        f"{ANSWER_SLACK_S:g} s: {'yes' if f.late == 0 else 'no'} ({f.late} late; the worst "
        f"answer came {f.worst_late_s:+.2f} s after max(deadline_s, timeout_s))",
        "",
    ]


def _md_requests(f: Figures) -> list[str]:
    def listed(c: Counter[str]) -> str:
        return f"{sum(c.values())} ({', '.join(f'{k} {v}' for k, v in c.most_common()) or 'none'})"

    apis = ", ".join(f"{k} {v}" for k, v in sorted(f.by_api.items()))
    limit = "max(deadline_s, timeout_s)"
    rows: list[list[object]] = [
        ["requests sent", f"{f.sent} ({apis})"],
        ["answered exactly once", f.sent - f.no_answer - f.two_answers],
        ["without an answer", f.no_answer],
        ["with two or more answers", f.two_answers],
        ["answered with a result", f.ok],
        ["answered with a typed error", listed(f.typed)],
        ["answered with an untyped error", listed(f.untyped)],
        ["inference results with wrong outputs", f.wrong_outputs],
        *(
            [f"answer time p50 / p99 / max, {api} (s)", " / ".join(fmt(v, 3) for v in t)]
            for api, t in sorted(f.latency.items())
        ),
        [f"worst answer time minus {limit} (s)", f"{f.worst_late_s:+.3f}"],
        [
            f"answered more than {ANSWER_SLACK_S:g} s after {limit} (of them TimedOut)",
            f"{f.late} ({f.timed_out_late})",
        ],
        *(
            [
                f"{what} (ok / typed / untyped)",
                " / ".join(str(c[k]) for k in ("ok", "typed", "untyped")),
            ]
            for what, c in (("lifecycle events", f.control), ("status calls", f.status_calls))
        ),
    ]
    errors = [f"- {e}" for e in f.control_errors[:5]]
    return _figures("Requests and answers", rows, *errors, *([""] if errors else []))


EXECUTIONS = (  # (figure, Figures attribute) of the executions table
    ("trace files (node processes)", "trace_files"),
    ("trace lines", "trace_lines"),
    ("lines cut short by a killed process", "truncated_lines"),
    ("lines of ids the harness never sent", "unknown_ids"),
    ("ids run to completion once", "ran_once"),
    ("ids run to completion more than once", "ran_more"),
    ("... re-run after the node that ran them was killed before answering", "reran_after_kill"),
    ("... re-run elsewhere while the node holding them was frozen", "reran_after_freeze"),
    (
        "... re-run elsewhere after the node holding them did not answer the caller's probe",
        "reran_after_loss",
    ),
    ("... re-run with no kill, freeze or loss to explain it", "reran_unexplained"),
    ("requests sent at_most_once / answered NodeLost ('may have run')", "once"),
    ("at_most_once ids run more than once", "reran_at_most_once"),
    ("successes without an execution", "success_without_run"),
    ("successes naming a node that has no execution of them", "wrong_node"),
    (
        "generations ended by the caller after their node died, every token sent",
        "success_by_caller",
    ),
    ("ran on a node, yet answered with an error (its node died first)", "ran_but_error"),
)


def _md_executions(f: Figures) -> list[str]:
    once = f"{f.at_most_once_sent:,} / {f.at_most_once_lost:,}"
    rows = [[what, once if attr == "once" else getattr(f, attr)] for what, attr in EXECUTIONS]
    text = (
        "A request whose node dies after running it but before its answer leaves is run again "
        "elsewhere under the same id; one held by a node that does not answer its caller's "
        "probe in time (frozen, or starved of CPU) is placed again elsewhere, and that node "
        "may still run it once it runs again. Both are the documented at-least-once execution "
        "of requests not sent at_most_once; the caller still gets one answer. A loss is when "
        "the caller held the node out of service (its view, polled every 50 ms)."
    )
    return _figures("Executions (node traces)", rows, text, "")


def _md_generations(f: Figures) -> list[str]:
    done = " / ".join(str(f.gen_completed[k]) for k in FINISHED)
    rows: list[list[object]] = [
        ["generations answered", f.generations],
        ["completed (stop / length / budget)", done],
        ["... tokens identical to the reference run (in order, each once)", f.gen_exact],
        ["... tokens duplicated, missing or wrong", f.gen_token_errors],
        ["cancelled by a node", f.gen_completed["cancelled"]],
        ["ended with a typed error", f.gen_typed],
        ["... tokens so far not a prefix of the reference", f.gen_partial_errors],
        ["tokens or errors after a stream's end", f.after_end],
    ]
    return _figures("Generations", rows)


def _md_events(f: Figures) -> list[str]:
    short = "." if f.covered else " (**not every kind**: the run was too short or cut short)."
    out = [
        "## Kills, freezes and head restarts",
        "",
        f"{len(f.events)} chaos events: {_md_counts(f)}{short}",
        "",
    ]
    if f.events:

        def after(t: float | None, e: Event) -> str:
            return f"{t - e.at:.1f}" if t else "-"

        rows = [
            [f"{e.at - f.t_start:.1f}", e.kind, e.target, " ".join(map(str, e.pids)) or "-"]
            + [after(e.back_at, e), after(e.healthy_at, e), e.note or "-"]
            for e in f.events
        ]
        headers = ["at s", "kind", "target", "pids", "back after s", "serving again after s"]
        headers.append("note")
        out += [md_table(headers, rows), ""]
        out += [
            "Back after: a killed raylet or head started again, a frozen process sent SIGCONT. "
            "Serving again: the node answering in a new process, or after its SIGCONT; the "
            "router answering a status call.",
            "",
        ]
    if f.controller_errors:
        out += [
            "Harness errors (the controller's, the sampler's): " + "; ".join(f.controller_errors),
            "",
        ]
    if f.fleet_counters:
        keys = ("received", "completed", "spilled", "replaced", "shed", "nodes_lost", "rejoined")
        shown = ", ".join(f"{k} {f.fleet_counters.get(k, 0)}" for k in keys)
        more = ", ".join(f"{k} {f.fleet_counters.get(k, 0)}" for k in ("unresponsive", "restarted"))
        out += [
            f"Fleet counters over the {f.routers} router processes seen: {shown}; {more}. The "
            "caller's (received ... shed) are the largest a router process held; the router's "
            "own (nodes_lost ... restarted) are added up over its processes (what a router "
            "counted after the last sample before it was killed is not counted).",
            "",
        ]
    return out


def _md_memory(f: Figures) -> list[str]:
    out = [
        "## Memory",
        "",
        f"Resident memory of the router and node processes, sampled every {SAMPLE_EVERY_S:g} s "
        f"while they answered; growth from the first sample after a warm-up of "
        f"{f.warmup_s:.0f} s to the last (for processes that lived at least 10 s past the "
        "warm-up). Every kill starts a new process.",
        "",
    ]
    if f.memory:
        headers = ["process", "pid", "lived s", "first MB", "after warm-up MB", "last MB"]
        headers.append("growth %")
        rows = [
            [role, pid, fmt(lived, 0), fmt(first), fmt(warm), fmt(last)]
            + ["-" if growth is None else fmt(growth, 1, signed=True)]
            for role, pid, lived, first, warm, last, growth in f.memory
        ]
        growths = [m[6] for m in f.memory if m[6] is not None]
        largest = fmt(max(growths) if growths else math.nan, 1, signed=True)
        out += [md_table(headers, rows), "", f"Largest growth after warm-up: {largest} %.", ""]
    if f.memory_over_time:
        out += ["Over time (MB), for the processes that lived past the warm-up:", ""]
        out += [
            f"- {what}, every {step:.0f} s: {' '.join(f'{mb:.0f}' for mb in marks)}"
            for what, step, marks in f.memory_over_time
        ]
        out += [""]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
