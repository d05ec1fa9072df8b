"""`edgefleet dashboard`: the Grafana dashboard and the Prometheus configuration that
feeds it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster.cli.common import RawHelpFormatter, Subparsers, say


def add_parser(sub: Subparsers) -> None:
    dash = sub.add_parser(
        "dashboard",
        help="the Grafana dashboard and the Prometheus configuration that feeds it",
        epilog="examples:\n"
        "  edgefleet dashboard export edgefleet.json\n"
        "  GRAFANA_TOKEN=... edgefleet dashboard push --url http://127.0.0.1:3000\n"
        "  edgefleet dashboard prometheus-config --out prometheus.yml\n"
        "  edgefleet dashboard check --prometheus http://127.0.0.1:9090",
        formatter_class=RawHelpFormatter,
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
    _add_prometheus_config_parser(dash_sub)
    _add_check_parser(dash_sub)


def _add_prometheus_config_parser(dash_sub: Subparsers) -> None:
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


def _add_check_parser(dash_sub: Subparsers) -> None:
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


def cmd_dashboard_export(args: argparse.Namespace) -> int:
    from cluster.dashboard import export

    path = export(Path(args.file))
    say(f"wrote the Grafana dashboard to {path} (import it in Grafana, or `dashboard push`)")
    return 0


def cmd_dashboard_push(args: argparse.Namespace) -> int:
    from cluster.dashboard import FOLDER_TITLE, push

    result = push(args.url, os.environ.get("GRAFANA_TOKEN"))
    verb = "created" if result.created else "updated"
    folder = f"new folder {FOLDER_TITLE!r}" if result.folder_created else f"folder {FOLDER_TITLE!r}"
    say(f"dashboard {verb} in {folder} (version {result.version}): {result.url}")
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
        say(f"wrote {args.out}: Prometheus scrapes the Ray metrics agents listed in {sd_file}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_dashboard_check(args: argparse.Namespace) -> int:
    from cluster.dashboard import check

    results = check(args.prometheus, fleet=args.fleet, window=args.window)
    for r in results:
        mark = "ok     " if r.has_data else "NO DATA"
        detail = f"  ({r.error})" if r.error else ""
        say(f"{mark} {r.query.panel} [{r.query.legend}]{detail}")
    missing = sum(not r.has_data for r in results)
    say(f"{len(results) - missing} of {len(results)} panel queries return data")
    return 1 if missing else 0
