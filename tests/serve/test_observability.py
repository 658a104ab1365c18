"""Metrics, rules and dashboards against a real Prometheus (the Debian package) scraping the
local Serve app on 127.0.0.1: every PromQL expression of every dashboard panel, recording
rule and alert is valid and returns data.

A Grafana server cannot be installed on these machines (not in apt, PyPI or npm): the
dashboards are checked as JSON and through their queries here, and the push command against a
stand-in (``test_dashboards.py``).

Nothing here waits a fixed time for something to happen: every check polls Prometheus or the
app for its condition (WAIT_S at most), and the 429s are made certain by holding the unit's
engine (fault injection) while a burst arrives, just before the checks that need them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import BASE, RAY_METRICS_PORT, deployed_one, unit_args, unit_handle

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_PORT = 18390
PROM = f"http://127.0.0.1:{PROMETHEUS_PORT}"
# Alerts whose condition depends on the traffic the test happens to produce: their condition
# is checked to evaluate, and their signal (the expression before the threshold) to return data.
# The others must fire on this traffic: the test makes units full, so 429s exist.
ALERTS_THAT_MUST_HAVE_DATA = {"SpecServeQueueFull"}
# Generous bound of every wait for a condition (a poll), for a busy 2-core machine.
WAIT_S = 120
# How long the unit's engine is held while a burst arrives (a few HTTP round trips).
HOLD_S = 10.0


def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    assert path, "prometheus is not installed (make install puts the Debian package in)"
    return path


@pytest.fixture(scope="module")
def obs_app(ray_cluster, tiny_models) -> str:
    """n-gram, adaptive K, two slots and one queue place: enough to make 429s on purpose. A
    paged KV cache, so the prefix cache's and the blocks' series carry values. Autoscaled
    between 1 and 1 unit: the policy runs and reports."""
    args = unit_args(tiny_models[0], speculative={"method": "ngram"}, max_num_seqs=2,
                     kv_cache={"layout": "paged"})
    args["unit"]["max_queue_len"] = 1
    # Unit autoscaling's policy runs (its gauges feed the Serving dashboard's last row); one
    # unit at most, so it never scales.
    args["autoscaling"] = {"min_units": 1, "max_units": 1, "metrics_interval_s": 0.5, "look_back_s": 2}
    yield from deployed_one("obs", args)


@pytest.fixture(scope="module")
def prometheus(obs_app, tmp_path_factory):
    """Prometheus on 127.0.0.1 scraping the app's /metrics and Ray's metrics port every
    second, with the project's rule files; stopped by its PID."""
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    # The app's /metrics every second (a few KB); Ray's metrics port at the shipped config's
    # own interval, with its whole interval to answer: its exposition is Ray's every metric
    # for every actor of the session (0.7 MB early in a suite, more later), and a 1 s scrape
    # timeout (Prometheus caps it at the interval) dropped every scrape of it on a busy
    # 2-core machine, so the units' mirror never showed (issue 50).
    shipped = config["global"]["scrape_interval"]
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(p) for p in sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["specserve"]["metrics_path"] = "/obs/metrics"
    jobs["specserve"]["static_configs"] = [{"targets": [BASE.removeprefix("http://")]}]
    jobs["ray"]["static_configs"] = [{"targets": [f"127.0.0.1:{RAY_METRICS_PORT}"]}]
    jobs["ray"]["scrape_interval"] = jobs["ray"]["scrape_timeout"] = shipped
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [prometheus_bin(), f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(PROM + "/-/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        yield PROM
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def overflow(url: str, model: str) -> list[int]:
    """A burst of 8 long requests at a unit with room for 3: some are served, the rest get
    429. The engine is held before they are sent, so the first three are still in the unit
    when the others arrive, however fast the machine."""
    unit = unit_handle("obs")
    unit.stall.remote(HOLD_S).result()
    burst = {"model": model, "temperature": 0, "prompt": "a b c", "max_tokens": 40,
             "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        sent = [pool.submit(lambda: httpx.post(url + "/v1/completions", json=burst,
                                               timeout=300).status_code) for _ in range(8)]
        for done in as_completed(sent):  # a 429 came while the engine was held: what the
            if done.result() == 429:     # hold was for (it ends by itself too)
                unit.end_stall.remote().result()
                break
        codes = [f.result() for f in sent]
    assert 429 in codes and 200 in codes, codes
    return codes


