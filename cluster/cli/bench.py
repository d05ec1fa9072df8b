"""`edgefleet bench`: the benchmarks of the source checkout (bench/)."""

from __future__ import annotations

import argparse
import os
import sys

from cluster.cli.common import Subparsers, err


def add_parser(sub: Subparsers) -> None:
    bench = sub.add_parser(  # its options and --help are bench.run's own
        "bench",
        help="run the benchmarks and print the report (see bench/RESULTS.md)",
        add_help=False,
    )
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.getcwd())  # the benchmarks live in the source checkout
    try:
        from bench.run import main as bench_main
    except ImportError:
        err("the benchmarks live in the source checkout (bench/); run from its top folder")
        return 2
    return bench_main(args.rest, prog="edgefleet bench")
