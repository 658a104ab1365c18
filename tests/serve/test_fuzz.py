"""Bad input over real HTTP: a hand-written list of nasty requests, property tests of the request
models (hypothesis) and schemathesis against the service's own OpenAPI document.

Every answer must be a 4xx with an OpenAI-shaped body that leaks nothing of the server (or a
200 where the input is odd but valid); never a 5xx, never a hang, and no slot may be left taken
afterwards."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from specserve.serve.protocol import ChatCompletionRequest, CompletionRequest

from tests.leaks import leaks

MODEL = "tiny-target"  # in the bodies below; replaced by the served name (its directory's)


def assert_clean_4xx(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    assert not leaks(r.text), r.text[:300]
    return error


def raw(url: str, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(url + path, content=body, timeout=60, headers={"content-type": "application/json"})


def chat(content, **extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 4, **extra}).encode()


def chat_raw(extra: bytes) -> bytes:
    """A chat body with ``extra`` spliced in as raw JSON text (for what json.dumps won't write)."""
    return b'{"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], ' + extra + b"}"


def messages(*msgs) -> bytes:
    return json.dumps({"model": MODEL, "messages": list(msgs)}).encode()


NASTY: list[tuple[str, bytes, int | None]] = [
    ("invalid utf-8", messages().replace(b"[]", b'[{"role": "user", "content": "\xff\xfe\xfd"}]'), 400),
    ("truncated utf-8", b'{"model": "tiny-target", "prompt": "caf\xc3"}', 400),
    ("lone surrogate escape", chat("\\ud800 alone").replace(b"\\\\ud800", b"\\ud800"), 400),
    ("huge json", b'{"model": "tiny-target", "prompt": "' + b"a" * (2 * 1024 * 1024) + b'"}', 413),
    ("deep nesting", b'{"model": "tiny-target", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("deep object nesting", b'{"x": ' * 50_000 + b"1" + b"}" * 50_000, 400),
    ("NaN temperature", chat_raw(b'"temperature": NaN'), 400),
    ("Infinity top_p", chat_raw(b'"top_p": Infinity'), 400),
    ("NaN as string", chat("x", temperature="NaN"), 400),
    ("overflowing float", chat_raw(b'"temperature": 1e999'), 400),
    ("negative max_tokens", chat("x", max_tokens=-1), 400),
    ("huge max_tokens", chat("x", max_tokens=10**30), 400),
    ("negative top_k", chat("x", top_k=-3), 400),
    ("negative seed", chat("x", seed=-1), 400),
    ("float max_tokens", chat("x", max_tokens=3.5), 400),
    ("bool max_tokens", chat("x", max_tokens=True), 400),
    ("100k-character stop", chat("x", stop="s" * 100_000), 400),
    ("100k stop strings", chat("x", stop=["s"] * 100_000), None),  # 413 or 400: both clean
    ("empty messages", messages(), 400),
    ("messages not a list", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400),
    ("unknown role", messages({"role": "wizard", "content": "x"}), 400),
    ("null content", messages({"role": "user", "content": None}), 400),
    ("image part", messages({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}), 400),
    ("array body", b"[]", 400),
    ("scalar body", b"42", 400),
    ("empty body", b"", 400),
    ("model name 10k characters", json.dumps({"model": "m" * 10_000, "messages": [
        {"role": "user", "content": "x"}]}).encode(), 400),
    ("wrong model", messages({"role": "user", "content": "x"}).replace(b"tiny-target", b"gpt-4"), 404),
    ("tools", chat("x", tools=[{"type": "function"}]), 400),
    ("response_format xml", chat("x", response_format={"type": "xml"}), 400),
    ("uncompilable schema", chat("x", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}), 400),
    ("logit_bias key not a token id", chat("x", logit_bias={"five": 100}), 400),
    ("logit_bias past 100", chat("x", logit_bias={"5": 1e6}), 400),
    ("allowed_token_ids past the vocabulary", chat("x", allowed_token_ids=[5, 10**9]), 400),
    ("a bad word of spaces", chat("x", bad_words=["ab", "  "]), 400),
    ("NaN presence_penalty", chat_raw(b'"presence_penalty": NaN'), 400),
    ("-Infinity temperature", chat_raw(b'"temperature": -Infinity'), 400),
    ("top_k -1.0", chat("x", top_k=-1.0), 400),  # -1 disables; a float is still not an int
    ("n = 500", chat("x", n=500), 400),
    ("stream as string", chat("x", stream="true"), 400),
    ("speculation K too big", chat("x", speculation={"num_speculative_tokens": 10**6}), 400),
    ("prompt too long", chat("word " * 5000), 400),
]
FINE: list[tuple[str, bytes]] = [  # odd but valid: 200
    ("NUL and control characters", chat("a\u0000b\u0007c\u001b[31m")),
    ("zero-width and RTL", chat("\u200b\u200e\u202eabc\ufeff")),
    ("emoji and CJK", chat("🦙🚀 日本語 𝔘𝔫𝔦𝔠𝔬𝔡𝔢")),
    ("unknown extra fields", chat("x", frobnicate={"deep": [1, 2]}, logit_bias=None)),
    ("explicit nulls", chat("x", temperature=None, top_p=None, n=None, stop=None, seed=None,
                            tools=None, response_format=None, stream=None)),
    ("values that ask for nothing", chat("x", top_k=-1, n=1, logprobs=False, tools=[],
                                         response_format={"type": "text"}, tool_choice="none")),
    ("subnormal temperature", chat_raw(b'"temperature": 5e-324, "max_tokens": 4')),
    ("logit_bias bans and forces", chat("x", logit_bias={"5": 100, "6": -100}, min_p=0.5)),
    ("allowed tokens and bad words", chat("x", allowed_token_ids=[5, 6, 7, 5], bad_words=["日本", "ab c"])),
    ("one special token allowed", chat("x", allowed_token_ids=[0])),
]


@pytest.fixture(scope="module")
def served(tiny_models) -> bytes:
    return json.dumps(Path(tiny_models[0]).name).encode()


@pytest.mark.parametrize("name, body, status", NASTY, ids=[n for n, _, _ in NASTY])
def test_nasty_inputs_get_clean_4xx(ngram_app, served, name, body, status):
    path = "/v1/completions" if b'"prompt"' in body[:60] else "/v1/chat/completions"
    assert_clean_4xx(raw(ngram_app, body.replace(b'"tiny-target"', served), path), status)


@pytest.mark.parametrize("name, body", FINE, ids=[n for n, _ in FINE])
def test_odd_but_valid_inputs_are_served(ngram_app, served, name, body):
    r = raw(ngram_app, body.replace(b'"tiny-target"', served))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# -- the request models alone ---------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": JSON | st.just(MODEL), "prompt": JSON | st.text(), "messages": JSON,
    "max_tokens": JSON, "temperature": JSON, "top_p": JSON, "top_k": JSON, "n": JSON,
    "stop": JSON, "seed": JSON, "stream": JSON, "stream_options": JSON, "speculation": JSON,
    "user": JSON, "logprobs": JSON, "max_completion_tokens": JSON, "tools": JSON,
    "response_format": JSON, "logit_bias": JSON, "presence_penalty": JSON,
    "allowed_token_ids": JSON, "bad_words": JSON})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FIELDS)
