"""Graceful shutdown with streams in flight, over real HTTP against the local Serve app.

- The explicit drain (what `specserve serve` does on SIGTERM): /health answers 503
  ``draining``, new requests get 503 with Retry-After, every stream that began before it runs
  to its end, and the drain returns once none is left.
- Serve's own stop (an app deleted or redeployed, a replica scaled away: what KubeRay does on
  an upgrade): the replicas drain for up to ``drain_timeout_s`` and every stream that began
  before the stop completes.

``specserve serve`` as a user runs it, a process with its own Ray, is in
test_server_process.py.

The streams are in flight at every moment the tests need them to be, whatever the machine's
speed: the unit's engine is held (fault injection) before they are sent, until the test makes
a release file (a unit being stopped or drained takes no more calls) or, where the test needs
a time the hold ended by (the redeploy), for a set time, and a stream's 200 comes from the
unit before its first token, so none can finish before the hold ends. Every
other wait polls for its condition, or waits for the line a server prints (``serving on``) or
its exit.
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
from specserve.serve.server import drain

from tests.serve.conftest import deployed, unit_args, unit_handle
from tests.serve.test_http import PROMPTS

MAX_TOKENS = 120
# Generous bound of every wait for a condition (a poll), for a busy 2-core machine.
WAIT_S = 120
HOLD_S = 600.0  # the most a unit holds for its release file (every test makes it well before)


def app_args(tiny_target: str) -> dict:
    args = unit_args(tiny_target, speculative={"method": "ngram"}, max_num_seqs=4)
    args["drain_timeout_s"] = 300  # far beyond what the held streams need, on any machine
    return args


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_models) -> dict[str, str]:
    """Two apps, deployed side by side; their URLs by name. ``stop-delete`` is deleted by its
    test; ``stop-redeploy`` is redeployed by its test, and its new replicas are then the ones
    the drain test drains (a drained or deleted app serves nothing after: the drain test is
    the module's last)."""
    names = ("stop-delete", "stop-redeploy")
    yield from deployed({name: (f"/{name}", app_args(tiny_models[0])) for name in names})


def stream_to_end(url: str, body: dict, started: threading.Event) -> dict:
    """Read one stream to its end; what it ended with. ``started`` is set once the server
    answered (a 200 means the unit has the request)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        started.set()
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return {"done": events[-1] == "[DONE]", "errors": [c for c in chunks if "error" in c],
            "finish": [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1],
            "tokens": next((c["usage"]["completion_tokens"] for c in chunks if c.get("usage")), 0),
            "text": text}


def start_streams(url: str, app: str, model: str, pool: ThreadPoolExecutor,
                  release: Path | None, stall_s: float = HOLD_S, n: int = 3):
    """``n`` streams, each in the unit once this returns; ``held_until`` (monotonic). The
    unit's engine is held (fault injection) before they are sent, until the file ``release``
    exists (a unit being stopped takes no calls: the file ends its hold) or, without one, for
    ``stall_s``, so none can finish before, however fast the machine."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"enabled": False}}
    held_until = time.monotonic() + stall_s  # the stall starts after this, so ends after it
    handle = unit_handle(app)
    handle.stall.remote(stall_s, None if release is None else str(release)).result()
    started = [threading.Event() for _ in range(n)]
    futures = [pool.submit(stream_to_end, url, {**body, "prompt": PROMPTS[i]}, started[i])
               for i in range(n)]
    for event in started:
        assert event.wait(WAIT_S), "a stream did not start"
    return futures, held_until


def wait_stopping(url: str) -> None:
    """Until Serve no longer routes to the app at ``url``: it has taken the deleted app's
    route down and is stopping its replicas."""
    deadline = time.monotonic() + WAIT_S
    while httpx.get(url + "/health", timeout=WAIT_S).status_code == 200:
        assert time.monotonic() < deadline, "Serve kept routing to the deleted app"
        time.sleep(0.1)


def assert_complete(results: list[dict]) -> None:
    for r in results:
        assert r["done"] and not r["errors"] and r["finish"] == "length", r
        assert r["tokens"] == MAX_TOKENS, r


@pytest.mark.parametrize("how", ["delete", "redeploy"])
def test_serve_stop_lets_streams_that_began_finish(apps, tiny_models, tmp_path, how):
    """``delete``: the app is removed; ``redeploy``: the same app with a new config, so Serve
    replaces every replica. Either way the old replicas drain their streams: the stop comes
    while they run (they are held), and they end complete."""
    from deploy.app import build_app

    model = Path(tiny_models[0]).name
    name = f"stop-{how}"
    url = apps[name]
    with ThreadPoolExecutor(4) as pool:
        if how == "delete":  # held until the route is down, however long that takes
            release = tmp_path / "release"
            streams, _ = start_streams(url, name, model, pool, release)
            serve.delete(name, _blocking=False)
            wait_stopping(url)
            assert not any(f.done() for f in streams), "the stop must come while streams run"
            release.touch()
            results = [f.result(timeout=300) for f in streams]
        else:
            streams, held_until = start_streams(url, name, model, pool, None, stall_s=12.0)
            new = app_args(tiny_models[0])
            new["max_tokens_cap"] = 199  # any change: new replicas replace the old ones

            def redeploy() -> float:
                serve.run(build_app(new), name=name, route_prefix=f"/{name}")
                return time.monotonic()

            rollout = pool.submit(redeploy)
            results = [f.result(timeout=300) for f in streams]
            # The rollout ended only after the hold, so not before the old replicas'
            # streams could end: it waited for them (and they ended complete, below).
            assert rollout.result(timeout=300) >= held_until
    assert_complete(results)
    if how == "redeploy":  # and the new replicas serve
        deadline = time.monotonic() + WAIT_S
        while True:
            r = httpx.post(url + "/v1/completions", timeout=WAIT_S,
                           json={"model": model, "prompt": "hi", "max_tokens": 200})
            if r.status_code == 400 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "at most 199" in r.json()["error"]["message"]


def test_drain_finishes_streams_refuses_new_ones_and_reports_draining(apps, tiny_models, tmp_path):
    model = Path(tiny_models[0]).name
    url = apps["stop-redeploy"]  # its replicas since the redeploy test (apps)
    with ThreadPoolExecutor(4) as pool:
        release = tmp_path / "release"
        streams, _ = start_streams(url, "stop-redeploy", model, pool, release)
        drained = pool.submit(drain, "stop-redeploy", 300.0)
        deadline = time.monotonic() + WAIT_S
        while httpx.get(url + "/health", timeout=WAIT_S).status_code == 200:
            assert time.monotonic() < deadline, "health never said draining"
            time.sleep(0.02)
        health = httpx.get(url + "/health", timeout=WAIT_S)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        r = httpx.post(url + "/v1/completions", timeout=WAIT_S,
                       json={"model": model, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "draining"
        assert not any(f.done() for f in streams), "the drain must come while streams run"
        release.touch()
        results = [f.result(timeout=300) for f in streams]
        assert drained.result(timeout=300) == 0  # nothing was left running
    assert_complete(results)
    stats = httpx.get(url + "/v1/units/stats", timeout=WAIT_S).json()
    assert stats["free_slots"] == stats["num_slots"]


# --- `specserve serve` as a user runs it: real processes, each with its own Ray ------------
