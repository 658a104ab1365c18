"""OpenAI API compatibility at the edges: explicit nulls mean the default, values that ask for
nothing are accepted, every feature we do not implement is refused by name, numbers are
finite, and error bodies say what happened without leaking internals.

Over real HTTP against the session's n-gram app (the official ``openai`` client and raw
httpx), plus the pieces that need no server: the mapping of a unit's exceptions to API
errors, the catch-all handler, the chat template's refusals and the router's class key."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import pytest
from fastapi import Request  # module level: FastAPI resolves the route's annotation here
from openai import OpenAI
from ray.exceptions import ActorDiedError, RayTaskError
from specserve.config import SamplingParams
from specserve.engine.tokenizer import encode_chat, encode_prompt
from specserve.errors import CapacityError, InvalidRequestError, RequestFailed, TargetUnavailable
from specserve.serve.engine_loop import EngineFailed, UnitError

from tests.engine.test_spec_decode import make_engine
from tests.leaks import leaks
from tests.serve.test_http import target_only_text
from tests.tiny import make_tiny_tokenizer

PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "Say something nice"}]


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return Path(tiny_models[0]).name


@pytest.fixture(scope="module")
def client(ngram_app) -> OpenAI:
    return OpenAI(base_url=ngram_app + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(tiny_models):
    """``greedy(prompt_ids, n)``: the target's own greedy text, memoized."""
    cache: dict[tuple, str] = {}

    def text(ids: list[int], n: int) -> str:
        if (tuple(ids), n) not in cache:
            cache[tuple(ids), n] = target_only_text(tiny_models[2], ids, n)
        return cache[tuple(ids), n]

    return text


def post(url: str, body: dict | bytes, chat: bool = True) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, timeout=120,
                          headers={"content-type": "application/json"})
    return httpx.post(url + path, json=body, timeout=120)


def assert_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"], error
    assert "\n" not in error["message"] and not leaks(r.text), error
    if param is not None:
        assert error["param"] == param, error
    return error


# -- explicit nulls mean the default ------------------------------------------------------------
def test_openai_client_with_explicit_nones(client, model, greedy):
    """Every optional field the client lets a caller pass, as None: sent as JSON null."""
    nones = dict(top_p=None, n=None, stop=None, seed=None, presence_penalty=None,
                 frequency_penalty=None, logprobs=None, top_logprobs=None, user=None,
                 logit_bias=None, response_format=None, tools=None, tool_choice=None)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                          max_tokens=None, max_completion_tokens=12,
                                          extra_body={"top_k": -1}, **nones)
    expected = greedy(encode_chat(make_tiny_tokenizer(), MESSAGES), 12)
    assert chat.choices[0].message.content == expected
    assert chat.usage.completion_tokens <= 12
    sampled = client.chat.completions.create(model=model, messages=MESSAGES, temperature=None,
                                             max_completion_tokens=4, **nones)
    assert sampled.choices[0].finish_reason in ("stop", "length")
    comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=None, temperature=0,
                                     echo=None, suffix=None, best_of=None, **{
                                         k: v for k, v in nones.items() if k not in (
                                             "top_logprobs", "response_format", "tools",
                                             "tool_choice")})
    # null max_tokens on /v1/completions is OpenAI's default there, 16
    assert comp.choices[0].text == greedy(encode_prompt(make_tiny_tokenizer(), PROMPT), 16)


def test_openai_client_values_that_ask_for_nothing(client, model, greedy):
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_completion_tokens=12, n=1,
        logprobs=False, presence_penalty=0, frequency_penalty=0, top_logprobs=0,
        response_format={"type": "text"}, tool_choice="none", logit_bias={},
        extra_body={"top_k": -1, "repetition_penalty": 1.0, "min_p": 0})
    assert chat.choices[0].message.content == \
        greedy(encode_chat(make_tiny_tokenizer(), MESSAGES), 12)


def test_openai_client_streams_with_null_options(client, model, greedy):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                            max_tokens=12, stream=True, stream_options=None)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == greedy(encode_chat(make_tiny_tokenizer(), MESSAGES), 12)


