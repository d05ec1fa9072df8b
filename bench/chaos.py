"""Chaos soak: while nodes, the router and whole machines die or freeze and the head
restarts, every request ends with exactly one answer, in time.

    python -m bench.chaos --minutes N [--seed S] [--out FILE.md] [--kinds KIND ...]

Mixed load through :class:`FleetClient` (inference drawn from a ``sim.workload`` mix at
every priority, chats, background generations, lifecycle events) on the cluster of
bench/chaos_cluster.py while its controller kills and freezes parts of it. The report
checks each request's answers (exactly one, typed when an error, within
max(deadline_s, timeout_s) + ANSWER_SLACK_S), executions per id in the node traces,
outputs against references, memory and leaks. Exit status 1 when an invariant fails.
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
from collections import ChainMap, Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import astuple, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from actors.decoder import DecoderEngine, Generation
from actors.engine import open_session
from actors.trace import read_traces
from bench import chaos_cluster as cc
from bench import common as bc
from bench.chaos_cluster import CONTROL_TIMEOUT_S, KINDS, LM, NODES, Controller, Event, Fleet
from bench.common import EnvFacts, Section, Target, fmt, log, md_table, percentile
from cluster.client import FleetClient
from cluster.head import LOOPBACK
from edgefleet.errors import EdgeFleetError
from edgefleet.messages import Reply
from edgefleet.modelgen import calibrate_slow, make_classifier, make_tiny_lm, random_inputs
from edgefleet.request import GenerateRequest
from sim.workload import Arrival, Workload, parse_workload

TITLE = (
    "Chaos soak: exactly one answer, in time, while nodes, the router and raylets die or "
    "freeze and the head restarts"
)
SLOW_MS = 4.0  # batch-1 cost the slow model is calibrated to
FEEDS = 8  # distinct inputs per tensor model, each with a reference output
SYSTEM = tuple(range(1, 17))  # the system prompt every generation starts with
CHAT_THREADS, CHAT_TURNS, CHAT_TOKENS = 3, 3, 16
SUMMARIES, SUMMARY_TOKENS = 4, 40
PRIORITIES = ("foreground", "inline", "background", "offline", 5, 1)
SUBMIT_RATE = 25.0  # submitted requests per second, plus bursts...
BURST, BURST_EVERY_S = 24, 4.0  # ...of about this many every BURST_EVERY_S
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
    kill_every: float = 12.0  # mean interval between chaos events
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
    out = "also write the report here (into a report like bench/RESULTS.md: its section)"
    p.add_argument("--out", type=Path, metavar="FILE", help=out)
    p.add_argument("--answers", type=Path, metavar="FILE", help="every request, a JSON line each")
    every = "mean s between events"
    p.add_argument("--kill-every", type=float, default=12.0, metavar="S", help=every)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, metavar="KIND")
    p.add_argument("--spare", nargs="*", default=["edge-0"], choices=NODES, metavar="NODE")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.kill_every <= 0:
        raise SystemExit("--minutes and --kill-every must be > 0")
    if set(args.spare) >= set(NODES):
        raise SystemExit("--spare: at least one node must be left to hit")
    kinds = tuple(k for k in KINDS if k in args.kinds)
    return Options(**vars(args) | {"kinds": kinds, "spare": tuple(args.spare)})


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
        return {
            "priority": self.priority,
            "request_id": self.id,
            "timeout_s": self.timeout_s,
            "deadline_s": self.deadline_s,
            "at_most_once": self.at_most_once,
        }

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
                line = {"id": s.id, "api": s.api, "at": round(s.at - t0, 3)}
                line |= {"timeout_s": round(s.timeout_s, 3), "deadline_s": s.deadline_s}
                answers = [[round(a.at - t0, 3), *astuple(a)[1:]] for a in s.answers]
                out.write(json.dumps(line | {"at_most_once": s.at_most_once, "answers": answers}))
                out.write("\n")


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

    def user(rng: random.Random, tokens: int) -> tuple[int, ...]:
        return tuple(rng.randrange(*PROMPT_RANGE) for _ in range(tokens))

    rng = random.Random(seed)
    chats: dict[tuple[int, int], tuple[tuple[int, ...], list[int]]] = {}
    for t in range(CHAT_THREADS):
        history = SYSTEM
        for k in range(CHAT_TURNS):
            prompt = history + user(rng, 6 + 2 * k)
            chats[(t, k)] = (prompt, greedy(prompt, CHAT_TOKENS))
            history = prompt + tuple(chats[(t, k)][1])
    prompts = [SYSTEM + user(rng, 24) for _ in range(SUMMARIES)]
    summaries = [(prompt, greedy(prompt, SUMMARY_TOKENS)) for prompt in prompts]
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


def inference_workload() -> Workload:
    """The inference traffic: classifier 70 %, slow 30 %, at every priority alike, half
    of it at_most_once; deadlines on background and priority 1, a dedup key (of two) on
    a third of inline; Poisson at SUBMIT_RATE, with bursts of about BURST requests."""
    mix = []
    models = (("classifier", 0.7), ("slow", 0.3))
    for (model, share), priority, once in itertools.product(models, PRIORITIES, (False, True)):
        variants: list[dict[str, Any]] = [{}]
        if priority in ("background", 1):
            variants = [{"deadline_ms": ms} for ms in (50, 300, 1000)]
        elif priority == "inline":
            variants = [{}, {}, {"keys": 2}]
        for v in variants:
            weight = share / len(variants)
            mix.append(
                {"model": model, "priority": priority, "at_most_once": once, "weight": weight} | v
            )
    bursts = {"every_s": BURST_EVERY_S, "length_s": 0.25, "factor": 1 + BURST / 0.25 / SUBMIT_RATE}
    arrivals = {"process": "bursts", "rate": SUBMIT_RATE, "bursts": bursts}
    return parse_workload({"duration_s": 1e6, "arrivals": arrivals, "mix": mix}, source="chaos")


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
    """The mixed load through the client, on threads that end when ``stop`` is set."""

    def __init__(self, refs: References, ledger: Ledger, seed: int) -> None:
        self.refs, self.ledger, self.seed = refs, ledger, seed
        self.stop = threading.Event()
        self.control: Counter[str] = Counter()  # lifecycle events: ok / typed / untyped
        self.control_errors: list[str] = []
        self.failures: list[str] = []  # load threads that raised (a harness bug)
        self.threads: list[threading.Thread] = []

    def start(self, client: FleetClient) -> None:
        self.client = client
        workers: list[tuple[str, Callable[[random.Random], None]]] = [
            ("submit", self._submitter),
            *((f"infer-{i}", self._caller) for i in range(2)),
            *((f"chat-{t}", partial(self._chat, t)) for t in range(CHAT_THREADS)),
            ("summaries", self._summaries),
            ("lifecycle", self._lifecycle),
        ]
        for i, (name, work) in enumerate(workers):
            rng = random.Random(f"{self.seed}/{i}")
            args = (name, work, rng)
            t = threading.Thread(target=self._guard, args=args, name=f"load-{name}", daemon=True)
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

    def _arrivals(self, rng: random.Random) -> Iterator[Arrival]:
        priorities = self.client.config.priorities
        return inference_workload().arrivals(rng, nodes=len(NODES), priorities=priorities)

    def _submitter(self, rng: random.Random) -> None:
        """The arrivals, each submitted at its time."""
        began = time.monotonic()
        for a in self._arrivals(rng):
            if self.stop.wait(max(0.0, began + a.at - time.monotonic())):
                return
            self._infer(a, rng, wait=False)

    def _caller(self, rng: random.Random) -> None:
        """The arrivals one after the other, each waited for (infer)."""
        for a in self._arrivals(rng):
            if self.stop.wait(rng.uniform(0.005, 0.03)):
                return
            self._infer(a, rng, wait=True)

    def _infer(self, a: Arrival, rng: random.Random, *, wait: bool) -> None:
        i, api = rng.randrange(FEEDS), "infer" if wait else "submit"
        kw = {
            "at_most_once": a.at_most_once,
            "timeout_s": _timeout(rng),
            "deadline_s": a.deadline_s,
        }
        sent = self.ledger.new(api, a.model, a.priority, (a.model, i), **kw)
        feed = self.refs.feeds[a.model][i]
        try:
            if wait:
                outputs = self.client.infer(a.model, feed, key=a.key, **sent.kw())
                self._replied(sent, Reply(sent.id, "", outputs))
            else:
                future = self.client.submit(a.model, feed, key=a.key, **sent.kw())
                future.add_done_callback(partial(self._replied, sent))
        except Exception as exc:
            self.ledger.answer(sent, _failed(exc))

    def _replied(self, sent: Sent, reply: Reply | Future[Reply]) -> None:
        try:
            reply = reply if isinstance(reply, Reply) else reply.result()
        except BaseException as exc:  # a future of the public API must never fail
            self.ledger.answer(
                sent, Answer(time.time(), "untyped", type(exc).__name__, "", str(exc))
            )
            return
        if reply.error is not None:
            outcome, what = _typed(reply.error)
            answer = Answer(time.time(), outcome, what, reply.node, str(reply.error)[:200])
            self.ledger.answer(sent, answer)
            return
        model, i = sent.ref
        sent.wrong = same_outputs(reply.outputs or {}, self.refs.outputs[model][i])
        if reply.request_id != sent.id:
            sent.wrong = f"answer for request {reply.request_id}"
        self.ledger.answer(sent, Answer(time.time(), "ok", "completed", reply.node))

    def _generate(
        self, sent: Sent, prompt: tuple[int, ...], session: str | None = None
    ) -> str | None:
        """Stream one generation; its finish reason, or None when it ended in an error."""
        try:
            n, prefix = sent.max_new_tokens, len(SYSTEM)
            stream = self.client.generate(
                LM, prompt, max_new_tokens=n, prefix_len=prefix, session=session, **sent.kw()
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
            j, priority = rng.randrange(SUMMARIES), rng.choice(("background", "offline", 2))
            once, timeout_s = rng.random() < AT_MOST_ONCE_SHARE, _timeout(rng)
            deadline_s = rng.uniform(0.05, 1.0) if rng.random() < 0.25 else None
            kw = {"at_most_once": once, "timeout_s": timeout_s, "deadline_s": deadline_s}
            sent = self.ledger.new(
                "generate", LM, priority, ("summary", j), max_new_tokens=SUMMARY_TOKENS, **kw
            )
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


# --------------------------------------------------------------------- the watcher


class Watcher:
    """Two threads until ``stop``: every LOSS_POLL_S, the windows in which the caller held
    each node out of service (they explain re-runs: :func:`_rerun_cause`); every
    SAMPLE_EVERY_S, the fleet's status (healthy nodes, their memory, the router's
    counters) and the router process's memory, and a progress line now and then."""

    def __init__(self, fleet: Fleet, ledger: Ledger, controller: Controller) -> None:
        self.fleet, self.ledger, self.controller = fleet, ledger, controller
        self.stop = threading.Event()
        self.windows: dict[str, list[list[float]]] = defaultdict(list)  # [from, to]
        self.samples: list[Sample] = []
        self.healthy: dict[str, bool] = {}
        self.status_calls: Counter[str] = Counter()  # ok / typed / untyped
        self.status_errors: list[str] = []  # untyped ones
        self.errors: list[str] = []  # the watcher's own failures
        self.routers: dict[int, dict[str, int]] = {}  # by router process: its last counters
        self.threads = [threading.Thread(target=t, daemon=True) for t in (self._poll, self._run)]

    def start(self, client: FleetClient) -> None:
        self.client, self.t0 = client, time.monotonic()
        for t in self.threads:
            t.start()

    def _poll(self) -> None:
        while not self.stop.wait(LOSS_POLL_S):
            now = time.time()
            for name, healthy in self.client._dispatcher.healthy().items():
                held = self.windows[name]
                out = bool(held) and held[-1][1] == math.inf
                if not healthy and not out:
                    held.append([now - LOSS_POLL_S, math.inf])
                elif healthy and out:
                    held[-1][1] = now

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
        """The fleet's status (its counters, healthy nodes, their memory), the router's
        memory (a new router process counts from 0: its counters are kept apart)."""
        if self.fleet.client is None:
            return
        pid = self.fleet.router_pid()
        try:
            status = self.fleet.client.status(timeout_s=CONTROL_TIMEOUT_S)
        except Exception as exc:  # the router restarting: next time
            _count_failure(self.status_calls, self.status_errors, "status", exc)
        else:
            self.status_calls["ok"] += 1
            self.routers.update({pid: dict(status.router)} if pid is not None else {})
            self.healthy = dict(status.healthy)
            self.samples += [
                Sample(time.time(), node.name, node.pid, node.rss_mb)
                for node in status.nodes
                if status.healthy.get(node.name) and node.pid
            ]
        with contextlib.suppress(psutil.Error):
            if pid is not None:
                rss = psutil.Process(pid).memory_info().rss / (1024 * 1024)
                self.samples.append(Sample(time.time(), "router", pid, rss))

    def losses(self) -> dict[str, list[tuple[float, float]]]:
        return {n: [(a, b) for a, b in w] for n, w in self.windows.items()}

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

