"""The fleet's Grafana dashboard: built in code, exported as JSON, pushed to Grafana,
and checked against a Prometheus (every panel's query must return data).

The dashboard reads the metrics defined in :mod:`actors.metrics` as Ray's metrics
agent exports them (prefix ``ray_``). Variables: ``datasource`` (a Prometheus data
source), ``fleet``, ``node`` (the per-node row repeats for each) and ``window``
(the rate window; 1m by default, the window ``edgefleet status`` uses too).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors import metrics as m
from actors.metrics import MetricDef
from edgefleet.errors import EdgeFleetError

UID = "edgefleet-fleet"
TITLE = "edgefleet fleet"
FOLDER_UID = "edgefleet"
FOLDER_TITLE = "edgefleet"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILTER = 'fleet=~"$fleet"'
NODE_FILTER = 'fleet=~"$fleet", node=~"$node"'
PUSH_TIMEOUT_S = 10.0


class DashboardError(EdgeFleetError):
    """Pushing or checking the dashboard failed; the message names the problem."""


# --------------------------------------------------------------------- PromQL


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel and its legend."""

    expr: str
    legend: str


def series(metric: MetricDef, suffix: str = "", where: str = FILTER, **match: str) -> str:
    """``ray_<name><suffix>{fleet=~"$fleet", key="value", ...}``."""
    matchers = [where, *(f'{k}="{v}"' for k, v in match.items())]
    return f"{metric.exported}{suffix}{{{', '.join(matchers)}}}"


def per_second(metric: MetricDef, by: str, where: str = FILTER, **match: str) -> str:
    """Rate of a counter over the ``$window``, summed by the labels in ``by``."""
    return f"sum by ({by}) (rate({series(metric, '', where, **match)}[$window]))"


def quantile(q: float, metric: MetricDef, by: str, where: str = FILTER) -> str:
    """The ``q`` quantile of a histogram over the ``$window``, per ``by``."""
    buckets = f"rate({series(metric, '_bucket', where)}[$window])"
    return f"histogram_quantile({q}, sum by (le, {by}) ({buckets}))"


def current(metric: MetricDef, by: str, where: str = FILTER) -> str:
    """A gauge's current value per ``by`` (max: a restarted process may leave a stale
    series for a while, which must not add up)."""
    return f"max by ({by}) ({series(metric, '', where)})"


# --------------------------------------------------------------------- panels


class Layout:
    """Places panels left to right on Grafana's 24-column grid, rows top to bottom."""

    def __init__(self) -> None:
        self.x = self.y = 0
        self.row_height = 0
        self.next_id = 1

    def place(self, panel: dict[str, Any], w: int = 8, h: int = 8) -> dict[str, Any]:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_height
            self.row_height = 0
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        panel["id"] = self.next_id
        self.next_id += 1
        self.x += w
        self.row_height = max(self.row_height, h)
        return panel

    def row(self, title: str, repeat: str | None = None) -> dict[str, Any]:
        if self.x:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        panel: dict[str, Any] = {"type": "row", "title": title, "collapsed": False, "panels": []}
        if repeat:
            panel["repeat"] = repeat
        self.place(panel, w=24, h=1)
        self.x, self.y, self.row_height = 0, self.y + 1, 0
        return panel


def timeseries(
    title: str,
    queries: list[Query],
    *,
    unit: str = "short",
    description: str = "",
    stack: bool = False,
    no_data: str = "nothing recorded in this window",
) -> dict[str, Any]:
    """A time-series panel; ``no_data`` is what Grafana shows while no query has data
    (counters appear with their first event)."""
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "noValue": no_data,
                "custom": {
                    "drawStyle": "line",
                    "fillOpacity": 20 if stack else 5,
                    "stacking": {"mode": "normal" if stack else "none"},
                },
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": q.expr, "legendFormat": q.legend}
            for i, q in enumerate(queries)
        ],
    }


