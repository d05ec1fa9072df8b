"""Chaos soak: while nodes, the router and whole machines die or freeze and the head
restarts, every request ends with exactly one answer, in time.

    python -m bench.chaos --minutes N [--seed S] [--out FILE.md] [--kinds KIND ...]

A multi-raylet Ray cluster on loopback (a head, one raylet per edge node, one for the
client; see bench/chaos_cluster.py) serves a fleet of three nodes with node traces on
(``node_defaults.trace_dir``, see ``actors/trace.py``) and three models:
``classifier``, ``slow`` (calibrated to a few milliseconds) and the ``tiny_lm``
decoder. Mixed load goes through the public :class:`FleetClient`: inference at every
priority class (``submit`` and ``infer``, some with deadlines, some with dedup keys,
bursts of background work), chats with sessions (several threads, turn after turn),
background generations, and lifecycle events. Meanwhile a seeded controller, at
random intervals, kills a node actor's process, the router or a whole raylet; freezes
(SIGSTOP, later SIGCONT) a node actor's process or a whole raylet; or kills the head
and starts it again (Ray's GCS fault tolerance on Redis; without redis-server that
kind is left out).

Every request has its own id and its own ``timeout_s`` (drawn from TIMEOUT_S), and
the harness records every answer the public API delivered for it: a future's Reply,
an ``infer`` result or exception, a stream's tokens and its end. The report counts
answers per request (exactly one each: a result or a typed EdgeFleetError), executions
per id from the node traces (re-runs after a node died, or froze, before answering
are at-least-once by nature and counted apart; any other re-run is a bug), the tokens
of every greedy generation against a reference run of the same prompt, inference
outputs against references, memory of the long-lived processes over time, and actors
left alive after the client closed.

Answer time. A request's *limit* is what its caller was promised: ``timeout_s``, the
longest the whole request may take (past it the fleet ends it ``TimedOut``; this is
what bounds a request whose node froze, whatever the call-limit probes found), or its
deadline (``deadline_s``) when that is later. Every request must be answered within
max(deadline_s, timeout_s) + ANSWER_SLACK_S, measured by the harness from just before
the API call to the answer's delivery (a generation: its stream's end).

Progress goes to stderr, the Markdown report to stdout (and ``--out``). The run ends
by itself after N minutes (the answers still out get a bounded wait); Ctrl-C ends the
load early and still reports. Everything started is torn down. Exit status: 0 when
every invariant holds, 1 otherwise.
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
import onnxruntime as ort
import psutil

from actors.decoder import DecoderEngine, Generation
from actors.trace import read_traces
from bench.chaos_cluster import (
    CONTROL_TIMEOUT_S,
    KINDS,
    LM,
    NODES,
    Controller,
    Event,
    Fleet,
)
from bench.chaos_report import render
from bench.common import EnvFacts, log, percentile, utc_now
from cluster.client import FleetClient
from edgefleet.errors import EdgeFleetError
from edgefleet.messages import Reply
from edgefleet.modelgen import calibrate_slow, make_classifier, make_tiny_lm, random_inputs
from edgefleet.request import GenerateRequest

SLOW_MS = 4.0  # batch-1 cost the slow model is calibrated to
FEEDS = 8  # distinct inputs per tensor model, each with a reference output
SYSTEM = tuple(range(1, 17))  # the system prompt every generation starts with
CHAT_THREADS = 3
CHAT_TURNS = 3
CHAT_TOKENS = 16
SUMMARIES = 4
SUMMARY_TOKENS = 40
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


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    minutes: float = 1.0
    seed: int = 0
    out: Path | None = None
    answers: Path | None = None  # every request and its answers, a JSON line each
    kill_every_s: float = 12.0  # mean interval between chaos events
    spare: tuple[str, ...] = ("edge-0",)  # nodes never hit: they live the whole run
    kinds: tuple[str, ...] = KINDS  # the kinds of chaos events

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0


def build_parser(prog: str = "python -m bench.chaos") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Chaos soak: mixed load through FleetClient on a multi-raylet Ray "
        "cluster on loopback while node processes, the router and whole raylets are "
        "killed, node processes and raylets frozen and the head restarted at seeded "
        "random intervals; reports whether every request got exactly one answer, in "
        "time (progress on stderr, the Markdown report on stdout).",
        epilog=f"example: {prog} --minutes 10 --seed 1 --out /tmp/chaos.md",
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="load duration (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the load and the chaos")
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the report here")
    parser.add_argument(
        "--answers",
        type=Path,
        metavar="FILE",
        help="write every request and its answers here, a JSON line each (to look into a failure)",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=12.0,
        metavar="S",
        help="mean seconds between chaos events (each interval is 0.6-1.4 times this; default 12)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=list(KINDS),
        choices=KINDS,
        metavar="KIND",
        help=f"the kinds of chaos events (default: all of {', '.join(KINDS)}; head restarts "
        "need redis-server)",
    )
    parser.add_argument(
        "--spare",
        nargs="*",
        default=["edge-0"],
        choices=NODES,
        metavar="NODE",
        help="nodes never hit, so their memory is followed over the whole run "
        "(default: edge-0; none: --spare with no name)",
    )
    return parser


def parse_options(argv: Sequence[str] | None = None) -> Options:
    args = build_parser().parse_args(argv)
    if args.minutes <= 0:
        raise SystemExit("--minutes must be > 0")
    if args.kill_every <= 0:
        raise SystemExit("--kill-every must be > 0")
    if set(args.spare) >= set(NODES):
        raise SystemExit("--spare: at least one node must be left to hit")
    return Options(
        minutes=args.minutes,
        seed=args.seed,
        out=args.out,
        answers=args.answers,
        kill_every_s=args.kill_every,
        spare=tuple(args.spare),
        kinds=tuple(k for k in KINDS if k in args.kinds),
    )


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
    answers: list[Answer] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # delivered, in order (generation)
    after_end: int = 0  # tokens or errors delivered after the answer (must stay 0)
    wrong: str = ""  # why the answer's content is wrong ('' when it is right)
    at_most_once: bool = False  # never placed again once sent: NodeLost instead
    timeout_s: float = math.inf  # the request's timeout_s
    deadline_s: float | None = None  # the request's deadline_s, if it has one

    @property
    def answered_at(self) -> float | None:
        return self.answers[0].at if self.answers else None

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
        self._answered = 0

    def new(
        self,
        api: str,
        model: str,
        priority: int | str,
        ref: tuple[Any, ...],
        max_new_tokens: int = 0,
        at_most_once: bool = False,
        timeout_s: float = math.inf,
        deadline_s: float | None = None,
    ) -> Sent:
        with self._lock:
            rid = f"{api[0]}{next(self._ids):07d}"
            sent = self.sent[rid] = Sent(
                rid, api, model, priority, time.time(), ref, max_new_tokens
            )
            sent.at_most_once = at_most_once
            sent.timeout_s, sent.deadline_s = timeout_s, deadline_s
        return sent

    def answer(self, sent: Sent, answer: Answer) -> None:
        with self._lock:
            if not sent.answers:
                self._answered += 1
            sent.answers.append(answer)

    def counts(self) -> tuple[int, int]:
        """Requests sent, and those answered."""
        with self._lock:
            return len(self.sent), self._answered

    def outstanding(self) -> int:
        sent, answered = self.counts()
        return sent - answered

    def write(self, path: Path, t0: float) -> None:
        """Every request and its answers, a JSON line each (times in s from ``t0``)."""
        with self._lock, path.open("w") as out:
            for s in self.sent.values():
                line = {
                    "id": s.id,
                    "api": s.api,
                    "at": round(s.at - t0, 3),
                    "timeout_s": round(s.timeout_s, 3),
                    "deadline_s": s.deadline_s,
                    "at_most_once": s.at_most_once,
                    "answers": [
                        [round(a.at - t0, 3), a.outcome, a.what, a.node, a.detail]
                        for a in s.answers
                    ],
                }
                out.write(json.dumps(line) + "\n")


@dataclass(frozen=True)
class Sample:
    at: float
    role: str  # a node's name, or "router"
    pid: int
    rss_mb: float


# ------------------------------------------------------------------- references


@dataclass
class References:
    """Inputs and the answers they must get: inference outputs computed in this
    process with ONNX Runtime, greedy generations on the decoder engine uninterrupted."""

    feeds: dict[str, list[dict[str, np.ndarray]]]
    outputs: dict[str, list[dict[str, np.ndarray]]]
    chats: dict[tuple[int, int], tuple[tuple[int, ...], list[int]]]  # (thread, turn)
    summaries: list[tuple[tuple[int, ...], list[int]]]

    def expected(self, sent: Sent) -> list[int]:
        if sent.ref[0] == "chat":
            return self.chats[(sent.ref[1], sent.ref[2])][1]
        return self.summaries[sent.ref[1]][1]


def make_models(directory: Path) -> dict[str, Path]:
    paths = {
        "classifier": make_classifier(directory / "classifier.onnx"),
        "slow": calibrate_slow(directory / "slow.onnx", SLOW_MS)[0],
        LM: make_tiny_lm(directory / "tiny_lm.onnx"),
    }
    return paths


def make_references(paths: Mapping[str, Path], seed: int) -> References:
    feeds: dict[str, list[dict[str, np.ndarray]]] = {}
    outputs: dict[str, list[dict[str, np.ndarray]]] = {}
    for model in ("classifier", "slow"):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(
            str(paths[model]), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in session.get_outputs()]
        feeds[model] = [random_inputs(model, seed=seed * 100 + i) for i in range(FEEDS)]
        outputs[model] = [
            dict(zip(names, session.run(names, feed), strict=True)) for feed in feeds[model]
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
            user = tuple(rng.randrange(*PROMPT_RANGE) for _ in range(6 + 2 * k))
            prompt = history + user
            out = greedy(prompt, CHAT_TOKENS)
            chats[(t, k)] = (prompt, out)
            history = prompt + tuple(out)
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
    if list(delivered) == list(expected[: len(delivered)]) and (
        not full or len(delivered) == len(expected)
    ):
        return ""
    first = next(
        (i for i, (a, b) in enumerate(zip(delivered, expected, strict=False)) if a != b),
        min(len(delivered), len(expected)),
    )
    return f"{len(delivered)} tokens, expected {len(expected)}; first difference at {first}"


# ------------------------------------------------------------------------ the load


def _typed(exc: BaseException) -> tuple[str, str]:
    return ("typed" if isinstance(exc, EdgeFleetError) else "untyped"), type(exc).__name__


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
        self.client = client
        self.refs = refs
        self.ledger = ledger
        self.stop = stop
        self.seed = seed
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

    # inference -----------------------------------------------------------------

    def _feed(self, rng: random.Random) -> tuple[str, int]:
        model = "classifier" if rng.random() < 0.7 else "slow"
        return model, rng.randrange(FEEDS)

    def _submit_one(
        self, rng: random.Random, priority: int | str, deadline_s: float | None = None
    ) -> None:
        model, i = self._feed(rng)
        once = rng.random() < AT_MOST_ONCE_SHARE
        sent = self.ledger.new(
            "submit",
            model,
            priority,
            (model, i),
            at_most_once=once,
            timeout_s=_timeout(rng),
            deadline_s=deadline_s,
        )
        key = f"camera-{rng.randrange(2)}" if priority == "inline" and rng.random() < 0.3 else None
        try:
            future = self.client.submit(
                model,
                self.refs.feeds[model][i],
                priority=priority,
                deadline_s=deadline_s,
                key=key,
                request_id=sent.id,
                at_most_once=once,
                timeout_s=sent.timeout_s,
            )
        except Exception as exc:
            outcome, what = _typed(exc)
            self.ledger.answer(sent, Answer(time.time(), outcome, what, detail=str(exc)[:200]))
            return
        future.add_done_callback(partial(self._replied, sent))

    def _replied(self, sent: Sent, future: Any) -> None:
        try:
            reply: Reply = future.result()
        except BaseException as exc:  # a future of the public API must never fail
            self.ledger.answer(
                sent, Answer(time.time(), "untyped", type(exc).__name__, "", str(exc))
            )
            return
        if reply.error is None:
            self._check(sent, reply.outputs or {}, reply.request_id)
            self.ledger.answer(sent, Answer(time.time(), "ok", "completed", reply.node))
        else:
            outcome, what = _typed(reply.error)
            self.ledger.answer(
                sent, Answer(time.time(), outcome, what, reply.node, str(reply.error)[:200])
            )

    def _check(self, sent: Sent, outputs: Mapping[str, np.ndarray], request_id: str) -> None:
        model, i = sent.ref
        problem = same_outputs(outputs, self.refs.outputs[model][i])
        if request_id != sent.id:
            problem = f"answer for request {request_id}"
        sent.wrong = problem

    def _submitter(self, rng: random.Random) -> None:
        next_burst = time.monotonic() + rng.uniform(3, 6)
        while not self.stop.wait(rng.expovariate(SUBMIT_RATE)):
            priority = rng.choice(PRIORITIES)
            deadline = rng.uniform(0.05, 1.0) if priority in ("background", 1) else None
            self._submit_one(rng, priority, deadline)
            if time.monotonic() >= next_burst:
                next_burst = time.monotonic() + rng.uniform(3, 6)
                for _ in range(BURST):
                    self._submit_one(rng, rng.choice(("background", "offline")))

    def _caller(self, rng: random.Random) -> None:
        while not self.stop.wait(rng.uniform(0.005, 0.03)):
            model, i = self._feed(rng)
            priority = rng.choice(PRIORITIES)
            once = rng.random() < AT_MOST_ONCE_SHARE
            timeout_s = _timeout(rng)
            sent = self.ledger.new(
                "infer", model, priority, (model, i), at_most_once=once, timeout_s=timeout_s
            )
            try:
                outputs = self.client.infer(
                    model,
                    self.refs.feeds[model][i],
                    priority=priority,
                    request_id=sent.id,
                    at_most_once=once,
                    timeout_s=timeout_s,
                )
            except Exception as exc:
                outcome, what = _typed(exc)
                self.ledger.answer(sent, Answer(time.time(), outcome, what, detail=str(exc)[:200]))
            else:
                self._check(sent, outputs, sent.id)
                self.ledger.answer(sent, Answer(time.time(), "ok", "completed"))

    # generation ----------------------------------------------------------------

    def _generate(self, sent: Sent, prompt: tuple[int, ...], **kw: Any) -> str | None:
        """Stream one generation; its finish reason, or None when it ended in an error."""
        try:
            stream = self.client.generate(
                LM,
                prompt,
                max_new_tokens=sent.max_new_tokens,
                priority=sent.priority,
                prefix_len=len(SYSTEM),
                request_id=sent.id,
                at_most_once=sent.at_most_once,
                deadline_s=sent.deadline_s,
                timeout_s=sent.timeout_s,
                **kw,
            )
            for token in stream:
                sent.tokens.append(token)
            result = stream.result
        except Exception as exc:
            outcome, what = _typed(exc)
            self.ledger.answer(sent, Answer(time.time(), outcome, what, detail=str(exc)[:200]))
            return None
        assert result is not None  # the stream raises rather than end without one
        self.ledger.answer(sent, Answer(time.time(), "ok", result.finish_reason or "", result.node))
        try:  # nothing may come after the end
            for _ in stream:
                sent.after_end += 1
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
            sent = self.ledger.new(
                "generate",
                LM,
                priority,
                ("chat", thread, turn),
                max_new_tokens=CHAT_TOKENS,
                timeout_s=_timeout(rng),
            )
            reason = self._generate(sent, prompt, session=f"chat-{thread}-{epoch}")
            if reason == "length" and sent.tokens == expected and turn + 1 < CHAT_TURNS:
                turn += 1  # the next turn builds on this answer
            else:
                epoch, turn = epoch + 1, 0  # a new conversation
            self.stop.wait(rng.uniform(0.05, 0.4))

    def _summaries(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            j = rng.randrange(SUMMARIES)
            priority = rng.choice(("background", "offline", 2))
            sent = self.ledger.new(
                "generate",
                LM,
                priority,
                ("summary", j),
                max_new_tokens=SUMMARY_TOKENS,
                at_most_once=rng.random() < AT_MOST_ONCE_SHARE,
                timeout_s=_timeout(rng),
                deadline_s=rng.uniform(0.05, 1.0) if rng.random() < 0.25 else None,
            )
            self._generate(sent, self.refs.summaries[j][0])
            self.stop.wait(rng.uniform(0.05, 0.3))

    # control -------------------------------------------------------------------

    def _lifecycle(self, rng: random.Random) -> None:
        while not self.stop.wait(rng.uniform(2.0, 5.0)):
            node, state = rng.choice(NODES), rng.choice(("background", "foreground"))
            try:
                self.client.set_lifecycle(node, state, timeout_s=CONTROL_TIMEOUT_S)
            except Exception as exc:
                outcome, what = _typed(exc)
                self.control[outcome] += 1
                if outcome == "untyped":
                    self.control_errors.append(f"set_lifecycle: {what}: {exc}"[:300])
            else:
                self.control["ok"] += 1


# --------------------------------------------------------------- the sampler


class Losses:
    """When the caller (the harness's FleetClient) held each node out of service: it
    did not answer a probe in time, died, or the router reported it so. Polled every
    LOSS_POLL_S on a thread of its own: the windows explain re-runs (see
    :func:`_rerun_cause`)."""

    def __init__(self, client: FleetClient, stop: threading.Event) -> None:
        self.client = client
        self.stop = stop
        self.windows: dict[str, list[list[float]]] = defaultdict(list)  # [from, to]
        self.thread = threading.Thread(target=self._run, name="losses", daemon=True)

    def start(self) -> None:
        self.thread.start()

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
        self,
        fleet: Fleet,
        ledger: Ledger,
        controller: Controller,
        stop: threading.Event,
    ) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.controller = controller
        self.stop = stop
        self.samples: list[Sample] = []
        self.healthy: dict[str, bool] = {}
        self.status_calls: Counter[str] = Counter()  # ok / typed / untyped
        self.status_errors: list[str] = []  # untyped ones
        self.errors: list[str] = []  # the sampler's own failures
        self.routers: dict[int, dict[str, int]] = {}  # by router process: its last counters
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.thread.start()

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
            outcome, what = _typed(exc)
            self.status_calls[outcome] += 1
            if outcome == "untyped":
                self.status_errors.append(f"status: {what}: {exc}"[:300])
        else:
            now = time.time()
            self.status_calls["ok"] += 1
            self._router_counters(dict(status.router))
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
        or (a freeze) healthy after its SIGCONT; the head once the router answers."""
        for event in self.controller.snapshot():
            if event.healthy_at is not None or event.kind == "router":
                continue
            if event.kind == "head":
                if event.back_at is not None:
                    event.healthy_at = now
                continue
            pid = _pid_of(status, event.target)
            thawed = event.freeze and event.back_at is not None
            if self.healthy.get(event.target) and (pid not in (0, *event.pids) or thawed):
                event.healthy_at = now

    def _router_counters(self, counters: dict[str, int]) -> None:
        """Keep the router's counters per incarnation (a restarted router counts from 0)."""
        pid = self.fleet.router_pid()
        if pid is not None:  # else between two incarnations: the next sample has it
            self.routers[pid] = counters  # counts only grow within one

    def router_totals(self) -> Counter[str]:
        """The fleet-wide counters over the router's incarnations: the router's own
        (ROUTER_OWN) added up, each counting from 0; the caller's the largest any
        incarnation held (a restarted router takes a running caller's totals whole)."""
        totals: Counter[str] = Counter()
        for counters in self.routers.values():
            for key, value in counters.items():
                if key in ROUTER_OWN:
                    totals[key] += value
                else:
                    totals[key] = max(totals[key], value)
        return totals

    def wait_healthy(self, deadline: float) -> list[str]:
        """Wait until every node serves again (bounded); the nodes that do not."""
        while True:
            down = [n for n in NODES if not self.healthy.get(n)]
            if not down or time.monotonic() >= deadline:
                return down
            time.sleep(0.5)

    def progress(self) -> str:
        sent, answered = self.ledger.counts()
        kinds = Counter(e.kind for e in self.controller.snapshot())
        healthy = ",".join(n for n in NODES if self.healthy.get(n)) or "-"
        events = ", ".join(f"{k} {kinds[k]}" for k in self.controller.kinds)
        return (
            f"{time.monotonic() - self.t0:5.0f} s: {sent} sent, {answered} answered, "
            f"{sent - answered} out | {events} | healthy {healthy}"
        )


def _pid_of(status: Any, name: str) -> int:
    for node in status.nodes:
        if node.name == name:
            return int(node.pid)
    return 0


# ------------------------------------------------------------------ the figures


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
    # answer time against max(deadline_s, timeout_s) (see the module's text)
    late: int = 0  # answered more than ANSWER_SLACK_S after it
    worst_late_s: float = -math.inf  # the largest answer time minus it
    timed_out_late: int = 0  # of the late ones, answered TimedOut
    # executions (node traces)
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
    # generations
    generations: int = 0
    gen_completed: Counter[str] = field(default_factory=Counter)  # finish reason
    gen_exact: int = 0
    gen_token_errors: int = 0  # completed ones whose tokens are not the reference's
    gen_partial_errors: int = 0  # ended otherwise, tokens not a prefix of the reference
    gen_typed: int = 0
    after_end: int = 0
    # control
    control: Counter[str] = field(default_factory=Counter)
    # chaos
    events: list[Event] = field(default_factory=list)
    losses: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # Losses
    controller_errors: list[str] = field(default_factory=list)
    fleet_counters: Counter[str] = field(default_factory=Counter)  # over router restarts
    routers: int = 0  # router incarnations seen
    status_calls: Counter[str] = field(default_factory=Counter)
    control_errors: list[str] = field(default_factory=list)
    latency: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # p50 p99 max
    # memory
    memory: list[tuple[str, int, float, float, float, float, float | None]] = field(
        default_factory=list
    )  # role, pid, lived s, first MB, warm MB, last MB, growth % after warm-up
    warmup_s: float = 0.0
    memory_over_time: list[tuple[str, float, list[float]]] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    still_running: list[str] = field(default_factory=list)  # load threads that never ended
    not_serving: list[str] = field(default_factory=list)  # nodes not back by the end
    error: str | None = None  # the soak could not run to the end

    @property
    def event_kinds(self) -> Counter[str]:
        return Counter(e.kind for e in self.events)

    @property
    def growth_pct(self) -> float:
        values = [m[6] for m in self.memory if m[6] is not None]
        return max(values) if values else math.nan

    def invariants(self) -> list[tuple[str, int, bool]]:
        """(what, value, holds) for every check the soak makes."""
        return [
            ("requests without an answer", self.no_answer, self.no_answer == 0),
            ("requests with two or more answers", self.two_answers, self.two_answers == 0),
            ("untyped errors (requests)", sum(self.untyped.values()), not self.untyped),
            (
                f"requests answered later than max(deadline_s, timeout_s) + {ANSWER_SLACK_S:g} s",
                self.late,
                self.late == 0,
            ),
            (
                "untyped errors (lifecycle events and status calls)",
                self.control["untyped"] + self.status_calls["untyped"],
                not self.control["untyped"] and not self.status_calls["untyped"],
            ),
            ("inference answers with wrong outputs", self.wrong_outputs, self.wrong_outputs == 0),
            (
                "completed generations with duplicated, missing or wrong tokens",
                self.gen_token_errors,
                self.gen_token_errors == 0,
            ),
            (
                "other generations whose tokens are not a prefix of the reference",
                self.gen_partial_errors,
                self.gen_partial_errors == 0,
            ),
            (
                "tokens or errors delivered after a stream's end",
                self.after_end,
                self.after_end == 0,
            ),
            (
                "successes without an execution in the traces",
                self.success_without_run,
                self.success_without_run == 0,
            ),
            (
                "successes naming a node that has no execution of them",
                self.wrong_node,
                self.wrong_node == 0,
            ),
            (
                "ids run more than once with no kill, freeze or loss to explain it",
                self.reran_unexplained,
                self.reran_unexplained == 0,
            ),
            (
                "at_most_once ids run more than once",
                self.reran_at_most_once,
                self.reran_at_most_once == 0,
            ),
            (
                "actors (or their processes) alive after the client closed",
                len(self.leaked),
                not self.leaked,
            ),
            ("load threads that never ended", len(self.still_running), not self.still_running),
            (
                f"nodes not serving again {RECOVER_S:g} s after the load",
                len(self.not_serving),
                not self.not_serving,
            ),
        ]

    @property
    def covered(self) -> bool:
        """Every kind of chaos event asked for happened at least once (a run too short
        or interrupted may miss one: then it proves less, but nothing it checked is
        wrong)."""
        return all(self.event_kinds[kind] > 0 for kind in self.options.kinds)

    @property
    def passed(self) -> bool:
        return self.error is None and all(ok for _, _, ok in self.invariants())


def analyse(
    figures: Figures,
    ledger: Ledger,
    refs: References,
    traces: Path,
    samples: Sequence[Sample],
    t_start: float,
    t_end: float,
) -> None:
    """Fill ``figures`` from the ledger, the references, the node traces and the
    memory samples."""
    sent = list(ledger.sent.values())
    figures.sent = len(sent)
    figures.by_api = Counter(s.api for s in sent)
    _answers(figures, sent)
    _answer_times(figures, sent)
    _generations(figures, sent, refs)
    _executions(figures, ledger, traces, t_start)
    _memory(figures, samples, t_start, t_end)


def _example(f: Figures, text: str) -> None:
    if len(f.examples) < 12:
        f.examples.append(text)


def _answers(f: Figures, sent: Sequence[Sent]) -> None:
    """Exactly one answer each, typed when an error, with the right outputs."""
    for s in sent:
        f.at_most_once_sent += s.at_most_once
        if not s.answers:
            f.no_answer += 1
            _example(f, f"{s.id} ({s.api} {s.model} p={s.priority}): no answer")
            continue
        if len(s.answers) > 1:
            f.two_answers += 1
            _example(f, f"{s.id}: {len(s.answers)} answers: {[a.what for a in s.answers]}")
        a = s.answers[0]
        f.at_most_once_lost += s.at_most_once and a.what == "NodeLost"
        if a.outcome == "ok":
            f.ok += 1
        elif a.outcome == "typed":
            f.typed[a.what] += 1
        else:
            f.untyped[a.what] += 1
            _example(f, f"{s.id}: untyped {a.what}: {a.detail[:160]}")
        if s.api != "generate" and s.wrong:
            f.wrong_outputs += 1
            _example(f, f"{s.id}: wrong outputs: {s.wrong}")
        f.after_end += s.after_end


def _answer_times(f: Figures, sent: Sequence[Sent]) -> None:
    """Answer times by API, and each answer against its request's limit."""
    waits: dict[str, list[float]] = defaultdict(list)
    for s in sent:
        if not s.answers:
            continue
        took = s.answers[0].at - s.at
        waits[s.api].append(took)
        over = took - s.limit_s
        f.worst_late_s = max(f.worst_late_s, over)
        if over > ANSWER_SLACK_S:
            f.late += 1
            f.timed_out_late += s.answers[0].what == "TimedOut"
            _example(
                f,
                f"{s.id} ({s.api}, sent at {s.at - f.t_start:.1f} s): answered "
                f"{s.answers[0].what} after {took:.2f} s, "
                f"{over:.2f} s past max(deadline_s, timeout_s) = {s.limit_s:.2f} s",
            )
    f.latency = {
        api: (percentile(w, 50), percentile(w, 99), max(w)) for api, w in waits.items() if w
    }


def _generations(f: Figures, sent: Sequence[Sent], refs: References) -> None:
    """Generations against the references."""
    for s in sent:
        if s.api != "generate" or not s.answers:
            continue
        f.generations += 1
        a = s.answers[0]
        expected = refs.expected(s)[: s.max_new_tokens]
        if a.outcome == "ok" and a.what in ("stop", "length", "budget"):
            f.gen_completed[a.what] += 1
            problem = token_problem(s.tokens, expected, full=a.what == "length") or s.wrong
            if problem:
                f.gen_token_errors += 1
                _example(f, f"{s.id} (generate, {a.what}): {problem}")
            else:
                f.gen_exact += 1
        else:
            if a.outcome == "ok":
                f.gen_completed[a.what] += 1  # cancelled
            else:
                f.gen_typed += 1
            problem = token_problem(s.tokens, expected, full=False)
            if problem:
                f.gen_partial_errors += 1
                _example(f, f"{s.id} (generate, ended {a.what}): {problem}")


def _rerun_cause(
    ran: Sequence[dict[str, Any]],
    s: Sent,
    events: Sequence[Event],
    losses: Mapping[str, Sequence[tuple[float, float]]],
) -> str:
    """Why request ``s`` ran more than once (its runs ``ran``, in time order): "kill"
    when each run but the last was on a process killed after it ran there, before the
    next run and before the answer (the node that knew the answer was gone); "freeze"
    when one of its runs was on a process frozen while the request was out (its caller
    placed it again; the frozen node ran it on SIGCONT); "loss" when the caller held
    the node of a run but the last out of service (it did not answer a probe in time)
    after the request was sent and before the next run; "" when nothing explains it."""
    killed: dict[int, float] = {}
    frozen: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        for pid in e.pids:
            if e.freeze:
                frozen[pid].append(e)
            else:
                killed.setdefault(pid, e.at)
    answered = s.answered_at
    by_kill = True
    for first, then in itertools.pairwise(ran):
        died = killed.get(int(first["pid"]))
        if (
            died is None
            or died < float(first["t"]) - 0.5  # killed before it ran there: not this
            or float(then["t"]) < died  # ran again before the first node died
            or (answered is not None and answered < died)  # answered before the kill
        ):
            by_kill = False
    if by_kill:
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
    """Executions per id from the node traces."""
    lines, f.truncated_lines = read_traces(traces)
    f.trace_lines = len(lines)
    f.trace_files = len(list(traces.glob("trace-*.jsonl")))
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
        cause = _rerun_cause(ran, s, f.events, f.losses)
        if cause == "kill":
            f.reran_after_kill += 1
        elif cause == "freeze":
            f.reran_after_freeze += 1
        elif cause == "loss":
            f.reran_after_loss += 1
        else:
            f.reran_unexplained += 1
            where = ", ".join(f"{r['node']}/{r['pid']}@{float(r['t']) - t_start:.2f}s" for r in ran)
            _example(f, f"{rid}: ran {len(ran)} times with nothing to explain it: {where}")
    for s in ledger.sent.values():
        if s.answers:
            _success_and_runs(f, s, runs)


def _success_and_runs(f: Figures, s: Sent, runs: Mapping[str, list[dict[str, Any]]]) -> None:
    """A success must have run, on the node it names."""
    a = s.answers[0]
    success = a.outcome == "ok" and (s.api != "generate" or a.what in ("stop", "length", "budget"))
    if success and s.id not in runs:
        if s.api == "generate" and a.node == "":
            f.success_by_caller += 1  # every token sent before its node died
        else:
            f.success_without_run += 1
            _example(f, f"{s.id} ({s.api}): a success without an execution in the traces")
    elif success and a.node and a.node not in {line["node"] for line in runs[s.id]}:
        f.wrong_node += 1
        _example(f, f"{s.id}: answered by {a.node}, which has no execution of it")
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


# ------------------------------------------------------------------------ main


@dataclass
class Parts:
    """What a soak started, for the figures whatever happened."""

    fleet: Fleet
    load: Load | None = None
    controller: Controller | None = None
    sampler: Sampler | None = None
    losses: Losses | None = None


def _load_and_chaos(parts: Parts, figures: Figures, ledger: Ledger, refs: References) -> float:
    """Start the fleet, run the load and the chaos for the options' minutes, wait for
    the answers still out and for every node to serve again, close the client; the
    unix time the load stopped."""
    options, stop = figures.options, threading.Event()
    t0 = time.perf_counter()
    client = parts.fleet.start()
    log(f"cluster and fleet up in {time.perf_counter() - t0:.1f} s")
    load = parts.load = Load(client, refs, ledger, stop, options.seed)
    controller = parts.controller = Controller(
        parts.fleet, options.kinds, options.spare, options.seed
    )
    stop_sampling = threading.Event()
    sampler = parts.sampler = Sampler(parts.fleet, ledger, controller, stop_sampling)
    losses = parts.losses = Losses(client, stop_sampling)
    figures.t_start = time.time()
    began = time.monotonic()
    load.start()
    controller.start(began, options.seconds, options.kill_every_s)
    sampler.start(began)
    losses.start()
    next_freeze = began
    try:
        while time.monotonic() < began + options.seconds:
            controller.tick()
            if time.monotonic() >= next_freeze:
                # The ledger only grows: out of the collector's full passes, which would
                # stall this process (the caller whose answer times are measured) longer
                # and longer.
                gc.freeze()
                next_freeze += GC_FREEZE_EVERY_S
            time.sleep(0.1)
    except KeyboardInterrupt:
        figures.interrupted = True
        log("interrupted: stopping the load, then reporting")
    stop.set()
    t_end = time.time()
    figures.seconds = t_end - figures.t_start
    drain_until = time.monotonic() + DRAIN_S
    try:
        controller.finish()  # what is down or frozen comes back
        figures.still_running = load.join(drain_until)
        while ledger.outstanding() and time.monotonic() < drain_until:
            time.sleep(0.2)
        log(f"load stopped; {ledger.outstanding()} answers still out")
        figures.not_serving = sampler.wait_healthy(time.monotonic() + RECOVER_S)
    except KeyboardInterrupt:
        figures.interrupted = True
    stop_sampling.set()
    sampler.thread.join(SAMPLE_EVERY_S + CONTROL_TIMEOUT_S)
    sampler.sample()  # the last counters of the router
    figures.leaked = parts.fleet.close()
    return t_end


def _gather(parts: Parts, figures: Figures) -> list[Sample]:
    """Copy what the soak's parts recorded into ``figures``; the memory samples."""
    if parts.controller is not None:
        figures.events = parts.controller.snapshot()
        figures.controller_errors = list(parts.controller.errors)
    samples: list[Sample] = []
    if parts.sampler is not None:
        samples = list(parts.sampler.samples)
        figures.fleet_counters = parts.sampler.router_totals()
        figures.routers = len(parts.sampler.routers)
        figures.status_calls = Counter(parts.sampler.status_calls)
        figures.controller_errors += parts.sampler.errors
        figures.control_errors += parts.sampler.status_errors
    if parts.losses is not None:
        figures.losses = parts.losses.snapshot()
    if parts.load is not None:
        figures.control = Counter(parts.load.control)
        figures.control_errors += parts.load.control_errors
        if parts.load.failures and figures.error is None:
            figures.error = "\n".join(parts.load.failures)
    return samples


def soak(options: Options, argv: Sequence[str] = ()) -> tuple[Figures, str]:
    """Run the soak; its figures and the Markdown report."""
    started = utc_now()
    facts = EnvFacts.collect()
    redis = shutil.which("redis-server") is not None
    if not redis and "head" in options.kinds:
        log("no redis-server: head restarts are left out (Debian: apt-get install redis-server)")
        options = replace(options, kinds=tuple(k for k in options.kinds if k != "head"))
    figures = Figures(options)
    ledger = Ledger()
    t_end = time.time()
    with tempfile.TemporaryDirectory(prefix="edgefleet-chaos-") as tmp:
        root = Path(tmp)
        traces = root / "trace"
        log(f"chaos soak: {options.minutes:g} min, seed {options.seed}; {facts.line()}")
        t0 = time.perf_counter()
        refs = make_references(make_models(root), options.seed)
        log(f"models and references ready in {time.perf_counter() - t0:.1f} s")
        parts = Parts(Fleet(root, traces, redis="head" in options.kinds, spare=options.spare))
        try:
            t_end = _load_and_chaos(parts, figures, ledger, refs)
        except BaseException as exc:
            figures.error = f"{type(exc).__name__}: {exc}"
            log(f"the soak failed: {figures.error}")
            if not isinstance(exc, Exception | KeyboardInterrupt):
                raise
        finally:
            if parts.load is not None:
                parts.load.stop.set()
            parts.fleet.shutdown()
            gc.unfreeze()
        samples = _gather(parts, figures)
        if options.answers is not None:
            ledger.write(options.answers, figures.t_start)
        analyse(figures, ledger, refs, traces, samples, figures.t_start or t_end, t_end)
    report = render(
        figures,
        facts,
        started,
        argv,
        timeouts=TIMEOUT_S,
        slack_s=ANSWER_SLACK_S,
        sample_every_s=SAMPLE_EVERY_S,
    )
    return figures, report


def run(argv: Sequence[str] | None = None) -> Figures:
    """Parse ``argv`` (the command line's arguments), soak, write the report (stdout and
    ``--out``); the figures."""
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


if __name__ == "__main__":
    raise SystemExit(main())