# The report's checks and tables, a row a line: "what | count" (the value of
# Figures.n[count], or of the report's own figures), checks holding when it is 0.
INVARIANTS = """\
requests without an answer | no_answer
requests with two or more answers | two_answers
untyped errors (requests) | untyped_requests
requests answered later than max(deadline_s, timeout_s) + {slack:g} s | late
untyped errors (lifecycle events and status calls) | untyped_control
inference answers with wrong outputs | wrong_outputs
completed generations with duplicated, missing or wrong tokens | gen_token_errors
other generations whose tokens are not a prefix of the reference | gen_partial_errors
tokens or errors delivered after a stream's end | after_end
successes without an execution in the traces | success_without_run
successes naming a node that has no execution of them | wrong_node
ids run more than once with no kill, freeze or loss to explain it | reran_unexplained
at_most_once ids run more than once | reran_at_most_once
actors (or their processes) alive after the client closed | leaked
load threads that never ended | still_running
nodes not serving again {recover:g} s after the load | not_serving"""
REQUESTS = """\
requests sent | sent_by_api
answered exactly once | answered_once
without an answer | no_answer
with two or more answers | two_answers
answered with a result | ok
answered with a typed error | typed_errors
answered with an untyped error | untyped_errors
inference results with wrong outputs | wrong_outputs
{latency}worst answer time minus {limit} (s) | worst_late
answered more than {slack:g} s after {limit} (of them TimedOut) | late_timed_out
lifecycle events (ok / typed / untyped) | lifecycle_events
status calls (ok / typed / untyped) | status_calls"""
EXECUTIONS = """\
trace files (node processes) | trace_files
trace lines | trace_lines
lines cut short by a killed process | truncated_lines
lines of ids the harness never sent | unknown_ids
ids run to completion once | ran_once
ids run to completion more than once | ran_more
... re-run after the node that ran them was killed before answering | reran_after_kill
... re-run elsewhere while the node holding them was frozen | reran_after_freeze
... re-run elsewhere after the node holding them did not answer the caller's probe | \
reran_after_loss
... re-run with no kill, freeze or loss to explain it | reran_unexplained
requests sent at_most_once / answered NodeLost ('may have run') | at_most_once
at_most_once ids run more than once | reran_at_most_once
successes without an execution | success_without_run
successes naming a node that has no execution of them | wrong_node
generations ended by the caller after their node died, every token sent | success_by_caller
ran on a node, yet answered with an error (its node died first) | ran_but_error"""
GENERATIONS = """\
generations answered | generations
completed (stop / length / budget) | completed
... tokens identical to the reference run (in order, each once) | gen_exact
... tokens duplicated, missing or wrong | gen_token_errors
cancelled by a node | cancelled
ended with a typed error | gen_typed
... tokens so far not a prefix of the reference | gen_partial_errors
tokens or errors after a stream's end | after_end"""
TEXT = {"slack": ANSWER_SLACK_S, "recover": RECOVER_S, "limit": "max(deadline_s, timeout_s)"}


