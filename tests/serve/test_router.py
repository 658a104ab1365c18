"""The router over real HTTP: the speculation decision flips with the unit's load and back,
short outputs are not speculated, and every decision is counted in ``/metrics``.

The load is made certain, not timed: the unit's engine is held (fault injection) before the
background requests are sent, so none of them can finish while the requests under test are
decided, however fast the machine; and the unit counts every decision, so the test knows
when all of them have arrived."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import deployed_one, unit_args, unit_handle

# How long the engine is held while the background arrives and one request is decided.
HOLD_S = 10.0
# Generous bound of every wait for a condition (a poll), for a busy 2-core machine.
WAIT_S = 120


def ask(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": "a b c a b c", "max_tokens": 20, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)  # may queue behind the load
    assert r.status_code == 200, r.text
    return r


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/units/stats", timeout=WAIT_S).json()


def decided(url: str) -> int:
    """Requests the unit's router has decided (on the unit's event loop: it counts while the
    engine is held)."""
    return sum(stats(url)["router"]["decisions"].values())


class Background:
    """``n`` streaming requests held open until ``stop()`` (closing a stream aborts it,
    whether it is running or still queued)."""

    def __init__(self, url: str, model: str, n: int) -> None:
        self.stopping = threading.Event()
        body = {"model": model, "prompt": "x y z", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        self.threads = [threading.Thread(target=self._run, args=(url, body)) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if self.stopping.is_set():
                    return

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=60)


def wait_decided(url: str, at_least: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while (n := decided(url)) < at_least:
        assert time.monotonic() < deadline, f"only {n} of {at_least} requests reached the unit"
        time.sleep(0.05)


def wait_idle(url: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stats(url)
        if s["running"] == 0 and s["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the unit did not drain: {s}")


@pytest.fixture(scope="module")
def router_app(ray_cluster, tiny_models):
    """Low router thresholds so a test can cross them: off at 3 requests in flight, back on
    at 1 or fewer, half a second of dwell; outputs below 16 tokens are short. Two slots, so
    background requests queue and the load lasts a few seconds even on the tiny model."""
    args = unit_args(tiny_models[0], speculative={"method": "ngram"}, max_num_seqs=2)
    args["unit"]["router"].update({"short_output_tokens": 16, "high_concurrency_threshold": 3,
                                   "high_concurrency_resume": 1, "min_dwell_s": 0.5})
    yield from deployed_one("router", args)


def test_decision_flips_with_load_and_back(router_app, tiny_models):
    model = Path(tiny_models[0]).name
    alone = ask(router_app, model)
    assert alone.headers["x-speculation"].startswith("on; reason=default; method=ngram")
    usage = alone.json()["usage"]["speculation"]
    assert usage["enabled"] and usage["k_mode"] == "adaptive" and usage["reason"] == "default"

    before = decided(router_app)
    unit = unit_handle("router")
    unit.stall.remote(HOLD_S).result()
    load = Background(router_app, model, 8)   # 8 in the unit: >= the threshold of 3
    try:
        wait_decided(router_app, before + 8)  # all in; held, so none can have finished
        busy = ask(router_app, model)
        assert busy.headers["x-speculation"] == "off; reason=high_concurrency"
        assert busy.json()["usage"]["speculation"]["num_draft_tokens"] == 0
        forced = ask(router_app, model, speculation={"enabled": True})  # an override still wins
        assert forced.headers["x-speculation"].startswith("on; reason=client_override")
    finally:
        unit.end_stall.remote().result()  # seen what the hold was for (it ends by itself too)
        load.stop()
    wait_idle(router_app)
    time.sleep(0.6)  # at least the dwell time since the last flip (a slower machine: longer)
    again = ask(router_app, model)
    assert again.headers["x-speculation"].startswith("on; reason=default")

    s = stats(router_app)
    assert s["router"]["concurrency_gate_open"] and s["router"]["concurrency_gate_flips"] >= 2
    assert s["free_slots"] == s["num_slots"]
    # The unit reports to the metrics hub every second: wait for a report with these numbers.
    deadline = time.monotonic() + WAIT_S
    while True:
        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(router_app + "/metrics", timeout=WAIT_S).text)}
        decisions = {(x.labels["decision"], x.labels["reason"]): x.value
                     for x in families["specserve:router_decisions"].samples
                     if x.name.endswith("_total")}
        k_steps = [x for x in families["specserve:speculation_length"].samples
                   if x.name.endswith("_count")]
        reported = decisions.get(("off", "high_concurrency"), 0) >= 1 and \
            decisions.get(("on", "default"), 0) >= 2 and k_steps and k_steps[0].value > 0
        if reported or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert decisions[("off", "high_concurrency")] >= 1 and decisions[("on", "default")] >= 2
    assert k_steps and k_steps[0].value > 0


def test_short_outputs_of_a_model_free_proposer_are_speculated(router_app, tiny_models):
    """This app drafts with n-gram lookup and K chosen per step: a short answer costs nothing
    more speculated (no draft prefill), so short_output does not switch it off. For a draft
    model it does: test_policy.py checks both sides of the rule."""
    model = Path(tiny_models[0]).name
    wait_idle(router_app)
    short = ask(router_app, model, max_tokens=15)
    assert short.headers["x-speculation"].startswith("on; reason=default; method=ngram")
    assert ask(router_app, model, max_tokens=16).headers["x-speculation"].startswith("on")
