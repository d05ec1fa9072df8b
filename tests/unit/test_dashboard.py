"""The Grafana dashboard: its structure, its export, the Prometheus configuration, and
the push through grafana-client to a local endpoint that speaks the part of Grafana's
HTTP API the push uses (search, folders, dashboards), a rejected token and an
unreachable server included."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

from cluster import dashboard
from cluster.cli import main
from cluster.dashboard import DashboardError, push

TOKEN = "glsa_test_token"


def test_panels_are_laid_out_and_queried():
    board = dashboard.build()
    json.dumps(board)  # plain JSON
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert titles == ["Fleet overview", "Node $node", "Generation"]
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "fleet", "node", "window"]
    values = {"fleet": "local", "node": ".*", "window": "1m"}
    for q in dashboard.panel_queries(board):
        assert "$" not in dashboard.render(q.expr, values), q


def test_overview_panels_are_the_status_figures():
    overview = [p["title"] for p in dashboard.overview_panels()]
    assert overview == [
        "Throughput by priority",
        "Latency by priority (p50, p99)",
        "Rejections and evictions",
    ]


def test_render_replaces_both_variable_forms():
    expr = 'rate(x{fleet=~"$fleet", a="${node}"}[$window]) $unknown'
    got = dashboard.render(expr, {"fleet": "f", "node": "n", "window": "1m"})
    assert got == 'rate(x{fleet=~"f", a="n"}[1m]) $unknown'


def test_cli_exports_the_dashboard_and_a_prometheus_config(tmp_path, capsys):
    assert main(["dashboard", "export", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["uid"] == dashboard.UID
    sd = tmp_path / "session" / "prom_metrics_service_discovery.json"
    out = tmp_path / "prometheus.yml"
    args = ["dashboard", "prometheus-config", "--sd-file", str(sd), "--out", str(out)]
    assert main([*args, "--scrape-interval", "2s"]) == 0
    config = yaml.safe_load(out.read_text())
    assert config["global"]["scrape_interval"] == "2s"
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"] == [{"files": [str(sd)]}]
    capsys.readouterr()
    assert main(["dashboard", "prometheus-config", "--fleet", "no-such-fleet"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    (path,) = printed["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert path.endswith("/ray/prom_metrics_service_discovery.json")


# ------------------------------------------------------------------- fake Grafana


class FakeGrafana(ThreadingHTTPServer):
    """Grafana's HTTP API as far as the push uses it, with a token check."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), GrafanaHandler)
        self.token = TOKEN
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}  # uid -> {dashboard, folderUid, version}
        self.calls: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class GrafanaHandler(BaseHTTPRequestHandler):
    server: FakeGrafana
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.token}":
            return True
        self._send(401, {"message": "Unauthorized"})
        return False

    def _body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        self.server.calls.append(f"GET {url.path}")
        if not self._authorised():
            return
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/api/search":
            uids = set(query.get("dashboardUIDs", []))
            hits = [
                {"uid": uid, "title": d["dashboard"]["title"], "type": "dash-db"}
                for uid, d in self.server.dashboards.items()
                if not uids or uid in uids
            ]
            self._send(200, hits)
        elif m := re.fullmatch(r"/api/folders/([\w-]+)", url.path):
            folder = self.server.folders.get(m.group(1))
            self._send(200, folder) if folder else self._send(404, {"message": "folder not found"})
        else:
            self._send(404, {"message": "not found"})

    def do_POST(self) -> None:
        self.server.calls.append(f"POST {self.path}")
        if not self._authorised():
            return
        body = self._body()
        if self.path == "/api/folders":
            if body["uid"] in self.server.folders:
                self._send(409, {"message": "a folder with the same uid already exists"})
                return
            folder = {
                "uid": body["uid"],
                "title": body["title"],
                "id": len(self.server.folders) + 1,
            }
            self.server.folders[body["uid"]] = folder
            self._send(200, folder)
        elif self.path == "/api/dashboards/db":
            board, folder = body["dashboard"], body.get("folderUid")
            if folder not in self.server.folders:
                self._send(400, {"message": "folder not found"})
                return
            old = self.server.dashboards.get(board["uid"])
            if old is not None and not body.get("overwrite"):
                self._send(412, {"message": "version-mismatch", "status": "version-mismatch"})
                return
            version = old["version"] + 1 if old else 1
            self.server.dashboards[board["uid"]] = {
                "dashboard": board,
                "folderUid": folder,
                "version": version,
            }
            self._send(
                200,
                {
                    "id": 1,
                    "uid": board["uid"],
                    "url": f"/d/{board['uid']}/edgefleet-fleet",
                    "status": "success",
                    "version": version,
                },
            )
        else:
            self._send(404, {"message": "not found"})


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_push_creates_then_updates_the_same_dashboard_in_its_folder(grafana):
    first = push(grafana.url, TOKEN)
    assert first.created and first.folder_created and first.version == 1
    assert first.url == f"{grafana.url}/d/{dashboard.UID}/edgefleet-fleet"
    second = push(grafana.url + "/", TOKEN)
    assert not second.created and not second.folder_created and second.version == 2
    assert list(grafana.dashboards) == [dashboard.UID]
    assert list(grafana.folders) == [dashboard.FOLDER_UID]
    stored = grafana.dashboards[dashboard.UID]
    assert stored["folderUid"] == dashboard.FOLDER_UID
    assert stored["dashboard"]["panels"] == dashboard.build()["panels"]
    assert "POST /api/folders" in grafana.calls and grafana.calls.count("POST /api/folders") == 1