def rows(spec: str, values: Mapping[str, Any], **text: object) -> list[tuple[str, Any]]:
    """The rows of a table ``spec`` (see INVARIANTS), each with its value."""
    lines = spec.format(**TEXT, **text).splitlines()
    return [(what, values[key]) for what, key in (line.rsplit(" | ", 1) for line in lines)]


@dataclass
class Figures:
    """What the soak found: counts by name (``figures.late`` reads ``figures.n["late"]``;
    every count is of requests unless its name says otherwise) and the rest."""

    options: Options
    n: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0  # of load
    t_start: float = 0.0  # unix time the load started
    interrupted: bool = False
    by_api: Counter[str] = field(default_factory=Counter)
    typed: Counter[str] = field(default_factory=Counter)
    untyped: Counter[str] = field(default_factory=Counter)
    gen_completed: Counter[str] = field(default_factory=Counter)  # finish reason
    control: Counter[str] = field(default_factory=Counter)  # lifecycle events
    status_calls: Counter[str] = field(default_factory=Counter)
    worst_late_s: float = -math.inf  # the largest answer time minus max(deadline_s, timeout_s)
    latency: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # p50 p99 max
    events: list[Event] = field(default_factory=list)
    losses: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    fleet_counters: Counter[str] = field(default_factory=Counter)  # over router restarts
    routers: int = 0  # router incarnations seen
    # role, pid, lived s, first MB, warm MB, last MB, growth % after warm-up
    memory: list[tuple[str, int, float, float, float, float, float | None]] = field(
        default_factory=list
    )
    warmup_s: float = 0.0
    memory_over_time: list[tuple[str, float, list[float]]] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    still_running: list[str] = field(default_factory=list)  # load threads that never ended
    not_serving: list[str] = field(default_factory=list)  # nodes not back by the end
    controller_errors: list[str] = field(default_factory=list)
    control_errors: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    error: str | None = None  # the soak could not run to the end

    def __getattr__(self, name: str) -> int:
        if name.startswith("_") or name == "n":
            raise AttributeError(name)
        return self.n[name]

    @property
    def event_kinds(self) -> Counter[str]:
        return Counter(e.kind for e in self.events)

    def invariants(self) -> list[tuple[str, int, bool]]:
        """(what, value, holds) for every check the soak makes: each holds at 0."""
        n = Counter({k: len(getattr(self, k)) for k in ("leaked", "still_running", "not_serving")})
        n.update(self.n, untyped_requests=sum(self.untyped.values()))
        n["untyped_control"] = self.control["untyped"] + self.status_calls["untyped"]
        return [(what, v, v == 0) for what, v in rows(INVARIANTS, n)]

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
    f.n["sent"], f.by_api = len(sent), Counter(s.api for s in sent)
    _answers(f, sent)
    _generations(f, sent, refs)
    _executions(f, ledger, traces, t_start)
    _memory(f, samples, t_start, t_end)
    for e in f.events:  # when its target served again (the head: the router answering)
        since = e.back_at if e.kind == "head" else e.at
        served = (x.at for x in samples if since is not None and x.at >= since and _serves(e, x))
        e.healthy_at = next(served, None)


