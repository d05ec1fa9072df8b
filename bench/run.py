"""Run the benchmarks and print a Markdown report: progress on stderr, the report on
stdout and in ``--out``, where each section of this run replaces the one of its title
and the others are kept (the project keeps its figures in ``bench/RESULTS.md``). Exit
status 1 when a scenario failed to run (a missed target is reported, not an error)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import (
    batching_window,
    devices,
    distribution,
    fidelity,
    fleet,
    genai,
    generation,
    membership,
    node_overhead,
    priority_latency,
    rollout,
    simulation,
)
from bench import common as bc
from bench.common import RunContext, Section, log

SCENARIOS = {  # name -> (run, title)
    "node_overhead": (node_overhead.run, node_overhead.TITLE),
    "batching_window": (batching_window.run, batching_window.TITLE),
    "priority_latency": (priority_latency.run, priority_latency.TITLE),
    "priority_batching": (priority_latency.run_batching, priority_latency.BATCHING_TITLE),
    "fleet": (fleet.run, fleet.TITLE),
    "generation": (generation.run, generation.TITLE),
    "genai": (genai.run, genai.TITLE),
    "simulation": (simulation.run, simulation.TITLE),
    "membership": (membership.run, membership.TITLE),
    "devices": (devices.run, devices.TITLE),
    "fidelity": (fidelity.run, fidelity.TITLE),
    "distribution": (distribution.run, distribution.TITLE),
    "rollout": (rollout.run, rollout.TITLE),
}


def build_parser(prog: str = "python -m bench.run") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run edgefleet's benchmarks and print a Markdown report (progress goes "
        "to stderr). Without --only, every scenario runs.",
        epilog=f"example: {prog} --quick --only priority_latency --out /tmp/results.md",
    )
    quick = "short durations: a smoke run in a few minutes"
    parser.add_argument("--quick", action="store_true", help=quick)
    only = f"run only these scenarios ({', '.join(SCENARIOS)})"
    parser.add_argument(
        "--only", nargs="+", action="extend", choices=list(SCENARIOS), metavar="NAME", help=only
    )
    out = "also write the report to this file"
    parser.add_argument("--out", type=Path, metavar="PATH", help=out)
    return parser


def _run_one(name: str, ctx: RunContext) -> Section:
    log(f"scenario {name}: start")
    run, title = SCENARIOS[name]

    def attempt() -> Section:
        try:
            return run(ctx)
        except Exception:
            raised = "The scenario raised before completing."
            return Section(title, raised, error=traceback.format_exc())

    section = bc.timed(attempt)
    verdict = "error" if section.error else ("all targets met" if section.passed else "misses")
    log(f"scenario {name}: done in {section.seconds:.0f} s ({verdict}); {section.cpu.describe()}")
    return section


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chosen = [name for name in SCENARIOS if name in set(args.only or SCENARIOS)]
    started, t0, cpu = bc.utc_now(), time.perf_counter(), bc.cpu_sample()
    mode = "quick" if args.quick else "full"
    log(f"{len(chosen)} scenario(s), {mode} mode; {bc.EnvFacts.collect().line()}")
    with bc.embedded_ray(num_cpus=2), bc.model_dir() as models:
        sections = [_run_one(name, RunContext(args.quick, models)) for name in chosen]
    seconds = time.perf_counter() - t0
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    mode = " (quick: a smoke run, figures are rough)" if args.quick else ""
    run = (
        f"`python -m bench.run{' ' + shown if shown else ''}`{mode}, {started}, "
        f"{seconds:.0f} s; other processes {bc.cpu_since(cpu).foreign_cores:.2f} cores"
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-")) / "RESULTS.md"
    print(bc.write_report(out, sections, run), end="")
    log(f"report written to {out}; finished in {seconds:.0f} s")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    raise SystemExit(main())