def send_traffic(url: str, model: str) -> None:
    """Speculated and target-only requests, streamed and not, both routes, bad requests, and
    a burst that overflows the unit (429)."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json={"model": model, "temperature": 0, **body},
                          timeout=WAIT_S)

    for i in range(6):
        spec = {} if i % 2 else {"speculation": {"enabled": False}}
        r = post("/v1/completions", {"prompt": "a b c a b c a b", "max_tokens": 40, **spec})
        assert r.status_code == 200, r.text
        r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x y x y"}],
                                          "max_tokens": 30, "stream": True, **spec})
        assert r.status_code == 200
    assert post("/v1/completions", {"prompt": "x", "max_tokens": -1}).status_code == 400
    overflow(url, model)


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=WAIT_S)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n{body}"
    return body["data"]["result"]


def wait_for(prom: str, expr: str, timeout: float = WAIT_S) -> list:
    deadline = time.monotonic() + timeout
    while True:
        result = query(prom, expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(1)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel, expr) of every target, with the variables set to "All"."""
    out = []
    for path in sorted((ROOT / "services/specserve/grafana").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "1m")
                expr = re.sub(r"\$(namespace|unit|method)\b", ".*", expr)
                out.append((path.name, panel["title"], expr))
    assert len(out) >= 20
    return out