def _serves(e: Event, x: Sample) -> bool:
    """Whether sample ``x`` shows the target of ``e`` serving: a node in a new process,
    or after a freeze's SIGCONT; the router in a new process; any node after a head
    restart (the router answered a status call)."""
    if e.kind == "head":
        return x.role != "router"
    thawed = e.freeze and e.back_at is not None and x.at >= e.back_at
    return x.role == e.target and (x.pid not in e.pids or thawed)


def _answers(f: Figures, sent: Sequence[Sent]) -> None:
    """Exactly one answer each, typed when an error, with the right outputs, in time."""
    waits: dict[str, list[float]] = defaultdict(list)
    n = f.n
    for s in sent:
        n["at_most_once_sent"] += s.at_most_once
        n["after_end"] += s.after_end
        if not s.answers:
            n["no_answer"] += 1
            f.example(f"{s.id} ({s.api} {s.model} p={s.priority}): no answer")
            continue
        if len(s.answers) > 1:
            n["two_answers"] += 1
            f.example(f"{s.id}: {len(s.answers)} answers: {[a.what for a in s.answers]}")
        a = s.answers[0]
        n["at_most_once_lost"] += s.at_most_once and a.what == "NodeLost"
        n["ok"] += a.outcome == "ok"
        if a.outcome != "ok":
            (f.typed if a.outcome == "typed" else f.untyped)[a.what] += 1
        if a.outcome == "untyped":
            f.example(f"{s.id}: untyped {a.what}: {a.detail[:160]}")
        if s.api != "generate" and s.wrong:
            n["wrong_outputs"] += 1
            f.example(f"{s.id}: wrong outputs: {s.wrong}")
        took = a.at - s.at
        waits[s.api].append(took)
        f.worst_late_s = max(f.worst_late_s, took - s.limit_s)
        if took - s.limit_s > ANSWER_SLACK_S:
            n["late"] += 1
            n["timed_out_late"] += a.what == "TimedOut"
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
        f.n["generations"] += 1
        a = s.answers[0]
        expected = refs.expected(s)[: s.max_new_tokens]
        if a.outcome == "ok":
            f.gen_completed[a.what] += 1  # a finish reason, or cancelled
        if a.outcome == "ok" and a.what in FINISHED:
            problem = token_problem(s.tokens, expected, full=a.what == "length") or s.wrong
            f.n["gen_token_errors" if problem else "gen_exact"] += 1
            if problem:
                f.example(f"{s.id} (generate, {a.what}): {problem}")
            continue
        f.n["gen_typed"] += a.outcome != "ok"
        if problem := token_problem(s.tokens, expected, full=False):
            f.n["gen_partial_errors"] += 1
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
    n = f.n
    lines, n["truncated_lines"] = read_traces(traces)
    n["trace_lines"], n["trace_files"] = len(lines), len(list(traces.glob("trace-*.jsonl")))
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        rid = str(line.get("id"))
        if rid not in ledger.sent:
            n["unknown_ids"] += 1
        elif line.get("ran"):
            runs[rid].append(line)
    for rid, ran in runs.items():
        n["ran_more" if len(ran) > 1 else "ran_once"] += 1
        if len(ran) == 1:
            continue
        s = ledger.sent[rid]
        n["reran_at_most_once"] += s.at_most_once
        cause = _rerun_cause(ran, s, f.events, f.losses)
        n[f"reran_after_{cause}" if cause else "reran_unexplained"] += 1
        if not cause:
            where = ", ".join(f"{r['node']}/{r['pid']}@{float(r['t']) - t_start:.2f}s" for r in ran)
            f.example(f"{rid}: ran {len(ran)} times with nothing to explain it: {where}")
    for s in ledger.sent.values():
        if not s.answers:
            continue
        a = s.answers[0]
        success = a.outcome == "ok" and (s.api != "generate" or a.what in FINISHED)
        if success and s.id not in runs:
            if s.api == "generate" and a.node == "":
                n["success_by_caller"] += 1  # every token sent before its node died
            else:
                n["success_without_run"] += 1
                f.example(f"{s.id} ({s.api}): a success without an execution in the traces")
        elif success and a.node and a.node not in {line["node"] for line in runs[s.id]}:
            n["wrong_node"] += 1
            f.example(f"{s.id}: answered by {a.node}, which has no execution of it")
        elif not success and s.id in runs and a.outcome != "ok":
            n["ran_but_error"] += 1


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