def test_raw_json_nulls_everywhere(ngram_app, model, greedy):
    nulls = {key: None for key in (
        "max_tokens", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed", "user",
        "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "echo",
        "suffix", "best_of", "ignore_eos", "speculation", "response_format", "tools",
        "stop_token_ids", "min_p", "repetition_penalty", "guided_json", "modalities")}
    r = post(ngram_app, {"model": model, "prompt": PROMPT, "temperature": 0, **nulls}, chat=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(encode_prompt(make_tiny_tokenizer(), PROMPT), 16)
    assert r.json()["usage"]["completion_tokens"] <= 16
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "temperature": 0,
                         "max_completion_tokens": 6, "speculation": {"enabled": None},
                         "stream": True, "stream_options": {"include_usage": None}, **{
                             k: v for k, v in nulls.items() if k not in ("stream",
                                                                          "stream_options")}})
    assert r.status_code == 200 and "data: [DONE]" in r.text, r.text


def test_null_temperature_is_the_default_not_greedy(ngram_app, model):
    """null is 1.0 (sampled), so two seeds may differ where greedy could not."""
    texts = set()
    for seed in range(6):
        r = post(ngram_app, {"model": model, "prompt": PROMPT, "temperature": None, "seed": seed,
                             "max_tokens": 12}, chat=False)
        assert r.status_code == 200, r.text
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) > 1


def test_stop_token_ids_are_honoured(ngram_app, model, tiny_models):
    """vLLM's extension, which the engine implements: generation ends at the first of them."""
    ids = encode_prompt(make_tiny_tokenizer(), PROMPT)
    engine = make_engine(tiny_models[2], None, max_len=256)
    [out] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    first = out.output_token_ids[0]
    r = post(ngram_app, {"model": model, "prompt": ids, "temperature": 0, "max_tokens": 12,
                         "stop_token_ids": [first]}, chat=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 1


def test_logit_bias_penalties_min_tokens_and_min_p_are_honoured(ngram_app, model, tiny_models):
    """OpenAI's logit_bias and penalties and vLLM's repetition_penalty, min_tokens, min_p,
    allowed_token_ids and bad_words reach the engine (their losslessness under speculation:
    tests/engine/step/test_logit_rules.py): a token biased +100 is every greedy token; with
    min_tokens 5 a forced stop token comes sixth; min_p 1 samples the greedy text; penalized
    greedy text, and text with allowed tokens and a bad word, is the engine's; refusals name
    the field."""
    tokenizer = make_tiny_tokenizer()
    ids = encode_prompt(tokenizer, PROMPT)
    [forced] = encode_prompt(tokenizer, "e")
    body = {"model": model, "prompt": ids, "temperature": 0, "max_tokens": 8}
    r = post(ngram_app, {**body, "max_tokens": 4, "logit_bias": {str(forced): 100}}, chat=False)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "eeee", r.text
    r = post(ngram_app, {**body, "logit_bias": {str(forced): 100}, "stop_token_ids": [forced],
                         "min_tokens": 5}, chat=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert r.json()["usage"]["completion_tokens"] == 6, r.text  # five others, then the stop
    greedy_text = post(ngram_app, body, chat=False).json()["choices"][0]["text"]
    r = post(ngram_app, {**body, "temperature": 1.5, "seed": 3, "min_p": 1}, chat=False)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text, r.text
    penalties = {"presence_penalty": 0.3, "frequency_penalty": 0.4, "repetition_penalty": 1.2}
    r = post(ngram_app, {**body, **penalties}, chat=False)
    [want] = make_engine(tiny_models[2], None, max_len=256).generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, **penalties))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text, r.text
    engine = make_engine(tiny_models[2], None, max_len=256)
    [free] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=8))
    rules = {"bad_words": [tokenizer.decode(free.output_token_ids[:2])],
             "allowed_token_ids": sorted(set(range(3, 512)) - {free.output_token_ids[3]})}
    r = post(ngram_app, {**body, **rules}, chat=False)
    [want] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=8, **rules))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text != greedy_text, r.text
    for bad, param in (({"min_tokens": 9}, "min_tokens"), ({"min_p": 1.5}, "min_p"),
                       ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                       ({"allowed_token_ids": []}, "allowed_token_ids"),
                       ({"bad_words": ["x", " "]}, "bad_words[1]"),
                       ({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"logit_bias": {"e": 5}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
                       ({"logit_bias": {str(10**6): 5}}, "logit_bias")):
        assert_error(post(ngram_app, {**body, **bad}, chat=False), 400, param=param)


# -- features we do not implement: a 400 that names them ----------------------------------------
UNSUPPORTED = [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("best_of", 3),
    ("prediction", {"type": "content", "content": "x"}),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("use_beam_search", True), ("chat_template", "{{ 'x' }}"), ("documents", [{"text": "x"}]),
    ("logits_processors", ["mod.Proc"]), ("guided_whitespace_pattern", " *"),
    ("spaces_between_special_tokens", False), ("echo", True),
]


@pytest.mark.parametrize("field, value", UNSUPPORTED, ids=[f"{f}={v}"[:40] for f, v in UNSUPPORTED])
def test_unimplemented_features_are_refused_by_name(ngram_app, model, field, value):
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 2, field: value})
    error = assert_error(r, 400, param=field)
    assert field in error["message"] and "not supported by this server" in error["message"]
    assert error["code"] == "unsupported_parameter"


