"""`edgefleet simulate`, `plan` and `simulate-rollout`: a workload on a simulated fleet
and its report, the fewest nodes that meet targets, and a model's staged rollout in
simulated time."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from cluster.cli.common import RawHelpFormatter, Subparsers, err, say


def add_parser(sub: Subparsers) -> None:
    simulate = sub.add_parser(
        "simulate",
        help="run a workload on a simulated fleet (the real schedulers and placement, "
        "in simulated time) and write a report",
        epilog="examples:\n"
        "  edgefleet simulate configs/local.yaml --workload configs/sim/steady.yaml "
        "--nodes 1000\n"
        "  edgefleet simulate configs/local.yaml --workload configs/sim/bursts.yaml "
        "--compare expected_completion,power_of_two,round_robin",
        formatter_class=RawHelpFormatter,
    )
    simulate.add_argument("config", help="fleet YAML: the nodes, models and placement")
    simulate.add_argument("--workload", required=True, help="workload YAML (see configs/sim/)")
    simulate.add_argument(
        "--nodes", type=int, help="grow the fleet to this many nodes (default: the config's)"
    )
    simulate.add_argument("--requests", type=int, help="stop after this many arrivals")
    simulate.add_argument("--seed", type=int, help="default: the workload's")
    simulate.add_argument(
        "--costs",
        metavar="PATH",
        help="engine costs a live fleet measured: the output of `edgefleet status --json` "
        "(its warm-up tables; the workload's costs: take precedence), or a call record "
        "(router.record_dir: a .jsonl file or a folder of them; each inference call takes "
        "the engine time of a recorded call of its model and batch size, near its own time "
        "into the run and on the node of its name when recorded, in place of the "
        "workload's costs_from:)",
    )
    simulate.add_argument(
        "--out", default="sim-report", help="folder for the report (default: %(default)s)"
    )
    simulate.add_argument(
        "--compare", metavar="POLICY,...", help="run once per placement policy, side by side"
    )
    simulate.set_defaults(func=cmd_simulate)

    from sim.plan import TARGET_HELP

    plan = sub.add_parser(
        "plan",
        help="the fewest nodes that meet latency and completion targets for a workload, "
        "found in simulation",
        epilog="examples:\n  edgefleet plan configs/local.yaml --workload configs/sim/steady.yaml "
        "--target 'foreground.p99<=50ms,offline.completed>=0.99'\n"
        "  edgefleet plan configs/fleet.yaml --workload W.yaml --target 'all.p99<=200ms' "
        "--node-type camera-0,assistant",
        formatter_class=RawHelpFormatter,
    )
    plan.add_argument(
        "config",
        help="fleet YAML: the nodes, models, placement; each entry of nodes: and each pool "
        "of pools: is a node type (neither: the one type local)",
    )
    plan.add_argument(
        "--workload",
        required=True,
        help="workload YAML; its traffic is held fixed (a rate_per_node at the config's size)",
    )
    plan.add_argument("--target", required=True, help=TARGET_HELP.replace("%", "%%"))
    plan.add_argument(
        "--max-nodes",
        type=int,
        default=1024,
        help="largest fleet tried, every type counted (default: %(default)s)",
    )
    plan.add_argument(
        "--requests", type=int, help="arrivals per simulation (default: the workload's)"
    )
    plan.add_argument("--costs", metavar="PATH", help="as for simulate --costs")
    plan.add_argument(
        "--node-type",
        metavar="NAME[,NAME...]",
        action="append",
        help="count the nodes of these node types only (repeatable or comma-separated); "
        "with several, the fewest nodes and, when each has a price (the workload's "
        "node_types:), the cheapest mix of them (default: every type the config has)",
    )
    plan.add_argument(
        "--out",
        default="plan-report",
        help="folder for plan.md and plan.png (default: %(default)s)",
    )
    plan.set_defaults(func=cmd_plan)

    rollout = sub.add_parser(
        "simulate-rollout",
        help="a model's staged rollout in simulated time: time to finish and the capacity "
        "it costs, by step size and bake time (and a bad version's rollback)",
        epilog="examples:\n  edgefleet simulate-rollout\n"
        "  edgefleet simulate-rollout --steps 5%,10% --bakes 60 --fail-at-step 3",
        formatter_class=RawHelpFormatter,
    )
    rollout.add_argument("--nodes", type=int, default=1000, help="fleet size")
    rollout.add_argument(
        "--steps",
        default="1%,5%,10%,25%",
        help="step sizes to compare: nodes (20) or shares of the fleet (5%%), comma-separated",
    )
    rollout.add_argument(
        "--bakes", default="0,60,300", help="bake times to compare (s), comma-separated"
    )
    rollout.add_argument("--canary", default="1%", help="the first step: nodes or a share")
    rollout.add_argument("--model-mb", type=float, default=200.0, help="the model's size (MiB)")
    rollout.add_argument("--seed", type=int, default=0, help="of the per-node draws")
    rollout.add_argument(
        "--fail-at-step",
        type=int,
        metavar="K",
        help="a bad version: its gate fails at the end of step K's bake (0: the canary's; "
        "the last step's when a plan has fewer) and the moved nodes roll back",
    )
    rollout.set_defaults(func=cmd_simulate_rollout)


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edgefleet.config import load_config
    from policies.placement.registry import placement_policies
    from sim.report import write_report
    from sim.run import Progress, compare, simulate, workload_costs
    from sim.workload import load_workload

    config = load_config(args.config)
    workload = load_workload(args.workload)
    policies = [p for p in (args.compare or "").split(",") if p]
    known = placement_policies()
    unknown = [p for p in policies if p not in known]
    if unknown:
        err(f"unknown placement policy {', '.join(unknown)}; known: {', '.join(known)}")
        return 2

    def progress(total: int | None) -> Progress:
        bar = tqdm(total=total, unit="req", desc="simulating", file=sys.stderr, leave=False)
        return Progress(lambda n: bar.update(n - bar.n), bar.close)

    options: dict[str, Any] = {
        "nodes": args.nodes,
        "requests": args.requests,
        "progress": progress,
        "seed": args.seed,
    }
    if args.costs is not None:  # measured on a live fleet
        options["costs"] = workload_costs(workload, args.costs)
    if policies:
        results = compare(config, workload, policies, **options)
    else:
        results = [simulate(config, workload, **options)]
    nodes = len(results[0].recorder.nodes)
    description = [
        f"Fleet: {args.config} grown to {nodes} nodes; workload: {args.workload}",
        f"Seed: {workload.seed if args.seed is None else args.seed}",
    ]
    report = write_report(args.out, results, title="Fleet simulation", description=description)
    for r in results:
        top, every = r.latency_table()[0], r.latency_table()[-1]
        counts = r.counts()
        say(
            f"{r.label}: {every['answered']:,} answered in {r.wall_s:.1f} s "
            f"({r.events / max(r.wall_s, 1e-9):,.0f} events/s); {top['name']} p99 "
            f"{_ms(top['p99_ms'])}, all p99 {_ms(every['p99_ms'])}; completed "
            f"{counts['completed']:,}, rejected {counts['rejected']:,}, evicted "
            f"{counts['evicted']:,}, expired {counts['expired']:,}"
            + (" (interrupted: results so far)" if r.interrupted else "")
        )
        if r.churned():
            c = r.churn_summary()
            p50, p99 = c["first_served_p50_s"], c["first_served_p99_s"]
            say(
                f"  churn: {c['leaves']:,} devices left, {c['rejoins']:,} came back, "
                f"fewest serving {c['fewest_serving']:,}; replaced {c['replaced']:,}, "
                f"NodeLost {c['node_lost']:,}; first served after coming back p50 "
                f"{_ms(None if p50 is None else p50 * 1000)}, p99 "
                f"{_ms(None if p99 is None else p99 * 1000)}"
            )
    say(f"report: {report}")
    return 130 if any(r.interrupted for r in results) else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from edgefleet.config import load_config
    from edgefleet.errors import InvalidInput
    from sim.plan import parse_targets, plan, plot
    from sim.run import node_types, workload_costs
    from sim.workload import load_workload

    if args.max_nodes < 1:
        raise InvalidInput(f"--max-nodes is {args.max_nodes}; give 1 or more")
    config = load_config(args.config)
    workload = load_workload(args.workload)
    targets = parse_targets(args.target, list(config.priorities))
    costs = workload_costs(workload, args.costs) if args.costs is not None else None

    types = [t.strip() for arg in args.node_type or [] for t in arg.split(",") if t.strip()]
    names = list(dict.fromkeys(types)) or list(node_types(config, workload))  # as counted

    def tried(trial: Any) -> None:
        shown = ", ".join(
            f"{t.text.split('<')[0].split('>')[0]} {t.show(v)}"
            for t, v in zip(targets, trial.values, strict=True)
        )
        what = f"{trial.nodes:>5} node(s)"
        if trial.counts:
            mix = [f"{n} {t}" for t, n in zip(names, trial.counts, strict=True) if n]
            what += f" ({' + '.join(mix)})"
        err(f"{what}: {shown}: {'all met' if trial.passed else 'missed'}")

    result = plan(
        config, workload, targets, max_nodes=args.max_nodes, requests=args.requests,
        costs=costs, tried=tried, types=types or None,
    )  # fmt: skip
    out = Path(args.out)
    lines = result.lines()
    chart = plot(result, out / "plan.png")
    title = f"# Capacity plan: {args.config}, workload {args.workload}"
    (out / "plan.md").write_text("\n".join([title, "", *lines, "", f"![curve]({chart.name})", ""]))
    say("\n".join(lines))
    say(f"report: {out / 'plan.md'} and {chart}")
    return 0 if result.answer is not None else 1


def cmd_simulate_rollout(args: argparse.Namespace) -> int:
    from edgefleet.errors import InvalidInput
    from policies.rollout import parse_share
    from sim.rollout import sweep, table

    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    try:
        parse_share(args.canary, "--canary")
        for text in steps:
            parse_share(text, "--steps")
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    bakes = [_seconds(b) for b in args.bakes.split(",") if b.strip()]
    if not steps or not bakes:
        raise InvalidInput("give at least one step size (--steps) and one bake time (--bakes)")
    if args.nodes < 1 or args.model_mb <= 0:
        raise InvalidInput("give --nodes 1 or more and --model-mb above 0")
    if args.fail_at_step is not None and args.fail_at_step < 0:
        raise InvalidInput(f"--fail-at-step is {args.fail_at_step}; give 0 (the canary) or more")
    results = sweep(
        args.nodes, steps, bakes, args.canary, args.seed,
        model_mib=args.model_mb, fail_at=args.fail_at_step,
    )  # fmt: skip
    what = "a bad version" if args.fail_at_step is not None else "a good version"
    say(
        f"rollout of {what} of a {args.model_mb:g} MiB model to {args.nodes:,} nodes, "
        f"canary {args.canary}, seed {args.seed}"
    )
    say(table(results))
    return 0


def _seconds(text: str) -> float:
    from edgefleet.errors import InvalidInput

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:  # NaN too
        raise InvalidInput(f"--bakes {text.strip()!r}: give seconds, 0 or more")
    return value


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
