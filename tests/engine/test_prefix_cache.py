"""Prefix caching through the engine (issue 34, the in-process engine on ``kv_cache.layout:
paged``): a conversation's second turn finds its first turn's blocks and prefills only the
rest, and every output, greedy and seeded, is the target-only slot-cache engine's token for
token, for each proposer. Seeded draws depend on (seed, position) only, so a cached prefix
cannot move them; the kernels are row-invariant, so a cached block holds a fresh prefill's
bits. EAGLE reads the target's features, which the cache does not keep yet: its requests
do not look prefixes up (no hit), and stay exact."""

from __future__ import annotations

import pytest
from specserve.config import KVCacheConfig, SamplingParams

from tests.engine.test_spec_decode import make_engine, prompts
from tests.models import perturbed, tiny_hf_model

PAGED = KVCacheConfig(layout="paged", block_size=16)
PARAMS = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=20),
          SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=11)]


def turns(engine) -> list[list[int]]:
    """Two turns of three conversations: turn 2 is turn 1's prompt, its answer and 9 more
    tokens. Every output, in order."""
    first = prompts(3, seed=7)
    done = engine.generate(first, PARAMS)
    second = [p + c.output_token_ids + list(range(40, 49)) for p, c in zip(first, done)]
    return [c.output_token_ids for c in done] + \
        [c.output_token_ids for c in engine.generate(second, PARAMS)]


@pytest.fixture(scope="module")
def target_hf():
    return tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)


@pytest.fixture(scope="module")
def close_draft_hf(target_hf):
    return perturbed(target_hf, scale=0.3)


@pytest.fixture(scope="module")
def reference(target_hf):
    return turns(make_engine(target_hf, None))


@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "suffix", "eagle"])
def test_second_turns_hit_the_cache_and_keep_target_onlys_output(target_hf, close_draft_hf,
                                                                  reference, method):
    engine = make_engine(target_hf, method, draft_hf=close_draft_hf, kv=PAGED)
    assert turns(engine) == reference
    stats = engine.target.cache.manager.stats
    if method == "eagle":
        assert stats.hits == 0
    else:
        assert stats.hits >= 3 * 16, stats  # each second turn found at least a block
    engine.target.cache.manager.check()
    assert engine.target.num_free_slots == engine.target.num_slots