def _load_and_chaos(
    f: Figures, fleet: Fleet, load: Load, controller: Controller, watcher: Watcher
) -> float:
    """Start the fleet, run the load and the chaos, wait for the answers still out and
    for every node to serve again, close the client; the unix time the load stopped."""
    t0 = time.perf_counter()
    client = fleet.start()
    log(f"cluster and fleet up in {time.perf_counter() - t0:.1f} s")
    f.t_start, began = time.time(), time.monotonic()
    load.start(client)
    controller.start(began, f.options.minutes * 60, f.options.kill_every)
    watcher.start(client)
    next_freeze = began
    try:
        while time.monotonic() < began + f.options.minutes * 60:
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
    load.stop.set()
    t_end = time.time()
    f.seconds = t_end - f.t_start
    drain_until = time.monotonic() + DRAIN_S
    try:
        controller.finish()  # what is down or frozen comes back
        f.still_running = load.join(drain_until)
        while load.ledger.outstanding() and time.monotonic() < drain_until:
            time.sleep(0.2)
        log(f"load stopped; {load.ledger.outstanding()} answers still out")
        f.not_serving = watcher.wait_healthy(time.monotonic() + RECOVER_S)
    except KeyboardInterrupt:
        f.interrupted = True
    watcher.stop.set()
    for t in watcher.threads:
        t.join(SAMPLE_EVERY_S + CONTROL_TIMEOUT_S)
    watcher.sample()  # the last counters of the router
    f.leaked = fleet.close()
    return t_end


