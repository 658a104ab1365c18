"""Killing the draft group while requests stream: every request completes with correct
output (the unit decodes target-only meanwhile), the fallback is counted, and speculation
resumes once Ray has restarted the draft actor."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ray
from specserve.engine.tokenizer import encode_prompt
from specserve.serve.placement import ACTOR_NAMESPACE

from tests.serve.conftest import unit_handle
from tests.serve.test_http import PROMPTS, read_sse, target_only_text
from tests.tiny import make_tiny_tokenizer


def stream_text(url: str, model: str, prompt: str, first_chunk) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["x-speculation"].startswith("on; reason=default; method=draft_model")
        events = []
        for event in read_sse(r):
            events.append(event)
            first_chunk()
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def unit_stats(url: str) -> dict:
    return httpx.get(url + "/v1/units/stats", timeout=30).json()


def test_killing_the_draft_mid_stream_loses_nothing(draft_app, tiny_models):
    model = Path(tiny_models[0]).name
    unit = unit_handle("draft")
    name = unit.draft_actor_name.remote().result()
    before = unit_stats(draft_app)
    assert before["draft_available"]
    killed = []

    def kill_once():
        if not killed:
            killed.append(True)
            ray.kill(ray.get_actor(name, namespace=ACTOR_NAMESPACE), no_restart=False)

    prompts = PROMPTS[:4]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: stream_text(draft_app, model, p, kill_once), prompts))
    tok = make_tiny_tokenizer()
    for prompt, text in zip(prompts, texts):
        assert text == target_only_text(tiny_models[2], encode_prompt(tok, prompt), 120), prompt
    after = unit_stats(draft_app)
    assert killed and after["draft_fallbacks"] == before["draft_fallbacks"] + 1
    assert after["free_slots"] == after["num_slots"]
    # Ray restarts the draft actor; the unit re-attaches it and speculates again.
    deadline = time.monotonic() + 120
    while not unit_stats(draft_app)["draft_available"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert unit_stats(draft_app)["draft_available"], "the draft did not come back"
    drafts_before = unit_stats(draft_app)["spec"]["num_drafts"]
    stream_text(draft_app, model, PROMPTS[5], lambda: None)
    assert unit_stats(draft_app)["spec"]["num_drafts"] > drafts_before
