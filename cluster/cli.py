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
    from cluster.metrics import Overview
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
        _write_service_discovery(fleet)
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


def _write_service_discovery(fleet: str) -> None:
    from cluster.head import head_dir
    from cluster.metrics import write_service_discovery

    try:
        path = write_service_discovery(head_dir(fleet))
    except OSError as exc:
        _err(f"note: no Prometheus service-discovery file ({exc})")
        return
    _say(f"Prometheus finds its metrics through {path} (`edgefleet dashboard prometheus-config`)")


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
    from cluster.metrics import OverviewWindow

    _connect(args.address, args.fleet)
    client = FleetClient.connect(fleet=args.fleet)
    window = OverviewWindow(args.window)
    live = args.watch and not args.json and sys.stdout.isatty()
    while True:
        status = client.status()
        overview = window.add(status)
        if args.json:
            _say(json.dumps(status_dict(status, overview), indent=2))
        else:
            screen = status_table(status, overview)
            _say(CLEAR_SCREEN + screen if live else screen)
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


CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, clear: --watch redraws in place


def _no_nan(value: Any) -> Any:
    """JSON has no NaN: a latency with no requests behind it becomes null."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return None if isinstance(value, float) and value != value else value


def status_dict(status: FleetStatus, overview: Overview | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fleet": status.fleet,
        "router": status.router,
        "callers": status.callers,
        "placement": status.placement,
        "totals": status.totals,
        "nodes": [
            {**dataclasses.asdict(n), "healthy": status.healthy.get(n.name, False)}
            for n in status.nodes
        ],
    }
    if overview is not None:
        out["overview"] = _no_nan(dataclasses.asdict(overview))
    return out


def status_line(status: FleetStatus) -> str:
    t, r = status.totals, status.router
    queues = " ".join(f"{n.name}:{n.queue_length}" for n in status.nodes)
    return (
        f"completed {t.get('completed', 0)}  rejected {r.get('rejected', 0)}  "
        f"evicted {t.get('evicted', 0)}  spilled {r.get('spilled', 0)}  "
        f"re-placed {r.get('replaced', 0)}  queues {queues}"
    )


def overview_lines(o: Overview) -> list[str]:
    """The dashboard's overview row as text: the same figures over the same window."""

    def ms(v: float) -> str:
        return "-" if v != v else f"{v * 1000:.0f}"

    classes = [c for c in o.classes if c in o.p50]
    latency = "  ".join(f"{c} {ms(o.p50[c])}/{ms(o.p99[c])}" for c in classes) or "-"
    if o.seconds <= 0:
        return [
            "overview since the nodes started (rates need a second snapshot: --watch)",
            f"  latency p50/p99 ms   {latency}",
            f"  rejected {o.rejected} in all   evicted {o.evicted} in all",
        ]
    per_class = "  ".join(f"{c} {o.throughput.get(c, 0.0):.1f}" for c in classes)
    return [
        f"overview over the last {o.seconds:.0f} s (the dashboard's Fleet overview)",
        f"  throughput {o.total_throughput:.1f} req/s   {per_class}",
        f"  latency p50/p99 ms   {latency}",
        f"  rejected {o.rejected_per_s or 0.0:.2f}/s ({o.rejected} in all)   "
        f"evicted {o.evicted_per_s or 0.0:.2f}/s ({o.evicted} in all)",
    ]


def status_table(status: FleetStatus, overview: Overview | None = None) -> str:
    lines = [f"fleet {status.fleet}", ""]
    if status.placement:
        lines += [
            f"placement: {status.placement}; placed by {status.callers} caller(s) "
            "straight to the nodes",
            "",
        ]
    if overview is not None:
        lines += [*overview_lines(overview), ""]
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
        if n.paused or n.lifecycle != "foreground" or any(n.kv_bytes.values()):
            paused = " ".join(f"{p}:{c}" for p, c in sorted(n.paused.items(), reverse=True))
            kv = sum(n.kv_bytes.values()) / (1024 * 1024)
            lines.append(
                f"{'':<12}lifecycle {n.lifecycle}; paused {paused or '-'}; KV cache {kv:.1f} MiB"
            )
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


def cmd_dashboard_export(args: argparse.Namespace) -> int:
    from cluster.dashboard import export

    path = export(Path(args.file))
    _say(f"wrote the Grafana dashboard to {path} (import it in Grafana, or `dashboard push`)")
    return 0


def cmd_dashboard_push(args: argparse.Namespace) -> int:
    from cluster.dashboard import FOLDER_TITLE, push

    result = push(args.url, os.environ.get("GRAFANA_TOKEN"))
    verb = "created" if result.created else "updated"
    folder = f"new folder {FOLDER_TITLE!r}" if result.folder_created else f"folder {FOLDER_TITLE!r}"
    _say(f"dashboard {verb} in {folder} (version {result.version}): {result.url}")
    return 0


