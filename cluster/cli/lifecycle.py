"""A fleet's lifecycle: `edgefleet validate`, `up`, `status` and `down`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from cluster.cli.common import (
    RawHelpFormatter,
    Subparsers,
    add_fleet_options,
    connect,
    err,
    fleet_client,
    say,
)
from cluster.cli.interrupts import StopAtOnce
from cluster.cli.tables import CLEAR_SCREEN, status_dict, status_line, status_table

if TYPE_CHECKING:
    from cluster.client import FleetClient
    from cluster.metrics import OverviewWindow
    from edgefleet.config import FleetConfig

# What is left of a Ray head whose GCS died ignores SIGTERM; nothing there to wait for.
DEAD_HEAD_GRACE_S = 0.5


def add_parser(sub: Subparsers) -> None:
    validate = sub.add_parser(
        "validate",
        help="check a fleet YAML file; exits non-zero and names each problem",
        description="Check a fleet YAML file as `up` would, without starting anything: the "
        "schema, and that each model file loads in ONNX Runtime (missing built-in models "
        "are only noted: `up` and `demo` write them). Exit status 2 names each problem.",
        epilog="example: edgefleet validate configs/local.yaml",
    )
    validate.add_argument("config", metavar="CONFIG")
    validate.set_defaults(func=cmd_validate)
    _add_up_parser(sub)
    _add_status_and_down_parsers(sub)


def _add_up_parser(sub: Subparsers) -> None:
    up = sub.add_parser(
        "up",
        help="deploy a fleet: on a running Ray cluster (--address) or an embedded one",
        epilog="examples:\n  edgefleet up configs/local.yaml            # serve until Ctrl-C\n"
        "  edgefleet up configs/local.yaml --detach   # leave it serving (`edgefleet down`)",
        formatter_class=RawHelpFormatter,
    )
    up.add_argument(
        "config",
        metavar="CONFIG",
        help="the fleet YAML; the fleet is named by its `fleet.name` (the --fleet of the "
        "other commands)",
    )
    up.add_argument("--address", help="Ray cluster address (default: start one on 127.0.0.1)")
    up.add_argument("--detach", action="store_true", help="return and leave the fleet serving")
    up.add_argument("--interval", type=float, default=2.0, help="seconds between status lines")
    up.add_argument(
        "--redis",
        action="store_true",
        help="with --detach: the head keeps its state in Redis and can restart (ray.redis)",
    )
    up.add_argument(
        "--start-timeout",
        type=float,
        metavar="SECONDS",
        help="give up on nodes not placed and started by then, and stop what was started "
        "(default: the config's ray.start_timeout_s, 300)",
    )
    up.set_defaults(func=cmd_up)


def _add_status_and_down_parsers(sub: Subparsers) -> None:
    for name, func, text in (
        ("status", cmd_status, "show queues, running work, models and health of a fleet"),
        ("down", cmd_down, "stop a fleet (and the Ray head `up --detach` started for it)"),
    ):
        p = sub.add_parser(name, help=text, epilog=f"example: edgefleet {name} --fleet local")
        add_fleet_options(p)
        p.set_defaults(func=func)
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
            p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
            p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
            p.add_argument(
                "--window",
                type=float,
                default=60.0,
                help="seconds the overview's rates cover (default: %(default)s, as the dashboard)",
            )


def cmd_validate(args: argparse.Namespace) -> int:
    from actors.engine import available_providers
    from cluster.modelfiles import provider_problems, require_loadable_models
    from edgefleet.config import load_config, missing_model_problem
    from edgefleet.modelgen import builtin_model

    config = load_config(args.config)
    later = {  # built-in models `up` and `demo` write when missing
        n: m.path
        for n, m in config.models.items()
        if not m.path.is_file() and builtin_model(m.path) is not None
    }
    require_loadable_models(config, [n for n in config.models if n not in later])
    specs = config.node_specs()
    loaded = f"{len(config.models) - len(later)} load in ONNX Runtime"
    models = f"{len(config.models)} model(s): {loaded}, {len(later)} built-in yet to be written"
    say(
        f"{args.config}: valid — fleet {config.fleet.name!r}, {len(specs)} node(s), "
        + (models if later else f"{len(config.models)} model(s); all {loaded}")
    )
    for spec in specs:
        say(f"  {spec.name}: {', '.join(spec.models)} (queue {spec.queue.capacity})")
    for pool in config.pools:  # what each member will be, on every Ray node that matches
        spec = config.member_spec(pool.name, "DEVICE", "")
        selector = ", ".join(f"{k}={v}" for k, v in pool.selector.items())
        say(
            f"  pool {pool.name} ({selector}): {spec.name}: {', '.join(spec.models)} "
            f"(queue {spec.queue.capacity})"
        )
    for name, path in later.items():
        say(f"  note: {missing_model_problem(name, path)}")
    for problem in provider_problems(config, available_providers()):
        say(f"  note: on this machine (where `up` without --address runs nodes): {problem}")
    return 0


def _load_with_models(path: str, *, here: bool = False) -> FleetConfig:
    """Load a fleet file; write the built-in models it names that are missing; check
    every model loads as a node would load it, and, when its nodes run ``here`` (on
    this machine), that this machine's ONNX Runtime has each strict model's provider."""
    from actors.engine import available_providers
    from cluster.modelfiles import provider_problems, require_loadable_models
    from edgefleet.config import load_config
    from edgefleet.errors import ConfigError
    from edgefleet.modelgen import make_missing_models

    config = load_config(path)
    make_missing_models(config, say)
    require_loadable_models(config)
    problems = provider_problems(config, available_providers()) if here else []
    if problems:
        raise ConfigError("nodes would not load their models here:\n  " + "\n  ".join(problems))
    return config


def cmd_up(args: argparse.Namespace) -> int:
    import ray

    from cluster.client import FleetClient
    from cluster.deploy import deploy_nodes, deploy_router, start_local_ray, teardown
    from cluster.head import head_dir, start_head, stop_children, stop_head
    from cluster.store import publish

    # Inside a Ray job (`ray job submit ... -- edgefleet up ...`) Ray sets RAY_ADDRESS.
    address = args.address or os.environ.get("RAY_ADDRESS")
    config = _load_with_models(args.config, here=not address)
    if args.start_timeout is not None:
        limits = config.ray.model_copy(update={"start_timeout_s": args.start_timeout})
        config = config.model_copy(update={"ray": limits})
    fleet = config.fleet.name
    specs = config.node_specs()
    token_auth = config.ray.auth == "token"
    nodes: dict[str, Any] = {}
    router = None
    client: FleetClient | None = None
    head = False  # a Ray head this command starts: stopped unless the fleet comes up
    keep = False  # a detached fleet that came up keeps serving
    try:
        if address:
            say(f"connecting to the Ray cluster at {address}")
            connect(address, fleet, token_auth=token_auth)
        elif args.detach:
            _clear_recorded_head(fleet)
            head = True
            address = start_head(
                fleet,
                config.local.num_cpus or max(2, len(specs)),
                dashboard_port=config.ray.dashboard_port,
                token_auth=token_auth,
                redis=args.redis or config.ray.redis,
            )
            port = config.ray.dashboard_port
            jobs = f"; dashboard and job API on http://127.0.0.1:{port}" if port else ""
            say(f"started a Ray head on {address} (loopback only{jobs})")
            connect(address, fleet)
            _write_service_discovery(fleet)
        else:
            say("starting an embedded Ray cluster on 127.0.0.1")
            with StopAtOnce():
                start_local_ray(config, log_to_driver=False)
        config = publish(config, say)
        nodes = deploy_nodes(config, say, detached=args.detach)
        router = deploy_router(config, say)
        pools = f", pool(s) {', '.join(p.name for p in config.pools)}" if config.pools else ""
        say(
            f"fleet {fleet!r} is up: {len(nodes)} node(s){pools}, models {', '.join(config.models)}"
        )
        if args.detach:
            keep = True
            say(f"it keeps serving: `edgefleet status --fleet {fleet}`; stop it with")
            say(f"`edgefleet down --fleet {fleet}`")
            return 0
        client = FleetClient(config, router, nodes)
        _serve(client, args.interval)
        return 0
    finally:
        if not keep:  # served until Ctrl-C, or did not come up: stop what was started
            if client is not None:
                client.close()  # leaves the fleet to the teardown below
            if ray.is_initialized():
                teardown(nodes, router, timeout_s=1.0, fleet=fleet)
                ray.shutdown()
            if not address:  # an embedded Ray whose start was cut short leaves processes
                stop_children()
            if head:
                count = stop_head(fleet)
                say(
                    f"stopped the Ray head it started ({count} processes) and removed "
                    f"{head_dir(fleet)}"
                )


def _serve(client: FleetClient, interval: float) -> None:
    """A status line every ``interval`` seconds until Ctrl-C."""
    say("serving until Ctrl-C")
    try:
        while True:
            time.sleep(interval)
            say(status_line(client.status()))
    except KeyboardInterrupt:
        say("stopping the fleet")


def _clear_recorded_head(fleet: str) -> None:
    """Before ``up --detach`` starts a head for ``fleet``: refuse if the one recorded
    for it still runs; clean up after one that died."""
    from cluster.head import reachable, recorded_address, stop_head
    from edgefleet.errors import FleetStartError

    recorded = recorded_address(fleet)
    if recorded is None:
        return
    if reachable(recorded):
        raise FleetStartError(
            f"fleet {fleet!r} is already running (its Ray head is at {recorded}); stop it "
            f"with `edgefleet down --fleet {fleet}`"
        )
    count = stop_head(fleet, grace_s=DEAD_HEAD_GRACE_S)
    say(
        f"cleaned up after fleet {fleet!r}'s earlier Ray head, which had died "
        f"({count} leftover processes)"
    )


def _write_service_discovery(fleet: str) -> None:
    from cluster.head import head_dir
    from cluster.metrics import write_service_discovery

    try:
        path = write_service_discovery(head_dir(fleet))
    except OSError as exc:
        err(f"note: no Prometheus service-discovery file ({exc})")
        return
    say(f"Prometheus finds its metrics through {path} (`edgefleet dashboard prometheus-config`)")


def cmd_down(args: argparse.Namespace) -> int:
    import ray

    from cluster.deploy import find_fleet, node_handles, teardown
    from cluster.head import head_dir, reachable, recorded_address, stop_head
    from edgefleet.errors import FleetNotRunning

    fleet = args.fleet
    recorded = None if args.address else recorded_address(fleet)
    if recorded is not None and not reachable(recorded):  # its head died: clean up after it
        count = stop_head(fleet, grace_s=DEAD_HEAD_GRACE_S)
        say(
            f"the Ray head `edgefleet up --detach` started for fleet {fleet!r} at {recorded} "
            f"was gone; cleaned up {count} leftover processes and removed {head_dir(fleet)}"
        )
        return 0
    try:
        # The nodes hear stop (queued callers get Cancelled) before the head goes.
        connect(args.address, fleet)
        router, config = find_fleet(fleet)
        stopped = teardown(node_handles(config), router, fleet=fleet)
        say(f"fleet {fleet!r} stopped ({stopped} node(s) and its router)")
    except FleetNotRunning as exc:
        if recorded is None:
            raise FleetNotRunning(f"nothing to stop: {exc}") from None
        say(f"note: {exc}")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if recorded is not None:
            count = stop_head(fleet)
            say(
                f"stopped the Ray head `edgefleet up` started ({count} processes) and removed "
                f"{head_dir(fleet)}"
            )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.metrics import OverviewWindow

    window = OverviewWindow(args.window)
    live = args.watch and not args.json and sys.stdout.isatty()
    try:
        with fleet_client(args) as client:
            return _show_status(client, args, window, live)
    except KeyboardInterrupt:
        if not args.watch:
            raise
        return 0  # Ctrl-C is how --watch ends


def _show_status(
    client: FleetClient, args: argparse.Namespace, window: OverviewWindow, live: bool
) -> int:
    while True:
        status = client.status()
        overview = window.add(status)
        if args.json:
            say(json.dumps(status_dict(status, overview), indent=2))
        else:
            screen = status_table(status, overview)
            say(CLEAR_SCREEN + screen if live else screen)
        if not args.watch:
            return 0
        time.sleep(args.interval)
