"""The chaos soak's Markdown report (see bench/chaos.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench.chaos_cluster import (
    HEALTH_CHECKS,
    LOST_AFTER_S,
    NODES,
    QUIET_END_S,
    REPORT_INTERVAL_S,
    RESTART_AFTER_S,
)
from bench.common import EnvFacts, fmt, md_table
from cluster.head import LOOPBACK

if TYPE_CHECKING:
    from bench.chaos import Figures

EVENT_NAMES = {
    "node": "node process killed",
    "router": "router killed",
    "raylet": "raylet killed",
    "node-freeze": "node process frozen",
    "raylet-freeze": "raylet frozen",
    "head": "head killed and restarted",
}


def render(
    f: Figures,
    facts: EnvFacts,
    started: str,
    argv: Sequence[str],
    *,
    timeouts: tuple[float, float],
    slack_s: float,
    sample_every_s: float,
) -> str:
    """The report: header, invariants, requests, executions, generations, the chaos
    events, memory and leaks."""
    out = _header(f, facts, started, argv, timeouts, slack_s)
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
    out += _requests(f, slack_s) + _executions(f) + _generations(f) + _events(f)
    out += _memory(f, sample_every_s)
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


def _counts(f: Figures) -> str:
    kinds = f.event_kinds
    return ", ".join(f"{EVENT_NAMES[k]} {kinds[k]}" for k in f.options.kinds)


def _header(
    f: Figures,
    facts: EnvFacts,
    started: str,
    argv: Sequence[str],
    timeouts: tuple[float, float],
    slack_s: float,
) -> list[str]:
    o = f.options
    command = "python -m bench.chaos" + (f" {' '.join(argv)}" if argv else "")
    verdict = "PASS" if f.passed else "FAIL"
    period_s = int(HEALTH_CHECKS["RAY_health_check_period_ms"]) / 1000
    home = f"{o.spare[0]}'s raylet" if o.spare else "a raylet of its own"
    return [
        "# edgefleet chaos soak",
        "",
        f"- Date: {started}; this report: `{command}`",
        f"- Machine: {facts.line()}",
        f"- Load: {f.seconds:.0f} s{' (interrupted by Ctrl-C)' if f.interrupted else ''}; "
        f"seed {o.seed}; a chaos event every {0.6 * o.kill_every_s:.1f}-"
        f"{1.4 * o.kill_every_s:.1f} s (none in the last {QUIET_END_S:g} s); never hit: "
        f"{', '.join(o.spare) or 'none'}; every request with a timeout_s drawn "
        f"log-uniformly from {timeouts[0]:g}-{timeouts[1]:g} s",
        f"- Cluster: a Ray head (GCS state in Redis: {'yes' if 'head' in o.kinds else 'no'}), "
        f"{len(NODES)} raylets with one edge node pinned to each (the harness's driver on "
        f"{home}), on "
        f"{LOOPBACK}; the router on the head; GCS health checks every "
        f"{period_s:g} s; router reports every {REPORT_INTERVAL_S:g} s, a node lost "
        f"(unresponsive) after {LOST_AFTER_S:g} s, restarted after {RESTART_AFTER_S:g} s more",
        f"- Verdict: **{verdict}** (every invariant below holds)"
        if f.passed
        else f"- Verdict: **{verdict}**",
        f"- Chaos events: {len(f.events)} ({_counts(f)}"
        + (")" if f.covered else "; not every kind: the run was too short or cut short)"),
        f"- Answer time: every request answered within max(deadline_s, timeout_s) + "
        f"{slack_s:g} s: {'yes' if f.late == 0 else 'no'} ({f.late} late; the worst answer "
        f"came {f.worst_late_s:+.2f} s after max(deadline_s, timeout_s))",
        "",
    ]


def _requests(f: Figures, slack_s: float) -> list[str]:
    typed = ", ".join(f"{k} {v}" for k, v in f.typed.most_common()) or "none"
    untyped = ", ".join(f"{k} {v}" for k, v in f.untyped.most_common()) or "none"
    apis = ", ".join(f"{k} {v}" for k, v in sorted(f.by_api.items()))
    rows: list[list[object]] = [
        ["requests sent", f"{f.sent} ({apis})"],
        ["answered exactly once", f.sent - f.no_answer - f.two_answers],
        ["without an answer", f.no_answer],
        ["with two or more answers", f.two_answers],
        ["answered with a result", f.ok],
        ["answered with a typed error", f"{sum(f.typed.values())} ({typed})"],
        ["answered with an untyped error", f"{sum(f.untyped.values())} ({untyped})"],
        ["inference results with wrong outputs", f.wrong_outputs],
    ]
    rows += [
        [f"answer time p50 / p99 / max, {api} (s)", " / ".join(fmt(v, 3) for v in t)]
        for api, t in sorted(f.latency.items())
    ]
    rows += [
        [
            "worst answer time minus max(deadline_s, timeout_s) (s)",
            f"{f.worst_late_s:+.3f}",
        ],
        [
            f"answered more than {slack_s:g} s after max(deadline_s, timeout_s) (of them TimedOut)",
            f"{f.late} ({f.timed_out_late})",
        ],
        [
            "lifecycle events (ok / typed / untyped)",
            f"{f.control['ok']} / {f.control['typed']} / {f.control['untyped']}",
        ],
        [
            "status calls (ok / typed / untyped)",
            f"{f.status_calls['ok']} / {f.status_calls['typed']} / {f.status_calls['untyped']}",
        ],
    ]
    return [
        "## Requests and answers",
        "",
        md_table(["figure", "value"], rows),
        "",
        *(f"- {e}" for e in f.control_errors[:5]),
        *([""] if f.control_errors else []),
    ]


def _executions(f: Figures) -> list[str]:
    rows: list[list[object]] = [
        ["trace files (node processes)", f.trace_files],
        ["trace lines", f.trace_lines],
        ["lines cut short by a killed process", f.truncated_lines],
        ["lines of ids the harness never sent", f.unknown_ids],
        ["ids run to completion once", f.ran_once],
        ["ids run to completion more than once", f.ran_more],
        ["... re-run after the node that ran them was killed before answering", f.reran_after_kill],
        ["... re-run elsewhere while the node holding them was frozen", f.reran_after_freeze],
        [
            "... re-run elsewhere after the node holding them did not answer the caller's probe",
            f.reran_after_loss,
        ],
        ["... re-run with no kill, freeze or loss to explain it", f.reran_unexplained],
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
        ["ran on a node, yet answered with an error (its node died first)", f.ran_but_error],
    ]
    return [
        "## Executions (node traces)",
        "",
        md_table(["figure", "value"], rows),
        "",
        "A request whose node dies after running it but before its answer leaves is run "
        "again elsewhere under the same id: the node that knew the answer is gone. A "
        "request held by a node that does not answer its caller's probe within "
        "router.probe_timeout_s once its call limit passes (frozen, or starved of CPU) is "
        "placed again elsewhere; that node, once it runs again, may still run it (the "
        "caller's request to drop it reaches it only then). Both are the documented "
        "at-least-once execution of requests not sent at_most_once, counted above, not "
        "hidden; the caller still gets one answer. A loss is when the caller held the "
        "node out of service (its view, polled every 50 ms).",
        "",
    ]


def _generations(f: Figures) -> list[str]:
    rows: list[list[object]] = [
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
    ]
    return ["## Generations", "", md_table(["figure", "value"], rows), ""]


def _events(f: Figures) -> list[str]:
    out = [
        "## Kills, freezes and head restarts",
        "",
        f"{len(f.events)} chaos events: {_counts(f)}"
        + ("." if f.covered else " (**not every kind**: the run was too short or cut short)."),
        "",
    ]
    if f.events:
        rows = []
        for e in f.events:
            rows.append(
                [
                    f"{e.at - f.t_start:.1f}",
                    e.kind,
                    e.target,
                    " ".join(map(str, e.pids)) or "-",
                    f"{e.back_at - e.at:.1f}" if e.back_at else "-",
                    f"{e.healthy_at - e.at:.1f}" if e.healthy_at else "-",
                    e.note or "-",
                ]
            )
        headers = ["at s", "kind", "target", "pids", "back after s", "serving again after s"]
        out += [md_table([*headers, "note"], rows), ""]
        out += [
            "Back after: a killed raylet or head started again, a frozen process sent "
            "SIGCONT. Serving again: the node answering in a new process, or after its "
            "SIGCONT; the router answering a status call.",
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
            f"Fleet counters over the {f.routers} router processes seen: {shown}; {more}. "
            "What the caller handed to the router (received ... shed) are its totals, the "
            "largest a router process held; the router's own (nodes_lost, rejoined, "
            "unresponsive, restarted) are added up over its processes. Approximate: what a "
            "router counted since the last sample before it was killed is not counted.",
            "",
        ]
    return out


def _memory(f: Figures, sample_every_s: float) -> list[str]:
    out = [
        "## Memory",
        "",
        f"Resident memory of the router and node processes, sampled every {sample_every_s:g} s "
        f"while they answered; growth from the first sample after a warm-up of "
        f"{f.warmup_s:.0f} s to the last (shown for processes that lived at least 10 s "
        "past the warm-up). Every kill starts a new process.",
        "",
    ]
    if f.memory:
        headers = ["process", "pid", "lived s", "first MB", "after warm-up MB", "last MB"]
        rows = [
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
        ]
        out += [
            md_table([*headers, "growth %"], rows),
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
    return out
