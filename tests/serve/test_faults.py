"""Fault injection against the local Serve app over HTTP.

- A tensor-parallel target rank killed (TP = 2 on CPU, gloo): every request in flight ends
  within a bounded time with a 503 and a retry hint (in-band in a stream), never a hang or a
  silently short answer; the unit restarts the group; later requests are served, with the
  same greedy output as before; no slot is left taken. Both ranks are killed in turn (rank 0
  answers the coordinator, rank 1 only follows it).
- The draft actor killed under a running load: zero failed requests, every output the
  target's own (greedy), and Ray restarts the draft.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
from specserve.serve.placement import ACTOR_NAMESPACE

from tests.serve.conftest import deployed_one, target_only_texts, unit_args, unit_handle
from tests.serve.test_fallback import unit_stats
from tests.serve.test_http import PROMPTS

STEP_TIMEOUT_S = 30.0  # target_step_timeout_s: the bound on finding a dead rank
END_WITHIN_S = STEP_TIMEOUT_S + 60.0  # a request in flight when a rank dies ends within this
RECOVER_WITHIN_S = 120.0


@pytest.fixture(scope="module")
def faults_app(ray_cluster, tiny_models):
    args = unit_args(tiny_models[0], speculative={"method": "ngram"}, max_num_seqs=4)
    args["unit"].update({"tensor_parallel_size": 2, "target_step_timeout_s": STEP_TIMEOUT_S})
    yield from deployed_one("faults", args)


def long_body(model: str, prompt: str, stream: bool) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": stream, "speculation": {"enabled": False}}


def run_stream(url: str, body: dict, started) -> tuple[list[dict], float]:
    """The stream's events (``[DONE]`` as None) and when it ended (monotonic)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
                started()
    return events, time.monotonic()


def run_plain(url: str, body: dict) -> tuple[httpx.Response, float]:
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    return r, time.monotonic()


@pytest.mark.parametrize("rank", [1, 0])
def test_killing_a_target_rank_ends_requests_with_503_then_recovers(faults_app, tiny_models, rank):
    model = Path(tiny_models[0]).name
    unit = unit_handle("faults")
    before = unit_stats(faults_app)
    names = unit.target_actor_names.remote().result()
    assert len(names) == 2 and before["target_available"]
    reference = httpx.post(faults_app + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}).json()
    first_chunks: list[bool] = []

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(run_stream, faults_app, long_body(model, p, True),
                               lambda: first_chunks.append(True)) for p in PROMPTS[:2]]
        plains = [pool.submit(run_plain, faults_app, long_body(model, p, False)) for p in PROMPTS[2:4]]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (len(first_chunks) < 2
                                               or unit_stats(faults_app)["running"] < 4):
            time.sleep(0.02)  # all four are decoding
        assert unit_stats(faults_app)["running"] == 4
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(names[rank], namespace=ACTOR_NAMESPACE), no_restart=True)
        stream_results = [f.result(timeout=END_WITHIN_S + 30) for f in streams]
        plain_results = [f.result(timeout=END_WITHIN_S + 30) for f in plains]

    for events, ended in stream_results:
        assert ended - killed_at <= END_WITHIN_S
        assert events[-1] is None, "the stream must end with [DONE]"
        error = events[-2]["error"]  # in-band: the 200 was already sent
        assert error["type"] == "service_unavailable" and "retry" in error["message"]
        # Cut short and said so: no chunk claims a normal end (a silent truncation would).
        assert all(c["finish_reason"] is None for e in events[:-2] for c in e.get("choices", []))
    for r, ended in plain_results:
        assert ended - killed_at <= END_WITHIN_S
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"] == "1"

    # New requests: 503 with Retry-After while the group restarts, then served again.
    deadline = time.monotonic() + RECOVER_WITHIN_S
    while True:
        r = httpx.post(faults_app + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference["choices"][0]["text"]  # the same model
    after = unit_stats(faults_app)
    assert after["free_slots"] == after["num_slots"] and after["running"] == after["waiting"] == 0
    assert after["target_available"] and after["target_restarts"] == before["target_restarts"] + 1
    assert unit.target_actor_names.remote().result() != names  # a fresh group


def test_killing_the_draft_under_load_fails_no_request(draft_app, tiny_models):
    """16 requests, 4 at a time, streamed and not; the draft actor is killed after the third
    has finished (Ray restarts it: max_restarts=-1)."""
    model = Path(tiny_models[0]).name
    unit = unit_handle("draft")
    name = unit.draft_actor_name.remote().result()
    jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 0) for i in range(16)]
    done: list[int] = []

    def one(job):
        prompt, stream = job
        body = {"model": model, "prompt": prompt, "max_tokens": 60, "temperature": 0,
                "stream": stream}
        if stream:
            with httpx.stream("POST", draft_app + "/v1/completions", json=body, timeout=120) as r:
                status = r.status_code
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert all("error" not in e for e in events), events[-1]
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        else:
            r = httpx.post(draft_app + "/v1/completions", json=body, timeout=120)
            status, text = r.status_code, r.json().get("choices", [{}])[0].get("text")
        done.append(1)
        if len(done) == 3:
            ray.kill(ray.get_actor(name, namespace=ACTOR_NAMESPACE), no_restart=False)
        return status, prompt, text

    before = unit_stats(draft_app)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, jobs))
    assert [status for status, _, _ in results] == [200] * len(jobs)
    expected = target_only_texts(tiny_models[2], [p for p, _ in jobs], 60)
    for _, prompt, text in results:
        assert text == expected[prompt], prompt
    after = unit_stats(draft_app)
    assert after["draft_fallbacks"] >= before["draft_fallbacks"] + 1
    assert after["free_slots"] == after["num_slots"]
    deadline = time.monotonic() + 60
    while not unit_stats(draft_app)["draft_available"]:
        assert time.monotonic() < deadline, "the draft did not come back"
        time.sleep(0.5)