def overview_panels() -> list[dict[str, Any]]:
    """The figures ``edgefleet status`` shows too: throughput, latency by priority,
    rejections and evictions."""
    return [
        timeseries(
            "Throughput by priority",
            [Query(per_second(m.REQUESTS, "priority", state="completed"), "{{priority}}")],
            unit="reqps",
            description="Completed requests per second, by priority class.",
            stack=True,
        ),
        timeseries(
            "Latency by priority (p50, p99)",
            [
                Query(quantile(0.5, m.LATENCY, "priority"), "{{priority}} p50"),
                Query(quantile(0.99, m.LATENCY, "priority"), "{{priority}} p99"),
            ],
            unit="s",
            description="Arrival on a node to the answer, completed requests.",
        ),
        timeseries(
            "Rejections and evictions",
            [
                Query(
                    per_second(m.ROUTER_REQUESTS, "priority", outcome="rejected"),
                    "rejected {{priority}}",
                ),
                Query(per_second(m.REQUESTS, "priority", state="evicted"), "evicted {{priority}}"),
            ],
            unit="reqps",
            description="Requests callers got Rejected for (every node refused, or shed), and "
            "requests pushed out of a full node by more urgent work (the router places "
            "them again where it can).",
        ),
    ]


def fleet_panels() -> list[dict[str, Any]]:
    return [
        timeseries(
            "Request outcomes",
            [Query(per_second(m.REQUESTS, "state"), "{{state}}")],
            unit="reqps",
            description="Terminal states reached on the nodes, per second.",
            stack=True,
        ),
        timeseries(
            "Placement: spills, re-placements, shedding",
            [
                Query(per_second(m.ROUTER_SPILLED, "priority"), "spilled {{priority}}"),
                Query(
                    per_second(m.ROUTER_REPLACED, "priority, reason"),
                    "re-placed {{priority}} ({{reason}})",
                ),
                Query(per_second(m.ROUTER_SHED, "priority"), "shed {{priority}}"),
            ],
            unit="reqps",
        ),
        timeseries(
            "Caller latency p99 (as callers see it)",
            [Query(quantile(0.99, m.ROUTER_LATENCY, "priority"), "{{priority}}")],
            unit="s",
            description="Router receipt to answer of completed requests, spills included.",
        ),
        timeseries(
            "Queue wait and service time p99",
            [
                Query(quantile(0.99, m.QUEUE_WAIT, "priority"), "wait {{priority}}"),
                Query(quantile(0.99, m.SERVICE, "priority"), "service {{priority}}"),
            ],
            unit="s",
        ),
        timeseries(
            "Node health",
            [
                Query(current(m.NODE_HEALTHY, "node"), "{{node}}"),
                Query(current(m.NODE_UNRESPONSIVE, "node"), "unresponsive {{node}}"),
                Query(per_second(m.NODE_RESTARTS, "node"), "restarts/s {{node}}"),
            ],
            description="Healthy: 1 while the router hears from the node, 0 once it is lost "
            "or unresponsive. Unresponsive: 1 while its actor is alive but silent, or its "
            "engine stuck. Restarts: unresponsive or stuck nodes killed for Ray to restart.",
        ),
        timeseries(
            "Pools: devices",
            [
                Query(current(m.POOL_DEVICES, "pool, state"), "{{pool}} {{state}}"),
                Query(per_second(m.POOL_CHANGES, "pool, change"), "{{change}}/s {{pool}}"),
            ],
            description="Devices of each pool by state: starting (its node actor is being "
            "created and started), serving, failed (could not start: tried again with "
            "backoff), left (its Ray node was declared dead). Joined and left per second: "
            "devices that came (back) and went.",
        ),
        timeseries(
            "Preempted requests",
            [Query(per_second(m.PREEMPTED, "priority"), "{{priority}}")],
            unit="reqps",
            description="Requests whose engine call was aborted for more urgent work.",
        ),
    ]


