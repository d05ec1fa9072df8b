"""The `edgefleet` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.errors import EdgeFleetError

if TYPE_CHECKING:
    from cluster.client import FleetClient, FleetStatus
    from cluster.metrics import Overview, OverviewWindow
    from edgefleet.config import FleetConfig

DEFAULT_CONFIG = Path("configs/local.yaml")
RAY_COMMANDS = ("up", "down", "status", "infer", "generate")  # they start or join a Ray
# What is left of a Ray head whose GCS died ignores SIGTERM; nothing there to wait for.
DEAD_HEAD_GRACE_S = 0.5


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


def cmd_models_show(args: argparse.Namespace) -> int:
    from cluster.modelfiles import model_signature, signature_lines
    from edgefleet.config import ModelConfig, load_config

    target = Path(args.target)
    if target.suffix == ".onnx":
        if args.models:
            _err("MODEL names go with a fleet YAML; for an .onnx file, give the file alone")
            return 2
        models = {target.stem: ModelConfig(path=target.absolute())}
    else:
        config = load_config(target)
        unknown = [n for n in args.models if n not in config.models]
        if unknown:
            known = ", ".join(config.models)
            _err(f"unknown model(s): {', '.join(unknown)}; {target} has: {known}")
            return 2
        models = {n: config.models[n] for n in args.models or config.models}
    failed = 0
    for name, model in models.items():
        try:
            sig = model_signature(name, model)
        except EdgeFleetError as exc:
            _err(f"error: {exc}")
            failed += 1
            continue
        _say("\n".join(signature_lines(name, model, sig)) + "\n")
    _say("(a name or N in a shape is a dynamic dimension: any size; one name, one size)")
    return 2 if failed else 0


def cmd_validate(args: argparse.Namespace) -> int:
    from cluster.modelfiles import require_loadable_models
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
    _say(
        f"{args.config}: valid — fleet {config.fleet.name!r}, {len(specs)} node(s), "
        + (models if later else f"{len(config.models)} model(s); all {loaded}")
    )
    for spec in specs:
        _say(f"  {spec.name}: {', '.join(spec.models)} (queue {spec.queue.capacity})")
    for name, path in later.items():
        _say(f"  note: {missing_model_problem(name, path)}")
    return 0


def _load_with_models(path: str) -> FleetConfig:
    """Load a fleet file; write the built-in models it names that are missing; check
    every model loads as a node would load it."""
    from cluster.modelfiles import require_loadable_models
    from edgefleet.config import load_config
    from edgefleet.modelgen import make_missing_models

    config = load_config(path)
    make_missing_models(config, _say)
    require_loadable_models(config)
    return config


def _connect(address: str | None, fleet: str, *, token_auth: bool = False) -> None:
    from cluster.deploy import connect_ray

    with _AfterThis():
        connect_ray(address, fleet, token_auth=token_auth)


def cmd_up(args: argparse.Namespace) -> int:
    import ray

    from cluster.client import FleetClient
    from cluster.deploy import deploy_nodes, deploy_router, start_local_ray, teardown
    from cluster.head import head_dir, start_head, stop_children, stop_head

    config = _load_with_models(args.config)
    if args.start_timeout is not None:
        limits = config.ray.model_copy(update={"start_timeout_s": args.start_timeout})
        config = config.model_copy(update={"ray": limits})
    fleet = config.fleet.name
    specs = config.node_specs()
    # Inside a Ray job (`ray job submit ... -- edgefleet up ...`) Ray sets RAY_ADDRESS.
    address = args.address or os.environ.get("RAY_ADDRESS")
    token_auth = config.ray.auth == "token"
    nodes: dict[str, Any] = {}
    router = None
    client: FleetClient | None = None
    head = False  # a Ray head this command starts: stopped unless the fleet comes up
    keep = False  # a detached fleet that came up keeps serving
    try:
        if address:
            _say(f"connecting to the Ray cluster at {address}")
            _connect(address, fleet, token_auth=token_auth)
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
            _say(f"started a Ray head on {address} (loopback only{jobs})")
            _connect(address, fleet)
            _write_service_discovery(fleet)
        else:
            _say("starting an embedded Ray cluster on 127.0.0.1")
            with _StopAtOnce():
                start_local_ray(config, log_to_driver=False)
        nodes = deploy_nodes(config, _say, detached=args.detach)
        router = deploy_router(config, _say)
        _say(f"fleet {fleet!r} is up: {len(nodes)} node(s), models {', '.join(config.models)}")
        if args.detach:
            keep = True
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
        return 0
    finally:
        if not keep:  # served until Ctrl-C, or did not come up: stop what was started
            if client is not None:
                client.close()  # leaves the fleet to the teardown below
            if ray.is_initialized():
                teardown(nodes, router, timeout_s=1.0)
                ray.shutdown()
            if not address:  # an embedded Ray whose start was cut short leaves processes
                stop_children()
            if head:
                count = stop_head(fleet)
                _say(
                    f"stopped the Ray head it started ({count} processes) and removed "
                    f"{head_dir(fleet)}"
                )


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
    _say(
        f"cleaned up after fleet {fleet!r}'s earlier Ray head, which had died "
        f"({count} leftover processes)"
    )


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
    from cluster.head import head_dir, reachable, recorded_address, stop_head
    from edgefleet.errors import FleetNotRunning

    fleet = args.fleet
    recorded = None if args.address else recorded_address(fleet)
    if recorded is not None and not reachable(recorded):  # its head died: clean up after it
        count = stop_head(fleet, grace_s=DEAD_HEAD_GRACE_S)
        _say(
            f"the Ray head `edgefleet up --detach` started for fleet {fleet!r} at {recorded} "
            f"was gone; cleaned up {count} leftover processes and removed {head_dir(fleet)}"
        )
        return 0
    try:
        # The nodes hear stop (queued callers get Cancelled) before the head goes.
        _connect(args.address, fleet)
        router, config = find_fleet(fleet)
        teardown(node_handles(config), router)
        _say(f"fleet {fleet!r} stopped ({len(config.node_specs())} node(s) and its router)")
    except FleetNotRunning as exc:
        if recorded is None:
            raise FleetNotRunning(f"nothing to stop: {exc}") from None
        _say(f"note: {exc}")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if recorded is not None:
            count = stop_head(fleet)
            _say(
                f"stopped the Ray head `edgefleet up` started ({count} processes) and removed "
                f"{head_dir(fleet)}"
            )
    return 0


@contextlib.contextmanager
def _fleet_client(args: argparse.Namespace) -> Iterator[FleetClient]:
    """A client of the running fleet ``args.fleet``, closed when the command is done:
    its last counters go to the router and its threads end before Ray shuts down."""
    from cluster.client import FleetClient

    _connect(args.address, args.fleet)
    client = FleetClient.connect(fleet=args.fleet)
    try:
        yield client
    finally:
        client.close()


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.metrics import OverviewWindow

    window = OverviewWindow(args.window)
    live = args.watch and not args.json and sys.stdout.isatty()
    try:
        with _fleet_client(args) as client:
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
            _say(json.dumps(status_dict(status, overview), indent=2))
        else:
            screen = status_table(status, overview)
            _say(CLEAR_SCREEN + screen if live else screen)
        if not args.watch:
            return 0
        time.sleep(args.interval)


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from cluster.modelfiles import name_single_input, read_input_file

    arrays = read_input_file(args.input)  # before Ray is even imported: a bad file fails fast
    with _fleet_client(args) as client:
        inputs = (
            arrays
            if isinstance(arrays, dict)
            else name_single_input(client.config, args.model, arrays)
        )
        deadline = None if args.deadline_ms is None else args.deadline_ms / 1000
        reply = client.infer_reply(args.model, inputs, priority=args.priority, deadline_s=deadline)
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
    with _fleet_client(args) as client:
        stream = client.generate(
            args.model,
            args.prompt_ids,
            max_new_tokens=args.max_new_tokens,
            priority=args.priority,
            session=args.session,
            prefix_len=args.prefix_len,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
        try:
            for token in stream:
                print(token, end=" ", flush=True)
        finally:
            print(flush=True)
            stream.close()  # before the end (Ctrl-C): cancels the generation on its node
    r = stream.result
    assert r is not None
    first = f"{r.first_token_s * 1000:.1f} ms" if r.first_token_s is not None else "-"
    _err(
        f"finish: {r.finish_reason} ({len(r.tokens)} tokens on {r.node}; first token {first}, "
        f"total {r.total_s * 1000:.1f} ms, paused {r.pauses}x)"
    )
    return 0


def _priority(value: str | int) -> str | int:
    """``--priority``: a class name as given (the fleet knows its classes), or an integer
    priority, checked to be 0-10 as the arguments are read, before anything connects."""
    from edgefleet.request import resolve_priority

    if isinstance(value, int):
        return value
    try:
        number = int(value)
    except ValueError:
        return value
    try:
        return resolve_priority(number)
    except EdgeFleetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        if n.failure:  # why a failed or stuck node is out of service
            lines.append(f"{'':<12}{n.state}: {n.failure}")
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edgefleet.config import load_config
    from policies.placement.registry import POLICIES
    from sim.report import write_report
    from sim.run import Progress, compare, simulate, workload_costs
    from sim.workload import load_workload

    config = load_config(args.config)
    workload = load_workload(args.workload)
    policies = [p for p in (args.compare or "").split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        _err(f"unknown placement policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
        return 2

    def progress(total: int | None) -> Progress:
        bar = tqdm(total=total, unit="req", desc="simulating", file=sys.stderr, leave=False)
        return Progress(lambda n: bar.update(n - bar.n), bar.close)

    options: dict[str, Any] = {
        "nodes": args.nodes,
        "requests": args.requests,
        "progress": progress,
        "seed": args.seed,
    }
    if args.costs is not None:  # measured on a live fleet
        options["costs"] = workload_costs(workload, args.costs)
    if policies:
        results = compare(config, workload, policies, **options)
    else:
        results = [simulate(config, workload, **options)]
    nodes = len(results[0].recorder.nodes)
    description = [
        f"Fleet: {args.config} grown to {nodes} nodes; workload: {args.workload}",
        f"Seed: {workload.seed if args.seed is None else args.seed}",
    ]
    report = write_report(args.out, results, title="Fleet simulation", description=description)
    for r in results:
        top, every = r.latency_table()[0], r.latency_table()[-1]
        counts = r.counts()
        _say(
            f"{r.label}: {every['answered']:,} answered in {r.wall_s:.1f} s "
            f"({r.events / max(r.wall_s, 1e-9):,.0f} events/s); {top['name']} p99 "
            f"{_ms(top['p99_ms'])}, all p99 {_ms(every['p99_ms'])}; completed "
            f"{counts['completed']:,}, rejected {counts['rejected']:,}, evicted "
            f"{counts['evicted']:,}, expired {counts['expired']:,}"
            + (" (interrupted: results so far)" if r.interrupted else "")
        )
    _say(f"report: {report}")
    return 130 if any(r.interrupted for r in results) else 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def cmd_bench(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.getcwd())  # the benchmarks live in the source checkout
    try:
        from bench.run import main as bench_main
    except ImportError:
        _err("the benchmarks live in the source checkout (bench/); run from its top folder")
        return 2
    return bench_main(args.rest, prog="edgefleet bench")


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


class _HelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with its default, unless it says it already or has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
            or "default" in text
        ):
            return action.help
        return f"{text} (default: %(default)s)"


class _RawHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`_HelpFormatter` that keeps the description's and epilog's lines."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose help shows every option's default (sub-commands too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from edgefleet.modelgen import BUILTIN_MODELS

    parser = _Parser(
        prog="edgefleet",
        description="Priority-aware inference scheduling across a fleet of edge nodes.",
        formatter_class=_RawHelpFormatter,
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
              edgefleet bench --quick                 # benchmarks (from the source checkout)
              edgefleet dashboard export fleet.json   # the Grafana dashboard
            """
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser(
        "models", help="generate the built-in test models; show a model's inputs and outputs"
    )
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    builtin = ", ".join(BUILTIN_MODELS)
    make = models_sub.add_parser(
        "make",
        help="write deterministic small ONNX models into DIR",
        description=f"Write the built-in test models ({builtin}) into DIR as NAME.onnx. "
        "A fleet file naming a missing NAME.onnx gets it written by `up` and `demo`.",
        epilog="example: edgefleet models make configs/models --only classifier slow",
    )
    make.add_argument("dir", metavar="DIR")
    make.add_argument(
        "--only", nargs="+", metavar="NAME", help=f"only these models (default: all: {builtin})"
    )
    make.set_defaults(func=cmd_models_make)
    show = models_sub.add_parser(
        "show",
        help="show a model's inputs and outputs (names, dtypes, shapes): what to put in an .npz",
        description="Load each model as a node would and print its inputs and outputs,\n"
        "with a numpy line that writes an .npz of inputs it takes (for `edgefleet infer`).",
        epilog="examples:\n"
        "  edgefleet models show configs/local.yaml classifier detector\n"
        "  edgefleet models show configs/models/classifier.onnx\n"
        "then, in Python, an .npz of named arrays for `edgefleet infer --input`:\n"
        "  import numpy as np\n"
        "  np.savez('frame.npz', images=np.zeros((1, 3, 32, 32), 'float32'))",
        formatter_class=_RawHelpFormatter,
    )
    show.add_argument("target", metavar="CONFIG|FILE.onnx", help="a fleet YAML or a model file")
    show.add_argument(
        "models", nargs="*", metavar="MODEL", help="models of CONFIG to show (default: all)"
    )
    show.set_defaults(func=cmd_models_show)

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

    up = sub.add_parser(
        "up",
        help="deploy a fleet: on a running Ray cluster (--address) or an embedded one",
        epilog="examples:\n  edgefleet up configs/local.yaml            # serve until Ctrl-C\n"
        "  edgefleet up configs/local.yaml --detach   # leave it serving (`edgefleet down`)",
        formatter_class=_RawHelpFormatter,
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
        description="Run one inference on a running fleet. The inputs are an .npz of arrays\n"
        "named as the model's inputs (`edgefleet models show CONFIG MODEL` lists them\n"
        "and prints a numpy line that writes one), or an .npy for a single-input model.",
        epilog="examples:\n"
        '  python -c "import numpy as np; '
        "np.savez('frame.npz', images=np.zeros((1, 3, 32, 32), 'float32'))\"\n"
        "  edgefleet infer classifier --input frame.npz --priority inline "
        "--deadline-ms 200 --out result.npz",
        formatter_class=_RawHelpFormatter,
    )
    infer.add_argument("model", metavar="MODEL")
    infer.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="an .npz of named input arrays, or an .npy for a single-input model",
    )
    infer.add_argument(
        "--out", metavar="FILE.npz", help="write the outputs here (default: print them only)"
    )
    infer.add_argument(
        "--deadline-ms", type=float, help="give up if not started by then (default: no deadline)"
    )
    infer.set_defaults(func=cmd_infer)

    generate = sub.add_parser(
        "generate",
        help="stream a generation from a decoder model on a running fleet",
        epilog="example: edgefleet generate tiny_lm --prompt-ids 5 17 42 --max-new-tokens 32 "
        "--priority background",
    )
    generate.add_argument("model", metavar="MODEL")
    generate.add_argument(
        "--prompt-ids",
        type=int,
        nargs="+",
        required=True,
        metavar="ID",
        help="the prompt as token ids of the model's vocabulary",
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, help="stop after this many new tokens"
    )
    generate.add_argument(
        "--session", help="chat session: later turns reuse its KV cache (default: none)"
    )
    generate.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="leading prompt tokens shared by many requests (a system prompt): kept when a "
        "paused generation's cache is trimmed",
    )
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    generate.add_argument(
        "--seed", type=int, help="sampling seed (default: none, each run samples anew)"
    )
    generate.set_defaults(func=cmd_generate)

    for p in (infer, generate):
        p.add_argument(
            "--priority", type=_priority, default="foreground", help="class name or 0-10"
        )
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
        formatter_class=_RawHelpFormatter,
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
    prom.add_argument(
        "--sd-file",
        metavar="PATH",
        help="Ray's service-discovery file to follow (default: that of the Ray head `up` "
        "started for --fleet, else the embedded Ray's)",
    )
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
    chk.add_argument(
        "--fleet",
        default="local",
        help="fleet name, a regular expression: '.*' checks every fleet (default: %(default)s)",
    )
    chk.add_argument("--window", default="1m", help="rate window (default: %(default)s)")
    chk.set_defaults(func=cmd_dashboard_check)

    simulate = sub.add_parser(
        "simulate",
        help="run a workload on a simulated fleet (the real schedulers and placement, "
        "in simulated time) and write a report",
        epilog="examples:\n"
        "  edgefleet simulate configs/local.yaml --workload configs/sim/steady.yaml "
        "--nodes 1000\n"
        "  edgefleet simulate configs/local.yaml --workload configs/sim/bursts.yaml "
        "--compare expected_completion,power_of_two,round_robin",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate.add_argument("config", help="fleet YAML: the nodes, models and placement")
    simulate.add_argument("--workload", required=True, help="workload YAML (see configs/sim/)")
    simulate.add_argument(
        "--nodes", type=int, help="grow the fleet to this many nodes (default: the config's)"
    )
    simulate.add_argument("--requests", type=int, help="stop after this many arrivals")
    simulate.add_argument("--seed", type=int, help="default: the workload's")
    simulate.add_argument(
        "--costs",
        metavar="PATH",
        help="engine costs a live fleet measured: the output of `edgefleet status --json` "
        "(its warm-up tables; the workload's costs: take precedence), or a call record "
        "(router.record_dir: a .jsonl file or a folder of them; each inference call takes "
        "the engine time of a recorded call of its model and batch size, near its own time "
        "into the run and on the node of its name when recorded, in place of the "
        "workload's costs_from:)",
    )
    simulate.add_argument(
        "--out", default="sim-report", help="folder for the report (default: %(default)s)"
    )
    simulate.add_argument(
        "--compare", metavar="POLICY,...", help="run once per placement policy, side by side"
    )
    simulate.set_defaults(func=cmd_simulate)

    bench = sub.add_parser(  # its options and --help are bench.run's own
        "bench",
        help="run the benchmarks and print the report (see bench/RESULTS.md)",
        add_help=False,
    )
    bench.set_defaults(func=cmd_bench)
    return parser


class _StopAtOnce:
    """Within it, Ctrl-C stops the processes this command started and exits at once
    (status 130): for a step that must not be interrupted half-way, such as ``ray.init``
    starting a cluster (raised into, it leaves processes behind, or crashes)."""

    active = False

    def __enter__(self) -> None:
        _StopAtOnce.active = True

    def __exit__(self, *exc: object) -> None:
        _StopAtOnce.active = False


class _AfterThis:
    """Within it, Ctrl-C waits for the step to end and is raised then: for a short step
    that must not be cut half-way, such as ``ray.init`` connecting to a cluster (raised
    into, it leaves this process to crash as it exits)."""

    active = False
    pending = False

    def __enter__(self) -> None:
        _AfterThis.active, _AfterThis.pending = True, False

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        _AfterThis.active = False
        if _AfterThis.pending and kind is None:
            raise KeyboardInterrupt


def _exit_on_stuck_interrupt(grace_s: float = 1.0) -> None:
    """Make Ctrl-C end the command even while Ray holds the main thread in native code,
    where Python cannot raise KeyboardInterrupt (``ray.init`` waiting for the processes
    it started, say): an interrupt Python has not begun to handle after ``grace_s``
    (outside :class:`_AfterThis`), or one within :class:`_StopAtOnce`, stops the
    processes this command started and exits with status 130. Any other raises
    KeyboardInterrupt, as usual."""
    import signal
    import threading

    from cluster.head import stop_children

    handled = [0]

    def stop_now() -> None:  # at once: Ray's threads here may crash as its processes go
        stop_children(grace_s=0)
        _err("interrupted")
        os._exit(130)

    def on_interrupt(signum: int, frame: Any) -> None:
        if _StopAtOnce.active:
            stop_now()
        handled[0] += 1
        if _AfterThis.active:
            _AfterThis.pending = True
            return
        raise KeyboardInterrupt

    def watch(wakeup: int) -> None:
        seen = 0
        while True:  # Python writes each signal's number here at once, whatever holds it
            seen += os.read(wakeup, 64).count(signal.SIGINT)
            deadline = time.monotonic() + grace_s
            while handled[0] < seen and (time.monotonic() < deadline or _AfterThis.active):
                time.sleep(0.05)
            if handled[0] < seen:
                stop_now()

    wakeup, notify = os.pipe()
    os.set_blocking(notify, False)
    signal.signal(signal.SIGINT, on_interrupt)
    signal.set_wakeup_fd(notify, warn_on_full_buffer=False)
    threading.Thread(target=watch, args=(wakeup,), name="interrupt", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    # A command talks to the Ray it started or connected to, never to one Ray would
    # start by itself when a call comes after shutdown (a thread still finishing).
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.command in RAY_COMMANDS:
        _exit_on_stuck_interrupt()
    try:
        return int(args.func(args))
    except EdgeFleetError as exc:
        _err(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    finally:
        if args.command in RAY_COMMANDS:  # done: Ray's exit handlers finish uninterrupted
            import signal

            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
