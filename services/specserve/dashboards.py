"""Load the project's Grafana dashboards into a Grafana through its HTTP API.

``specserve dashboards push --url URL --token TOKEN [--folder NAME]`` uses the card's
``grafana-api`` client. It is idempotent: the folder is looked up by title and created when
missing; each dashboard is written by its uid with ``overwrite``, so pushing twice leaves
one copy. The JSON lies beside this module in ``specserve/grafana/`` (package data, so an
installed ``specserve`` has it): the committed output of ``deploy/grafana/dashboards.py``, the
same files the Helm chart ships as ConfigMaps.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

from specserve.errors import SpecServeError


def default_dir() -> Path:
    """``specserve/grafana``, beside this module (the JSON ships as package data of specserve)."""
    return Path(__file__).with_name("grafana")


class DashboardPushError(SpecServeError):
    """The push failed; the message says why in one line."""


def dashboard_files(directory: Path | None = None) -> list[Path]:
    directory = directory or default_dir()
    files = sorted(directory.glob("*.json"))
    if not files:
        raise DashboardPushError(f"no dashboard JSON in {directory}; run `make dashboards`")
    return files


def _client(url: str, token: str, timeout_s: float):
    from grafana_api.grafana_face import GrafanaFace

    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DashboardPushError(f"--url must look like http://host:3000, not {url!r}")
    return GrafanaFace(auth=token, host=parts.hostname, port=parts.port,
                       url_path_prefix=parts.path.strip("/"), protocol=parts.scheme,
                       timeout=timeout_s)


def _call(what: str, fn, *args):
    """One API call, with the client's and the network's errors as one readable line."""
    import requests
    from grafana_api.grafana_api import (
        GrafanaBadInputError,
        GrafanaClientError,
        GrafanaServerError,
        GrafanaUnauthorizedError,
    )

    try:
        return fn(*args)
    except GrafanaUnauthorizedError as exc:
        raise DashboardPushError(f"{what}: Grafana refused the token (401): check --token") from exc
    except (GrafanaBadInputError, GrafanaClientError, GrafanaServerError) as exc:
        raise DashboardPushError(f"{what}: Grafana answered {exc}") from exc
    except requests.exceptions.RequestException as exc:
        raise DashboardPushError(f"{what}: cannot reach Grafana ({type(exc).__name__}); "
                                 "check --url") from exc
    except ValueError as exc:  # a server that is not Grafana (not JSON)
        raise DashboardPushError(f"{what}: the answer is not Grafana's JSON; check --url") from exc


def push(url: str, token: str, folder: str | None = None, *, timeout_s: float = 10.0,
         files: list[Path] | None = None) -> list[dict]:
    """Push every dashboard; returns Grafana's answer per dashboard (uid, url, version)."""
    if not token:
        raise DashboardPushError("--token is empty; create a service-account token in Grafana")
    api = _client(url, token, timeout_s)
    folder_uid = None
    if folder:
        folders = _call("listing folders", api.folder.get_all_folders)
        match = next((f for f in folders if f.get("title") == folder), None)
        if match is None:
            match = _call(f"creating folder {folder!r}", api.folder.create_folder, folder)
        folder_uid = match["uid"]
    results = []
    for path in files or dashboard_files():
        dashboard = json.loads(path.read_text())
        body = {"dashboard": {**dashboard, "id": None}, "overwrite": True,
                "message": "specserve dashboards push"}
        if folder_uid:
            body["folderUid"] = folder_uid
        answer = _call(f"pushing {path.name}", api.dashboard.update_dashboard, body)
        results.append({"file": path.name, "uid": answer.get("uid"), "url": answer.get("url"),
                        "version": answer.get("version")})
    return results