def node_panels() -> list[dict[str, Any]]:
    """One row per node (the row repeats over ``$node``)."""
    where = NODE_FILTER
    batched = per_second(m.BATCHED, "model", where)
    calls = per_second(m.ENGINE_CALLS, "model", where)
    return [
        timeseries(
            "Queue by priority",
            [
                Query(current(m.QUEUE_DEPTH, "node, priority", where), "queued {{priority}}"),
                Query(current(m.RUNNING, "node, priority", where), "running {{priority}}"),
            ],
            stack=True,
        ),
        timeseries(
            "Batch size",
            [
                Query(f"{batched} / {calls}", "mean {{model}}"),
                Query(quantile(0.9, m.BATCH_SIZE, "model", where), "p90 {{model}}"),
            ],
            description="Requests per engine call: the mean, and the p90 of the sizes.",
        ),
        timeseries(
            "Engine utilisation",
            [Query(per_second(m.ENGINE_BUSY, "model", where), "{{model}}")],
            unit="percentunit",
            description="Share of the time the engine spends in calls, by model.",
            stack=True,
        ),
        timeseries(
            "Model switches",
            [
                Query(
                    f"sum by (model) (increase({series(m.MODEL_LOADS, '', where)}[$window]))",
                    "loads {{model}}",
                ),
                Query(quantile(0.9, m.MODEL_LOAD_SECONDS, "model", where), "p90 s {{model}}"),
            ],
            description="Models loaded on demand in the window, and the time a load takes.",
        ),
        timeseries(
            "State and resident models",
            [
                Query(f"{current(m.NODE_STATE, 'node, state', where)} == 1", "{{state}}"),
                Query(f"{current(m.MODEL_RESIDENT, 'node, model', where)} == 1", "{{model}}"),
            ],
        ),
        timeseries(
            "Memory",
            [Query(current(m.RSS_BYTES, "node", where), "{{node}}")],
            unit="bytes",
        ),
        timeseries(
            "Execution providers",
            [
                Query(
                    f"{current(m.MODEL_PROVIDER, 'node, model, provider, fallback', where)} == 1",
                    "{{model}} on {{provider}} (fallback: {{fallback}})",
                ),
                Query(
                    f"{current(m.NODE_ONNXRUNTIME, 'node, build, version', where)} == 1",
                    "{{build}} {{version}}",
                ),
            ],
            description="What each model's session runs on, and the device's ONNX Runtime "
            "build; `edgefleet status` says why a model fell back.",
        ),
        timeseries(
            "Model versions",
            [
                Query(
                    f"{current(m.MODEL_VERSION, 'node, model, version, digest', where)} == 1",
                    "{{node}} {{model}}@{{version}} ({{digest}})",
                )
            ],
            description="The version of each model's files each node serves (see README, "
            "Shipping models).",
        ),
    ]


