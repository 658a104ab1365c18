"""Same seed, same text, over HTTP: a seeded sampled request gives the target-only text of its
seed with speculation off, forced on at K = 1 and K = 4, and left to the router (K chosen per
step), alone and while other requests share its batch; for prompt lookup and a draft model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from specserve.config import SamplingParams
from specserve.engine.tokenizer import encode_prompt

from tests.engine.test_spec_decode import make_engine
from tests.serve.test_http import PROMPTS
from tests.tiny import make_tiny_tokenizer

SAMPLING = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 40, "seed": 1234}
MODES = {"off": {"enabled": False}, "k1": {"enabled": True, "num_speculative_tokens": 1},
         "k4": {"enabled": True, "num_speculative_tokens": 4}, "router": None}


def complete(url: str, model: str, prompt: str, speculation: dict | None, **sampling) -> dict:
    body = {"model": model, "prompt": prompt, **sampling}
    if speculation is not None:
        body["speculation"] = speculation
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def in_batch(url: str, model: str, prompt: str, speculation: dict | None) -> dict:
    """The seeded request sent together with three others (sampled without a seed, greedy)."""
    others = [(PROMPTS[i], {"temperature": t, "max_tokens": 60}) for i, t in ((4, 1.0), (5, 0), (6, 0.7))]
    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(complete, url, model, p, None, **s) for p, s in others]
        mine = pool.submit(complete, url, model, prompt, speculation, **SAMPLING)
        for f in noise:
            f.result()
        return mine.result()


@pytest.mark.parametrize("app_name", ["ngram_app", "draft_app"])
def test_seeded_text_is_the_same_with_speculation_off_on_at_any_k_alone_or_batched(
        request, tiny_models, app_name):
    url, model = request.getfixturevalue(app_name), Path(tiny_models[0]).name
    prompt = PROMPTS[2]
    ids = encode_prompt(make_tiny_tokenizer(), prompt)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=1234)
    expected = make_engine(tiny_models[2], None).generate([ids], params)[0].text
    for name, speculation in MODES.items():
        for send in (lambda s: complete(url, model, prompt, s, **SAMPLING),
                     lambda s: in_batch(url, model, prompt, s)):
            body = send(speculation)
            assert body["choices"][0]["text"] == expected, name
            assert body["usage"]["speculation"]["enabled"] == (name != "off"), name
    other_seed = complete(url, model, prompt, None, **{**SAMPLING, "seed": 4321})
    assert other_seed["choices"][0]["text"] != expected
