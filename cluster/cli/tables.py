"""A fleet's status as `status` and `up` print it, and as `status --json`."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.metrics import Overview
    from edgefleet.messages import FleetStatus, NodeStatus, PoolStatus

POOL_STATES = ("serving", "starting", "failed", "left")  # cluster.membership.DeviceState

CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, clear: --watch redraws in place


def _no_nan(value: Any) -> Any:
    """JSON has no NaN: a latency with no requests behind it becomes null."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return None if isinstance(value, float) and value != value else value


def status_dict(status: FleetStatus, overview: Overview | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fleet": status.fleet,
        "router": status.router,
        "callers": status.callers,
        "placement": status.placement,
        "totals": status.totals,
        "nodes": [
            {**dataclasses.asdict(n), "healthy": status.healthy.get(n.name, False)}
            for n in status.nodes
        ],
        "unresponsive": status.unresponsive,
        "pools": [dataclasses.asdict(p) for p in status.pools],
        "rollouts": list(status.rollouts),
    }
    if overview is not None:
        out["overview"] = _no_nan(dataclasses.asdict(overview))
    return out


def status_line(status: FleetStatus) -> str:
    t, r = status.totals, status.router
    queues = " ".join(f"{n.name}:{n.queue_length}" for n in status.nodes)
    return (
        f"completed {t.get('completed', 0)}  rejected {r.get('rejected', 0)}  "
        f"evicted {t.get('evicted', 0)}  spilled {r.get('spilled', 0)}  "
        f"re-placed {r.get('replaced', 0)}  queues {queues}"
    )


def overview_lines(o: Overview) -> list[str]:
    """The dashboard's overview row as text: the same figures over the same window."""

    def ms(v: float) -> str:
        return "-" if v != v else f"{v * 1000:.0f}"

    classes = [c for c in o.classes if c in o.p50]
    latency = "  ".join(f"{c} {ms(o.p50[c])}/{ms(o.p99[c])}" for c in classes) or "-"
    if o.seconds <= 0:
        return [
            "overview since the nodes started (rates need a second snapshot: --watch)",
            f"  latency p50/p99 ms   {latency}",
            f"  rejected {o.rejected} in all   evicted {o.evicted} in all",
        ]
    per_class = "  ".join(f"{c} {o.throughput.get(c, 0.0):.1f}" for c in classes)
    return [
        f"overview over the last {o.seconds:.0f} s (the dashboard's Fleet overview)",
        f"  throughput {o.total_throughput:.1f} req/s   {per_class}",
        f"  latency p50/p99 ms   {latency}",
        f"  rejected {o.rejected_per_s or 0.0:.2f}/s ({o.rejected} in all)   "
        f"evicted {o.evicted_per_s or 0.0:.2f}/s ({o.evicted} in all)",
    ]


def status_table(status: FleetStatus, overview: Overview | None = None) -> str:
    lines = [f"fleet {status.fleet}", ""]
    if status.placement:
        lines += [
            f"placement: {status.placement}; placed by {status.callers} caller(s) "
            "straight to the nodes",
            "",
        ]
    if overview is not None:
        lines += [*overview_lines(overview), ""]
    w = max([12, *(len(n.name) + 2 for n in status.nodes)])  # pool members: POOL/DEVICE
    lines.append(
        f"{'node':<{w}}{'health':<9}{'state':<10}{'queued by priority':<28}{'running':<22}models"
    )
    for n in status.nodes:
        queued = " ".join(f"{p}:{c}" for p, c in sorted(n.queued.items(), reverse=True)) or "-"
        running = "-"
        if n.running is not None:
            running = f"{n.running.model} x{len(n.running.request_ids)} p{n.running.priority}"
        models = ", ".join(m.name + ("*" if m.loaded else "") for m in n.models)
        health = _health(status, n.name)
        lines.append(f"{n.name:<{w}}{health:<9}{n.state:<10}{queued:<28}{running:<22}{models}")
        if n.failure:  # why a failed or stuck node is out of service
            lines.append(f"{'':<{w}}{n.state}: {n.failure}")
        lines += [f"{'':<{w}}{line}" for line in provider_lines(n)]
        if n.name in status.unresponsive:
            silent = status.unresponsive[n.name]
            lines.append(f"{'':<{w}}unresponsive for {silent:.0f} s: callers send it nothing")
        if n.paused or n.lifecycle != "foreground" or any(n.kv_bytes.values()):
            paused = " ".join(f"{p}:{c}" for p, c in sorted(n.paused.items(), reverse=True))
            kv = sum(n.kv_bytes.values()) / (1024 * 1024)
            lines.append(
                f"{'':<{w}}lifecycle {n.lifecycle}; paused {paused or '-'}; KV cache {kv:.1f} MiB"
            )
    lost = [name for name, ok in status.healthy.items() if not ok]
    for name in lost:
        if all(n.name != name for n in status.nodes):
            lines.append(f"{name:<{w}}{_health(status, name):<9}")
    lines += ["", "(* = resident)", *version_lines(status)]
    lines += [f"rollout: {r}" for r in status.rollouts]
    lines.append(status_line(status))
    for pool in status.pools:
        lines += ["", *pool_lines(pool)]
    return "\n".join(lines)


