"""Logprobs over the OpenAI API (issue 22, first part), over real HTTP against the session's
n-gram and draft-model apps: chat ``logprobs`` / ``top_logprobs`` and completions
``logprobs: N``, streamed and not, parsed by the official ``openai`` client; with speculation
on they equal the same request's with speculation off (the client's override), value for
value, and the values are the target's own log-softmax (greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from specserve.engine.tokenizer import encode_chat, encode_prompt

from tests.serve.test_api_compat import MESSAGES, PROMPT, post
from tests.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return Path(tiny_models[0]).name


def _chat(url: str, model: str, speculate: bool, **extra) -> dict:
    r = post(url, {"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                   "logprobs": True, "top_logprobs": 3, "ignore_eos": True,
                   "speculation": {"enabled": speculate}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("app", ["ngram_app", "draft_app"])
def test_chat_logprobs_with_speculation_equal_target_only(request, model, app):
    url = request.getfixturevalue(app)
    on, off = _chat(url, model, True), _chat(url, model, False)
    assert on["usage"]["speculation"]["enabled"] and not off["usage"]["speculation"]["enabled"]
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    assert on["choices"][0]["logprobs"] == off["choices"][0]["logprobs"]
    content = on["choices"][0]["logprobs"]["content"]
    assert len(content) == on["usage"]["completion_tokens"] == 12
    assert "".join(c["token"] for c in content) == on["choices"][0]["message"]["content"]
    for c in content:  # greedy: the chosen token is the likeliest
        assert len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"]
        assert c["top_logprobs"][0]["logprob"] == c["logprob"] <= 0
        assert bytes(c["bytes"]).decode() == c["token"]


def test_chat_logprobs_are_the_targets_log_softmax(ngram_app, model, tiny_models):
    """The target's greedy continuation (transformers, no EOS stop) token by token: each
    entry is that token's text and its log-softmax under the model."""
    body = _chat(ngram_app, model, True)
    tokenizer = make_tiny_tokenizer()
    prompt = encode_chat(tokenizer, MESSAGES)
    with torch.no_grad():
        ids = tiny_models[2].generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        logits = tiny_models[2](torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:]
    truth = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([i]) for i in ids]
    got = torch.tensor([c["logprob"] for c in content])
    assert torch.allclose(got, truth, atol=1e-4, rtol=0)


