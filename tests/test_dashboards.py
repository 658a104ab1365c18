"""The Grafana dashboards: the committed JSON is what the code generates, it has the panels and
variables operators need, and ``specserve dashboards push`` talks to Grafana's HTTP API
correctly. A real Grafana cannot be installed on these machines (not in apt, PyPI or npm), so
the push is tested against a stand-in HTTP server on 127.0.0.1 that answers like Grafana's
folder and dashboard endpoints and records every call. Every panel's PromQL runs against a
live Prometheus in ``tests/serve/test_observability.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from specserve.cli import main
from specserve.dashboards import DashboardPushError, push

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "deploy" / "grafana" / "dashboards.py"
GRAFANA_DIR = ROOT / "services" / "specserve" / "grafana"  # the generated JSON (package data)
TOKEN = "glsa_test_token"


def test_committed_json_is_fresh():
    proc = subprocess.run([sys.executable, str(GENERATOR), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_stale_json_is_detected(tmp_path, monkeypatch):
    """The freshness check has teeth: an edited JSON file fails it."""
    sys.path.insert(0, str(ROOT))
    from deploy.grafana import dashboards

    for name in dashboards.DASHBOARDS:
        (tmp_path / name).write_text((GRAFANA_DIR / name).read_text())
    monkeypatch.setattr(dashboards, "OUT", tmp_path)
    assert dashboards.main(["--check"]) == 0
    (tmp_path / "serving.json").write_text("{}")
    assert dashboards.main(["--check"]) == 1


@pytest.mark.parametrize("name, must_have", [
    ("speculation.json", ["Acceptance rate", "Mean acceptance length", "Acceptance by position",
                          "K chosen", "Estimated vs measured speedup", "Router decisions by reason",
                          "Draft fallbacks and availability", "Tree size and accepted depth",
                          "Accepted depth", "Accepted sibling rank"]),
    ("serving.json", ["Requests/s by status", "Time to first token", "Inter-token latency",
                      "End-to-end latency", "Output tokens/s", "Running / waiting", "Free KV slots",
                      "Errors/s"]),
])
def test_dashboard_has_its_panels_and_variables(name, must_have):
    dash = json.loads((GRAFANA_DIR / name).read_text())
    titles = {p["title"] for p in dash["panels"]}
    assert set(must_have) <= titles
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "unit", "method"} <= variables
    assert dash["uid"].startswith("specserve-") and len(dash["uid"]) <= 40
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            assert target["expr"] and target["datasource"] == "${datasource}"


class FakeGrafana(BaseHTTPRequestHandler):
    """Grafana's /api/folders and /api/dashboards/db, bearer-token checked; records calls."""

    calls: list = []
    folders: list = []
    dashboards: dict = {}

    def _reply(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.calls.append((method, self.path, body, self.headers.get("authorization")))
        if self.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"message": "Unauthorized"})
        if (method, self.path) == ("GET", "/api/folders"):
            return self._reply(200, self.folders)
        if (method, self.path) == ("POST", "/api/folders"):
            folder = {"id": len(self.folders) + 1, "uid": f"f{len(self.folders) + 1}",
                      "title": body["title"]}
            self.folders.append(folder)
            return self._reply(200, folder)
        if (method, self.path) == ("POST", "/api/dashboards/db"):
            uid = body["dashboard"]["uid"]
            version = self.dashboards.get(uid, {}).get("version", 0) + 1
            if uid in self.dashboards and not body.get("overwrite"):
                return self._reply(412, {"message": "version-mismatch"})
            self.dashboards[uid] = {"version": version, "folderUid": body.get("folderUid"),
                                    "dashboard": body["dashboard"]}
            return self._reply(200, {"id": 1, "uid": uid, "url": f"/d/{uid}", "status": "success",
                                     "version": version})
        return self._reply(404, {"message": "Not found"})

    def do_GET(self):  # noqa: N802
        self._handle("GET")

    def do_POST(self):  # noqa: N802
        self._handle("POST")

    def log_message(self, *args):
        pass


@pytest.fixture
def grafana():
    FakeGrafana.calls, FakeGrafana.folders, FakeGrafana.dashboards = [], [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_push_creates_the_folder_once_and_overwrites_by_uid(grafana):
    first = push(grafana, TOKEN, "specserve")
    second = push(grafana, TOKEN, "specserve")
    assert {r["uid"] for r in first} == {"specserve-speculation", "specserve-serving"}
    assert [r["version"] for r in second] == [2, 2]
    assert len(FakeGrafana.folders) == 1  # looked up by title the second time, not recreated
    posts = [c for c in FakeGrafana.calls if c[:2] == ("POST", "/api/dashboards/db")]
    assert len(posts) == 4 and all(c[2]["overwrite"] and c[2]["folderUid"] == "f1" for c in posts)
    committed = json.loads((GRAFANA_DIR / "serving.json").read_text())
    sent = FakeGrafana.dashboards["specserve-serving"]["dashboard"]
    assert {k: v for k, v in sent.items() if k != "id"} == \
        {k: v for k, v in committed.items() if k != "id"}
    assert all(c[3] == f"Bearer {TOKEN}" for c in FakeGrafana.calls)


def test_push_cli_prints_one_line_per_dashboard(grafana, capsys):
    assert main(["dashboards", "push", "--url", grafana, "--token", TOKEN]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("uid=specserve-" in line for line in out)
    assert not any(c[1] == "/api/folders" for c in FakeGrafana.calls)  # no folder asked


def test_wrong_token_is_one_clear_line(grafana, capsys):
    assert main(["dashboards", "push", "--url", grafana, "--token", "wrong"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "refused the token (401)" in err and "wrong" not in err


@pytest.mark.parametrize("url, message", [
    ("ftp://127.0.0.1:1", "must look like http://host:3000"),
    ("http://127.0.0.1:1", "cannot reach Grafana"),   # nothing listens on port 1
])
def test_wrong_url_is_one_clear_line(url, message):
    with pytest.raises(DashboardPushError, match=message):
        push(url, TOKEN, timeout_s=60)  # refused at once; the limit only bounds a hang


def test_a_server_that_is_not_grafana(grafana):
    with pytest.raises(DashboardPushError, match="Grafana answered|not Grafana"):
        push(grafana + "/not-grafana", TOKEN, "x", timeout_s=60)