def version_lines(status: FleetStatus) -> list[str]:
    """Which version of each model's files the nodes serve, and on how many nodes."""
    served: dict[str, Counter[tuple[str, str]]] = {}
    for n in status.nodes:
        for m in n.models:
            if m.version:
                served.setdefault(m.name, Counter())[(m.version, m.digest[:12])] += 1
    lines = []
    for model, versions in sorted(served.items()):
        each = ", ".join(
            f"{v}{'' if v == d else f' (sha256 {d})'} on {c} node(s)"
            for (v, d), c in sorted(versions.items())
        )
        lines.append(f"{model}: {each}")
    return lines


def provider_lines(node: NodeStatus) -> list[str]:
    """What a node's device runs its models on, when it is not the plain CPU build's
    CPU provider: the device's ONNX Runtime build and, per model, the providers its
    session took and why it fell back (plain CPU nodes say nothing)."""
    plain = all(m.providers.used[:1] == ("cpu",) and not m.providers.fallback for m in node.models)
    if plain and set(node.device.providers) <= {"cpu", "azure"}:
        return []
    lines = [f"device: {node.device.describe()}"]
    lines += [f"  {m.name} on {m.providers.describe()}" for m in node.models]
    return lines


def pool_lines(pool: PoolStatus) -> list[str]:
    """A pool and its devices: state, age (since it first joined), its current (or last)
    Ray node's join, the Ray node, and why a device failed or when it left."""
    counts = "  ".join(f"{pool.count(state)} {state}" for state in POOL_STATES)
    lines = [f"pool {pool.name} ({pool.selector}): {counts}"]
    if not pool.devices:
        return [*lines, "  no Ray node matches yet: a node starts on each as it joins"]
    w = max(12, *(len(d.device) + 2 for d in pool.devices))
    lines.append(f"  {'device':<{w}}{'state':<10}{'age':<9}{'(re)joined':<12}{'joins':<7}Ray node")
    for d in pool.devices:
        joined = f"{_ago(d.joined_s)} ago"
        lines.append(
            f"  {d.device:<{w}}{d.state:<10}{_ago(d.age_s):<9}{joined:<12}{d.joins:<7}"
            f"{d.ray_node[:12] or '-'}"
        )
        if d.reason:
            lines.append(f"  {'':<{w}}{d.reason}")
        if d.left_s is not None:
            lines.append(f"  {'':<{w}}left {_ago(d.left_s)} ago")
    return lines


def _ago(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``, ``2d04h``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _health(status: FleetStatus, node: str) -> str:
    """``ok``, ``UNRESP`` (alive but silent, or stuck: see ``FleetStatus.unresponsive``)
    or ``LOST``."""
    if status.healthy.get(node):
        return "ok"
    return "UNRESP" if node in status.unresponsive else "LOST"