def generation_panels() -> list[dict[str, Any]]:
    where = NODE_FILTER
    idle = "no generation recorded in this window"
    return [
        timeseries(
            "Tokens per second",
            [
                Query(per_second(m.TOKENS, "priority", where), "{{priority}}"),
                Query(per_second(m.TOKENS, "model", where), "{{model}}"),
            ],
            no_data=idle,
        ),
        timeseries(
            "Paused generations",
            [
                Query(
                    f"sum by (priority) ({current(m.PAUSED, 'node, priority', where)})",
                    "{{priority}}",
                )
            ],
            no_data=idle,
        ),
        timeseries(
            "Pauses and resumes",
            [
                Query(per_second(m.PAUSES, "priority", where), "paused {{priority}}"),
                Query(per_second(m.RESUMES, "priority", where), "resumed {{priority}}"),
            ],
            unit="ops",
            no_data=idle,
        ),
        timeseries(
            "Token budget cuts",
            [Query(per_second(m.BUDGET_CUTS, "priority", where), "{{priority}}")],
            unit="ops",
            description="Generations ended by their token budget (lifecycle-driven).",
            no_data=idle,
        ),
        timeseries(
            "KV cache",
            [Query(f"sum by (kind) ({current(m.KV_BYTES, 'node, kind', where)})", "{{kind}}")],
            unit="bytes",
            no_data=idle,
        ),
        timeseries(
            "Lifecycle state",
            [
                Query(
                    f"{current(m.NODE_LIFECYCLE, 'node, lifecycle', where)} == 1",
                    "{{node}}: {{lifecycle}}",
                )
            ],
            no_data=idle,
        ),
    ]


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, query: str) -> dict[str, Any]:
        return {
            "type": "query",
            "name": name,
            "label": name,
            "datasource": DATASOURCE,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-values"},
            "refresh": 2,  # on time range change: nodes come and go
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
            "sort": 1,
        }

    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Prometheus",
            "query": "prometheus",
            "current": {},
        },
        query_var("fleet", f"label_values({m.NODE_STATE.exported}, fleet)"),
        query_var("node", f"label_values({m.NODE_STATE.exported}{{{FILTER}}}, node)"),
        {
            "type": "interval",
            "name": "window",
            "label": "rate window",
            "query": "1m,5m,15m,1h",
            "current": {"text": "1m", "value": "1m"},
            "auto": False,
        },
    ]


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict)."""
    layout = Layout()
    panels: list[dict[str, Any]] = []

    def section(title: str, members: list[dict[str, Any]], repeat: str | None = None) -> None:
        panels.append(layout.row(title, repeat))
        panels.extend(layout.place(p) for p in members)

    section("Fleet overview", overview_panels() + fleet_panels())
    section("Node $node", node_panels(), repeat="node")
    section("Generation", generation_panels())
    return {
        "uid": UID,
        "title": TITLE,
        "description": "Throughput, latency, queues and generation of an edgefleet fleet.",
        "tags": ["edgefleet", "ray"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": variables()},
        "panels": panels,
    }


def export(path: Path) -> Path:
    path.write_text(json.dumps(build(), indent=2) + "\n")
    return path


# --------------------------------------------------------------------- queries


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    legend: str
    expr: str


def panel_queries(dashboard: Mapping[str, Any]) -> Iterator[PanelQuery]:
    """Every PromQL target of every panel (rows included)."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for t in inner.get("targets", []):
                yield PanelQuery(inner["title"], t["refId"], t.get("legendFormat", ""), t["expr"])


def render(expr: str, values: Mapping[str, str]) -> str:
    """Replace dashboard variables (``$name`` or ``${name}``) with ``values``."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


@dataclass(frozen=True)
class QueryResult:
    query: PanelQuery
    expr: str  # as sent
    series: int
    finite: int  # series whose value is a number (not NaN or infinite)
    error: str = ""

    @property
    def has_data(self) -> bool:
        return self.finite > 0


def prometheus_query(url: str, expr: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """An instant query against Prometheus's HTTP API; the result vector."""
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{query}", timeout=timeout_s) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise DashboardError(f"Prometheus refused {expr!r}: {body.get('error', body)}")
    return list(body["data"]["result"])


def check(
    prometheus_url: str, *, fleet: str = ".*", node: str = ".*", window: str = "1m"
) -> list[QueryResult]:
    """Evaluate every panel's query against Prometheus, as Grafana would with these
    variable values."""
    values = {"fleet": fleet, "node": node, "window": window}
    results = []
    for q in panel_queries(build()):
        expr = render(q.expr, values)
        try:
            vector = prometheus_query(prometheus_url, expr)
        except (OSError, ValueError, DashboardError) as exc:
            results.append(QueryResult(q, expr, 0, 0, str(exc)))
            continue
        finite = sum(math.isfinite(float(s["value"][1])) for s in vector)
        results.append(QueryResult(q, expr, len(vector), finite))
    return results


# ------------------------------------------------------------------------ push


@dataclass(frozen=True)
class PushResult:
    created: bool  # False: an existing dashboard (same uid) was updated
    url: str  # the dashboard in Grafana
    version: int
    folder_created: bool


