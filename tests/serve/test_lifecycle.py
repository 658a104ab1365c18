"""Graceful shutdown with streams in flight, over real HTTP against the local Serve app.

- The explicit drain (what `specserve serve` does on SIGTERM): /health answers 503
  ``draining``, new requests get 503 with Retry-After, every stream that began before it runs
  to its end, and the drain returns once none is left.
- Serve's own stop (an app deleted or redeployed, a replica scaled away: what KubeRay does on
  an upgrade): the replicas drain for up to ``drain_timeout_s`` and every stream that began
  before the stop completes.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from ray import serve
from specserve.cli import drain

from tests.serve.conftest import deploy, unit_args
from tests.serve.test_http import PROMPTS

MAX_TOKENS = 120


def app_args(tiny_target: str) -> dict:
    args = unit_args(tiny_target, speculative={"method": "ngram"}, max_num_seqs=4)
    args["drain_timeout_s"] = 60
    return args


def stream_to_end(url: str, body: dict, started: threading.Event) -> dict:
    """Read one stream to its end; what it ended with."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return {"done": events[-1] == "[DONE]", "errors": [c for c in chunks if "error" in c],
            "ended": time.monotonic(),
            "finish": [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1],
            "tokens": next((c["usage"]["completion_tokens"] for c in chunks if c.get("usage")), 0),
            "text": text}


def start_streams(url: str, app: str, model: str, pool: ThreadPoolExecutor, stall_s: float,
                  n: int = 3):
    """``n`` streams, each running once this returns: the unit's engine is then held for
    ``stall_s`` (fault injection), so they are still in flight whatever happens next."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"enabled": False}}  # one token per step: long enough
    started = [threading.Event() for _ in range(n)]
    futures = [pool.submit(stream_to_end, url, {**body, "prompt": PROMPTS[i]}, started[i])
               for i in range(n)]
    for event in started:
        assert event.wait(60), "a stream did not start"
    serve.get_deployment_handle("SpeculationUnit", app_name=app).stall.remote(stall_s).result()
    return futures


def assert_complete(results: list[dict]) -> None:
    for r in results:
        assert r["done"] and not r["errors"] and r["finish"] == "length", r
        assert r["tokens"] == MAX_TOKENS, r


def test_drain_finishes_streams_refuses_new_ones_and_reports_draining(ray_cluster, tiny_models):
    model = Path(tiny_models[0]).name
    url = deploy("drain", "/drain", app_args(tiny_models[0]))
    try:
        with ThreadPoolExecutor(4) as pool:
            streams = start_streams(url, "drain", model, pool, stall_s=4.0)
            drained = pool.submit(drain, "drain", 60.0)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health", timeout=10).status_code == 200:
                assert time.monotonic() < deadline, "health never said draining"
                time.sleep(0.02)
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": model, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "draining"
            results = [f.result(timeout=120) for f in streams]
            assert drained.result(timeout=120) == 0  # nothing was left running
        assert_complete(results)
        stats = httpx.get(url + "/v1/units/stats", timeout=30).json()
        assert stats["free_slots"] == stats["num_slots"]
    finally:
        serve.delete("drain")


@pytest.mark.parametrize("how", ["delete", "redeploy"])
def test_serve_stop_lets_streams_that_began_finish(ray_cluster, tiny_models, how):
    """``delete``: the app is removed; ``redeploy``: the same app with a new config, so Serve
    replaces every replica. Either way the old replicas drain their streams."""
    from deploy.app import build_app

    model = Path(tiny_models[0]).name
    name = f"stop-{how}"
    url = deploy(name, f"/{name}", app_args(tiny_models[0]))
    try:
        with ThreadPoolExecutor(4) as pool:
            streams = start_streams(url, name, model, pool, stall_s=12.0)
            if how == "delete":
                serve.delete(name, _blocking=False)
                time.sleep(2.0)  # the controller is stopping the replicas by now
                assert not any(f.done() for f in streams), "the stop must come while streams run"
                results = [f.result(timeout=120) for f in streams]
            else:
                new = app_args(tiny_models[0])
                new["max_tokens_cap"] = 199  # any change: new replicas replace the old ones

                def redeploy() -> float:
                    serve.run(build_app(new), name=name, route_prefix=f"/{name}")
                    return time.monotonic()

                rollout = pool.submit(redeploy)
                results = [f.result(timeout=120) for f in streams]
                # The rollout ended only after the old replicas' streams had: it waited for them.
                assert rollout.result(timeout=180) >= max(r["ended"] for r in results)
        assert_complete(results)
        if how == "redeploy":  # and the new replicas serve
            deadline = time.monotonic() + 120
            while True:
                r = httpx.post(url + "/v1/completions", timeout=30,
                               json={"model": model, "prompt": "hi", "max_tokens": 200})
                if r.status_code == 400 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert "at most 199" in r.json()["error"]["message"]
    finally:
        serve.delete(name)
