"""load/locustfile.py end to end: short headless Locust runs against the local Serve app.

Locust runs as a subprocess (it monkey-patches the standard library with gevent, which must
not happen inside this pytest process that also drives Ray), with a hard timeout.

The runs last a few seconds each, and the checks ask only for at least one request of each
kind in that time (a request is a few hundred ms even on a busy machine); the per-request
limit and the hard timeout are far beyond what a slow machine needs, so they only end a run
that hangs.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOCUSTFILE = Path(__file__).resolve().parents[2] / "load" / "locustfile.py"
HARD_TIMEOUT_S = 300
METRICS = ("TTFT", "ITL", "TPOT", "E2E", "tokens_per_s")

# find_spec, not importorskip: importing locust here would gevent-patch this process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                reason="locust is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def model_name(tiny_models) -> str:
    return Path(tiny_models[0]).name


def run_locust(host: str, out: Path, duration: str, users: int, classes: list[str],
               **env: str) -> subprocess.CompletedProcess:
    """A headless run as `make load` does it, outputs under ``out``; env adds SPECSERVE_*."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users),
           "-r", str(users), "-t", duration, "--host", host, "--csv", str(out / "locust"),
           "--html", str(out / "locust.html"), "--exit-code-on-error", "1", "--only-summary",
           "--stop-timeout", "2", *classes]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    full_env = {**inherited, "SPECSERVE_TIMEOUT_S": "120", **env}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=HARD_TIMEOUT_S)


def stats_rows(out: Path) -> list[dict]:
    with open(out / "locust_stats.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def totals(rows: list[dict], name: str) -> tuple[int, int]:
    """(requests, failures) of every row called ``name``, over the Type column."""
    picked = [r for r in rows if r["Name"] == name]
    return (sum(int(r["Request Count"]) for r in picked),
            sum(int(r["Failure Count"]) for r in picked))


def test_streaming_run_records_metrics(ngram_app, model_name, tmp_path):
    """Closed loop, router decides (the ngram app: on): every metric row has samples."""
    proc = run_locust(ngram_app, tmp_path, "6s", 2, ["ShortOutputUser", "ChatUser"],
                      SPECSERVE_MODEL=model_name, SPECSERVE_MAX_TOKENS="24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for suffix in ("stats", "stats_history", "failures", "exceptions"):
        assert (tmp_path / f"locust_{suffix}.csv").is_file()
    assert (tmp_path / "locust.html").stat().st_size > 0
    rows = stats_rows(tmp_path)
    for name in (*METRICS, "/v1/chat/completions"):
        requests, failures = totals(rows, name)
        assert requests > 0 and failures == 0, (name, rows)
    assert totals(rows, "speculation_on")[0] > 0 and totals(rows, "speculation_off")[0] == 0
    assert {r["Type"] for r in rows if r["Name"] == "TTFT"} <= {"short", "chat"}
    assert "speculation modes: {'on'" in proc.stderr


def test_override_off_with_poisson_arrivals_and_model_lookup(ngram_app, tmp_path):
    """SPECSERVE_SPECULATION=off is honoured (header says off); the model name comes from
    GET /v1/models; SPECSERVE_RATE paces arrivals."""
    proc = run_locust(ngram_app, tmp_path, "4s", 2, ["CodeUser"], SPECSERVE_SPECULATION="off",
                      SPECSERVE_RATE="4", SPECSERVE_MAX_TOKENS="16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = stats_rows(tmp_path)
    assert totals(rows, "/v1/models") == (1, 0)
    assert totals(rows, "speculation_off")[0] > 0 and totals(rows, "speculation_on")[0] == 0
    assert {r["Type"] for r in rows if r["Name"] == "E2E"} == {"code"}
    assert "reasons: {'off:client_override'" in proc.stderr and "poisson arrivals" in proc.stderr


@pytest.mark.parametrize("case", ["unknown_model", "bad_host"])
def test_failed_requests_make_locust_exit_non_zero(request, tmp_path, case):
    """A model the server does not serve (404) or a host nobody listens on: exit 1.
    (The bad host run also picks its class by tag, ``-T short``.)"""
    if case == "unknown_model":
        host, classes = request.getfixturevalue("ngram_app"), ["ShortOutputUser"]
    else:
        host, classes = "http://127.0.0.1:9", ["-T", "short"]
    proc = run_locust(host, tmp_path, "2s", 2, classes,
                      SPECSERVE_MODEL="no-such-model", SPECSERVE_MAX_TOKENS="8")
    assert proc.returncode == 1, proc.stderr[-3000:]
    requests, failures = totals(stats_rows(tmp_path), "/v1/chat/completions")
    assert failures > 0 and failures == requests
    assert totals(stats_rows(tmp_path), "TTFT") == (0, 0)
    expected = "HTTP 404" if case == "unknown_model" else "connection failed"
    assert expected in (tmp_path / "locust_failures.csv").read_text()
    assert len((tmp_path / "locust_exceptions.csv").read_text().splitlines()) == 1  # header only
