"""``n > 1`` over the OpenAI API (issue 22), over real HTTP against the session's n-gram and
draft-model apps: n choices, each the single request of its own seed (seed + i), streamed
and not, parsed by the official ``openai`` client; the prompt is computed once (the unit's
``prefill_tokens`` counters), and a request of n counts n sequences."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from specserve.engine.tokenizer import encode_chat

from tests.serve.test_api_compat import MESSAGES, PROMPT, post
from tests.tiny import make_tiny_tokenizer

# Speculation forced on (fixed K): the router's per-step K may find drafting does not pay on a
# busy machine and draft nothing, and the first test checks that the choices speculate.
SAMPLED = {"max_tokens": 12, "temperature": 0.9, "ignore_eos": True,
           "speculation": {"enabled": True}}


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return Path(tiny_models[0]).name


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/units/stats", timeout=60).json()


@pytest.mark.parametrize("app", ["ngram_app", "draft_app"])
def test_n_choices_are_the_single_requests_of_seed_plus_i_and_share_the_prefill(request, model, app):
    url = request.getfixturevalue(app)
    before = _stats(url)
    r = post(url, {"model": model, "messages": MESSAGES, "n": 4, "seed": 40, **SAMPLED})
    assert r.status_code == 200, r.text
    body = r.json()
    after = _stats(url)
    prompt_len = len(encode_chat(make_tiny_tokenizer(), MESSAGES))
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]  # a paged app's prefix cache
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len - cached  # once, not 4 times
    assert after["prefill_tokens_shared"] - before["prefill_tokens_shared"] == 3 * (prompt_len - 1)
    assert after["requests_admitted"] - before["requests_admitted"] == 4
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["message"]["content"] for c in body["choices"]]
    for i, text in enumerate(texts):
        alone = post(url, {"model": model, "messages": MESSAGES, "seed": 40 + i, **SAMPLED}).json()
        assert alone["choices"][0]["message"]["content"] == text, f"choice {i}"
    assert len(set(texts)) > 1
    assert body["usage"]["prompt_tokens"] == prompt_len
    assert body["usage"]["completion_tokens"] == 4 * 12
    assert body["usage"]["speculation"]["num_draft_tokens"] > 0


def test_streamed_choices_equal_the_whole_response(ngram_app, model):
    whole = post(ngram_app, {"model": model, "prompt": PROMPT, "n": 3, "seed": 5, "logprobs": 1,
                             **SAMPLED}, chat=False).json()
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    with httpx.stream("POST", ngram_app + "/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPT, "n": 3, "seed": 5, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLED}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    assert texts == [c["text"] for c in whole["choices"]]
    assert finishes == ["length"] * 3
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 36
    for c in whole["choices"]:
        assert len(c["logprobs"]["tokens"]) == 12 and "".join(c["logprobs"]["tokens"]) == c["text"]


def test_echo_gives_every_choice_the_prompt_and_its_scores(ngram_app, model):
    body = post(ngram_app, {"model": model, "prompt": PROMPT, "n": 2, "echo": True, "logprobs": 0,
                            "seed": 1, **SAMPLED}, chat=False).json()
    first, second = (c["logprobs"] for c in body["choices"])
    for c in body["choices"]:
        assert c["text"].startswith(PROMPT)
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert first["token_logprobs"][:prompt_tokens] == second["token_logprobs"][:prompt_tokens]
    assert first["token_logprobs"][0] is None and first["token_logprobs"][1] < 0


def test_the_openai_client_reads_n_choices(ngram_app, model):
    client = OpenAI(base_url=ngram_app + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model=model, messages=MESSAGES, n=2, seed=3, max_tokens=12,
                                         temperature=0.9, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 24


def test_n_beyond_the_units_slots_is_400_and_admits_nothing(ngram_app, model):
    before = _stats(ngram_app)["requests_admitted"]
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "n": 9, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert _stats(ngram_app)["requests_admitted"] == before