def soak(options: Options, argv: Sequence[str] = ()) -> tuple[Figures, Section]:
    """Run the soak; its figures and its report."""
    started, facts, t0 = bc.utc_now(), EnvFacts.collect(), time.perf_counter()
    if "head" in options.kinds and shutil.which("redis-server") is None:
        log("no redis-server: head restarts are left out (Debian: apt-get install redis-server)")
        options = replace(options, kinds=tuple(k for k in options.kinds if k != "head"))
    f, ledger, t_end = Figures(options), Ledger(), time.time()
    with tempfile.TemporaryDirectory(prefix="edgefleet-chaos-") as tmp:
        root = Path(tmp)
        log(f"chaos soak: {options.minutes:g} min, seed {options.seed}; {facts.line()}")
        refs = make_references(make_models(root), options.seed)
        fleet = Fleet(root, root / "trace", redis="head" in options.kinds, spare=options.spare)
        controller = Controller(fleet, options.kinds, options.spare, options.seed)
        load, watcher = Load(refs, ledger, options.seed), Watcher(fleet, ledger, controller)
        try:
            t_end = _load_and_chaos(f, fleet, load, controller, watcher)
        except BaseException as exc:
            f.error = f"{type(exc).__name__}: {exc}"
            log(f"the soak failed: {f.error}")
            if not isinstance(exc, Exception | KeyboardInterrupt):
                raise
        finally:
            load.stop.set()
            fleet.shutdown()
            gc.unfreeze()
        f.events, f.losses = controller.snapshot(), watcher.losses()
        f.fleet_counters, f.routers = watcher.router_totals(), len(watcher.routers)
        f.control, f.status_calls = Counter(load.control), Counter(watcher.status_calls)
        f.controller_errors = controller.errors + watcher.errors
        f.control_errors = watcher.status_errors + load.control_errors
        if load.failures and f.error is None:
            f.error = "\n".join(load.failures)
        if options.answers is not None:
            ledger.write(options.answers, f.t_start)
        analyse(f, ledger, refs, root / "trace", watcher.samples, f.t_start or t_end, t_end)
    section = report(f, facts, started, argv)
    section.seconds = time.perf_counter() - t0
    return f, section


