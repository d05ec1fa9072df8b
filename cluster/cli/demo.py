"""`edgefleet demo`: a mixed workload on the embedded default fleet, and its report."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.cli.common import Subparsers, err, say

DEFAULT_CONFIG = Path("configs/local.yaml")


def add_parser(sub: Subparsers) -> None:
    demo = sub.add_parser(
        "demo",
        help="run a mixed workload on the embedded default fleet and print a report",
        epilog="example: edgefleet demo --duration 30",
    )
    demo.add_argument("--config", default=str(DEFAULT_CONFIG), help="default: %(default)s")
    demo.add_argument(
        "--duration", type=float, default=60.0, help="seconds of traffic (default: %(default)s)"
    )
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from cluster.demo import run_demo

    if not Path(args.config).is_file():
        err(f"config {args.config} not found; run from the edgefleet checkout or pass --config")
        return 2
    run_demo(Path(args.config), args.duration, out=say)
    return 0
