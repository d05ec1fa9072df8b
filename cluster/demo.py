"""`edgefleet demo`: a mixed workload on the embedded default fleet, with a report.

Four streams share the fleet: foreground classifications, camera frames with a
deadline and a dedup key, a background flood of batch jobs, and offline work on a
model that cannot batch. The report shows what the scheduler did for each class.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

from actors.node import Reply
from cluster.client import FleetClient
from edgefleet.config import FleetConfig, load_config
from edgefleet.errors import Rejected
from edgefleet.modelgen import BUILTIN_MODELS, random_inputs

Print = Callable[[str], None]


@dataclass
class Stream:
    """One source of requests: a fixed rate, or a number kept in flight."""

    name: str
    model: str
    priority: str
    rate_hz: float = 0.0  # open loop at this rate...
    in_flight: int = 0  # ...or closed loop with this many outstanding
    deadline_s: float | None = None
    key: str | None = None
    next_at: float = 0.0
    outstanding: int = 0
    retry_at: list[float] = field(default_factory=list)  # refused slots, resent after retry_after


@dataclass
class ClassStats:
    latencies: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    batch_sizes: list[int] = field(default_factory=list)


def default_streams() -> list[Stream]:
    return [
        Stream("chat-ui", "classifier", "foreground", rate_hz=8),
        Stream("camera", "detector", "inline", rate_hz=15, deadline_s=0.25, key="camera-0"),
        Stream("batch-jobs", "heavy", "background", in_flight=160),
        Stream("indexer", "stateful", "offline", rate_hz=20),
    ]


def ensure_models(config: FleetConfig, out: Print) -> None:
    """Generate the built-in models a config names when their files are missing."""
    for name, model in config.models.items():
        if model.path.is_file():
            continue
        spec = BUILTIN_MODELS.get(model.path.stem)
        if spec is None:
            continue  # a user's own model: FleetClient.local reports it missing
        out(f"generating model {name} -> {model.path}")
        spec(model.path)


def run_demo(config_path: Path, duration_s: float, out: Print = print) -> dict[str, ClassStats]:
    config = load_config(config_path)
    ensure_models(config, out)
    inputs = {s.model: random_inputs(s.model) for s in default_streams()}
    streams = default_streams()
    stats = {s.priority: ClassStats() for s in streams}
    ran_on: Counter[str] = Counter()
    with FleetClient.local(config, progress=out) as client:
        pending: dict[ray.ObjectRef, tuple[Stream, float]] = {}
        start = time.monotonic()
        last_report = start
        out(f"running a mixed workload for {duration_s:.0f} s on {len(config.node_specs())} nodes")
        while True:
            now = time.monotonic()
            sending = now - start < duration_s
            for s in streams if sending else ():
                while s.rate_hz and s.next_at <= now:
                    s.next_at = (s.next_at or now) + 1.0 / s.rate_hz
                    _send(client, s, inputs, pending)
                if s.retry_at:
                    s.retry_at = [t for t in s.retry_at if t > now]
                while s.in_flight and s.outstanding + len(s.retry_at) < s.in_flight:
                    _send(client, s, inputs, pending)
            if not pending and not sending:
                break
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.005)
            for ref in ready:
                stream, sent = pending.pop(ref)
                stream.outstanding -= 1
                reply: Reply = ray.get(ref)
                st = stats[stream.priority]
                if reply.error is None:
                    st.latencies.append(time.monotonic() - sent)
                    st.batch_sizes.append(reply.batch_size)
                    st.outcomes["completed"] += 1
                    ran_on[reply.node] += 1
                else:
                    st.outcomes[type(reply.error).__name__] += 1
                    if isinstance(reply.error, Rejected) and stream.in_flight:
                        # A well-behaved client backs off for the hinted time.
                        stream.retry_at.append(time.monotonic() + reply.error.retry_after_s)
            if now - last_report >= 2.0:
                last_report = now
                out(_progress_line(client, now - start, stats))
        fleet = client.status()
    out("")
    out(report(stats, fleet.totals, ran_on, config))
    return stats


def _send(
    client: FleetClient,
    stream: Stream,
    inputs: dict[str, dict[str, np.ndarray]],
    pending: dict[ray.ObjectRef, tuple[Stream, float]],
) -> None:
    ref = client.submit(
        stream.model,
        inputs[stream.model],
        priority=stream.priority,
        deadline_s=stream.deadline_s,
        key=stream.key,
    )
    stream.outstanding += 1
    pending[ref] = (stream, time.monotonic())


def _progress_line(client: FleetClient, elapsed: float, stats: dict[str, ClassStats]) -> str:
    status = client.status()
    queues = " ".join(f"{n.name}:{n.queue_length}" for n in status.nodes)
    done = sum(s.outcomes["completed"] for s in stats.values())
    refused = sum(sum(s.outcomes.values()) - s.outcomes["completed"] for s in stats.values())
    return f"[{elapsed:5.1f}s] completed {done:6d}  not served {refused:5d}  queues {queues}"


def _pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:8.1f}" if values else "       -"


def report(
    stats: dict[str, ClassStats],
    totals: dict[str, int],
    ran_on: Counter[str],
    config: FleetConfig,
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
        "fleet: "
        + ", ".join(
            f"{k} {totals.get(k, 0)}"
            for k in ("admitted", "completed", "rejected", "evicted", "superseded", "expired")
        )
        + f"; {totals.get('preemptions', 0)} engine calls preempted"
        + f" ({totals.get('preempted', 0)} requests requeued)"
    )
    lines.append("ran on: " + ", ".join(f"{n} {c}" for n, c in sorted(ran_on.items())))
    return "\n".join(lines)
