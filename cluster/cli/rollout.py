"""`edgefleet rollout`: a model's new version across a running fleet, node by node, its
status, an abort, and pins of a node or pool to a version."""

from __future__ import annotations

import argparse
import time

from cluster.cli.common import RawHelpFormatter, Subparsers, add_fleet_options, fleet_client, say
from edgefleet.artifacts import split_version
from edgefleet.errors import InvalidInput
from policies.rollout import DEFAULT_GATES

# Each action's arguments after it: (fewest, most), and its usage.
ACTIONS = {
    "status": ((0, 1), "status [MODEL]"),
    "abort": ((1, 1), "abort MODEL"),
    "pin": ((2, 2), "pin NODE|POOL MODEL@VERSION"),
    "unpin": ((2, 2), "unpin NODE|POOL MODEL"),
}


def add_parser(sub: Subparsers) -> None:
    rollout = sub.add_parser(
        "rollout",
        help="roll a model's new version out to a running fleet: a canary, then steps, "
        "gated, rolled back when it fails; its status, abort, pins",
        description="Moves MODEL to the ONNX file --to node by node: --canary nodes first, "
        "then --step at a time. Each node fetches the new files while it serves, finishes "
        "what it holds of the model (new requests go to other nodes), loads, warms up and "
        "admits again. After each step the moved nodes serve for --bake seconds while the "
        "gates compare them with the nodes still on the old version; a failed gate, or a "
        "node where the new version does not load, moves every moved node back.",
        epilog="examples:\n"
        "  edgefleet rollout configs/local.yaml classifier --to models/v2/classifier.onnx \\\n"
        "      --canary 1 --step 50% --bake 120 --gate 'error_rate<=0.01,p99<=1.5x'\n"
        "  edgefleet rollout status --fleet local\n"
        "  edgefleet rollout abort classifier --fleet local\n"
        "  edgefleet rollout pin camera-3 classifier@3f2a9c1d04be --fleet local\n"
        "  edgefleet rollout unpin camera-3 classifier --fleet local",
        formatter_class=RawHelpFormatter,
    )
    rollout.add_argument(
        "what",
        nargs="+",
        metavar="ARG",
        help="CONFIG MODEL (start a rollout; CONFIG: the fleet's YAML), or: status [MODEL] | "
        "abort MODEL | pin NODE|POOL MODEL@VERSION | unpin NODE|POOL MODEL",
    )
    rollout.add_argument("--to", metavar="PATH", help="the new version's ONNX file")
    rollout.add_argument("--version", help="its name (default: its digest's first 12 hex digits)")
    rollout.add_argument(
        "--canary", default="1", help="nodes moved first: a count or a share such as 10%%"
    )
    rollout.add_argument("--step", default="25%", help="nodes moved at a time after the canary")
    rollout.add_argument(
        "--bake", type=float, default=60.0, help="seconds the gates watch after each step"
    )
    rollout.add_argument(
        "--gate",
        default=DEFAULT_GATES,
        help="METRIC<=LIMIT,...: error_rate (a fraction) or p50/p90/p99 of the engine time "
        "per request, as a multiple of the old version's (1.5x) or in ms or s",
    )
    rollout.add_argument(
        "--allow-signature-change",
        action="store_true",
        help="roll out a file whose inputs or outputs differ from the version served",
    )
    rollout.add_argument(
        "--no-wait", action="store_true", help="start it and return (see `rollout status`)"
    )
    add_fleet_options(rollout)
    rollout.set_defaults(func=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    action, rest = args.what[0], args.what[1:]
    if action not in ACTIONS:
        return _start(args)
    (fewest, most), usage = ACTIONS[action]
    if not fewest <= len(rest) <= most:
        raise InvalidInput(f"usage: edgefleet rollout {usage}")
    with fleet_client(args) as client:
        if action == "abort":
            client.abort_rollout(rest[0])
            ended = client.wait_rollout(rest[0], progress=say)
            return 0 if ended.phase == "aborted" else 1
        if action in ("pin", "unpin"):
            target, model = rest
            name, version = split_version(model)
            if action == "pin" and version is None:
                raise InvalidInput(f"pin {target} {model}: give MODEL@VERSION")
            client.pin(target, name, version if action == "pin" else None)
            what = f"{name}@{version}" if action == "pin" else f"{name} as the fleet serves it"
            say(f"{target} serves {what}; its nodes move when they are free")
            return 0
        shown = [r for r in client.rollouts() if not rest or r.model == rest[0]]
        if not shown:
            say("no rollout" + (f" of {rest[0]}" if rest else ""))
        for r in shown:
            say(r.summary())
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started))
            say(f"  started {started}; gates {','.join(map(str, r.gates)) or 'none'}")
            for event in r.events[-5:]:
                say(f"  {event}")
        return 0


def _start(args: argparse.Namespace) -> int:
    from edgefleet.config import load_config

    if len(args.what) != 2 or args.to is None:
        raise InvalidInput(
            "usage: edgefleet rollout CONFIG MODEL --to PATH (or: status, abort, pin, unpin)"
        )
    config = load_config(args.what[0])
    args.fleet = config.fleet.name
    with fleet_client(args) as client:
        ended = client.rollout(
            args.what[1],
            args.to,
            version=args.version,
            canary=args.canary,
            step=args.step,
            bake_s=args.bake,
            gates=args.gate,
            allow_signature_change=args.allow_signature_change,
            wait=not args.no_wait,
            progress=say,
        )
    if args.no_wait:
        return 0
    say(ended.summary())
    return 0 if ended.phase == "done" else 1
