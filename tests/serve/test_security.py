"""API keys, per-key limits, request caps and the request timeout, over real HTTP against a
local Serve app with auth on (keys from a file, as the Helm chart mounts them), and the
official ``openai`` client. Ends by searching every Ray log of the session for the keys and
for a prompt: neither may be there."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from ray import serve

from tests.serve.conftest import deploy, unit_args
from tests.serve.test_http import read_sse

# One key per test: the limits are per key, so the tests cannot use up each other's budget.
KEYS = {name: f"sk-test-{name}-{'0123456789abcdef' * 2}" for name in
        ("main", "rate", "streams", "caps", "openai", "timeout", "logs", "unused")}
WRONG = "sk-test-wrong-0123456789abcdef"
SECRET_PROMPT = "the launch code is 7f3a9c0e5b21 and nobody may log it"
TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def secure_app(ray_cluster, tiny_models, tmp_path_factory):
    """Auth on with a key file; 1 request / s per key (burst 8), 2 in flight per key; small
    body and prompt caps; a 4 s request timeout. Deleted after the module."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# test keys\n" + "\n".join(KEYS.values()) + "\n")
    args = unit_args(tiny_models[0], speculative={"method": "ngram"}, max_num_seqs=2)
    args["auth"] = {"enabled": True, "api_keys_file": str(keys), "protect_metrics": True}
    args["limits"] = {"requests_per_minute": 60, "burst": 8, "max_concurrent_requests": 2,
                      "max_request_bytes": 4096, "max_prompt_tokens": 64,
                      "request_timeout_s": TIMEOUT_S}
    url = deploy("secure", "/secure", args)
    yield url
    serve.delete("secure")


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return Path(tiny_models[0]).name


def auth(name: str = "main") -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def post(url: str, body: dict, headers: dict | None = None, path: str = "/v1/completions"):
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def unit_stats(url: str) -> dict:
    return httpx.get(url + "/v1/units/stats", headers=auth(), timeout=30).json()


