"""The `edgefleet` command line: one module per command group, assembled here.

Each module adds its commands' parsers (``add_parser``) and holds their functions;
a command function takes the parsed arguments and returns the exit status.
"""

from __future__ import annotations

import argparse
import os
import textwrap

from cluster.cli import (
    dashboard,
    demo,
    device,
    drive,
    inference,
    lifecycle,
    models,
    rollout,
    simulate,
)
from cluster.cli.common import Parser, RawHelpFormatter, err
from cluster.cli.interrupts import exit_on_stuck_interrupt
from edgefleet.errors import EdgeFleetError

# The commands that start or join a Ray.
RAY_COMMANDS = ("up", "down", "status", "infer", "generate", "drive", "rollout")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="edgefleet",
        description="Priority-aware inference scheduling across a fleet of edge nodes.",
        formatter_class=RawHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              edgefleet demo                          # embedded fleet, mixed workload, report
              edgefleet up configs/local.yaml --detach && edgefleet status --fleet local
              edgefleet generate tiny_lm --fleet local --prompt-ids 1 2 3 --max-new-tokens 16
              edgefleet infer classifier --fleet local --input frame.npz --priority inline
              edgefleet models make configs/models    # generate the built-in test models
              edgefleet models show configs/local.yaml  # every model's inputs and outputs
              edgefleet validate configs/local.yaml   # check a fleet file
              edgefleet rollout configs/local.yaml classifier --to v2/classifier.onnx
              edgefleet dashboard export fleet.json   # the Grafana dashboard
              edgefleet drive configs/local.yaml --workload configs/sim/steady.yaml  # live
              edgefleet join 10.0.0.1:6379 --labels zone=dock  # on a device: join the cluster
            """
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups = (models, lifecycle, rollout, device, inference, demo, dashboard, simulate, drive)
    for group in groups:  # help's order
        group.add_parser(sub)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; its exit status: 2 for an error the command names, 130 for
    Ctrl-C. Touches no signal handler, so tests run commands in-process through it."""
    try:
        return int(args.func(args))
    except EdgeFleetError as exc:
        err(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        err("interrupted")
        return 130


def main(argv: list[str] | None = None) -> int:
    # A command talks to the Ray it started or connected to, never to one Ray would
    # start by itself when a call comes after shutdown (a thread still finishing).
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    args = build_parser().parse_args(argv)
    if args.command not in RAY_COMMANDS:
        return run(args)
    exit_on_stuck_interrupt()
    try:
        return run(args)
    finally:  # done: Ray's exit handlers finish uninterrupted
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