def test_request_models_accept_or_refuse_cleanly(body):
    """Any JSON object either validates into bounded sampling parameters or raises
    ValidationError with a message: nothing else escapes (a 500 would)."""
    raw_json = json.dumps(body)
    for model in (CompletionRequest, ChatCompletionRequest):
        try:
            req = model.model_validate_json(raw_json)
        except ValidationError as exc:
            assert exc.errors() and exc.errors()[0]["msg"]
            continue
        params = req.sampling_params(req.max_tokens or 16)
        assert 0 <= params.temperature <= 2 and 0 < params.top_p <= 1 and len(params.stop) <= 16


# -- schemathesis against the live OpenAPI document ---------------------------------------------
def test_openapi_document_describes_the_bodies(ngram_app, served):
    doc = httpx.get(ngram_app + "/openapi.json", timeout=30).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ChatCompletionRequest")
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["properties"]["model"]["enum"] == [json.loads(served)]
    assert "messages" in schema["required"]
    assert {"400", "401", "429", "503"} <= set(doc["paths"]["/v1/completions"]["post"]["responses"])


def test_schemathesis_finds_no_5xx_and_only_openai_shaped_4xx(ngram_app):
    """schemathesis generates requests from /openapi.json, valid ones and (negative mode) ones
    the schema forbids, and they go to the live app: no 5xx, every 4xx OpenAI-shaped, and
    both kinds of answer seen."""
    import schemathesis

    schema = schemathesis.openapi.from_url(ngram_app + "/openapi.json")
    failures: list[str] = []
    seen: dict[int, int] = {}

    def send(case, path: str) -> None:
        body = case.body
        if isinstance(body, bytes):
            content = body
        elif isinstance(body, (dict, list, str, int, float, bool, type(None))):
            content = json.dumps(body).encode()
        else:  # no body at all (schemathesis' NotSet)
            content = b""
        r = httpx.request(case.method, ngram_app + case.formatted_path, timeout=60,
                          content=content, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            failures.append(f"{r.status_code} {path} {r.text[:100]} <- {str(body)[:200]}")
        elif r.status_code >= 400:
            try:
                assert_clean_4xx(r)
            except (AssertionError, ValueError, KeyError):
                failures.append(f"unshaped {r.status_code} {path}: {r.text[:200]}")

    def run(op, mode) -> None:
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=mode))
        def check(case):
            send(case, op.path)

        check()

    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "POST":
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                run(op, mode)
    assert not failures, failures[:5]
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen


def test_nothing_is_left_behind(ngram_app):
    """After all of the above: every slot free, nothing waiting."""
    deadline = time.monotonic() + 120
    while True:
        stats = httpx.get(ngram_app + "/v1/units/stats", timeout=30).json()
        if stats["free_slots"] == stats["num_slots"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert stats["free_slots"] == stats["num_slots"] and stats["waiting"] == 0
    kv = stats["kv_cache"]  # the n-gram app pages: no block held once every slot is free
    assert kv["layout"] == "paged" and kv["blocks_free"] == kv["blocks_total"], kv
