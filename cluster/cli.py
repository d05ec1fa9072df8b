"""The `edgefleet` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.errors import EdgeFleetError

if TYPE_CHECKING:
    from cluster.client import FleetStatus
    from edgefleet.config import FleetConfig

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
    _say(
        f"{args.config}: valid — fleet {config.fleet.name!r}, {len(specs)} node(s), "
        f"{len(config.models)} model(s)"
    )
    for spec in specs:
        _say(f"  {spec.name}: {', '.join(spec.models)} (queue {spec.queue.capacity})")
    for m in config.missing_models():
        _say(f"  note: model file not found yet: {m}")
    return 0


def _load_with_models(path: str) -> FleetConfig:
    """Load a fleet file; write the built-in models it names that are missing."""
    from edgefleet.config import load_config
    from edgefleet.modelgen import make_missing_models

    config = load_config(path)
    make_missing_models(config, _say)
    config.require_models()
    return config


def _connect(address: str | None, fleet: str, *, token_auth: bool = False) -> None:
    from cluster.deploy import connect_ray

    connect_ray(address, fleet, token_auth=token_auth)


def cmd_up(args: argparse.Namespace) -> int:
    import ray

    from cluster.client import FleetClient
    from cluster.deploy import deploy_nodes, deploy_router, start_local_ray
    from cluster.deploy import teardown as stop_fleet

    config = _load_with_models(args.config)
    fleet = config.fleet.name
    specs = config.node_specs()
    # Inside a Ray job (`ray job submit ... -- edgefleet up ...`) Ray sets RAY_ADDRESS.
    address = args.address or os.environ.get("RAY_ADDRESS")
    token_auth = config.ray.auth == "token"
    if address:
        _say(f"connecting to the Ray cluster at {address}")
        _connect(address, fleet, token_auth=token_auth)
    elif args.detach:
        from cluster.head import start_head

        address = start_head(
            fleet,
            config.local.num_cpus or max(2, len(specs)),
            dashboard_port=config.ray.dashboard_port,
            token_auth=token_auth,
        )
        port = config.ray.dashboard_port
        jobs = f"; dashboard and job API on http://127.0.0.1:{port}" if port else ""
        _say(f"started a Ray head on {address} (loopback only{jobs})")
        _connect(address, fleet)
    else:
        _say("starting an embedded Ray cluster on 127.0.0.1")
        start_local_ray(config)
    nodes = deploy_nodes(config, _say, detached=args.detach)
    router = deploy_router(config)
    _say(f"fleet {fleet!r} is up: {len(nodes)} node(s), models {', '.join(config.models)}")
    if args.detach:
        _say(f"it keeps serving: `edgefleet status --fleet {fleet}`; stop it with")
        _say(f"`edgefleet down --fleet {fleet}`")
        return 0
    client = FleetClient(config, router, nodes)
    _say("serving until Ctrl-C")
    try:
        while True:
            time.sleep(args.interval)
            _say(status_line(client.status()))
    except KeyboardInterrupt:
        _say("stopping the fleet")
    finally:
        stop_fleet(nodes, router)
        ray.shutdown()
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    import ray

    from cluster.deploy import find_fleet, node_handles, teardown
    from cluster.head import recorded_address, stop_head

    started_head = recorded_address(args.fleet) is not None and not args.address
    try:
        _connect(args.address, args.fleet)
        router, config = find_fleet(args.fleet)
        teardown(node_handles(config), router)
        _say(f"fleet {args.fleet!r} stopped ({len(config.node_specs())} node(s) and its router)")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if started_head:
            count = stop_head(args.fleet)
            _say(f"stopped the Ray head `edgefleet up` started ({count} processes)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.client import FleetClient

    _connect(args.address, args.fleet)
    client = FleetClient.connect(fleet=args.fleet)
    while True:
        status = client.status()
        if args.json:
            _say(json.dumps(status_dict(status), indent=2))
        else:
            _say(status_table(status))
        if not args.watch:
            return 0
        time.sleep(args.interval)


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from cluster.client import FleetClient

    try:
        with np.load(args.input, allow_pickle=False) as data:
            inputs = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        _err(f"cannot read inputs from {args.input}: {exc} (expected an .npz of named arrays)")
        return 2
    _connect(args.address, args.fleet)
    client = FleetClient.connect(fleet=args.fleet)
    deadline = None if args.deadline_ms is None else args.deadline_ms / 1000
    reply = client.infer_reply(
        args.model, inputs, priority=_priority(args.priority), deadline_s=deadline
    )
    outputs = reply.unwrap()
    for name, value in outputs.items():
        head = np.array2string(value.ravel()[:8], precision=4)
        _say(f"{name}: {value.dtype.name} {list(value.shape)} {head}")
    _say(
        f"node {reply.node}: queued {reply.queue_s * 1000:.1f} ms, engine "
        f"{reply.service_s * 1000:.1f} ms, batch of {reply.batch_size}"
    )
    if args.out:
        np.savez(args.out, **outputs)  # type: ignore[arg-type]
        _say(f"outputs written to {args.out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.client import FleetClient

    _connect(args.address, args.fleet)
    client = FleetClient.connect(fleet=args.fleet)
    stream = client.generate(
        args.model,
        args.prompt_ids,
        max_new_tokens=args.max_new_tokens,
        priority=_priority(args.priority),
        session=args.session,
        prefix_len=args.prefix_len,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    for token in stream:
        print(token, end=" ", flush=True)
    print(flush=True)
    r = stream.result
    assert r is not None
    first = f"{r.first_token_s * 1000:.1f} ms" if r.first_token_s is not None else "-"
    _err(
        f"finish: {r.finish_reason} ({len(r.tokens)} tokens on {r.node}; first token {first}, "
        f"total {r.total_s * 1000:.1f} ms, paused {r.pauses}x)"
    )
    return 0


def _priority(value: str) -> str | int:
    return int(value) if value.isdigit() else value


def status_dict(status: FleetStatus) -> dict[str, Any]:
    return {
        "fleet": status.fleet,
        "router": status.router,
        "totals": status.totals,
        "nodes": [
            {**dataclasses.asdict(n), "healthy": status.healthy.get(n.name, False)}
            for n in status.nodes
        ],
    }


def status_line(status: FleetStatus) -> str:
    t, r = status.totals, status.router
    queues = " ".join(f"{n.name}:{n.queue_length}" for n in status.nodes)
    return (
        f"completed {t.get('completed', 0)}  rejected {r.get('rejected', 0)}  "
        f"evicted {t.get('evicted', 0)}  spilled {r.get('spilled', 0)}  "
        f"re-placed {r.get('replaced', 0)}  queues {queues}"
    )


def status_table(status: FleetStatus) -> str:
    lines = [f"fleet {status.fleet}", ""]
    lines.append(
        f"{'node':<12}{'health':<9}{'state':<10}{'queued by priority':<28}{'running':<22}models"
    )
    for n in status.nodes:
        queued = " ".join(f"{p}:{c}" for p, c in sorted(n.queued.items(), reverse=True)) or "-"
        running = "-"
        if n.running is not None:
            running = f"{n.running.model} x{len(n.running.request_ids)} p{n.running.priority}"
        models = ", ".join(m.name + ("*" if m.loaded else "") for m in n.models)
        health = "ok" if status.healthy.get(n.name) else "LOST"
        lines.append(f"{n.name:<12}{health:<9}{n.state:<10}{queued:<28}{running:<22}{models}")
    lost = [name for name, ok in status.healthy.items() if not ok]
    for name in lost:
        if all(n.name != name for n in status.nodes):
            lines.append(f"{name:<12}{'LOST':<9}")
    lines += ["", "(* = resident)", status_line(status)]
    return "\n".join(lines)


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
              edgefleet up configs/local.yaml --detach && edgefleet status --fleet local
              edgefleet generate tiny_lm --fleet local --prompt-ids 1 2 3 --max-new-tokens 16
              edgefleet infer classifier --fleet local --input frame.npz --priority inline
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

    up = sub.add_parser(
        "up",
        help="deploy a fleet: on a running Ray cluster (--address) or an embedded one",
        epilog="examples:\n  edgefleet up configs/local.yaml            # serve until Ctrl-C\n"
        "  edgefleet up configs/local.yaml --detach   # leave it serving (`edgefleet down`)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("config", metavar="CONFIG")
    up.add_argument("--address", help="Ray cluster address (default: start one on 127.0.0.1)")
    up.add_argument("--detach", action="store_true", help="return and leave the fleet serving")
    up.add_argument("--interval", type=float, default=2.0, help="seconds between status lines")
    up.set_defaults(func=cmd_up)

    for name, func, text in (
        ("status", cmd_status, "show queues, running work, models and health of a fleet"),
        ("down", cmd_down, "stop a fleet (and the Ray head `up --detach` started for it)"),
    ):
        p = sub.add_parser(name, help=text, epilog=f"example: edgefleet {name} --fleet local")
        p.add_argument("--fleet", default="local", help="fleet name (default: %(default)s)")
        p.add_argument("--address", help="Ray cluster address (default: the one `up` started)")
        p.set_defaults(func=func)
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
            p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
            p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")

    infer = sub.add_parser(
        "infer",
        help="run one inference on a running fleet",
        epilog="example: edgefleet infer classifier --input frame.npz --priority inline "
        "--deadline-ms 200 --out result.npz",
    )
    infer.add_argument("model", metavar="MODEL")
    infer.add_argument("--input", required=True, metavar="FILE.npz", help="named input arrays")
    infer.add_argument("--out", metavar="FILE.npz", help="write the outputs here")
    infer.add_argument("--deadline-ms", type=float, help="give up if not started by then")
    infer.set_defaults(func=cmd_infer)

    generate = sub.add_parser(
        "generate",
        help="stream a generation from a decoder model on a running fleet",
        epilog="example: edgefleet generate tiny_lm --prompt-ids 5 17 42 --max-new-tokens 32 "
        "--priority background",
    )
    generate.add_argument("model", metavar="MODEL")
    generate.add_argument("--prompt-ids", type=int, nargs="+", required=True, metavar="ID")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--session", help="chat session: later turns reuse its KV cache")
    generate.add_argument("--prefix-len", type=int, default=0, help="tokens of shared prefix")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    generate.add_argument("--seed", type=int, help="sampling seed")
    generate.set_defaults(func=cmd_generate)

    for p in (infer, generate):
        p.add_argument("--priority", default="foreground", help="class name or 0-10")
        p.add_argument("--fleet", default="local", help="fleet name (default: %(default)s)")
        p.add_argument("--address", help="Ray cluster address (default: the one `up` started)")

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