def rules(kind: str) -> list[dict]:
    doc = yaml.safe_load((ROOT / f"deploy/prometheus/rules/{kind}.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def signal(expr: str) -> str:
    """An alert's expression without its final threshold comparison."""
    return re.split(r"\s[<>]=?\s*[-\d.]+\s*$", expr.strip())[0]


@pytest.fixture(scope="module")
def scraped(prometheus, obs_app, tiny_models):
    # The counters' zeros must be scraped before the traffic: increase() cannot see the first
    # events of a series it has never seen at 0 (and scrapes can time out while 2 cores are busy).
    assert wait_for(prometheus, 'specserve:requests_total{status="429"} == 0')
    send_traffic(obs_app, Path(tiny_models[0]).name)
    assert wait_for(prometheus, "specserve:spec_decode_num_draft_tokens_total > 0")
    assert wait_for(prometheus, 'specserve:requests_total{status="429"}')
    return prometheus


def test_every_dashboard_query_returns_data(scraped):
    empty = [(d, p, e) for d, p, e in dashboard_queries() if not wait_for(scraped, e)]
    assert not empty, "queries with no data:\n" + "\n".join(map(str, empty))


def test_every_recording_rule_returns_data_and_is_evaluated(scraped):
    for rule in rules("recording"):
        assert wait_for(scraped, rule["expr"]), rule["record"]
        assert wait_for(scraped, rule["record"]), f"{rule['record']} not recorded"


def test_every_alert_evaluates_and_its_signal_has_data(scraped, obs_app, tiny_models):
    """The alerts that must fire look back a few minutes: a condition that no longer holds
    (the tests before took longer than its look-back) is made true again before it is
    checked."""
    must_fire = [rule for rule in rules("alerts") if rule["alert"] in ALERTS_THAT_MUST_HAVE_DATA]
    if not all(query(scraped, rule["expr"]) for rule in must_fire):
        overflow(obs_app, Path(tiny_models[0]).name)  # 429s again, for SpecServeQueueFull
    for rule in rules("alerts"):
        query(scraped, rule["expr"])  # valid
        assert wait_for(scraped, signal(rule["expr"])), rule["alert"]
        if rule["alert"] in ALERTS_THAT_MUST_HAVE_DATA:
            assert wait_for(scraped, rule["expr"]), rule["alert"]


def test_metrics_values_agree_with_the_units(scraped, obs_app):
    """The exposition parses, carries one series per unit, and the drafted tokens equal what
    the unit reports itself (once the hub has a report newer than the last request: the
    unit reports every second)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        text = httpx.get(obs_app + "/metrics", timeout=WAIT_S).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        drafted = [s for s in families["specserve:spec_decode_num_draft_tokens"].samples
                   if s.name.endswith("_total")]
        stats = httpx.get(obs_app + "/v1/units/stats", timeout=WAIT_S).json()
        agree = len(drafted) == 1 and drafted[0].value == stats["spec"]["num_draft_tokens"]
        if agree or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(drafted) == 1 and drafted[0].value == stats["spec"]["num_draft_tokens"]
    decisions = {(s.labels["decision"], s.labels["reason"]): s.value
                 for s in families["specserve:router_decisions"].samples if s.name.endswith("_total")}
    assert decisions[("off", "client_override")] >= 6 and decisions[("on", "default")] >= 6
    # one proposer here: its part is the whole
    samples = families["specserve:proposer_num_draft_tokens"].samples
    by_proposer = {s.labels["proposer"]: s.value for s in samples if s.name.endswith("_total")}
    assert by_proposer == {name: float(part["num_draft_tokens"])
                           for name, part in stats["spec_by_proposer"].items()}
    assert sum(by_proposer.values()) == stats["spec"]["num_draft_tokens"]
    times = stats["times"]  # the steps without a prompt, apart (bench-vs-llama-server's fwd ms)
    assert 0 < times["decode_steps"] < times["steps"] and 0 < times["decode_verify_s"] < times["verify_s"]
    for family in families.values():  # low cardinality: no request ids, prompts, tenants
        if not family.name.startswith("specserve:"):
            continue
        for sample in family.samples:
            assert set(sample.labels) <= {"route", "status", "speculation", "unit", "method",
                                          "decision", "reason", "position", "le", "name",
                                          "proposer", "source"}, sample


RAY_SCRAPES = 'up{job="ray"} or scrape_duration_seconds{job="ray"}'


def test_units_are_mirrored_on_rays_metrics_port(scraped):
    """Ray exports the units' numbers as ray_specserve_* (Ray reports every few seconds)."""
    for expr in ('{__name__=~"ray_specserve_spec_decode_num_draft_tokens.*"}',
                 '{__name__=~"ray_specserve_free_slots.*"}'):
        assert wait_for(scraped, expr), (f"{expr}: nothing in {WAIT_S} s; Ray's scrapes: "
                                         f"{query(scraped, RAY_SCRAPES)}")


def test_promtool_checks_and_rule_unit_tests():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (make install puts the Debian package in)"
    prom_dir = ROOT / "deploy/prometheus"
    for args in (["check", "config", str(prom_dir / "prometheus.yml")],
                 ["check", "rules", *map(str, sorted((prom_dir / "rules").glob("*.yml")))],
                 ["test", "rules", *map(str, sorted((prom_dir / "tests").glob("*.yml")))]):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                              cwd=prom_dir)
        assert proc.returncode == 0, f"promtool {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"


def test_the_hub_keeps_pickled_snapshots_and_takes_an_earlier_units_objects():
    """The hub holds each unit's snapshot as the bytes the unit pickled (its process imports
    none of the engine); the ingress reads them back, and takes a snapshot object as it is
    (a unit of an earlier version, in a rolling update). No Prometheus here."""
    from specserve.serve.metrics import packed, unpacked
    from specserve.serve.unit_messages import UnitSnapshot

    numbers = dict.fromkeys(("num_requests_running", "num_requests_waiting", "free_slots", "num_slots",
                             "draft_available", "target_available", "target_restarts",
                             "estimated_speedup", "speculation_length_current",
                             "concurrency_gate_open", "requests_admitted", "requests_aborted"), 3)
    snap = UnitSnapshot(method="suffix", router_decisions={("spec", "short"): 2}, **numbers)
    raw = packed(snap)
    assert isinstance(raw, bytes) and b"UnitSnapshot" in raw
    assert unpacked({"u1": raw, "u2": snap}) == {"u1": snap, "u2": snap}