def test_usage_on_every_chunk_as_vllm(ngram_app, model):
    """vLLM's stream_options.continuous_usage_stats (benchmark clients send it): with
    include_usage every chunk carries its choice's usage so far, counting up to the final
    usage's; without it, only the last chunk has usage."""
    def chunks(**options) -> list[dict]:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True, **options}}
        with httpx.stream("POST", ngram_app + "/v1/chat/completions", json=body, timeout=120) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    every = chunks(continuous_usage_stats=True)
    final, counts = every[-1]["usage"], [c["usage"]["completion_tokens"] for c in every[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == final["completion_tokens"] == 8
    assert {c["usage"]["prompt_tokens"] for c in every} == {final["prompt_tokens"]}
    assert [("usage" in c) for c in chunks()][-2:] == [False, True]


@pytest.mark.parametrize("field, value", [("suffix", "}\n"), ("best_of", 2)])
def test_unimplemented_completion_features_are_refused_by_name(ngram_app, model, field, value):
    r = post(ngram_app, {"model": model, "prompt": PROMPT, "max_tokens": 2, field: value}, chat=False)
    assert field in assert_error(r, 400, param=field)["message"]


def test_openai_client_gets_the_refusal(client, model):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       functions=[{"name": "f"}])
    assert exc.value.status_code == 400 and exc.value.param == "functions"
    assert "functions is not supported by this server" in exc.value.message


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")])
def test_completions_refuse_tools_by_name(ngram_app, model, field, value):
    r = post(ngram_app, {"model": model, "prompt": PROMPT, "max_tokens": 2, field: value}, chat=False)
    assert field in assert_error(r, 400, param=field)["message"]


def test_special_tokens_and_stop_strings_shown_when_asked(ngram_app, model):
    """vLLM's skip_special_tokens false shows a special token's text; its
    include_stop_str_in_output keeps the stop string that ended the text."""
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": 3,
            "logit_bias": {"1": 100}}  # <|im_start|>: special
    assert post(ngram_app, body, chat=False).json()["choices"][0]["text"] == ""
    r = post(ngram_app, {**body, "skip_special_tokens": False}, chat=False)
    assert r.json()["choices"][0]["text"] == "<|im_start|>" * 3, r.text
    body = {**body, "max_tokens": 12, "logit_bias": {}}
    free = post(ngram_app, body, chat=False).json()["choices"][0]["text"]
    stop = free[4:7]
    for include, end in ((False, free.index(stop)), (True, free.index(stop) + 3)):
        r = post(ngram_app, {**body, "stop": [stop], "include_stop_str_in_output": include}, chat=False)
        assert r.json()["choices"][0]["text"] == free[:end], (include, stop, free, r.text)


