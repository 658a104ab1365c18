"""The OpenAI-compatible API over real HTTP against the local Serve app (tiny model)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from specserve.config import SamplingParams
from specserve.engine.tokenizer import encode_chat, encode_prompt

from tests.engine.test_spec_decode import make_engine
from tests.serve.conftest import target_only_texts, unit_handle
from tests.tiny import make_tiny_tokenizer

MODEL = "tiny-target"  # the served name is the model directory's name, see conftest
PROMPTS = ["hello world", "def add(a, b):\n    return", "The quick brown fox jumps over",
           "café naïve", "SELECT * FROM users WHERE", "one two three one two three one",
           "import numpy as np\nimport", "Once upon a time"]


@pytest.fixture(scope="module")
def model_name(tiny_models):
    from pathlib import Path

    return Path(tiny_models[0]).name


def target_only_text(target_hf, prompt_ids: list[int], max_tokens: int) -> str:
    """What the target alone produces, greedily, in this process (no Ray, no HTTP)."""
    engine = make_engine(target_hf, None, max_len=256)
    return engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


def complete(url: str, model: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def greedy_equals_target_only(url: str, model: str, target_hf, prompts: list[str], max_tokens: int,
                              method: str) -> list[dict]:
    """Each prompt served greedily over HTTP, speculated by ``method``, must produce what the
    target alone produces; returns the response bodies."""
    expected = target_only_texts(target_hf, prompts, max_tokens)
    bodies = []
    for prompt in prompts:
        r = complete(url, model, prompt, max_tokens)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[prompt], prompt
        assert r.headers["x-speculation"].startswith(f"on; reason=default; method={method}")
        bodies.append(r.json())
    return bodies


def read_sse(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_greedy_output_equals_the_engine_target_only(ngram_app, tiny_models, model_name):
    for body in greedy_equals_target_only(ngram_app, model_name, tiny_models[2], PROMPTS[:3], 24, "ngram"):
        spec = body["usage"]["speculation"]
        assert spec["enabled"] and spec["num_drafts"] >= 0 and "mean_acceptance_length" in spec


def test_chat_greedy_equals_target_only(ngram_app, tiny_models, model_name):
    messages = [{"role": "user", "content": "Say something nice"}]
    r = httpx.post(ngram_app + "/v1/chat/completions", timeout=120, json={
        "model": model_name, "messages": messages, "max_tokens": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    expected = target_only_text(tiny_models[2], encode_chat(make_tiny_tokenizer(), messages), 20)
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}


def test_a_second_turn_finds_its_prefix_cached_and_answers_as_the_target_alone(
        ngram_app, tiny_models, model_name):
    """The n-gram app pages its KV cache with prefix caching (``tests/serve/conftest.py``): a
    request that repeats an earlier one's prompt and answer and adds to them reports the full
    blocks it found (OpenAI's ``usage.prompt_tokens_details.cached_tokens``) and answers what
    the target alone answers; a first request reports none."""
    first = "The quick brown fox jumps over the lazy dog, " * 4
    r1 = complete(ngram_app, model_name, first, 16)
    assert r1.status_code == 200, r1.text
    assert r1.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = first + r1.json()["choices"][0]["text"] + " and then it slept."
    r2 = complete(ngram_app, model_name, second, 16)
    assert r2.status_code == 200, r2.text
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32 and cached % 16 == 0 and cached < r2.json()["usage"]["prompt_tokens"]
    assert r2.json()["choices"][0]["text"] == target_only_texts(tiny_models[2], [second], 16)[second]
    salted = [complete(ngram_app, model_name, second, 16, cache_salt="tenant-b") for _ in range(2)]
    hits = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in salted]
    assert hits[0] == 0 and hits[1] >= cached  # another tenant's cache: its own blocks only
    assert {r.json()["choices"][0]["text"] for r in salted} == {r2.json()["choices"][0]["text"]}


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_equals_non_streamed(ngram_app, model_name, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model_name, "max_tokens": 30, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": PROMPTS[5]}]} if chat
                else {"prompt": PROMPTS[5]})
    whole = httpx.post(ngram_app + path, json=body, timeout=120).json()
    with httpx.stream("POST", ngram_app + path, timeout=120, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-speculation"].startswith("on")
        events = read_sse(r)
    pieces = [e["choices"][0]["delta"].get("content", "") if chat else e["choices"][0]["text"]
              for e in events if e["choices"]]
    text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert "".join(pieces) == text
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == \
        whole["usage"]["completion_tokens"]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == whole["choices"][0]["finish_reason"] and set(finishes[:-1]) <= {None}


def test_concurrent_requests_each_get_their_own_output(ngram_app, tiny_models, model_name):
    tok = make_tiny_tokenizer()
    lengths = [5, 40, 12, 33, 8, 25, 17, 3]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda pl: complete(ngram_app, model_name, *pl),
                                  zip(PROMPTS, lengths)))
    for prompt, n, r in zip(PROMPTS, lengths, responses):
        assert r.status_code == 200, r.text
        expected = target_only_text(tiny_models[2], encode_prompt(tok, prompt), n)
        assert r.json()["choices"][0]["text"] == expected, prompt


def test_client_can_turn_speculation_off(ngram_app, model_name):
    r = complete(ngram_app, model_name, PROMPTS[0], 10, speculation={"enabled": False})
    assert r.status_code == 200
    assert r.headers["x-speculation"] == "off; reason=client_override"
    assert r.json()["usage"]["speculation"]["num_drafts"] == 0


def test_models_and_health(ngram_app, model_name):
    assert httpx.get(ngram_app + "/health").json() == {"status": "ok"}
    models = httpx.get(ngram_app + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [model_name]


def test_openai_client_unchanged(ngram_app, model_name):
    from openai import OpenAI

    client = OpenAI(base_url=ngram_app + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=model_name, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    comp = client.completions.create(model=model_name, prompt="hello", max_tokens=12, temperature=0)
    assert comp.choices[0].text and comp.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=model_name, max_tokens=12, temperature=0,
                                            stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        chat.choices[0].message.content
    with pytest.raises(Exception) as exc:
        client.completions.create(model="not-this-one", prompt="x", max_tokens=2)
    assert getattr(exc.value, "status_code", None) == 404


def _admitted(url: str) -> int:
    return httpx.get(url + "/v1/units/stats").json()["requests_admitted"]


BAD = [
    ({"model": "no-such-model", "prompt": "x"}, 404, "does not exist"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 201}, 400, "at most 200"),
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "word " * 300, "max_tokens": 1}, 400, "maximum context length"),
    ({"prompt": "word " * 100, "max_tokens": 200}, 400, "maximum context length"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "token ids"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 9}, 400, "n: at most 8"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "speculation": {"num_speculative_tokens": 0}}, 400, "num_speculative_tokens"),
    ({"prompt": "x", "speculation": {"enabeld": True}}, 400, "enabeld"),
    ({"prompt": "x", "speculation": {"method": "draft_model"}}, 400, "runs 'ngram'"),
]


@pytest.mark.parametrize("body, status, needle", BAD, ids=[str(b)[:40] for b, _, _ in BAD])
def test_bad_requests_are_refused_before_the_model(ngram_app, model_name, body, status, needle):
    before = _admitted(ngram_app)
    r = httpx.post(ngram_app + "/v1/completions", json={"model": model_name, **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and needle in error["message"]
    assert _admitted(ngram_app) == before


@pytest.mark.parametrize("raw, needle", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "m", "messages": []}', "messages"),
])
def test_malformed_bodies(ngram_app, raw, needle):
    r = httpx.post(ngram_app + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "wizard", "content": "x"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": 5}], "content"),
])
def test_bad_chat_messages(ngram_app, model_name, messages, needle):
    before = _admitted(ngram_app)
    r = httpx.post(ngram_app + "/v1/chat/completions", timeout=30,
                   json={"model": model_name, "messages": messages})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert _admitted(ngram_app) == before


def test_disconnect_mid_stream_frees_the_slot(ngram_app, model_name):
    """The abort reaches the engine (counted), not just a request that ran to its end."""
    import time

    stats = httpx.get(ngram_app + "/v1/units/stats", timeout=60).json()
    with httpx.stream("POST", ngram_app + "/v1/completions", timeout=120, json={
            "model": model_name, "prompt": "a b c", "max_tokens": 200, "temperature": 0.8,
            "speculation": {"enabled": False},  # one token per step: far from done at disconnect
            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)  # the generation is running: a slot is taken
        # Hold the engine so the stream cannot finish before the disconnect, however fast
        # the machine: the abort below must be what ends it.
        unit_handle("ngram").stall.remote(5.0).result()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = httpx.get(ngram_app + "/v1/units/stats", timeout=60).json()
        if now["free_slots"] == stats["num_slots"] and now["running"] == 0:
            break
        time.sleep(0.2)
    assert now["free_slots"] == now["num_slots"] and now["running"] == 0
    assert now["requests_aborted"] == stats["requests_aborted"] + 1