def cmd_dashboard_prometheus(args: argparse.Namespace) -> int:
    from cluster.head import head_dir, recorded_address
    from cluster.metrics import SERVICE_DISCOVERY_FILE, default_temp_dir, prometheus_config

    if args.sd_file:
        sd_file = Path(args.sd_file)
    elif recorded_address(args.fleet) is not None:
        sd_file = head_dir(args.fleet) / SERVICE_DISCOVERY_FILE
    else:
        sd_file = default_temp_dir() / SERVICE_DISCOVERY_FILE
    text = prometheus_config(sd_file.absolute(), scrape_interval=args.scrape_interval)
    if args.out:
        Path(args.out).write_text(text)
        _say(f"wrote {args.out}: Prometheus scrapes the Ray metrics agents listed in {sd_file}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_dashboard_check(args: argparse.Namespace) -> int:
    from cluster.dashboard import check

    results = check(args.prometheus, fleet=args.fleet, window=args.window)
    for r in results:
        mark = "ok     " if r.has_data else "NO DATA"
        detail = f"  ({r.error})" if r.error else ""
        _say(f"{mark} {r.query.panel} [{r.query.legend}]{detail}")
    missing = sum(not r.has_data for r in results)
    _say(f"{len(results) - missing} of {len(results)} panel queries return data")
    return 1 if missing else 0


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
              edgefleet dashboard export fleet.json   # the Grafana dashboard
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
            p.add_argument(
                "--window",
                type=float,
                default=60.0,
                help="seconds the overview's rates cover (default: %(default)s, as the dashboard)",
            )

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

    dash = sub.add_parser(
        "dashboard",
        help="the Grafana dashboard and the Prometheus configuration that feeds it",
        epilog="examples:\n"
        "  edgefleet dashboard export edgefleet.json\n"
        "  GRAFANA_TOKEN=... edgefleet dashboard push --url http://127.0.0.1:3000\n"
        "  edgefleet dashboard prometheus-config --out prometheus.yml\n"
        "  edgefleet dashboard check --prometheus http://127.0.0.1:9090",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dash_sub = dash.add_subparsers(dest="dashboard_command", required=True, metavar="ACTION")
    export = dash_sub.add_parser(
        "export",
        help="write the dashboard's JSON to FILE",
        epilog="example: edgefleet dashboard export edgefleet.json",
    )
    export.add_argument("file", metavar="FILE")
    export.set_defaults(func=cmd_dashboard_export)
    push = dash_sub.add_parser(
        "push",
        help="create or update the dashboard in Grafana (token from GRAFANA_TOKEN)",
        description="Create or update the dashboard (same uid each time) in the folder "
        "'edgefleet', created if missing. The token is read from the GRAFANA_TOKEN "
        "environment variable only: a Grafana service-account token with the Editor role.",
        epilog="example: GRAFANA_TOKEN=glsa_... edgefleet dashboard push --url http://127.0.0.1:3000",
    )
    push.add_argument("--url", required=True, help="Grafana's URL, e.g. http://127.0.0.1:3000")
    push.set_defaults(func=cmd_dashboard_push)
    prom = dash_sub.add_parser(
        "prometheus-config",
        help="a Prometheus configuration that scrapes the fleet's Ray metrics agents",
        epilog="example: edgefleet dashboard prometheus-config --fleet local --out prometheus.yml",
    )
    prom.add_argument("--out", metavar="FILE", help="write here (default: standard output)")
    prom.add_argument(
        "--fleet",
        default="local",
        help="a fleet started with `up --detach`: use its Ray head (default: %(default)s; "
        "without one, the embedded Ray's default folder)",
    )
    prom.add_argument("--sd-file", metavar="PATH", help="Ray's service-discovery file to follow")
    prom.add_argument("--scrape-interval", default="5s", help="default: %(default)s")
    prom.set_defaults(func=cmd_dashboard_prometheus)
    chk = dash_sub.add_parser(
        "check",
        help="evaluate every panel's query against a Prometheus; non-zero if any is empty",
        epilog="example: edgefleet dashboard check --prometheus http://127.0.0.1:9090",
    )
    chk.add_argument(
        "--prometheus", required=True, metavar="URL", help="e.g. http://127.0.0.1:9090"
    )
    chk.add_argument("--fleet", default=".*", help="fleet name (regex; default: every fleet)")
    chk.add_argument("--window", default="1m", help="rate window (default: %(default)s)")
    chk.set_defaults(func=cmd_dashboard_check)

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
