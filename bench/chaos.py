"""Chaos soak: while nodes, the router and whole machines die, every request ends with
exactly one answer.

    python -m bench.chaos --minutes N [--seed S] [--out FILE.md]

A multi-raylet Ray cluster on loopback (a head and three raylets; one edge node pinned
to each raylet by a custom resource, the router on the head) serves a fleet of three
nodes with node traces on (``node_defaults.trace_dir``, see ``actors/trace.py``) and
three models: ``classifier``, ``slow`` (calibrated to a few milliseconds) and the
``tiny_lm`` decoder. Mixed load goes through the public :class:`FleetClient`:
inference at every priority class (``submit`` and ``infer``, some with deadlines, some
with dedup keys, bursts of background work), chats with sessions (several threads,
turn after turn), background generations, and lifecycle events. Meanwhile a seeded
controller, at random intervals, kills a node actor's process (Ray restarts it), the
router (Ray restarts it) or a whole raylet (it comes back after a few seconds with the
same resources, and Ray places the node actor there again).

Every request has its own id, and the harness records every answer the public API
delivered for it: a future's Reply, an ``infer`` result or exception, a stream's
tokens and its end. The report counts answers per request (exactly one each: a result
or a typed EdgeFleetError), executions per id from the node traces (re-runs after a
node died before answering are at-least-once by nature and counted apart; any other
re-run is a bug), the tokens of every greedy generation against a reference run of
the same prompt, inference outputs against references, memory of the long-lived
processes over time, and actors left alive after the client closed.

Progress goes to stderr, the Markdown report to stdout (and ``--out``). The run ends
by itself after N minutes (the answers still out get a bounded wait); Ctrl-C ends the
load early and still reports. Everything started is torn down. Exit status: 0 when
every invariant holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort
import psutil
import ray
from ray.cluster_utils import Cluster

from actors.decoder import DecoderEngine, Generation
from actors.trace import read_traces
from bench.common import EnvFacts, fmt, log, md_table, percentile, utc_now
from cluster.client import FleetClient
from cluster.deploy import LOOPBACK, pin_loopback
from cluster.names import NAMESPACE, actor_name, router_name
from edgefleet.config import parse_config
from edgefleet.errors import EdgeFleetError
from edgefleet.messages import NodeState, NodeStatus, Reply
from edgefleet.modelgen import calibrate_slow, make_classifier, make_tiny_lm, random_inputs
from edgefleet.request import GenerateRequest

FLEET = "chaos"
NODES = ("edge-0", "edge-1", "edge-2")
KINDS = ("node", "router", "raylet")
LM = "tiny_lm"
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
REPORT_INTERVAL_S = 0.25
KV_BUDGET_MB = 16  # sessions' and paused generations' KV per node
LOST_AFTER_S = 2.0
# A raylet that dies is found dead by the GCS's health checks: a few seconds, not Ray's
# default of about 15 s, so a machine's node actor moves on within the run.
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 3,
}
FIRST_KILL_S = (5.0, 8.0)  # the first kill, seconds after the load starts
AIM_WORK = 2  # a node or raylet kill waits for a target holding this many requests...
AIM_S = 2.0  # ...for at most this long
QUIET_END_S = 12.0  # no kill this close to the end: what died comes back
DOWN_S = (4.0, 8.0)  # how long a killed raylet stays away
SAMPLE_EVERY_S = 2.0  # memory and health samples
PROGRESS_EVERY_S = 5.0
DRAIN_S = 45.0  # after the load: the longest wait for answers still out
RECOVER_S = 30.0  # then the longest wait for every node to serve again
LEAK_WAIT_S = 15.0  # after close: how long actors get to be reported dead
CONTROL_TIMEOUT_S = 10.0

PROMPT_RANGE = (20, 500)  # token ids of user turns (the tiny LM's vocabulary is 512)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    minutes: float = 1.0
    seed: int = 0
    out: Path | None = None
    kill_every_s: float = 12.0  # mean interval between kills
    spare: tuple[str, ...] = ("edge-0",)  # nodes never killed: they live the whole run

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0


def build_parser(prog: str = "python -m bench.chaos") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Chaos soak: mixed load through FleetClient on a multi-raylet Ray "
        "cluster on loopback while node processes, the router and whole raylets are "
        "killed at seeded random intervals; reports whether every request got exactly "
        "one answer (progress on stderr, the Markdown report on stdout).",
        epilog=f"example: {prog} --minutes 10 --seed 1 --out /tmp/chaos.md",
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="load duration (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the load and the kills")
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the report here")
    parser.add_argument(
        "--kill-every",
        type=float,
        default=12.0,
        metavar="S",
        help="mean seconds between kills (each interval is 0.6-1.4 times this; default 12)",
    )
    parser.add_argument(
        "--spare",
        nargs="*",
        default=["edge-0"],
        choices=NODES,
        metavar="NODE",
        help="nodes never killed, so their memory is followed over the whole run "
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
        raise SystemExit("--spare: at least one node must be left to kill")
    return Options(
        minutes=args.minutes,
        seed=args.seed,
        out=args.out,
        kill_every_s=args.kill_every,
        spare=tuple(args.spare),
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

    @property
    def answered_at(self) -> float | None:
        return self.answers[0].at if self.answers else None


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
    ) -> Sent:
        with self._lock:
            rid = f"{api[0]}{next(self._ids):07d}"
            sent = self.sent[rid] = Sent(
                rid, api, model, priority, time.time(), ref, max_new_tokens
            )
            sent.at_most_once = at_most_once
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


@dataclass
class Kill:
    at: float  # unix time
    kind: str  # node | router | raylet
    target: str
    pids: tuple[int, ...]
    back_at: float | None = None  # a raylet added back
    healthy_at: float | None = None  # the node (or router) answering again
    note: str = ""


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
        sent = self.ledger.new("submit", model, priority, (model, i), at_most_once=once)
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
            sent = self.ledger.new("infer", model, priority, (model, i), at_most_once=once)
            try:
                outputs = self.client.infer(
                    model,
                    self.refs.feeds[model][i],
                    priority=priority,
                    request_id=sent.id,
                    at_most_once=once,
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
                "generate", LM, priority, ("chat", thread, turn), max_new_tokens=CHAT_TOKENS
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
            )
            deadline = rng.uniform(0.05, 1.0) if rng.random() < 0.25 else None
            self._generate(sent, self.refs.summaries[j][0], deadline_s=deadline)
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


# ----------------------------------------------------------------- the cluster


def _own(pid: int | None) -> psutil.Process | None:
    """The process ``pid`` if this process started it (directly or not), else None."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.pid != os.getpid() and any(p.pid == os.getpid() for p in proc.parents()):
            return proc
    except psutil.Error:
        pass
    return None