def push(url: str, token: str | None, *, timeout_s: float = PUSH_TIMEOUT_S) -> PushResult:
    """Create or update the dashboard in Grafana at ``url`` (same uid every time), in
    the folder ``edgefleet`` (created if missing). ``token`` is a Grafana service
    account token (``GRAFANA_TOKEN``). Raises DashboardError naming the problem."""
    from grafana_client import GrafanaApi

    _check_url(url)
    if not token:
        raise DashboardError(
            "GRAFANA_TOKEN is not set: export a Grafana service-account token (Editor role)"
        )
    # grafana-client appends "api" to the URL's path as it is: a Grafana under a path
    # (http://host/grafana) needs the trailing slash.
    api = GrafanaApi.from_url(url.rstrip("/") + "/", credential=token, timeout=timeout_s)
    with _grafana_errors(url):
        existing = api.search.search_dashboards(dashboard_uids=[UID], type_="dash-db")
        folder_created = False
        try:
            api.folder.get_folder(FOLDER_UID)
        except Exception as exc:
            if getattr(exc, "status_code", None) != 404:
                raise
            api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
            folder_created = True
        reply = api.dashboard.update_dashboard(
            {
                "dashboard": {**build(), "id": None},
                "folderUid": FOLDER_UID,
                "overwrite": True,
                "message": "edgefleet dashboard push",
            }
        )
    if not isinstance(reply, dict) or reply.get("uid") != UID:
        raise DashboardError(f"Grafana at {url} answered the push unexpectedly: {reply!r}")
    found = isinstance(existing, list) and any(d.get("uid") == UID for d in existing)
    return PushResult(
        created=not found,
        url=urllib.parse.urljoin(url.rstrip("/") + "/", str(reply.get("url", "")).lstrip("/")),
        version=int(reply.get("version", 0)),
        folder_created=folder_created,
    )


def _check_url(url: str) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise DashboardError(
            f"bad Grafana URL {url!r}: expected http(s)://HOST[:PORT][/PATH], "
            "e.g. http://127.0.0.1:3000"
        )
    try:
        parsed.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as exc:
        raise DashboardError(f"bad Grafana URL {url!r}: {exc}") from None


@contextlib.contextmanager
def _grafana_errors(url: str) -> Iterator[None]:
    """Turn grafana-client's and the HTTP stack's exceptions into one-line
    DashboardErrors that say what went wrong and what to do."""
    try:
        yield
    except DashboardError:
        raise
    except Exception as exc:
        raise DashboardError(_describe(url, exc)) from None


def _describe(url: str, exc: Exception) -> str:
    from grafana_client.client import GrafanaException

    status = getattr(exc, "status_code", None) if isinstance(exc, GrafanaException) else None
    if status == 401:
        return f"Grafana at {url} rejected the token (401 Unauthorized): check GRAFANA_TOKEN"
    if status == 403:
        return (
            f"Grafana at {url} refused the push (403 Forbidden): the token needs the "
            "Editor role (dashboards and folders: write)"
        )
    if status:
        return f"Grafana at {url} answered {status}: {_one_line(getattr(exc, 'message', exc))}"
    if isinstance(exc, ValueError):  # JSONDecodeError included: not Grafana's API
        return f"{url} did not answer like Grafana's HTTP API (is it the Grafana URL?)"
    return f"cannot reach Grafana at {url}: {_network_reason(exc)}"


def _network_reason(exc: Exception) -> str:
    """The heart of an HTTP stack's connection error ("Connection refused", ...)."""
    text = str(exc)
    if "Failed to resolve" in text or "Name or service not known" in text:
        return "unknown host name"
    if "timed out" in text.lower():
        return "timed out"
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    return errno.group(1).strip() if errno else _one_line(text)


def _one_line(value: object) -> str:
    text = " ".join(str(value).split())
    return text[:300]
