"""`edgefleet demo`: a mixed workload on the embedded default fleet, with a report.

Four streams share the fleet: foreground classifications and offline work on a model
that cannot batch (Poisson arrivals), camera frames with a deadline and a dedup key (a
periodic stream: a frame every 1/15 s, a little late at times), all sent open loop at
the arrivals of seeded ``sim.workload`` workloads, and a background flood of batch jobs
(a closed loop, as many in flight as offline work may fill of the queues: see
:func:`batch_jobs_in_flight`). When the config has a decoder model, a foreground chat (with
sessions) and background summaries run on it too, and halfway through one node is
told its device went to the background (token budgets shrink) and later back. The
report shows what the scheduler did for each class.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import heapq
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from cluster.client import FleetClient
from cluster.head import stop_children
from cluster.traffic import Answer, Backoff, ClosedLoop, Driver, LoopThread, OpenLoop
from edgefleet.config import FleetConfig, load_config
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import make_missing_models, random_inputs
from policies.placement import ShedBelowPriority
from sim.workload import Arrival, parse_workload

Print = Callable[[str], None]

# Open-loop classes of requests, sent at the arrivals of a seeded ``sim.workload``
# workload of their process (default poisson); weight: requests/s.
OPEN_LOOP: tuple[Mapping[str, Any], ...] = (
    {"model": "classifier", "priority": "foreground", "weight": 8},  # a chat UI
    # a camera: a frame every 1/15 s, each with a deadline and the camera's dedup key (a
    # newer frame replaces a queued older one)
    {
        "model": "detector",
        "priority": "inline",
        "weight": 15,
        "deadline_ms": 250,
        "keys": 1,
        "process": "periodic",
    },
    {"model": "stateful", "priority": "offline", "weight": 20},  # an indexer
)
PERIODIC = {"jitter": 0.05, "phase": "random"}  # a camera's frames: up to 5 % late
WORKLOAD_SEED = 0
# Batch jobs, kept in flight (see batch_jobs_in_flight): a refused one is sent again
# after the reply's retry hint (as given, as a well-behaved client does), an evicted or
# failed one at once.
BATCH_JOBS = ("heavy", "background")  # model, priority class
BATCH_BACKOFF = Backoff(min_retry_s=0.0, max_retry_s=None, error_pause_s=0.0)
DRAIN_S = 30.0  # at the end, the replies still out may take this long to come


@dataclass
class ChatStream:
    """A generation client on its own thread: turns of ``new_tokens`` each."""

    name: str
    priority: str
    new_tokens: int
    session: bool  # a chat: later turns extend the conversation and reuse its KV
    first_token: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    tokens: int = 0
    busy_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    pauses: int = 0


INTERRUPTED_STOP_S = 20.0  # after Ctrl-C and the report, stopping the fleet may take this
SYSTEM_PROMPT = tuple(range(1, 33))


def default_chats() -> list[ChatStream]:
    return [
        ChatStream("chat", "foreground", 24, session=True),
        ChatStream("summaries-1", "background", 160, session=False),
        ChatStream("summaries-2", "background", 160, session=False),
    ]


def _chat_loop(
    client: FleetClient, model: str, chat: ChatStream, until: float, stop: threading.Event
) -> None:
    try:
        _chat_turns(client, model, chat, until, stop)
    except Exception:
        if not stop.is_set():  # stopping: the fleet goes away under a turn in progress
            raise


def _chat_turns(
    client: FleetClient, model: str, chat: ChatStream, until: float, stop: threading.Event
) -> None:
    rng = np.random.default_rng(len(chat.name))
    history: tuple[int, ...] = SYSTEM_PROMPT
    turn = 0
    while time.monotonic() < until and not stop.is_set():
        turn += 1
        user = tuple(int(t) for t in rng.integers(1, 400, 8))
        prompt = (*history, *user) if chat.session else (*SYSTEM_PROMPT, *user * 8)
        if len(prompt) > 400:  # start a new conversation before the context fills
            history, prompt = SYSTEM_PROMPT, (*SYSTEM_PROMPT, *user)
        t0 = time.monotonic()
        try:
            stream = client.generate(
                model,
                prompt,
                max_new_tokens=chat.new_tokens,
                priority=chat.priority,
                session=f"{chat.name}-{turn // 8}" if chat.session else None,
                prefix_len=len(SYSTEM_PROMPT),
            )
            out = []
            for token in stream:
                if stop.is_set():
                    stream.close()  # cancels the generation on its node
                    return
                out.append(token)
        except EdgeFleetError as exc:
            chat.outcomes[type(exc).__name__] += 1
            stop.wait(getattr(exc, "retry_after_s", 0.1) or 0.1)
            continue
        r = stream.result
        assert r is not None
        chat.outcomes[r.finish_reason or "?"] += 1
        chat.total.append(time.monotonic() - t0)
        if r.first_token_s is not None:
            chat.first_token.append(r.first_token_s)
        chat.tokens += len(out)
        chat.busy_s += r.total_s
        chat.pauses += r.pauses
        history = (*prompt, *out) if chat.session else SYSTEM_PROMPT
        if chat.session:
            stop.wait(0.3)  # a person reads the answer before the next turn


@dataclass
class ClassStats:
    latencies: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    batch_sizes: list[int] = field(default_factory=list)


class _Tally:
    """Replies by priority class and the nodes that served them (fed by the drivers'
    callbacks, on the traffic's loop thread)."""

    def __init__(self, classes: Mapping[int, str]) -> None:
        self.stats = {name: ClassStats() for name in classes.values()}
        self.ran_on: Counter[str] = Counter()
        self._classes = classes

    def add(self, answer: Answer) -> None:
        """Count one reply under the priority class it was sent at."""
        assert answer.arrival is not None
        self.add_to(self._classes[answer.arrival.priority], answer)

    def add_to(self, cls: str, answer: Answer) -> None:
        st, reply = self.stats[cls], answer.reply
        if reply.error is None:
            st.latencies.append(answer.latency_s)
            st.batch_sizes.append(reply.batch_size)
            st.outcomes["completed"] += 1
            self.ran_on[reply.node] += 1
        else:
            st.outcomes[type(reply.error).__name__] += 1

    def progress(self) -> tuple[int, int]:
        """Requests completed, and requests answered with an error."""
        done = sum(s.outcomes["completed"] for s in self.stats.values())
        return done, sum(sum(s.outcomes.values()) for s in self.stats.values()) - done


def _traffic(
    client: FleetClient, config: FleetConfig, duration_s: float
) -> tuple[list[Driver], _Tally]:
    """The demo's drivers for the models the fleet serves (the open loop of the
    workload's arrivals, the batch jobs' closed loop), and the tally of their replies."""
    mix = [c for c in OPEN_LOOP if c["model"] in config.models]
    jobs_model, jobs_class = BATCH_JOBS
    jobs = [jobs_model] if jobs_model in config.models else []
    classes = [c["priority"] for c in mix] + [jobs_class] * len(jobs)
    tally = _Tally({config.priorities[c]: c for c in classes})
    inputs = {m: random_inputs(m) for m in {c["model"] for c in mix} | set(jobs)}
    drivers: list[Driver] = []
    if mix and duration_s > 0:
        arrivals = _open_loop_arrivals(mix, config, duration_s)
        drivers.append(OpenLoop(client, arrivals, inputs, on_answer=tally.add))
    for model in jobs:
        batch_jobs = ClosedLoop(
            client,
            model,
            inputs[model],
            lanes=batch_jobs_in_flight(config, model),
            priority=jobs_class,
            backoff=BATCH_BACKOFF,
            on_answer=partial(tally.add_to, jobs_class),
        )
        drivers.append(batch_jobs)
    return drivers, tally


def batch_jobs_in_flight(config: FleetConfig, model: str) -> int:
    """How many batch jobs the demo keeps in flight: as many as work of the lowest
    priority may fill of the queues of the nodes serving ``model`` (its shed share,
    ``router.placement.shed``). The flood alone then keeps those queues just below
    that line, so offline work is placed between batch jobs and shed only when the
    two together pass it; a larger flood would hold the queues above the line, where
    only the one offline request at a time that a starvation bound lets past it reaches
    each node."""
    shed = ShedBelowPriority(config.router.placement.params(config.priorities).shed)
    share = shed.limit(min(config.priorities.values()))
    room = sum(s.queue.capacity for s in config.node_specs() if model in s.models)
    return max(1, int(share * room))


def _open_loop_arrivals(
    mix: Sequence[Mapping[str, Any]], config: FleetConfig, duration_s: float
) -> Iterator[Arrival]:
    """The arrivals of the open-loop classes, in time order: one seeded workload per
    arrival process (its classes' weights its rate), merged."""
    rng = random.Random(WORKLOAD_SEED)
    streams = []
    for process in dict.fromkeys(c.get("process", "poisson") for c in mix):
        classes = [
            {k: v for k, v in c.items() if k != "process"}
            for c in mix
            if c.get("process", "poisson") == process
        ]
        arrivals: dict[str, Any] = {
            "process": process,
            "rate": sum(c["weight"] for c in classes),
        }
        if process == "periodic":
            arrivals["periodic"] = PERIODIC
        workload = parse_workload(
            {"duration_s": duration_s, "arrivals": arrivals, "mix": classes},
            source=f"of the demo ({process})",
        )
        streams.append(
            workload.arrivals(rng, nodes=len(config.node_specs()), priorities=config.priorities)
        )
    return heapq.merge(*streams, key=lambda a: a.at)


def _drive(
    client: FleetClient,
    traffic: LoopThread,
    drivers: Sequence[Driver],
    tally: _Tally,
    lifecycle: _LifecycleEvents | None,
    duration_s: float,
    out: Print,
) -> None:
    """Run the drivers for ``duration_s``, then until the replies still out have come
    (bounded), with a progress line every 2 s and the lifecycle events on time."""
    start = last_report = time.monotonic()
    for d in drivers:
        traffic.run(d.start())
    finishing: cf.Future[None] | None = None
    while finishing is None or not finishing.done():
        now = time.monotonic()
        if lifecycle is not None:
            lifecycle.tick(now)
        if finishing is None and now - start >= duration_s:
            finishing = traffic.spawn(_finish(drivers, DRAIN_S))
        if now - last_report >= 2.0:
            last_report = now
            done, refused = traffic.call(tally.progress)
            out(_progress_line(client, now - start, done, refused))
        time.sleep(0.01)
    finishing.result()
    for d in drivers:
        d.check()


async def _finish(drivers: Sequence[Driver], timeout_s: float) -> None:
    """Stop sending, and wait (bounded) for the replies still out: they count too."""
    await asyncio.gather(*(d.stop(timeout_s, drain=True) for d in drivers))


def run_demo(config_path: Path, duration_s: float, out: Print = print) -> dict[str, ClassStats]:
    config = load_config(config_path)
    make_missing_models(config, out)
    decoder = next((n for n, m in config.models.items() if m.kind == "decoder"), None)
    chats = default_chats() if decoder else []
    stop = threading.Event()
    interrupted = False
    with FleetClient.local(config, progress=out) as client:
        drivers, tally = _traffic(client, config, duration_s)
        start = time.monotonic()
        out(f"running a mixed workload for {duration_s:.0f} s on {len(config.node_specs())} nodes")
        out(
            "every 2 s: requests completed, requests not served (answered with a typed "
            "error: rejected, evicted, superseded or expired) and each node's queue"
        )
        threads = [
            threading.Thread(
                target=_chat_loop, args=(client, decoder, c, start + duration_s, stop), daemon=True
            )
            for c in chats
        ]
        for t in threads:
            t.start()
        lifecycle = _LifecycleEvents(client, config.node_specs()[-1].name, start, duration_s, out)
        with LoopThread("edgefleet-demo") as traffic:
            try:
                _drive(
                    client, traffic, drivers, tally, lifecycle if decoder else None, duration_s, out
                )
                for t in threads:
                    t.join()
            except KeyboardInterrupt:
                out("interrupted: stopping the fleet; the report covers what was answered so far")
                interrupted = True
                stop.set()
                traffic.close(timeout_s=1.0)  # what is in flight ends with the fleet's stop
                for t in threads:  # each ends at its next token (the fleet's stop ends the rest)
                    t.join(1.0)
        try:
            totals, router = _fleet_totals(client, timeout_s=2.0 if stop.is_set() else 30.0)
        finally:
            stop.set()  # chats still in a turn end quietly as the fleet goes away
        if interrupted:  # the report first: stopping the fleet comes after it, bounded
            _report(out, tally.stats, totals, tally.ran_on, config, router, chats)
            _bound_the_stop(out)
    if interrupted:
        raise KeyboardInterrupt  # the report is out; the command ends as interrupted
    _report(out, tally.stats, totals, tally.ran_on, config, router, chats)
    return tally.stats


def _report(
    out: Print,
    stats: dict[str, ClassStats],
    totals: dict[str, int],
    ran_on: Counter[str],
    config: FleetConfig,
    router: dict[str, int] | None,
    chats: list[ChatStream],
) -> None:
    out("")
    out(report(stats, totals, ran_on, config, router))
    if chats:
        out("")
        out(generation_report(chats, totals))


def _bound_the_stop(out: Print) -> None:
    """After Ctrl-C, stopping the fleet may take at most ``INTERRUPTED_STOP_S``: past
    that (a Ray process that does not answer), the processes this one started are
    stopped and the command ends as interrupted."""

    def give_up() -> None:
        out(f"stopping the fleet took over {INTERRUPTED_STOP_S:.0f} s: stopping its processes")
        stop_children(grace_s=0)
        os._exit(130)

    timer = threading.Timer(INTERRUPTED_STOP_S, give_up)
    timer.daemon = True
    timer.start()


class _LifecycleEvents:
    """The device behind one node goes to the background at half time, and comes back
    at three quarters: events, as a phone's app lifecycle would send them."""

    def __init__(self, client: FleetClient, node: str, start: float, duration: float, out: Print):
        self._client, self._node, self._out = client, node, out
        self._events = [
            (start + duration / 2, "background"),
            (start + 3 * duration / 4, "foreground"),
        ]

    def tick(self, now: float) -> None:
        while self._events and self._events[0][0] <= now:
            _, state = self._events.pop(0)
            self._client.set_lifecycle(self._node, state)
            self._out(f"event: {self._node} is now in the {state}")


def generation_report(chats: list[ChatStream], totals: dict[str, int]) -> str:
    lines = [
        "generation       turns  first token p50/p99 ms  total p50/p99 ms  tokens/s  "
        "paused  finish",
    ]
    for c in chats:
        finish = ", ".join(f"{k} {v}" for k, v in sorted(c.outcomes.items()))
        rate = c.tokens / c.busy_s if c.busy_s else 0.0
        ttft = f"{_pct(c.first_token, 50)}/{_pct(c.first_token, 99).strip():<8}"
        total = f"{_pct(c.total, 50)}/{_pct(c.total, 99).strip():<8}"
        lines.append(
            f"{c.name:<15}{len(c.total):7d}  {ttft}     {total}{rate:8.0f}  {c.pauses:6d}  {finish}"
        )
    lines.append(
        f"node totals: {totals.get('tokens', 0)} tokens, {totals.get('paused', 0)} pauses, "
        f"{totals.get('resumed', 0)} resumes, {totals.get('finish_budget', 0)} cut by the token "
        f"budget, {totals.get('kv_trimmed', 0)} KV caches trimmed"
    )
    return "\n".join(lines)


def _fleet_totals(
    client: FleetClient, timeout_s: float
) -> tuple[dict[str, int], dict[str, int] | None]:
    """The nodes' totals and the router's counters; none when the fleet does not
    answer in time (the report then has the callers' side only)."""
    try:
        fleet = client.status(timeout_s=timeout_s)
    except EdgeFleetError:
        return {}, None
    return fleet.totals, fleet.router


def _progress_line(client: FleetClient, elapsed: float, done: int, refused: int) -> str:
    status = client.status()
    queues = " ".join(f"{n.name}:{n.queue_length}" for n in status.nodes)
    return f"[{elapsed:5.1f}s] completed {done:6d}  not served {refused:5d}  queues {queues}"


def _pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:8.1f}" if values else "       -"


