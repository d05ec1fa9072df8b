"""The `edgefleet` command line."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from edgefleet.errors import EdgeFleetError

DEFAULT_CONFIG = Path("configs/local.yaml")


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    print(msg, flush=True)


def cmd_models_make(args: argparse.Namespace) -> int:
    from edgefleet.modelgen import BUILTIN_MODELS

    names = args.only or list(BUILTIN_MODELS)
    unknown = [n for n in names if n not in BUILTIN_MODELS]
    if unknown:
        _err(f"unknown model(s): {', '.join(unknown)}; built-in: {', '.join(BUILTIN_MODELS)}")
        return 2
    directory = Path(args.dir)
    for i, name in enumerate(names, 1):
        spec = BUILTIN_MODELS[name]
        path = spec(directory / spec.filename)
        _say(f"[{i}/{len(names)}] {name:<11} {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from edgefleet.config import load_config

    config = load_config(args.config)
    specs = config.node_specs()
    missing = [f"{n}: {m.path}" for n, m in config.models.items() if not m.path.is_file()]
    _say(
        f"{args.config}: valid — fleet {config.fleet.name!r}, {len(specs)} node(s), "
        f"{len(config.models)} model(s)"
    )
    for spec in specs:
        _say(f"  {spec.name}: {', '.join(spec.models)} (queue {spec.queue.capacity})")
    for m in missing:
        _say(f"  note: model file not found yet: {m}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cluster.demo import run_demo

    if not Path(args.config).is_file():
        _err(f"config {args.config} not found; run from the edgefleet checkout or pass --config")
        return 2
    run_demo(Path(args.config), args.duration, out=_say)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.getcwd())  # the benchmarks live in the source checkout
    try:
        from bench.run import main as bench_main
    except ImportError:
        _err("the benchmarks live in the source checkout (bench/); run from its top folder")
        return 2
    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet",
        description="Priority-aware inference scheduling across a fleet of edge nodes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              edgefleet demo                          # embedded fleet, mixed workload, report
              edgefleet models make configs/models    # generate the built-in test models
              edgefleet validate configs/local.yaml   # check a fleet file
              edgefleet bench --quick                 # benchmarks (from the source checkout)
            """
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", help="generate the built-in test models")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    make = models_sub.add_parser(
        "make",
        help="write deterministic small ONNX models into DIR",
        epilog="example: edgefleet models make configs/models --only classifier slow",
    )
    make.add_argument("dir", metavar="DIR")
    make.add_argument("--only", nargs="+", metavar="NAME", help="only these models")
    make.set_defaults(func=cmd_models_make)

    validate = sub.add_parser(
        "validate",
        help="check a fleet YAML file; exits non-zero and names each problem",
        epilog="example: edgefleet validate configs/local.yaml",
    )
    validate.add_argument("config", metavar="CONFIG")
    validate.set_defaults(func=cmd_validate)

    demo = sub.add_parser(
        "demo",
        help="run a mixed workload on the embedded default fleet and print a report",
        epilog="example: edgefleet demo --duration 30",
    )
    demo.add_argument("--config", default=str(DEFAULT_CONFIG), help="default: %(default)s")
    demo.add_argument(
        "--duration", type=float, default=20.0, help="seconds of traffic (default: %(default)s)"
    )
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser(
        "bench",
        help="run the benchmarks and print the report (see bench/RESULTS.md)",
        description="Run the benchmarks from the source checkout. Options go to bench.run: "
        "--quick (a short smoke run), --only NAME ..., --out PATH.",
        epilog="example: edgefleet bench --quick --out /tmp/results.md",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return int(args.func(args))
    except EdgeFleetError as exc:
        _err(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