def test_chat_template_options_as_vllm(ngram_app, model):
    """vLLM's chat_template_kwargs (a template variable: the tiny template's enable_thinking,
    as Qwen3's), continue_final_message with add_generation_prompt false: the prompt the
    template renders (usage counts it; /tokenize gives the same); a template's own arguments
    as kwargs, both options at once, a continued user message and a client's own template
    are refused by name."""
    def prompt_tokens(**extra) -> int:
        r = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain, thinking_off = prompt_tokens(), prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert thinking_off > plain and prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    tokenized = httpx.post(ngram_app + "/tokenize", timeout=60, json={
        "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert tokenized["count"] == thinking_off, tokenized
    started = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    assert prompt_tokens(messages=started, add_generation_prompt=False,
                         continue_final_message=True) < prompt_tokens(messages=started)
    for extra, param in (({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs"),
                         ({"continue_final_message": True}, "continue_final_message"),
                         ({"continue_final_message": True, "add_generation_prompt": False},
                          "continue_final_message"),
                         ({"chat_template": "{{ 'x' }}"}, "chat_template")):
        assert_error(post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 1, **extra}),
                     400, param=param)


def test_truncate_prompt_tokens_keeps_the_prompts_end(ngram_app, model):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (after the chat template),
    the same output as that shorter prompt sent whole; echo returns what was kept."""
    ids = encode_prompt(make_tiny_tokenizer(), PROMPT)
    body = {"model": model, "temperature": 0, "max_tokens": 4, "echo": True}
    cut = post(ngram_app, {**body, "prompt": PROMPT, "truncate_prompt_tokens": 3}, chat=False).json()
    kept = post(ngram_app, {**body, "prompt": ids[-3:]}, chat=False).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == kept["choices"][0]["text"]
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 1, "truncate_prompt_tokens": 5})
    assert r.json()["usage"]["prompt_tokens"] == 5, r.text
    r = post(ngram_app, {**body, "prompt": PROMPT, "truncate_prompt_tokens": -1}, chat=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    assert_error(post(ngram_app, {**body, "prompt": PROMPT, "truncate_prompt_tokens": -2}, chat=False),
                 400, param="truncate_prompt_tokens")


def test_tokenize_and_detokenize_as_vllm(ngram_app, model):
    """vLLM's /tokenize gives the ids the generation routes run (a prompt's as /v1/completions
    tokenizes it; messages' as the chat route renders them: its usage counts as many); the
    model is optional; /detokenize turns ids back; bad bodies are OpenAI-shaped 4xx."""
    def call(path: str, body: dict) -> httpx.Response:
        return httpx.post(ngram_app + path, json=body, timeout=60)

    ids = encode_prompt(make_tiny_tokenizer(), PROMPT)
    max_model_len = httpx.get(ngram_app + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    r = call("/tokenize", {"model": model, "prompt": PROMPT})
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": max_model_len,
                                                 "tokens": ids, "token_strs": None}, r.text
    chat = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 1})
    r = call("/tokenize", {"messages": MESSAGES, "return_token_strs": True})
    assert r.status_code == 200 and r.json()["count"] == chat.json()["usage"]["prompt_tokens"], r.text
    assert len(r.json()["token_strs"]) == r.json()["count"]
    bare = call("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == r.json()["tokens"][:bare["count"]] and bare["count"] < r.json()["count"]
    r = call("/detokenize", {"model": model, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}, r.text
    for path, body, status, param in (("/tokenize", {}, 400, "prompt"),
                                      ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
                                      ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
                                      ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "5"}, 400, "tokens")):
        assert_error(call(path, body), status, param=param)


def test_token_ids_returned_as_vllm(ngram_app, model, client):
    """vLLM's return_token_ids (what RL rollout and agent frameworks read): the prompt's ids
    (completions: on each choice; chat: on the response) as /tokenize gives them, and each
    choice's output ids, as many as its completion_tokens, whose text /detokenize gives;
    streamed, the prompt's on a choice's first chunk only and the chunks' ids adding up to the
    whole response's. Without it, neither key."""
    def streamed(body: dict, chat: bool) -> list[dict]:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with httpx.stream("POST", ngram_app + path, json={**body, "stream": True}, timeout=120) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    common = {"model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for chat, asked in ((False, {"prompt": PROMPT}), (True, {"messages": MESSAGES})):
        body = {**common, **asked}
        whole = post(ngram_app, body, chat=chat).json()
        choice = whole["choices"][0]
        prompt_ids = whole["prompt_token_ids"] if chat else choice["prompt_token_ids"]
        tokenized = httpx.post(ngram_app + "/tokenize", json=asked, timeout=60).json()["tokens"]
        assert prompt_ids == tokenized
        assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 8
        text = choice["message"]["content"] if chat else choice["text"]
        detokenized = httpx.post(ngram_app + "/detokenize", json={"tokens": choice["token_ids"]}, timeout=60)
        assert detokenized.json()["prompt"] == text, (detokenized.text, text)
        chunks = streamed(body, chat)
        with_prompt = [c for c in chunks if "prompt_token_ids" in (c if chat else c["choices"][0])]
        assert len(with_prompt) == 1 and with_prompt[0] is chunks[0], chunks[:2]
        assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == choice["token_ids"]
        plain = post(ngram_app, {**body, "return_token_ids": False}, chat=chat).json()
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0], plain
        assert "prompt_token_ids" not in plain["choices"][0]
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(reply.choices[0].model_extra["token_ids"]) == reply.usage.completion_tokens == 4
    assert reply.model_extra["prompt_token_ids"] == tokenized
    # return_tokens_as_token_ids: logprobs name their tokens token_id:<id>, the chosen ones the
    # output's own ids; top alternatives likewise; the text itself unchanged
    named = {**common, "prompt": PROMPT, "logprobs": 2, "return_tokens_as_token_ids": True}
    for choices in ([post(ngram_app, named, chat=False).json()["choices"][0]],
                    [c["choices"][0] for c in streamed(named, chat=False)]):
        logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
        tokens, ids = sum((lp["tokens"] for lp in logprobs), []), sum((c["token_ids"] for c in choices), [])
        assert tokens == [f"token_id:{t}" for t in ids] and len(ids) == 8, (tokens, ids)
        tops = [k for lp in logprobs for top in lp["top_logprobs"] for k in top]
        assert all(re.fullmatch(r"token_id:\d+", k) for k in tops), tops
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    entries = chat.choices[0].logprobs.content
    assert entries and all(re.fullmatch(r"token_id:\d+", e.token) for e in entries)
    assert all(re.fullmatch(r"token_id:\d+", a.token) for e in entries for a in e.top_logprobs)


def test_fields_without_semantics_are_still_ignored(ngram_app, model):
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 2, "store": True,
                         "metadata": {"team": "x"}, "service_tier": "auto", "user": "u-1",
                         "parallel_tool_calls": False, "tools": [], "functions": [],
                         "modalities": ["text"], "logprobs": False, "n": 1})
    assert r.status_code == 200, r.text