def report(
    stats: dict[str, ClassStats],
    totals: dict[str, int],
    ran_on: Counter[str],
    config: FleetConfig,
    router: dict[str, int] | None = None,
) -> str:
    lines = [
        "priority class   p50 ms   p99 ms  completed  rejected  evicted  superseded  "
        "expired  mean batch",
    ]
    for cls in sorted(stats, key=lambda c: -config.priorities[c]):
        s = stats[cls]
        mean_batch = f"{np.mean(s.batch_sizes):10.2f}" if s.batch_sizes else "         -"
        lines.append(
            f"{cls:<15}{_pct(s.latencies, 50)} {_pct(s.latencies, 99)}"
            f"  {s.outcomes['completed']:9d}  {s.outcomes['Rejected']:8d}"
            f"  {s.outcomes['Evicted']:7d}  {s.outcomes['Superseded']:10d}"
            f"  {s.outcomes['DeadlineExceeded']:7d}  {mean_batch}"
        )
    lines.append("")
    lines.append(
        "nodes: "
        + ", ".join(
            f"{k} {totals.get(k, 0)}"
            for k in ("admitted", "completed", "rejected", "evicted", "superseded", "expired")
        )
        + f"; {totals.get('preemptions', 0)} engine calls preempted"
        + f" ({totals.get('preempted', 0)} requests requeued)"
    )
    if router is not None:
        lines.append(
            f"router: shed {router.get('shed', 0)} low-priority requests to keep room for "
            f"urgent work, spilled {router.get('spilled', 0)} to another node, re-placed "
            f"{router.get('replaced', 0)}"
        )
    lines.append("ran on: " + ", ".join(f"{n} {c}" for n, c in sorted(ran_on.items())))
    return "\n".join(lines)