def test_requests_without_or_with_a_wrong_key_get_401(secure_app, model):
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    for headers, code in ((None, "missing_api_key"),
                          ({"Authorization": f"Bearer {WRONG}"}, "invalid_api_key"),
                          ({"Authorization": KEYS["main"]}, "missing_api_key"),  # no scheme
                          ({"Authorization": f"Basic {KEYS['main']}"}, "missing_api_key")):
        r = post(secure_app, body, headers)
        assert_openai_error(r, 401, code)
        assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/units/stats", "/metrics"):  # metrics closed by config
        assert_openai_error(httpx.get(secure_app + path, timeout=30), 401, "missing_api_key")
        assert httpx.get(secure_app + path, headers=auth(), timeout=30).status_code == 200
    r = post(secure_app, body, auth())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_health_stays_open(secure_app):
    r = httpx.get(secure_app + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_openai_client_with_right_and_wrong_keys(secure_app, model):
    good = openai.OpenAI(base_url=secure_app + "/v1", api_key=KEYS["openai"], max_retries=0)
    r = good.chat.completions.create(model=model, max_tokens=5, temperature=0,
                                     messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=secure_app + "/v1", api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_rate_limit_gives_429_with_retry_after(secure_app, model):
    body = {"model": model, "prompt": "hello", "max_tokens": 1}
    statuses, refused = [], None
    for _ in range(30):  # burst 8, refilled at 1 / s: a tight loop runs out
        r = post(secure_app, body, auth("rate"))
        statuses.append(r.status_code)
        if r.status_code == 429:
            refused = r
            break
    assert refused is not None, statuses
    assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert int(refused.headers["retry-after"]) >= 1
    assert post(secure_app, body, auth("main")).status_code == 200  # other keys are not limited
    time.sleep(int(refused.headers["retry-after"]))
    assert post(secure_app, body, auth("rate")).status_code == 200  # the wait it named was enough


def test_concurrent_stream_limit_per_key(secure_app, model):
    body = {"model": model, "prompt": "a b c", "max_tokens": 150, "ignore_eos": True,
            "stream": True, "speculation": {"enabled": False}}
    short = {**body, "stream": False, "max_tokens": 1}
    with httpx.Client(timeout=60) as client, ExitStack() as streams:
        responses = [streams.enter_context(client.stream(
            "POST", secure_app + "/v1/completions", json=body, headers=auth("streams")))
            for _ in range(2)]
        assert [r.status_code for r in responses] == [200, 200]
        third = post(secure_app, short, auth("streams"))
        assert_openai_error(third, 429, "concurrency_limit_exceeded")
        assert third.headers["retry-after"] == "1"
        assert post(secure_app, short, auth("caps")).status_code == 200  # per key, not global
        texts = [read_sse(r) for r in responses]  # both streams run to their end
    assert all(events[-1]["choices"][0]["finish_reason"] == "length" for events in texts)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the leases are back: a third one fits again
        r = post(secure_app, short, auth("streams"))
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text


def test_body_and_prompt_caps(secure_app, model):
    r = post(secure_app, {"model": model, "prompt": "x" * 5000}, auth("caps"))
    assert_openai_error(r, 413, "request_too_large")
    r = post(secure_app, {"model": model, "prompt": "word " * 100, "max_tokens": 1}, auth("caps"))
    error = assert_openai_error(r, 400, "context_length_exceeded")
    assert "at most 64" in error["message"]
    r = post(secure_app, {"model": model, "prompt": "x", "stop": ["s"] * 17}, auth("caps"))
    assert "at most 16 stop" in assert_openai_error(r, 400)["message"]
    r = post(secure_app, {"model": model, "prompt": "x", "stop": "s" * 2000}, auth("caps"))
    assert "1 to 1024" in assert_openai_error(r, 400)["message"]
    r = post(secure_app, {"model": model, "prompt": "x", "max_tokens": 201}, auth("caps"))
    assert "at most 200" in assert_openai_error(r, 400)["message"]


def test_request_timeout_cancels_and_frees_the_slot(secure_app, model):
    """The unit's engine hangs for longer than the timeout (fault injection): a plain request
    ends with 504 and a stream with an in-band 504 error and [DONE], both within about the
    timeout; once the engine moves again, no slot is left taken."""
    unit = serve.get_deployment_handle("SpeculationUnit", app_name="secure")
    unit.stall.remote(TIMEOUT_S + 4).result()
    body = {"model": model, "prompt": "hello", "max_tokens": 8}

    def plain():
        t0 = time.monotonic()
        return post(secure_app, body, auth("timeout")), time.monotonic() - t0

    def streamed():
        t0 = time.monotonic()
        with httpx.stream("POST", secure_app + "/v1/completions", json={**body, "stream": True},
                          headers=auth("openai"), timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        return r.status_code, lines, time.monotonic() - t0

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(plain), pool.submit(streamed)
        (r, took), (status, lines, took_stream) = first.result(), second.result()
    assert_openai_error(r, 504, "request_timeout")
    assert TIMEOUT_S - 0.5 <= took <= TIMEOUT_S + 3
    assert status == 200 and lines[-1] == "data: [DONE]" and "request_timeout" in "".join(lines)
    assert took_stream <= TIMEOUT_S + 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = unit_stats(secure_app)
        if stats["free_slots"] == stats["num_slots"] and stats["running"] == stats["waiting"] == 0:
            break
        time.sleep(0.3)
    assert stats["free_slots"] == stats["num_slots"] and stats["running"] == stats["waiting"] == 0
    assert post(secure_app, body, auth("timeout")).status_code == 200


def test_keys_and_prompts_never_reach_the_logs(secure_app, model):
    """Every Ray log of this session (driver, proxy, ingress, unit, ranks) is searched for
    every key, the wrong key and a prompt sent with the right key."""
    import ray

    r = post(secure_app, {"model": model, "prompt": SECRET_PROMPT, "max_tokens": 2}, auth("logs"))
    assert r.status_code in (200, 400)  # 400: longer than the prompt cap; it was still read
    post(secure_app, {"model": model, "prompt": "x"}, {"Authorization": f"Bearer {WRONG}"})
    time.sleep(1.5)  # log files are written by each process as it goes
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert files, logs
    needles = [*KEYS.values(), WRONG, SECRET_PROMPT]
    for path in files:
        text = path.read_bytes().decode("utf-8", "replace")
        for needle in needles:
            assert needle not in text, f"{needle[:12]}... found in {path}"