def test_cli_push_takes_the_token_from_the_environment(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert main(["dashboard", "push", "--url", grafana.url]) == 0
    assert "dashboard created in new folder 'edgefleet'" in capsys.readouterr().out
    assert main(["dashboard", "push", "--url", grafana.url]) == 0
    assert "dashboard updated in folder 'edgefleet' (version 2)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # never from the command line
        main(["dashboard", "push", "--url", grafana.url, "--token", TOKEN])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "case, expected",
    [
        ("rejected token", "rejected the token (401 Unauthorized): check GRAFANA_TOKEN"),
        ("no token", "GRAFANA_TOKEN is not set"),
        ("unreachable", "cannot reach Grafana at http://127.0.0.1:"),
        ("bad url", "bad Grafana URL 'grafana.local:3000'"),
        ("bad port", "bad Grafana URL 'http://127.0.0.1:99999'"),
    ],
)
def test_push_failures_are_one_clear_line(case, expected, grafana, monkeypatch, capsys, caplog):
    caplog.set_level(logging.DEBUG)  # the token is never printed, not even in debug logs
    url = {
        "unreachable": f"http://127.0.0.1:{_free_port()}",
        "bad url": "grafana.local:3000",
        "bad port": "http://127.0.0.1:99999",
    }.get(case, grafana.url)
    if case == "no token":
        monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    else:
        monkeypatch.setenv("GRAFANA_TOKEN", "wrong" if case == "rejected token" else TOKEN)
    assert main(["dashboard", "push", "--url", url]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and expected in out.err, out.err
    assert grafana.dashboards == {}
    token = os.environ.get("GRAFANA_TOKEN")
    if token:
        assert token not in out.err + caplog.text


def test_a_server_that_is_not_grafana_is_named(grafana):
    class NotGrafana(GrafanaHandler):
        def do_GET(self) -> None:
            data = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    grafana.RequestHandlerClass = NotGrafana
    with pytest.raises(DashboardError, match="did not answer like Grafana's HTTP API"):
        push(grafana.url, TOKEN)


def test_the_shipped_prometheus_config_is_the_generated_one():
    from pathlib import Path

    from cluster.metrics import SERVICE_DISCOVERY_FILE, default_temp_dir, prometheus_config

    shipped = Path(__file__).resolve().parents[2] / "configs" / "prometheus.yml"
    generated = prometheus_config(default_temp_dir() / SERVICE_DISCOVERY_FILE)
    assert yaml.safe_load(shipped.read_text()) == yaml.safe_load(generated)
