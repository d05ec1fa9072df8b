"""Run the benchmarks and print a Markdown report.

    python -m bench.run [--quick] [--only NAME ...] [--out PATH]

Progress goes to stderr, the report to stdout (and to ``--out``; the project keeps
the last full run as ``bench/RESULTS.md``). Exit status: 0 when every scenario ran
(a missed target is reported, not an error), 1 when a scenario failed to run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import (
    batching_window,
    fleet,
    generation,
    node_overhead,
    priority_latency,
    simulation,
)
from bench.common import (
    CpuUse,
    EnvFacts,
    RunContext,
    Section,
    cpu_sample,
    cpu_since,
    embedded_ray,
    log,
    model_dir,
    utc_now,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[RunContext], Section]
    title: str


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("node_overhead", node_overhead.run, node_overhead.TITLE),
    Scenario("batching_window", batching_window.run, batching_window.TITLE),
    Scenario("priority_latency", priority_latency.run, priority_latency.TITLE),
    Scenario("priority_batching", priority_latency.run_batching, priority_latency.BATCHING_TITLE),
    Scenario("fleet", fleet.run, fleet.TITLE),
    Scenario("generation", generation.run, generation.TITLE),
    Scenario("simulation", simulation.run, simulation.TITLE),
)


def build_parser(prog: str = "python -m bench.run") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run edgefleet's benchmarks and print a Markdown report (progress goes "
        "to stderr). Without --only, every scenario runs.",
        epilog=f"example: {prog} --quick --only priority_latency --out /tmp/results.md",
    )
    parser.add_argument(
        "--quick", action="store_true", help="short durations: a smoke run in about two minutes"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        action="extend",
        choices=[s.name for s in SCENARIOS],
        metavar="NAME",
        help=f"run only these scenarios ({', '.join(s.name for s in SCENARIOS)})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="also write the report to this file (default: stdout only)",
    )
    return parser


def _run_one(scenario: Scenario, ctx: RunContext) -> Section:
    log(f"scenario {scenario.name}: start")
    t0 = time.perf_counter()
    cpu = cpu_sample()
    try:
        section = scenario.run(ctx)
    except Exception:
        section = Section(
            scenario.title, "The scenario raised before completing.", error=traceback.format_exc()
        )
    section.seconds = time.perf_counter() - t0
    section.cpu = cpu_since(cpu)
    verdict = "error" if section.error else ("all targets met" if section.passed else "misses")
    log(
        f"scenario {scenario.name}: done in {section.seconds:.0f} s ({verdict}); "
        f"{section.cpu.describe()}"
    )
    return section


def _verdict(section: Section) -> str:
    if section.error:
        return "did not run (error)"
    targets = section.all_targets
    if not targets:
        return "no targets"
    missed = [t.label for t in targets if not t.passed]
    met = len(targets) - len(missed)
    if not missed:
        return f"PASS ({met}/{len(targets)} targets met)"
    return f"MISS ({met}/{len(targets)} met; missed: {'; '.join(missed)})"


def render(
    sections: list[Section],
    facts: EnvFacts,
    *,
    quick: bool,
    started: str,
    seconds: float,
    cpu: CpuUse,
    argv: list[str],
) -> str:
    args = " ".join(argv)
    command = "python -m bench.run" + (f" {args}" if args else "")
    header = [
        "# edgefleet benchmark results",
        "",
        f"- Date: {started}",
        f"- Machine: {facts.line()}",
        f"- Mode: {'quick (smoke run; figures are rough)' if quick else 'full'}; "
        f"total run time {seconds:.0f} s; CPU during the run: {cpu.describe()}",
        "- Reproduce: from the source checkout, with the project installed "
        "(`pip install -e .`), run "
        "`python -m bench.run --out bench/RESULTS.md`; add "
        "`--quick` for a smoke run, `--only NAME` for one scenario. Models are generated "
        "and calibrated to this machine at the start of each run; Ray runs embedded on "
        "127.0.0.1.",
        f"- This report: `{command}`",
        "",
        "Every figure is a ratio of measurements taken side by side in this run: the "
        "machine is small and shared, so absolute numbers drift between runs.",
        "",
    ]
    summary = [
        "| scenario | result |",
        "| --- | --- |",
        *(f"| {s.title} | {_verdict(s)} |" for s in sections),
        "",
    ]
    body = "\n\n".join(s.markdown() for s in sections)
    return "\n".join(header + summary) + "\n" + body + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wanted = set(args.only or [s.name for s in SCENARIOS])
    chosen = [s for s in SCENARIOS if s.name in wanted]
    started = utc_now()
    t0 = time.perf_counter()
    cpu = cpu_sample()
    facts = EnvFacts.collect()
    log(f"{len(chosen)} scenario(s), {'quick' if args.quick else 'full'} mode; {facts.line()}")
    sections: list[Section] = []
    with embedded_ray(num_cpus=2), model_dir() as models:
        ctx = RunContext(quick=args.quick, models=models)
        for scenario in chosen:
            sections.append(_run_one(scenario, ctx))
    seconds = time.perf_counter() - t0
    shown = argv if argv is not None else sys.argv[1:]
    report = render(
        sections,
        facts,
        quick=args.quick,
        started=started,
        seconds=seconds,
        cpu=cpu_since(cpu),
        argv=shown,
    )
    print(report, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        log(f"report written to {args.out}")
    log(f"finished in {seconds:.0f} s")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    raise SystemExit(main())