def _kill(proc: psutil.Process | None) -> bool:
    """SIGKILL ``proc`` (found by :func:`_own`); False when it had exited already.
    psutil checks that the pid still names the same process before signalling it."""
    if proc is None:
        return False
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        proc.send_signal(signal.SIGKILL)
    except psutil.Error:
        return False
    return True


def _actors_of(title: str) -> list[psutil.Process]:
    """Ray worker processes this process started whose title starts with ``title``."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0].startswith(title):
            found.append(proc)
    return found


class Fleet:
    """The cluster (head + one raylet per node, on loopback) and the deployed fleet."""

    def __init__(self, models: Path, traces: Path) -> None:
        self.models = models
        self.traces = traces
        self.cluster: Cluster | None = None
        self.raylets: dict[str, Any] = {}
        self.client: FleetClient | None = None
        self.closed = False

    def start(self) -> FleetClient:
        pin_loopback()
        if ray.is_initialized():
            ray.shutdown()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"head": 1},
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "_system_config": HEALTH_CHECKS,
            },
        )
        for name in NODES:
            self.add_raylet(name)
        self.cluster.wait_for_nodes()
        ray.init(
            address=self.cluster.address,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        config = parse_config(
            {
                "fleet": {"name": FLEET},
                "models": {
                    "classifier": {
                        "path": "classifier.onnx",
                        "batching": {"window_ms": 2, "max_batch_size": 8},
                    },
                    "slow": {"path": "slow.onnx"},
                    LM: {"path": "tiny_lm.onnx", "kind": "decoder"},
                },
                "node_defaults": {
                    "queue": {"capacity": 24},
                    # Bounded caches fill within the warm-up, so later growth is a leak.
                    "kv_budget_mb": KV_BUDGET_MB,
                    "trace_dir": str(self.traces),
                },
                "nodes": [{"name": n, "resources": {n: 0.5}} for n in NODES],
                "router": {
                    "resources": {"head": 0.5},
                    "report_interval_s": REPORT_INTERVAL_S,
                    "lost_after_s": LOST_AFTER_S,
                },
            },
            self.models,
        )
        self.client = FleetClient.local(config, progress=lambda m: log(f"  {m}"))
        return self.client

    def add_raylet(self, name: str) -> None:
        assert self.cluster is not None
        self.raylets[name] = self.cluster.add_node(
            num_cpus=1, resources={name: 1}, node_ip_address=LOOPBACK
        )

    def remove_raylet(self, name: str) -> None:
        assert self.cluster is not None
        self.cluster.remove_node(self.raylets.pop(name), allow_graceful=False)

    def node_status(self, name: str) -> NodeStatus | None:
        """The node's status, asked of it (its pid is NodeStatus.pid); None when it does
        not answer or does not serve."""
        try:
            actor = ray.get_actor(actor_name(FLEET, name), namespace=NAMESPACE)
            status: NodeStatus = ray.get(actor.status.remote(), timeout=2.0)
        except Exception:
            return None
        return status if status.state == NodeState.SERVING and status.pid else None

    @staticmethod
    def router_pid() -> int | None:
        procs = _actors_of("ray::RouterActor")
        return procs[0].pid if len(procs) == 1 else None

    def close(self) -> list[str]:
        """Close the client (it tears the fleet down); what is still alive after."""
        leaked: list[str] = []
        if self.client is not None:
            self.client.close()
            self.client = None
            leaked = _alive_actors()
        return leaked

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            if self.client is not None:
                self.client.close()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self.cluster is not None:
            try:
                self.cluster.shutdown()
            except Exception as exc:
                log(f"cluster shutdown: {type(exc).__name__}: {exc}")


def _alive_actors() -> list[str]:
    """Actors Ray does not report dead, and processes of this fleet's actors still
    running, waiting up to LEAK_WAIT_S for the ones just killed to go."""
    end = time.monotonic() + LEAK_WAIT_S
    while True:
        actors = ray._private.state.actors()
        alive = [
            f"{a.get('Name') or a.get('ActorClassName') or actor_id} ({a.get('State')})"
            for actor_id, a in actors.items()
            if a.get("State") != "DEAD"
        ]
        alive += [
            f"process {p.pid} ({title})"
            for title in ("ray::NodeRuntime", "ray::RouterActor")
            for p in _actors_of(title)
        ]
        if not alive or time.monotonic() >= end:
            return sorted(alive)
        time.sleep(0.5)


# ------------------------------------------------------------------ the chaos


class Controller:
    """Kills on a seeded schedule: a node's process, the router, a whole raylet (added
    back after a while). The first three kills are one of each kind, in a seeded order.

    Driven by :meth:`tick` from the main thread: Ray adds a raylet only from there."""

    def __init__(self, fleet: Fleet, options: Options) -> None:
        self.fleet = fleet
        self.options = options
        self.rng = random.Random(f"{options.seed}/chaos")
        self.kills: list[Kill] = []
        self.down: dict[str, tuple[float, Kill]] = {}  # raylet -> (back at, its kill)
        self.errors: list[str] = []
        self._lock = threading.Lock()
        order = list(KINDS)
        self.rng.shuffle(order)
        self._first = order
        self._next = math.inf
        self.until = 0.0
        self._kind: str | None = None  # the kind of the kill that is due
        self._due = 0.0

    def start(self, t0: float) -> None:
        self._next = t0 + self.rng.uniform(*FIRST_KILL_S)
        self.until = t0 + max(self.options.seconds - QUIET_END_S, FIRST_KILL_S[1])

    def targets(self) -> list[str]:
        return [n for n in NODES if n not in self.options.spare and n not in self.down]

    def tick(self) -> None:
        """Add back the raylets whose time has come; kill when the schedule says so."""
        now = time.monotonic()
        for name, (back, kill) in list(self.down.items()):
            if now >= back:
                self._restore(name, kill)
        if now < self._next or now >= self.until:
            return
        if self._kind is None:
            self._kind = self._first.pop(0) if self._first else self.rng.choice(KINDS)
            self._due = now
        try:
            done = self._attempt(self._kind, aim=now < self._due + AIM_S)
            if done is None:
                return  # waiting for the target to hold work, a little longer
            missed = not isinstance(done, Kill) or done.kind != self._kind
            if missed and not any(k.kind == self._kind for k in self.snapshot()):
                self._first.insert(0, self._kind)  # its first time is still to come
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            log(f"chaos: a kill failed: {type(exc).__name__}: {exc}")
        mean = self.options.kill_every_s
        self._next = now + self.rng.uniform(0.6 * mean, 1.4 * mean)
        self._kind = None

    def _attempt(self, kind: str, *, aim: bool) -> Kill | None | bool:
        """Kill one of ``kind`` (another kind when none can be): the Kill, None to wait
        (``aim``: no node holds work yet), False when nothing could be killed."""
        kinds = [kind, *(k for k in self.rng.sample(list(KINDS), len(KINDS)) if k != kind)]
        for k in kinds:
            if k == "router":
                kill = self._kill_router()
            else:
                target = self._target(aim=aim and k == kind)
                if target == "wait":
                    return None
                if target is None:
                    continue
                kill = self._kill_node(*target) if k == "node" else self._kill_raylet(*target)
            if kill:
                with self._lock:
                    self.kills.append(kill)
                log(f"chaos: killed {k} {kill.target} (pids {list(kill.pids)}) {kill.note}")
                return kill
        return False

    def _target(self, *, aim: bool) -> tuple[str, int | None] | Literal["wait"] | None:
        """The node to kill (name, pid): of the nodes that may be killed, the one
        holding the most requests. "wait" while none holds AIM_WORK requests yet
        (``aim``); None when there is none to kill."""
        names = self.targets()
        self.rng.shuffle(names)  # a seeded choice among equals
        held: list[tuple[int, str, int | None]] = []
        for name in names:
            status = self.fleet.node_status(name)
            if status is None:
                held.append((-1, name, None))
                continue
            work = status.queue_length + sum(status.paused.values())
            work += len(status.running.request_ids) if status.running is not None else 0
            held.append((work, name, int(status.pid)))
        if not held:
            return None
        work, name, pid = max(held, key=lambda h: h[0])
        if aim and work < AIM_WORK:
            return "wait"
        return name, pid

    def finish(self) -> None:
        """Nothing stays dead: add back every raylet still away."""
        self._next = math.inf
        for name, (_, kill) in list(self.down.items()):
            self._restore(name, kill)

    def _kill_node(self, name: str, pid: int | None) -> Kill | None:
        if pid is not None and _kill(_own(pid)):
            return Kill(time.time(), "node", name, (pid,))
        return None

    def _kill_router(self) -> Kill | None:
        pid = self.fleet.router_pid()
        try:
            router = ray.get_actor(router_name(FLEET), namespace=NAMESPACE)
        except ValueError:
            return None
        ray.kill(router, no_restart=False)  # Ray restarts it
        return Kill(time.time(), "router", "router", (pid,) if pid else ())

    def _kill_raylet(self, name: str, pid: int | None) -> Kill | None:
        proc = _own(pid)  # found now: once its raylet is gone it is no longer our child
        self.fleet.remove_raylet(name)
        # The machine is gone: its node's process goes with its raylet (a worker whose
        # raylet alone died may otherwise finish the calls it holds).
        killed = _kill(proc)
        down = self.rng.uniform(*DOWN_S)
        kill = Kill(time.time(), "raylet", name, (pid,) if pid else (), note=f"down {down:.1f} s")
        if pid is not None and not killed:
            kill.note += "; its node's process exited with its raylet"
        self.down[name] = (time.monotonic() + down, kill)
        return kill

    def _restore(self, name: str, kill: Kill) -> None:
        self.down.pop(name, None)
        try:
            self.fleet.add_raylet(name)
        except Exception as exc:
            self.errors.append(f"adding raylet {name} back: {type(exc).__name__}: {exc}")
            return
        kill.back_at = time.time()
        log(f"chaos: raylet {name} added back")

    def snapshot(self) -> list[Kill]:
        with self._lock:
            return list(self.kills)


# --------------------------------------------------------------- the sampler


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
        self.routers: list[tuple[int | None, dict[str, int]]] = []  # per router incarnation
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.thread.start()

    def _run(self) -> None:
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while not self.stop.wait(SAMPLE_EVERY_S):
            self.sample()
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
            for kill in self.controller.snapshot():
                if (
                    kill.healthy_at is None
                    and kill.kind != "router"
                    and self.healthy.get(kill.target)
                    and _pid_of(status, kill.target) not in (0, *kill.pids)
                ):
                    kill.healthy_at = now
        pid = self.fleet.router_pid()
        if pid is not None:
            now = time.time()
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss / (1024 * 1024)
                self.samples.append(Sample(now, "router", pid, rss))
                for kill in self.controller.snapshot():
                    if kill.kind == "router" and kill.healthy_at is None and pid not in kill.pids:
                        kill.healthy_at = now

    def _router_counters(self, counters: dict[str, int]) -> None:
        """Keep the router's counters per incarnation (a restarted router counts from 0)."""
        pid = self.fleet.router_pid()
        if self.routers:
            last_pid, last = self.routers[-1]
            if pid == last_pid and counters.get("received", 0) >= last.get("received", 0):
                self.routers[-1] = (pid, counters)
                return
        self.routers.append((pid, counters))

    def router_totals(self) -> Counter[str]:
        totals: Counter[str] = Counter()
        for _, counters in self.routers:
            totals.update(counters)
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
        kinds = Counter(k.kind for k in self.controller.snapshot())
        healthy = ",".join(n for n in NODES if self.healthy.get(n)) or "-"
        return (
            f"{time.monotonic() - self.t0:5.0f} s: {sent} sent, {answered} answered, "
            f"{sent - answered} out | kills: node {kinds['node']}, router {kinds['router']}, "
            f"raylet {kinds['raylet']} | healthy {healthy}"
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
    # executions (node traces)
    trace_lines: int = 0
    trace_files: int = 0
    truncated_lines: int = 0
    unknown_ids: int = 0
    ran_once: int = 0
    ran_more: int = 0
    reran_after_kill: int = 0
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
    kills: list[Kill] = field(default_factory=list)
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
    def kill_kinds(self) -> Counter[str]:
        return Counter(k.kind for k in self.kills)

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
                "ids run more than once without a kill to explain it",
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
        """Every kind of kill happened at least once (a run too short or interrupted
        may miss one: then it proves less, but nothing it checked is wrong)."""
        return all(self.kill_kinds[kind] > 0 for kind in KINDS)

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
    f = figures
    sent = list(ledger.sent.values())
    f.sent = len(sent)
    f.by_api = Counter(s.api for s in sent)

    def example(text: str) -> None:
        if len(f.examples) < 12:
            f.examples.append(text)

    for s in sent:
        f.at_most_once_sent += s.at_most_once
        if not s.answers:
            f.no_answer += 1
            example(f"{s.id} ({s.api} {s.model} p={s.priority}): no answer")
            continue
        if len(s.answers) > 1:
            f.two_answers += 1
            example(f"{s.id}: {len(s.answers)} answers: {[a.what for a in s.answers]}")
        a = s.answers[0]
        f.at_most_once_lost += s.at_most_once and a.what == "NodeLost"
        if a.outcome == "ok":
            f.ok += 1
        elif a.outcome == "typed":
            f.typed[a.what] += 1
        else:
            f.untyped[a.what] += 1
            example(f"{s.id}: untyped {a.what}: {a.detail[:160]}")
        if s.api != "generate" and s.wrong:
            f.wrong_outputs += 1
            example(f"{s.id}: wrong outputs: {s.wrong}")
        f.after_end += s.after_end

    waits: dict[str, list[float]] = defaultdict(list)
    for s in sent:
        if s.answers:
            waits[s.api].append(s.answers[0].at - s.at)
    f.latency = {
        api: (percentile(w, 50), percentile(w, 99), max(w)) for api, w in waits.items() if w
    }

    # generations against the references
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
                example(f"{s.id} (generate, {a.what}): {problem}")
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
                example(f"{s.id} (generate, ended {a.what}): {problem}")

    # executions per id from the node traces
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
    killed: dict[int, float] = {}
    for kill in f.kills:
        for pid in kill.pids:
            killed.setdefault(pid, kill.at)
    for rid, ran in runs.items():
        if len(ran) == 1:
            f.ran_once += 1
            continue
        f.ran_more += 1
        f.reran_at_most_once += ledger.sent[rid].at_most_once
        answered = ledger.sent[rid].answered_at
        explained = True
        for first, then in itertools.pairwise(ran):
            died = killed.get(int(first["pid"]))
            if (
                died is None
                or died < float(first["t"]) - 0.5  # killed before it ran there: not this
                or float(then["t"]) < died  # ran again before the first node died
                or (answered is not None and answered < died)  # answered before the kill
            ):
                explained = False
        if explained:
            f.reran_after_kill += 1
        else:
            f.reran_unexplained += 1
            where = ", ".join(f"{r['node']}/{r['pid']}@{float(r['t']) - t_start:.2f}s" for r in ran)
            example(f"{rid}: ran {len(ran)} times without a kill to explain it: {where}")
    for s in sent:
        if not s.answers:
            continue
        a = s.answers[0]
        success = a.outcome == "ok" and (
            s.api != "generate" or a.what in ("stop", "length", "budget")
        )
        if success and s.id not in runs:
            if s.api == "generate" and a.node == "":
                f.success_by_caller += 1  # every token sent before its node died
            else:
                f.success_without_run += 1
                example(f"{s.id} ({s.api}): a success without an execution in the traces")
        elif success and a.node and a.node not in {line["node"] for line in runs[s.id]}:
            f.wrong_node += 1
            example(f"{s.id}: answered by {a.node}, which has no execution of it")
        elif not success and s.id in runs and a.outcome != "ok":
            f.ran_but_error += 1

    # memory of the long-lived processes
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
        f.memory.append(
            (
                role,
                pid,
                last.at - head.at,
                head.rss_mb,
                warm.rss_mb if warm is not None else math.nan,
                last.rss_mb,
                growth,
            )
        )


# --------------------------------------------------------------------- report


def render(f: Figures, facts: EnvFacts, started: str, argv: Sequence[str]) -> str:
    o = f.options
    command = "python -m bench.chaos" + (f" {' '.join(argv)}" if argv else "")
    verdict = "PASS" if f.passed else "FAIL"
    out = [
        "# edgefleet chaos soak",
        "",
        f"- Date: {started}; this report: `{command}`",
        f"- Machine: {facts.line()}",
        f"- Load: {f.seconds:.0f} s{' (interrupted by Ctrl-C)' if f.interrupted else ''}; "
        f"seed {o.seed}; a kill every {0.6 * o.kill_every_s:.1f}-{1.4 * o.kill_every_s:.1f} s "
        f"(none in the last {QUIET_END_S:g} s); never killed: "
        f"{', '.join(o.spare) or 'none'}",
        f"- Cluster: a Ray head and {len(NODES)} raylets on {LOOPBACK}, one edge node pinned "
        "to each raylet, the router on the head; GCS health checks every "
        f"{HEALTH_CHECKS['health_check_period_ms'] / 1000:g} s; router reports every "
        f"{REPORT_INTERVAL_S:g} s, a node lost after {LOST_AFTER_S:g} s",
        f"- Verdict: **{verdict}** (every invariant below holds)"
        if f.passed
        else f"- Verdict: **{verdict}**",
        f"- Kills: {len(f.kills)} ("
        + ", ".join(f"{kind} {f.kill_kinds[kind]}" for kind in KINDS)
        + (")" if f.covered else "; not every kind: the run was too short or cut short)"),
        "",
    ]
    if f.error:
        out += ["**The soak did not run to the end:**", "", "```", f.error, "```", ""]
    out += [
        "## Invariants",
        "",
        md_table(
            ["check", "value", "result"],
            [[what, value, "ok" if ok else "**FAIL**"] for what, value, ok in f.invariants()],
        ),
        "",
    ]
    typed = ", ".join(f"{k} {v}" for k, v in f.typed.most_common()) or "none"
    untyped = ", ".join(f"{k} {v}" for k, v in f.untyped.most_common()) or "none"
    apis = ", ".join(f"{k} {v}" for k, v in sorted(f.by_api.items()))
    out += [
        "## Requests and answers",
        "",
        md_table(
            ["figure", "value"],
            [
                ["requests sent", f"{f.sent} ({apis})"],
                ["answered exactly once", f.sent - f.no_answer - f.two_answers],
                ["without an answer", f.no_answer],
                ["with two or more answers", f.two_answers],
                ["answered with a result", f.ok],
                ["answered with a typed error", f"{sum(f.typed.values())} ({typed})"],
                ["answered with an untyped error", f"{sum(f.untyped.values())} ({untyped})"],
                ["inference results with wrong outputs", f.wrong_outputs],
                *(
                    [f"answer time p50 / p99 / max, {api} (s)", " / ".join(fmt(v, 3) for v in t)]
                    for api, t in sorted(f.latency.items())
                ),
                [
                    "lifecycle events (ok / typed / untyped)",
                    f"{f.control['ok']} / {f.control['typed']} / {f.control['untyped']}",
                ],
                [
                    "status calls (ok / typed / untyped)",
                    f"{f.status_calls['ok']} / {f.status_calls['typed']} / "
                    f"{f.status_calls['untyped']}",
                ],
            ],
        ),
        "",
        *(f"- {e}" for e in f.control_errors[:5]),
        *([""] if f.control_errors else []),
        "## Executions (node traces)",
        "",
        md_table(
            ["figure", "value"],
            [
                ["trace files (node processes)", f.trace_files],
                ["trace lines", f.trace_lines],
                ["lines cut short by a killed process", f.truncated_lines],
                ["lines of ids the harness never sent", f.unknown_ids],
                ["ids run to completion once", f.ran_once],
                ["ids run to completion more than once", f.ran_more],
                [
                    "... re-run after the node that ran them was killed before answering",
                    f.reran_after_kill,
                ],
                ["... re-run with no kill to explain it", f.reran_unexplained],
                [
                    "requests sent at_most_once / answered NodeLost ('may have run')",
                    f"{f.at_most_once_sent:,} / {f.at_most_once_lost:,}",
                ],
                ["at_most_once ids run more than once", f.reran_at_most_once],
                ["successes without an execution", f.success_without_run],
                ["successes naming a node that has no execution of them", f.wrong_node],
                [
                    "generations ended by the caller after their node died, every token sent",
                    f.success_by_caller,
                ],
                [
                    "ran on a node, yet answered with an error (its node died first)",
                    f.ran_but_error,
                ],
            ],
        ),
        "",
        "A request whose node dies after running it but before its answer leaves is run "
        "again elsewhere under the same id: the node that knew the answer is gone. That "
        "at-least-once execution on node death is inherent and counted above, not hidden; "
        "the caller still gets one answer.",
        "",
        "## Generations",
        "",
        md_table(
            ["figure", "value"],
            [
                ["generations answered", f.generations],
                [
                    "completed (stop / length / budget)",
                    f"{f.gen_completed['stop']} / {f.gen_completed['length']} / "
                    f"{f.gen_completed['budget']}",
                ],
                ["... tokens identical to the reference run (in order, each once)", f.gen_exact],
                ["... tokens duplicated, missing or wrong", f.gen_token_errors],
                ["cancelled by a node", f.gen_completed["cancelled"]],
                ["ended with a typed error", f.gen_typed],
                ["... tokens so far not a prefix of the reference", f.gen_partial_errors],
                ["tokens or errors after a stream's end", f.after_end],
            ],
        ),
        "",
        "## Kills",
        "",
    ]
    kinds = f.kill_kinds
    out += [
        f"{len(f.kills)} kills: node process {kinds['node']}, router {kinds['router']}, "
        f"raylet {kinds['raylet']}"
        + ("." if f.covered else " (**not every kind**: the run was too short or cut short)."),
        "",
    ]
    if f.kills:
        t0 = f.t_start
        rows = []
        for k in f.kills:
            back = f"{k.back_at - k.at:.1f}" if k.back_at else "-"
            healthy = f"{k.healthy_at - k.at:.1f}" if k.healthy_at else "-"
            rows.append(
                [
                    f"{k.at - t0:.1f}",
                    k.kind,
                    k.target,
                    " ".join(map(str, k.pids)) or "-",
                    back,
                    healthy,
                    k.note or "-",
                ]
            )
        out += [
            md_table(
                [
                    "at s",
                    "kind",
                    "target",
                    "pids",
                    "raylet back after s",
                    "serving again after s",
                    "note",
                ],
                rows,
            ),
            "",
        ]
    if f.controller_errors:
        out += ["Controller errors: " + "; ".join(f.controller_errors), ""]
    if f.fleet_counters:
        keys = ("received", "completed", "spilled", "replaced", "shed", "nodes_lost", "rejoined")
        shown = ", ".join(f"{k} {f.fleet_counters.get(k, 0)}" for k in keys)
        out += [
            f"Fleet counters (what callers handed to the router, and the router's own), added "
            f"up over the {f.routers} router processes seen: {shown}. Approximate: what a "
            "router held when it was killed, since the last sample, is not counted.",
            "",
        ]
    out += [
        "## Memory",
        "",
        f"Resident memory of the router and node processes, sampled every {SAMPLE_EVERY_S:g} s "
        f"while they answered; growth from the first sample after a warm-up of "
        f"{f.warmup_s:.0f} s to the last (shown for processes that lived at least 10 s "
        "past the warm-up). Every kill starts a new process.",
        "",
    ]
    if f.memory:
        out += [
            md_table(
                [
                    "process",
                    "pid",
                    "lived s",
                    "first MB",
                    "after warm-up MB",
                    "last MB",
                    "growth %",
                ],
                [
                    [
                        role,
                        pid,
                        fmt(lived, 0),
                        fmt(first, 1),
                        fmt(warm, 1),
                        fmt(last, 1),
                        "-" if growth is None else fmt(growth, 1, signed=True),
                    ]
                    for role, pid, lived, first, warm, last, growth in f.memory
                ],
            ),
            "",
            f"Largest growth after warm-up: {fmt(f.growth_pct, 1, signed=True)} %.",
            "",
        ]
    if f.memory_over_time:
        out += [
            "Over time (MB), for the processes that lived past the warm-up:",
            "",
            *(
                f"- {what}, every {step:.0f} s: {' '.join(f'{mb:.0f}' for mb in marks)}"
                for what, step, marks in f.memory_over_time
            ),
            "",
        ]
    out += [
        "## Leaks",
        "",
        "Actors (or processes of the fleet's actors) alive after the client closed: "
        f"{len(f.leaked)}" + (f" ({', '.join(f.leaked)})" if f.leaked else "") + ".",
        "",
    ]
    if f.still_running:
        out += [f"Load threads still running at the end: {', '.join(f.still_running)}.", ""]
    if f.not_serving:
        out += [f"Nodes not serving again at the end: {', '.join(f.not_serving)}.", ""]
    if f.examples:
        out += ["## Examples of failures", "", *(f"- {e}" for e in f.examples), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------ main


def soak(options: Options, argv: Sequence[str] = ()) -> tuple[Figures, str]:
    """Run the soak; its figures and the Markdown report."""
    started = utc_now()
    facts = EnvFacts.collect()
    figures = Figures(options)
    ledger = Ledger()
    stop = threading.Event()
    samples: list[Sample] = []
    t_start = t_end = time.time()
    with tempfile.TemporaryDirectory(prefix="edgefleet-chaos-") as tmp:
        root = Path(tmp)
        traces = root / "trace"
        log(f"chaos soak: {options.minutes:g} min, seed {options.seed}; {facts.line()}")
        t0 = time.perf_counter()
        paths = make_models(root)
        refs = make_references(paths, options.seed)
        log(f"models and references ready in {time.perf_counter() - t0:.1f} s")
        fleet = Fleet(root, traces)
        controller: Controller | None = None
        sampler: Sampler | None = None
        load: Load | None = None
        try:
            t0 = time.perf_counter()
            client = fleet.start()
            log(f"cluster and fleet up in {time.perf_counter() - t0:.1f} s")
            load = Load(client, refs, ledger, stop, options.seed)
            controller = Controller(fleet, options)
            stop_sampling = threading.Event()
            sampler = Sampler(fleet, ledger, controller, stop_sampling)
            t_start = time.time()
            figures.t_start = t_start
            began = time.monotonic()
            load.start()
            controller.start(began)
            sampler.start(began)
            try:
                while time.monotonic() < began + options.seconds:
                    controller.tick()
                    time.sleep(0.1)
            except KeyboardInterrupt:
                figures.interrupted = True
                log("interrupted: stopping the load, then reporting")
            stop.set()
            t_end = time.time()
            figures.seconds = t_end - t_start
            drain_until = time.monotonic() + DRAIN_S
            try:
                controller.finish()  # what is down comes back
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
            figures.control = Counter(load.control)
            figures.leaked = fleet.close()
        except BaseException as exc:
            stop.set()
            figures.error = f"{type(exc).__name__}: {exc}"
            log(f"the soak failed: {figures.error}")
            if not isinstance(exc, Exception | KeyboardInterrupt):
                raise
        finally:
            stop.set()
            fleet.shutdown()
        if controller is not None:
            figures.kills = controller.snapshot()
            figures.controller_errors = list(controller.errors)
        if sampler is not None:
            samples = list(sampler.samples)
            figures.fleet_counters = sampler.router_totals()
            figures.routers = len(sampler.routers)
            figures.status_calls = Counter(sampler.status_calls)
            figures.control_errors += sampler.status_errors
        if load is not None:
            figures.control = Counter(load.control)
            figures.control_errors += load.control_errors
            if load.failures and figures.error is None:
                figures.error = "\n".join(load.failures)
        analyse(figures, ledger, refs, traces, samples, t_start, t_end)
    report = render(figures, facts, started, argv)
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