def run(argv: Sequence[str] | None = None) -> Figures:
    """Parse ``argv``, soak, print the report and write it into ``--out``; the figures."""
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse_options(args)
    started = bc.utc_now()
    figures, section = soak(options, args)
    print(section.markdown(), flush=True)
    if options.out is not None:
        shown = f"`python -m bench.chaos {' '.join(args)}`, {started}, {section.seconds:.0f} s"
        bc.write_report(options.out, [section], shown)
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
CALLERS, ROUTER = (
    ("received", "completed", "spilled", "replaced", "shed"),
    ("nodes_lost", "rejoined"),
)
RERUNS = (
    "A request whose node dies after running it but before its answer leaves is run again "
    "elsewhere under the same id; one held by a node that does not answer its caller's "
    "probe in time (frozen, or starved of CPU) is placed again elsewhere, and that node "
    "may still run it once it runs again. Both are the documented at-least-once execution "
    "of requests not sent at_most_once; the caller still gets one answer. A loss is when "
    "the caller held the node out of service (its view, polled every 50 ms)."
)
BACK = (
    "Back after: a killed raylet or head started again, a frozen process sent SIGCONT. "
    "Serving again: the node answering in a new process, or after its SIGCONT; the "
    "router answering a status call."
)
COUNTERS = (
    "Fleet counters over the {routers} router processes seen: {shown}; {more}. The caller's "
    "(received ... shed) are the largest a router process held; the router's own "
    "(nodes_lost ... restarted) are added up over its processes (what a router counted "
    "after the last sample before it was killed is not counted)."
)


def _part(title: str, *blocks: str) -> str:
    """A ``###`` part of the report: its title and its blocks (tables, paragraphs)."""
    return "\n\n".join([f"### {title}", *(b for b in blocks if b)])


def _table(spec: str, values: Mapping[str, Any], **text: object) -> str:
    return md_table(["figure", "value"], [list(r) for r in rows(spec, values, **text)])


def _listed(c: Counter[str]) -> str:
    return f"{sum(c.values())} ({', '.join(f'{k} {v}' for k, v in c.most_common()) or 'none'})"


def _outcomes(c: Counter[str]) -> str:
    return " / ".join(str(c[k]) for k in ("ok", "typed", "untyped"))


def report(f: Figures, facts: EnvFacts, started: str, argv: Sequence[str]) -> Section:
    """The report: the run, the invariants, requests, executions, generations, the chaos
    events, memory and leaks; its one target: every invariant holds."""
    checks = [[what, value, "ok" if ok else "**FAIL**"] for what, value, ok in f.invariants()]
    latency = "".join(
        f"answer time p50 / p99 / max, {api} (s) | latency_{api}\n" for api in sorted(f.latency)
    )
    apis = f.by_api.items()
    values: ChainMap[str, Any] = ChainMap(
        {
            "sent_by_api": f"{f.sent} ({', '.join(f'{k} {v}' for k, v in sorted(apis))})",
            "answered_once": f.sent - f.no_answer - f.two_answers,
            "typed_errors": _listed(f.typed),
            "untyped_errors": _listed(f.untyped),
            "worst_late": f"{f.worst_late_s:+.3f}",
            "late_timed_out": f"{f.late} ({f.timed_out_late})",
            "lifecycle_events": _outcomes(f.control),
            "status_calls": _outcomes(f.status_calls),
            "at_most_once": f"{f.at_most_once_sent:,} / {f.at_most_once_lost:,}",
            "completed": " / ".join(str(f.gen_completed[k]) for k in FINISHED),
            "cancelled": f.gen_completed["cancelled"],
            **{f"latency_{a}": " / ".join(fmt(v, 3) for v in t) for a, t in f.latency.items()},
        },
        f.n,
    )
    errors = "\n".join(f"- {e}" for e in f.control_errors[:5])
    parts = [
        _part("Invariants", md_table(["check", "value", "result"], checks)),
        _part("Requests and answers", _table(REQUESTS, values, latency=latency), errors),
        _part("Executions (node traces)", _table(EXECUTIONS, values), RERUNS),
        _part("Generations", _table(GENERATIONS, values)),
        _md_events(f),
        _md_memory(f),
        _md_leaks(f),
    ]
    failed = sum(not ok for _, _, ok in f.invariants())
    target = Target("invariants that do not hold", failed, "<=", 0, 0)
    header = "\n".join(_md_header(f, facts, started, argv))
    return Section(TITLE, header, tables=parts, targets=[target], error=f.error)