# -- numbers are finite --------------------------------------------------------------------------
FLOATS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_p"]


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
@pytest.mark.parametrize("field", FLOATS)
def test_nan_and_infinity_are_refused_in_every_float(ngram_app, model, field, value):
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2}).encode()
    raw = body[:-1] + b', "' + field.encode() + b'": ' + value + b"}"
    error = assert_error(post(ngram_app, raw, chat=False), 400, param=field)
    assert "finite" in error["message"]


@pytest.mark.parametrize("value", [b"1e-46", b"5e-324", b"1e-39", b"0.0"])
def test_tiny_temperature_is_greedy(ngram_app, model, greedy, value):
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 12}).encode()
    r = post(ngram_app, body[:-1] + b', "temperature": ' + value + b"}", chat=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(encode_prompt(make_tiny_tokenizer(), PROMPT), 12)


# -- error messages --------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, needle", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid"),
    ({"messages": MESSAGES, "stop": [1]}, "stop[0]", "string"),
    ({"messages": MESSAGES, "speculation": {"num_speculative_tokens": "4"}},
     "speculation.num_speculative_tokens", "integer"),
    ({"messages": MESSAGES, "temperature": [1]}, "temperature", "number"),
])
def test_validation_errors_are_one_clean_line_with_the_param(ngram_app, model, body, param, needle):
    error = assert_error(post(ngram_app, {"model": model, **body}), 400, param=param)
    assert error["message"].startswith(param + ": ") and needle in error["message"]
    assert "{" not in error["message"] and "'loc'" not in error["message"]


