"""A real scale-down (issue 55), over real HTTP against the local Serve app: two units with
streams in flight on each, the bounds lowered to one, and Serve's autoscaling (this
project's policy on the units' signals) drains a unit; every stream ends complete.

The streams are in flight for as long as the test needs, whatever the machine's speed: each
unit's engine is held (fault injection) until a file of its own exists, before the streams
are sent, and a stream's 200 comes from its unit before its first token. Lowering
``min_units`` is a lightweight update (options only: neither the units nor the ingress
restart, ``deploy/app.py``). Once Serve runs one unit and the other is stopping with its
streams held (the router sends the four by load, so each unit has some; not necessarily two
and two: a test that counted on two each failed on a busy machine), the files are made and
all four end complete: the unit that went drained its own before it stopped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from ray import serve

from tests.serve.conftest import deployed_one, unit_args
from tests.serve.test_http import PROMPTS
from tests.serve.test_lifecycle import MAX_TOKENS, WAIT_S, assert_complete, stream_to_end

APP = "scaling"
HOLD_S = 600.0  # the most a unit holds for a release file (the test makes the files first)


def app_args(tiny_target: str, min_units: int) -> dict:
    args = unit_args(tiny_target, speculative={"method": "ngram"},
                     kv_cache={"layout": "paged", "block_size": 16})
    args.update(num_units=2, drain_timeout_s=300,
                autoscaling={"min_units": min_units, "max_units": 2, "upscale_delay_s": 0,
                             "downscale_delay_s": 1, "look_back_s": 1, "metrics_interval_s": 0.5})
    return args


@pytest.fixture(scope="module")
def scaling_app(ray_cluster, tiny_models):
    yield from deployed_one(APP, app_args(tiny_models[0], min_units=2))


def replica_states() -> dict[str, int]:
    deployment = serve.status().applications[APP].deployments["SpeculationUnit"]
    return {str(state): n for state, n in deployment.replica_states.items()}


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_unit_scaled_away_drains_its_streams_and_the_other_serves_on(scaling_app, tiny_models,
                                                                        tmp_path):
    from deploy.app import build_app

    model = Path(tiny_models[0]).name
    wait_for(lambda: replica_states().get("RUNNING") == 2, "two units running")
    handle = serve.get_deployment_handle("SpeculationUnit", app_name=APP)
    release = [tmp_path / "release-0", tmp_path / "release-1"]
    held = [handle.stall.remote(HOLD_S, str(path)).result() for path in release]
    assert len(set(held)) == 2, "the router sends the second call to the unit with fewer sent"
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"enabled": False}}
    try:
        with ThreadPoolExecutor(6) as pool:
            started = [threading.Event() for _ in range(4)]
            streams = [pool.submit(stream_to_end, scaling_app, {**body, "prompt": PROMPTS[i]},
                                   started[i]) for i in range(4)]
            for event in started:
                assert event.wait(WAIT_S), "a stream did not start"
            # Lower the bounds: the units report 4 sequences in 16 slots, which one unit
            # holds below the hysteresis band, so the policy wants one; Serve drains the other.
            pool.submit(serve.run, build_app(app_args(tiny_models[0], min_units=1)), name=APP,
                        route_prefix=f"/{APP}")
            wait_for(lambda: replica_states().get("RUNNING") == 1, "Serve scaled to one unit")
            assert replica_states().get("STOPPING") == 1, "the other drains its held streams"
            assert not any(f.done() for f in streams), "held streams cannot have ended"
            for path in release:  # every stream runs on, those on the draining unit too
                path.touch()
            results = [f.result(timeout=300) for f in streams]
    finally:
        for path in release:
            path.touch()
    assert_complete(results)
    wait_for(lambda: replica_states() == {"RUNNING": 1}, "the drained unit stopped")
    r = httpx.post(scaling_app + "/v1/completions", timeout=WAIT_S,
                   json={"model": model, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
