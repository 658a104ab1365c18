"""A real scale-down (issue 55), over real HTTP against the local Serve app: two units with
streams in flight on each, the bounds lowered to one, and Serve's autoscaling (this
project's policy on the units' signals) drains a unit; every stream ends complete.

The streams are in flight whatever the machine's speed: both units' engines are held (fault
injection) before the streams are sent, and a stream's 200 comes from its unit before its
first token. Lowering ``min_units`` is a lightweight update (options only: neither the units
nor the ingress restart, ``deploy/app.py``). The remaining unit's hold is ended once Serve
is stopping the other; the draining unit's runs out on its own clock, so a stream that ends
after it was on the unit that went.
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
HOLD_S = 20.0


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


def test_a_unit_scaled_away_drains_its_streams_and_the_other_serves_on(scaling_app, tiny_models):
    from deploy.app import build_app

    model = Path(tiny_models[0]).name
    wait_for(lambda: replica_states().get("RUNNING") == 2, "two units running")
    handle = serve.get_deployment_handle("SpeculationUnit", app_name=APP)
    held_until = time.monotonic() + HOLD_S
    held = {handle.stall.remote(HOLD_S).result() for _ in range(2)}
    assert len(held) == 2, "the router sends the second call to the unit with fewer sent"
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"enabled": False}}
    with ThreadPoolExecutor(6) as pool:
        started = [threading.Event() for _ in range(4)]

        def stream(i: int) -> tuple[dict, float]:
            out = stream_to_end(scaling_app, {**body, "prompt": PROMPTS[i]}, started[i])
            return out, time.monotonic()

        streams = [pool.submit(stream, i) for i in range(4)]
        for event in started:
            assert event.wait(WAIT_S), "a stream did not start"
        # Lower the bounds: the units report 4 sequences in 16 slots, which one unit holds
        # below the hysteresis band, so the policy wants one; Serve drains the other.
        pool.submit(serve.run, build_app(app_args(tiny_models[0], min_units=1)), name=APP,
                    route_prefix=f"/{APP}")
        wait_for(lambda: replica_states().get("RUNNING") == 1, "Serve scaled to one unit")
        assert not any(f.done() for f in streams), "the scale-down must come while streams run"
        handle.end_stall.remote().result()  # the remaining unit (Serve routes to it alone)
        results = [f.result(timeout=300) for f in streams]
    assert_complete([out for out, _ in results])
    assert any(ended >= held_until for _, ended in results), "no stream was on the unit that went"
    assert any(ended < held_until for _, ended in results), "the remaining unit held its streams"
    wait_for(lambda: replica_states() == {"RUNNING": 1}, "the drained unit stopped")
    r = httpx.post(scaling_app + "/v1/completions", timeout=WAIT_S,
                   json={"model": model, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
