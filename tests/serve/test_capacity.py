"""A full unit queues a bounded number of requests, then answers 429 with Retry-After."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import deployed_one, unit_args, unit_handle

# How long the unit's engine is held while the six requests arrive (a few HTTP round trips).
HOLD_S = 10.0


@pytest.fixture(scope="module")
def tight_app(ray_cluster, tiny_models):
    """One slot and one queue place: the third concurrent request must get 429."""
    args = unit_args(tiny_models[0], speculative={"method": "ngram"}, max_num_seqs=1)
    args["unit"]["max_queue_len"] = 1
    yield from deployed_one("tight", args)


def test_full_unit_queues_then_429(tight_app, tiny_models):
    """One slot and one queue place: of six requests sent at once, the first two are served
    (one running, one queued) and the others refused. The engine is held (fault injection)
    before they are sent, so the first two are still in the unit when the others arrive,
    however fast the machine."""
    model = Path(tiny_models[0]).name
    body = {"model": model, "prompt": "a b c", "max_tokens": 150, "temperature": 0.8,
            "ignore_eos": True, "speculation": {"enabled": False}}
    unit = unit_handle("tight")
    unit.stall.remote(HOLD_S).result()
    with ThreadPoolExecutor(6) as pool:
        sent = [pool.submit(httpx.post, tight_app + "/v1/completions", json=body, timeout=300)
                for _ in range(6)]
        # The refusals come back while the engine is held; once four have, the unit holds the
        # other two, and the hold has done its work (it would end by itself after HOLD_S).
        deadline = time.monotonic() + HOLD_S
        while sum(f.done() for f in sent) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        unit.end_stall.remote().result()
        responses = [f.result() for f in sent]
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(busy) == 6, [(r.status_code, r.text[:200]) for r in responses]
    assert len(ok) >= 2, "one running and one queued request are served"
    assert busy, "beyond one slot and one queue place, requests are refused"
    for r in busy:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in ok)
    stats = httpx.get(tight_app + "/v1/units/stats", timeout=60).json()
    assert stats["free_slots"] == stats["num_slots"] == 1 and stats["waiting"] == 0
    # the target's weights as held (a tiny safetensors model: float32, no GGUF blocks)
    assert stats["weights"]["bytes"] > 0 and stats["weights"]["quantized_linears"] == 0
