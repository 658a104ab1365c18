"""A stand-in for the Kubernetes API server: no API server can run here (no container runtime,
no etcd), so the client layer is tested against a local HTTP server on 127.0.0.1 that answers
the API's own JSON for the paths the layer reads. The JSON is the official client's
serialization of its own model objects (``ApiClient.sanitize_for_serialization``), so what
the client parses back is what a real API server sends for those objects.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client


class FakeAPI:
    """Answers ``GET path`` with the object registered for it; 404 (a Status) otherwise."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict]] = {}
        self.requests: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                path = self.path.split("?")[0]
                api.requests.append(path)
                status, body = api.routes.get(path, (404, _status(404, "NotFound", f"{path} not found")))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def serve(self, path: str, obj, status: int = 200) -> None:
        """Answer ``path`` with ``obj`` (a client model object, or a dict as the API sends it)."""
        self.routes[path] = (status, client.ApiClient().sanitize_for_serialization(obj))

    def deny(self, path: str, status: int = 403, reason: str = "Forbidden", message: str = "") -> None:
        self.routes[path] = (status, _status(status, reason, message or f"{path} is forbidden"))

    def api_client(self) -> client.ApiClient:
        cfg = client.Configuration(host=self.url)
        cfg.retries = 0
        return client.ApiClient(cfg)

    def kubeconfig(self, path) -> str:
        """A kubeconfig file whose current context talks to this server."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        return str(path)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}


@pytest.fixture
def fake_api():
    api = FakeAPI()
    yield api
    api.close()