def _md_counts(f: Figures) -> str:
    return ", ".join(f"{EVENT_NAMES[k]} {f.event_kinds[k]}" for k in f.options.kinds)


def _md_header(f: Figures, facts: EnvFacts, started: str, argv: Sequence[str]) -> list[str]:
    o = f.options
    period_s = int(cc.HEALTH_CHECKS["RAY_health_check_period_ms"]) / 1000
    home = f"{o.spare[0]}'s raylet" if o.spare else "a raylet of its own"
    verdict = "**PASS** (every invariant below holds)" if f.passed else "**FAIL**"
    short = ")" if f.covered else "; not every kind: the run was too short or cut short)"
    return [
        f"- Date: {started}; this report: `python -m bench.chaos{''.join(' ' + a for a in argv)}`",
        f"- Machine: {facts.line()}",
        f"- Load: {f.seconds:.0f} s{' (interrupted by Ctrl-C)' if f.interrupted else ''}; "
        f"seed {o.seed}; a chaos event every {0.6 * o.kill_every:.1f}-"
        f"{1.4 * o.kill_every:.1f} s (none in the last {cc.QUIET_END_S:g} s); never hit: "
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
    ]


def _md_events(f: Figures) -> str:
    short = "." if f.covered else " (**not every kind**: the run was too short or cut short)."

    def after(t: float | None, e: Event) -> str:
        return f"{t - e.at:.1f}" if t else "-"

    table = md_table(
        ["at s", "kind", "target", "pids", "back after s", "serving again after s", "note"],
        [
            [f"{e.at - f.t_start:.1f}", e.kind, e.target, " ".join(map(str, e.pids)) or "-"]
            + [after(e.back_at, e), after(e.healthy_at, e), e.note or "-"]
            for e in f.events
        ],
    )
    counts = [
        ", ".join(f"{k} {f.fleet_counters.get(k, 0)}" for k in keys)
        for keys in (CALLERS + ROUTER, ("unresponsive", "restarted"))
    ]
    harness = "; ".join(f.controller_errors)
    return _part(
        "Kills, freezes and head restarts",
        f"{len(f.events)} chaos events: {_md_counts(f)}{short}",
        f"{table}\n\n{BACK}" if f.events else "",
        f"Harness errors (the controller's, the sampler's): {harness}" if harness else "",
        COUNTERS.format(routers=f.routers, shown=counts[0], more=counts[1])
        if f.fleet_counters
        else "",
    )


def _md_memory(f: Figures) -> str:
    text = (
        f"Resident memory of the router and node processes, sampled every {SAMPLE_EVERY_S:g} s "
        f"while they answered; growth from the first sample after a warm-up of "
        f"{f.warmup_s:.0f} s to the last (for processes that lived at least 10 s past the "
        "warm-up). Every kill starts a new process."
    )
    table = md_table(
        ["process", "pid", "lived s", "first MB", "after warm-up MB", "last MB", "growth %"],
        [
            [role, pid, fmt(lived, 0), fmt(first), fmt(warm), fmt(last)]
            + ["-" if growth is None else fmt(growth, 1, signed=True)]
            for role, pid, lived, first, warm, last, growth in f.memory
        ],
    )
    growths = [m[6] for m in f.memory if m[6] is not None]
    largest = fmt(max(growths) if growths else math.nan, 1, signed=True)
    over_time = [
        f"- {what}, every {step:.0f} s: {' '.join(f'{mb:.0f}' for mb in marks)}"
        for what, step, marks in f.memory_over_time
    ]
    return _part(
        "Memory",
        text,
        f"{table}\n\nLargest growth after warm-up: {largest} %." if f.memory else "",
        "Over time (MB), for the processes that lived past the warm-up:" if over_time else "",
        "\n".join(over_time),
    )


def _md_leaks(f: Figures) -> str:
    leaked = f"{len(f.leaked)}" + (f" ({', '.join(f.leaked)})" if f.leaked else "")
    running, down = ", ".join(f.still_running), ", ".join(f.not_serving)
    examples = "\n".join(f"- {e}" for e in f.examples)
    return _part(
        "Leaks",
        f"Actors (or processes of the fleet's actors) alive after the client closed: {leaked}.",
        f"Load threads still running at the end: {running}." if running else "",
        f"Nodes not serving again at the end: {down}." if down else "",
        _part("Examples of failures", examples) if examples else "",
    )


if __name__ == "__main__":
    raise SystemExit(main())