def test_streamed_chat_logprobs_equal_the_whole_response(ngram_app, model):
    whole = _chat(ngram_app, model, True)["choices"][0]["logprobs"]["content"]
    with httpx.stream("POST", ngram_app + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = [c for chunk in chunks for choice in chunk["choices"]
                if choice.get("logprobs") for c in choice["logprobs"]["content"]]
    assert streamed == whole


def test_the_openai_client_reads_chat_logprobs(ngram_app, model):
    client = OpenAI(base_url=ngram_app + "/v1", api_key="x", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                          temperature=0.7, seed=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_completion_logprobs(ngram_app, model):
    r = post(ngram_app, {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                         "logprobs": 2, "ignore_eos": True}, chat=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and len(top) == 2  # greedy: the chosen token is in the top 2
    assert encode_prompt(make_tiny_tokenizer(), PROMPT)  # the prompt tokenizes (sanity)


def test_bad_logprobs_values_are_400(ngram_app, model):
    for body, chat in (({"logprobs": True, "top_logprobs": 21}, True),
                       ({"top_logprobs": 2}, True),  # top_logprobs without logprobs
                       ({"logprobs": 21}, False), ({"logprobs": -1}, False)):
        base = {"model": model, "max_tokens": 2, **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
        r = post(ngram_app, {**base, **body}, chat=chat)
        assert r.status_code == 400 and "logprobs" in r.text, (body, r.text)


def _prompt_ids() -> list[int]:
    return encode_prompt(make_tiny_tokenizer(), PROMPT + " and then some more words")


@pytest.mark.parametrize("app", ["ngram_app", "draft_app"])
def test_echo_with_max_tokens_0_gives_the_prompts_log_likelihood(request, model, tiny_models, app):
    """What lm-evaluation-harness sends for a log-likelihood (token ids, ``echo``,
    ``logprobs``, ``max_tokens: 0``): the prompt back, its first token null, every later
    token's log-softmax given those before it, as the model computes it; nothing generated."""
    url = request.getfixturevalue(app)
    ids = _prompt_ids()
    r = post(url, {"model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
                   "temperature": 0}, chat=False)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    lp = choice["logprobs"]
    assert choice["text"] == make_tiny_tokenizer().decode(ids) and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.no_grad():
        logits = tiny_models[2](torch.tensor([ids])).logits[0, :-1]
    truth = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), truth, atol=1e-4, rtol=0)
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # top 1, and the token itself


def test_echo_with_generation_streamed_and_not(ngram_app, model):
    ids = encode_prompt(make_tiny_tokenizer(), PROMPT)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 0,
            "temperature": 0, "ignore_eos": True}
    whole = post(ngram_app, body, chat=False).json()["choices"][0]
    assert whole["text"].startswith(PROMPT)
    assert len(whole["logprobs"]["tokens"]) == len(ids) + 6
    assert "".join(whole["logprobs"]["tokens"][len(ids):]) == whole["text"][len(PROMPT):]
    with httpx.stream("POST", ngram_app + "/v1/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = {key: [v for c in choices if c["logprobs"] for v in c["logprobs"][key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == whole["logprobs"]


def test_vllm_prompt_logprobs_on_both_routes(ngram_app, model, tiny_models):
    """vLLM's ``prompt_logprobs``: per prompt token (the first null) ``{id: {logprob, rank,
    decoded_token}}`` of the token and its k likeliest (ranks 1..k), the model's log-softmax;
    on each completion choice, on a chat response; with echo asking for fewer alternatives,
    echo's keep theirs; not with stream (400, as vLLM)."""
    tokenizer = make_tiny_tokenizer()
    ids = _prompt_ids()
    body = {"model": model, "prompt": ids, "max_tokens": 0, "prompt_logprobs": 3, "echo": True,
            "logprobs": 1, "temperature": 0}
    r = post(ngram_app, body, chat=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    with torch.no_grad():
        logp = torch.log_softmax(tiny_models[2](torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    for j, (token, entry) in enumerate(zip(ids[1:], scored[1:])):
        assert str(token) in entry and len(entry) in (3, 4)
        truth = logp[j, token]
        assert abs(entry[str(token)]["logprob"] - truth) < 1e-4
        assert entry[str(token)]["rank"] == int((logp[j] > truth).sum()) + 1
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        by_rank = sorted((e["rank"], e["logprob"]) for e in entry.values())
        assert [rank for rank, _ in by_rank][:3] == [1, 2, 3]
        assert [v for _, v in by_rank] == sorted((v for _, v in by_rank), reverse=True)
    assert all(top is None or len(top) in (1, 2) for top in choice["logprobs"]["top_logprobs"])  # echo's 1
    chat = post(ngram_app, {"model": model, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    prompt = encode_chat(tokenizer, MESSAGES)
    assert [None if e is None else list(e) for e in chat.json()["prompt_logprobs"]] == \
        [None, *([str(t)] for t in prompt[1:])]
    plain = post(ngram_app, {**body, "prompt_logprobs": None}, chat=False).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    r = post(ngram_app, {**body, "max_tokens": 2, "echo": False, "stream": True}, chat=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_max_tokens_0_without_echo_is_400(ngram_app, model):
    r = post(ngram_app, {"model": model, "prompt": PROMPT, "max_tokens": 0}, chat=False)
    assert r.status_code == 400 and "echo" in r.text


def test_lm_evaluation_harness_scores_log_likelihoods(ngram_app, model, tiny_models):
    """The real lm-evaluation-harness client (``local-completions``: token-id prompts in a
    batch of one, ``echo``, ``logprobs: 1``, ``max_tokens: 1``) gets each continuation's
    log-likelihood as the model computes it, and whether it is the greedy continuation."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=ngram_app + "/v1/completions", model=model,
                             tokenizer=tiny_models[0], tokenizer_backend="huggingface",
                             max_retries=1, timeout=120)
    tokenizer = make_tiny_tokenizer()
    pairs = [(PROMPT, " the lazy dog"), ("Say something", " nice please")]
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    for (context, continuation), (loglik, _) in zip(pairs, results):
        ctx = tokenizer.encode(context, add_special_tokens=False)
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        with torch.no_grad():
            logp = torch.log_softmax(tiny_models[2](torch.tensor([whole])).logits[0, :-1].float(), -1)
        truth = float(logp.gather(1, torch.tensor(whole[1:])[:, None])[len(ctx) - 1:, 0].sum())
        assert abs(loglik - truth) < 1e-3, (context, loglik, truth)


def test_a_batch_of_one_token_id_prompt_is_served_and_more_are_refused(ngram_app, model):
    ids = encode_prompt(make_tiny_tokenizer(), PROMPT)
    one = post(ngram_app, {"model": model, "prompt": [ids], "max_tokens": 3, "temperature": 0},
               chat=False)
    alone = post(ngram_app, {"model": model, "prompt": ids, "max_tokens": 3, "temperature": 0},
                 chat=False)
    assert one.status_code == 200 and one.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    for prompt in ([ids, ids], [[]]):
        r = post(ngram_app, {"model": model, "prompt": prompt, "max_tokens": 3}, chat=False)
        assert r.status_code == 400 and "prompt" in r.text