def _wrapped(cause: Exception) -> Exception:
    """What Serve re-raises for an exception raised in a unit: Ray's task error, also an
    instance of the cause's class, its text the remote traceback."""
    trace = ('Traceback (most recent call last):\n  File "/work/main/services/specserve/serve/'
             f'unit.py", line 80, in generate\n{type(cause).__name__}: {cause}')
    return RayTaskError("SpeculationUnit.generate", trace, cause, pid=4242, ip="10.0.0.7",
                        actor_id="8c5d3a0f1e2b4c6d8e0f1a2b3c4d5e6f7a8b9c0d").as_instanceof_cause()


def test_a_units_4xx_keeps_its_own_message():
    from specserve.serve.api_errors import from_unit_error as _from_engine

    for cause, status in ((InvalidRequestError("the prompt is empty"), 400),
                          (CapacityError("all 8 KV cache slots are in use"), 429)):
        wrapped = _wrapped(cause)
        assert "pid=4242" in str(wrapped) and isinstance(wrapped, type(cause))
        error = _from_engine(wrapped, "cmpl-1")
        assert error.status == status and error.body["error"]["message"] == str(cause)


@pytest.mark.parametrize("cause, status, code", [
    (TargetUnavailable('target rank 0 died: ray::TargetRank.step() (pid=77, ip=10.0.0.7)\n  File '
                       '"/usr/lib/python3/site-packages/ray/actor.py", line 1'), 503,
     "target_unavailable"),
    (RequestFailed("the server could not process this request"), 500, "request_failed"),
    (KeyError("/work/main/secret.py"), 500, "internal_error"),
    (ActorDiedError(), 503, "unit_unavailable"),
    (EngineFailed("the target group failed; the request was cancelled, retry shortly"), 503,
     "engine_failed"),
    (UnitError("the server failed while processing this request"), 500, "unit_error"),
])
def test_a_units_5xx_says_what_happened_and_leaks_nothing(cause, status, code):
    from specserve.serve.api_errors import from_unit_error as _from_engine

    for exc in (cause, _wrapped(cause)):
        error = _from_engine(exc, "chatcmpl-0123456789abcdef0123456789abcdef")
        message = error.body["error"]["message"]
        assert error.status == status and error.body["error"]["code"] == code
        assert status != 503 or "retry" in message
        assert message.endswith("(request id chatcmpl-0123456789abcdef0123456789abcdef)")
        assert not leaks(json.dumps(error.body)) and "\n" not in message, message


def test_an_unexpected_exception_is_an_openai_shaped_500():
    """The catch-all: a bug answers JSON with a request id, never a plain-text traceback."""
    from fastapi.testclient import TestClient
    from specserve.serve.http_app import app
    from specserve.serve.http_app import request_id as _request_id

    @app.get("/test-only/boom")
    async def boom(request: Request):
        _request_id(request, "cmpl-")  # as the handlers do: the id the log line will carry
        raise RuntimeError('File "/work/main/services/specserve/secret.py", line 1')

    try:
        r = TestClient(app).get("/test-only/boom")
    finally:
        app.router.routes[:] = [r for r in app.router.routes
                                if getattr(r, "path", "") != "/test-only/boom"]
    error = assert_error(r, 500)
    assert error["type"] == "internal_error" and "(request id cmpl-" in error["message"]


def test_the_leak_watch_sees_error_bodies():
    """tests/conftest.py's watch is on: a leaking body is recorded (and removed here)."""
    from tests import conftest

    body = 'Traceback (most recent call last):\n  File "/work/x.py", line 3\nray.exceptions.X'
    in_band = json.dumps({"error": {"message": "ray::Unit.generate() (pid=42)"}})

    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stream":  # an error after a stream's 200
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=f"data: {in_band}\n\ndata: [DONE]\n\n".encode())
        return httpx.Response(500, text=body)

    before = len(conftest._LEAKED)
    with httpx.Client(transport=httpx.MockTransport(reply)) as c:
        c.get("http://leaky.invalid/")
        with c.stream("GET", "http://leaky.invalid/stream") as r:
            assert list(r.iter_lines())[0] == f"data: {in_band}"
    caught = conftest._LEAKED[before:]
    del conftest._LEAKED[before:]
    assert len(caught) == 2 and "traceback" in caught[0] and "host path" in caught[0]
    assert caught[1].startswith("200 ") and "pid" in caught[1]


