"""Hostile sampling values sent while other requests stream: the hostile request gets a clean
4xx (or a 200 where the value legitimately means something, a tiny temperature being greedy),
and nobody else notices. Every request beside it completes with the target's own greedy
output, the target group is never restarted, and every slot is free at the end.

A NaN reaching a sampler would poison the batch it shares (a NaN row in a softmax, an
``inf`` divided logit): the point is that none gets that far."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from specserve.config import SamplingParams
from specserve.engine.tokenizer import encode_prompt

from tests.engine.test_spec_decode import make_engine
from tests.leaks import leaks
from tests.serve.test_http import PROMPTS, read_sse
from tests.tiny import make_tiny_tokenizer

BACKGROUND = PROMPTS[3:6]  # streamed beside every hostile request
BACKGROUND_TOKENS = 120
HOSTILE_PROMPT = PROMPTS[0]
HOSTILE_TOKENS = 16
GREEDY, OK = "greedy", "ok"  # a 200 whose text is the greedy one / any 200

# (name, the hostile member as raw JSON text, what it must get)
HOSTILE: list[tuple[str, str, int | str]] = [
    ("temperature 1e-46", '"temperature": 1e-46', GREEDY),
    ("temperature 5e-324", '"temperature": 5e-324', GREEDY),  # the smallest subnormal
    ("temperature 1e-39", '"temperature": 1e-39', GREEDY),
    ("temperature NaN", '"temperature": NaN', 400),
    ("temperature Infinity", '"temperature": Infinity', 400),
    ("temperature -Infinity", '"temperature": -Infinity', 400),
    ("temperature 1e999", '"temperature": 1e999', 400),
    ("temperature -1", '"temperature": -1', 400),
    ("temperature 3.0", '"temperature": 3.0', 400),
    ("temperature list", '"temperature": [0.5]', 400),
    ("top_p NaN", '"top_p": NaN', 400),
    ("top_p 0", '"top_p": 0', 400),
    ("top_p 1e-320", '"top_p": 1e-320, "temperature": 0.7', GREEDY),  # keeps the top token only
    ("top_p 2", '"top_p": 2', 400),
    ("top_k -2", '"top_k": -2', 400),
    ("top_k 10**30", f'"top_k": {10**30}', 400),
    ("max_tokens -1", '"max_tokens": -1', 400),
    ("max_tokens 0", '"max_tokens": 0', 400),
    ("max_tokens 10**30", f'"max_tokens": {10**30}', 400),
    ("max_tokens string", '"max_tokens": "12"', 400),
    ("max_tokens 1.5", '"max_tokens": 1.5', 400),
    ("seed -1", '"seed": -1', 400),
    ("seed 2**64", f'"seed": {2**64}', 400),
    ("presence_penalty NaN", '"presence_penalty": NaN', 400),
    ("K 0", '"speculation": {"num_speculative_tokens": 0}', 400),
    ("K -1", '"speculation": {"num_speculative_tokens": -1}', 400),
    ("K 10**9", f'"speculation": {{"num_speculative_tokens": {10**9}}}', 400),
    ("K string", '"speculation": {"num_speculative_tokens": "4"}', 400),
    ("K true", '"speculation": {"num_speculative_tokens": true}', 400),
    ("prompt object", '"prompt": {"text": "hi"}', 400),
]


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return Path(tiny_models[0]).name


@pytest.fixture(scope="module")
def expected(tiny_models) -> dict[str, str]:
    """Each background prompt's and the hostile prompt's greedy text, from the target alone."""
    tok = make_tiny_tokenizer()
    engine = make_engine(tiny_models[2], None, max_len=256)
    out = {p: engine.generate([encode_prompt(tok, p)], SamplingParams(
        temperature=0, max_tokens=BACKGROUND_TOKENS, ignore_eos=True))[0].text for p in BACKGROUND}
    out[HOSTILE_PROMPT] = engine.generate([encode_prompt(tok, HOSTILE_PROMPT)], SamplingParams(
        temperature=0, max_tokens=HOSTILE_TOKENS))[0].text
    return out


@pytest.fixture(scope="module")
def before(ngram_app) -> dict:
    """The unit's numbers before any hostile request."""
    return unit_stats(ngram_app)


def unit_stats(url: str) -> dict:
    return httpx.get(url + "/v1/units/stats", timeout=60).json()


def stream(url: str, model: str, prompt: str, started: threading.Event) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": BACKGROUND_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = []
        for event in read_sse(r):
            events.append(event)
            started.set()
    assert all("error" not in e for e in events), events[-1]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def hostile_body(model: str, member: str) -> bytes:
    """A completion request with ``member`` spliced in as raw JSON (json.dumps writes no NaN);
    a later key wins, so ``member`` may override the prompt."""
    base = json.dumps({"model": model, "prompt": HOSTILE_PROMPT, "max_tokens": HOSTILE_TOKENS})
    return (base[:-1] + ", " + member + "}").encode()


def send(url: str, model: str, member: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=hostile_body(model, member),
                      headers={"content-type": "application/json"}, timeout=120)


def beside_streams(url: str, model: str, expected: dict[str, str], send_hostile) -> list:
    """``send_hostile()`` while every background prompt streams; checks the streams' texts and
    returns what ``send_hostile`` returned."""
    started = [threading.Event() for _ in BACKGROUND]
    with ThreadPoolExecutor(len(BACKGROUND)) as pool:
        others = [pool.submit(stream, url, model, p, s) for p, s in zip(BACKGROUND, started)]
        for event in started:  # all of them decoding (or failed: .result() below says why)
            event.wait(timeout=120)
        result = send_hostile()
        texts = [f.result(timeout=240) for f in others]
    for prompt, text in zip(BACKGROUND, texts):
        assert text == expected[prompt], prompt
    return result


REFUSED = [(name, member, want) for name, member, want in HOSTILE if isinstance(want, int)]
SERVED = [(name, member) for name, member, want in HOSTILE if want == GREEDY]


def test_refused_values_hurt_nobody_else(ngram_app, model, expected, before):
    """Every value a sampler must never see, one request each, while three requests stream:
    a clean OpenAI-shaped 4xx naming the field, and the streams go on untouched."""
    responses = beside_streams(ngram_app, model, expected, lambda: [
        send(ngram_app, model, member) for _, member, _ in REFUSED])
    wrong = []
    for (name, _, want), r in zip(REFUSED, responses):
        error = r.json().get("error") if r.headers.get("content-type") == "application/json" else None
        if r.status_code != want or not error or set(error) != {"message", "type", "code", "param"} \
                or not error["param"] or leaks(r.text):
            wrong.append(f"{name}: {r.status_code} {r.text[:200]}")
    assert not wrong, wrong


@pytest.mark.parametrize("name, member", SERVED, ids=[n for n, _ in SERVED])
def test_values_that_mean_greedy_are_served_greedily(ngram_app, model, expected, before, name,
                                                     member):
    """A temperature below 1e-5 (subnormal ones included) is greedy, as in vLLM, and so is a
    top_p so small that only the top token is left; nobody else's output changes."""
    r = beside_streams(ngram_app, model, expected, lambda: send(ngram_app, model, member))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected[HOSTILE_PROMPT]


def test_the_unit_was_never_hurt(ngram_app, before):
    """After every hostile value: no target restart, every slot free, nothing waiting."""
    deadline = time.monotonic() + 60
    while True:
        after = unit_stats(ngram_app)
        if after["free_slots"] == after["num_slots"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert after["target_restarts"] == before["target_restarts"]
    assert after["target_available"]
    assert after["free_slots"] == after["num_slots"] and after["waiting"] == 0
