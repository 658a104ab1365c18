"""A request whose step fails (fault injection: its prompt holds a poisoned token, so every
step it is in raises) fails alone, with an OpenAI-shaped 500 that names no internals, while
the requests sharing its steps complete with the target's own output; the target group is
not restarted and no slot is left taken."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from specserve.engine.tokenizer import encode_prompt

from tests.serve.conftest import unit_handle
from tests.serve.test_fallback import unit_stats
from tests.serve.test_http import PROMPTS, read_sse, target_only_text
from tests.tiny import make_tiny_tokenizer

POISON = 511


def long_stream(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = read_sse(r)
    assert not any("error" in e for e in events), events[-1]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_a_failing_request_fails_alone(ngram_app, tiny_models):
    model = Path(tiny_models[0]).name
    tok = make_tiny_tokenizer()
    others = PROMPTS[:3]
    assert all(POISON not in encode_prompt(tok, p) for p in others)
    unit = unit_handle("ngram")
    before = unit_stats(ngram_app)
    unit.inject_fault_token.remote(POISON).result()
    try:
        with ThreadPoolExecutor(5) as pool:
            streams = [pool.submit(long_stream, ngram_app, model, p) for p in others]
            poisoned = {"model": model, "prompt": [5, 6, 7, POISON, 8], "max_tokens": 60,
                        "temperature": 0}
            plain = pool.submit(httpx.post, ngram_app + "/v1/completions", json=poisoned, timeout=120)
            streamed = pool.submit(lambda: httpx.post(ngram_app + "/v1/completions", timeout=120,
                                                      json={**poisoned, "stream": True}))
            texts = [f.result() for f in streams]
            r, s = plain.result(), streamed.result()
    finally:
        unit.inject_fault_token.remote(None).result()
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "request_failed" and error["type"] == "internal_error"
    assert s.status_code == 200  # the stream had started: the error comes in-band
    events = [json.loads(line[6:]) for line in s.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["code"] == "request_failed"
    for prompt, text in zip(others, texts):
        assert text == target_only_text(tiny_models[2], encode_prompt(tok, prompt), 120), prompt
    after = unit_stats(ngram_app)
    assert after["target_restarts"] == before["target_restarts"]
    assert after["free_slots"] == after["num_slots"]