# -- chat templates and the router's class key --------------------------------------------------
def test_a_chat_template_that_refuses_the_messages_is_a_400():
    tok = copy.deepcopy(make_tiny_tokenizer())  # the shared one is cached: leave it alone
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="messages: .*System role not supported"):
        encode_chat(tok, [{"role": "system", "content": "be nice"}, *MESSAGES])
    assert encode_chat(tok, MESSAGES)


def test_the_router_class_key_is_per_api_key():
    """Two tenants sending the same ``user`` must not share acceptance state."""
    from specserve.serve.ingress import class_key as _class_key
    from specserve.serve.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "user": "bob",
                                                "speculation": {"traffic_class": "code"}})
    mine, theirs = _class_key(req, True, "key-aaaa1111", 40), _class_key(req, True, "key-bbbb2222", 40)
    assert mine != theirs and "key-aaaa1111" in mine and mine.endswith("|bob|code|p<128,single")


def test_the_router_class_key_separates_request_shapes():
    """A long prompt, a conversation that carries an earlier answer, or a penalty is another
    class than a one-line question on the same route and key."""
    from specserve.serve.ingress import class_key as _class_key
    from specserve.serve.protocol import ChatCompletionRequest

    def key(messages, prompt_len, **fields):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
        return _class_key(req, True, "key-aaaa1111", prompt_len)

    revise = [*MESSAGES, {"role": "assistant", "content": "an answer"},
              {"role": "user", "content": "shorter, please"}]
    assert len({key(MESSAGES, 40), key(MESSAGES, 600), key(revise, 40), key(MESSAGES, 5000)}) == 4
    assert key(revise, 40).endswith("|p<128,multi") and key(MESSAGES, 5000).endswith("|p>=2048,single")
    for penalty in ({"presence_penalty": 0.5}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}):
        assert key(MESSAGES, 40, **penalty).endswith("|p<128,single,penalized")
    assert key(MESSAGES, 40, presence_penalty=0, repetition_penalty=1) == key(MESSAGES, 40)


def _nested(levels: int) -> str:
    """A JSON schema of arrays of arrays, ``levels`` deep, as text (Python's own encoder stops
    short of 1000 levels)."""
    return '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels


@pytest.mark.parametrize("levels", [200, 1000])
def test_a_body_nested_too_deep_names_the_parameter_that_holds_it(ngram_app, model, levels):
    """pydantic's JSON parser stops at 201 levels; the 400 says so and names the field (it
    said "not valid JSON" with no param)."""
    head = f'{{"model": "{model}", "messages": {json.dumps(MESSAGES)}, "max_tokens": 2, '
    schema = _nested(levels)
    body = head + f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "d", ' \
                  f'"schema": {schema}}}}}}}'
    error = assert_error(post(ngram_app, body.encode()), 400, "response_format.json_schema.schema")
    assert error["code"] == "json_too_deep" and "at most 201 levels" in error["message"], error
    body = head + f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": ' \
                  f'{schema}}}}}]}}'
    error = assert_error(post(ngram_app, body.encode()), 400, "tools[0].function.parameters")
    assert error["code"] == "json_too_deep", error
    assert assert_error(post(ngram_app, b'{"model": "x"')).get("param") is None  # truncated: not JSON


def test_a_prompt_over_the_context_names_prompt_or_messages(ngram_app, model):
    """Completions have no messages: their over-long prompt is ``prompt``'s fault."""
    r = post(ngram_app, {"model": model, "prompt": [5] * 300, "max_tokens": 1}, chat=False)
    assert assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = post(ngram_app, {"model": model, "messages": [{"role": "user", "content": "word " * 300}],
                         "max_tokens": 1})
    assert assert_error(r, 400, "messages")["code"] == "context_length_exceeded"


def test_a_seed_whose_last_choice_leaves_the_range_is_refused(ngram_app, model):
    """Choice i is the single request with seed + i, so seed + n - 1 must be a seed too (it
    wrapped to 0 before)."""
    top = 2**63 - 1
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 2, "n": 2, "seed": top})
    error = assert_error(r, 400, "seed")
    assert f"at most {top - 1}" in error["message"], error
    r = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 2, "n": 2, "seed": top - 1})
    assert r.status_code == 200, r.text
