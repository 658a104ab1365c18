"""Suffix decoding: proposals equal a brute-force count over every occurrence, the global cache
keeps the last responses within its bounds (and its memory with them), greedy output is
target-only's with a cold and a warm cache, sampled output keeps the target's distribution.
The greedy, stop and distribution suites of test_spec_decode run ``suffix`` and the
``suffix+eagle`` hybrid as well."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest
from specserve.config import SamplingParams, SpeculativeConfig
from specserve.engine.drafts.suffix import SEP, SuffixOptions, SuffixProposer
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step.proposal import DraftRequest

from tests.engine.test_spec_decode import EOS, prompts
from tests.models import tiny_hf_model, worker_of
from tests.tiny import make_tiny_tokenizer


def reference_continuation(seqs: list[list[int]], context: list[int], k: int, options,
                           min_match: int = 1) -> tuple[list[int], float]:
    """What suffix decoding proposes from ``seqs``, by counting every occurrence in plain
    Python: the longest suffix of ``context`` (at least ``min_match``) that occurs followed
    by a token, then the most frequent next token (ties: the smaller) while the cumulative
    probability holds."""
    length, occurrences = 0, []
    for n in range(1, min(options.max_match_tokens, len(context)) + 1):
        found = [(i, e) for i, s in enumerate(seqs) for e in range(n - 1, len(s) - 1)
                 if s[e - n + 1:e + 1] == context[-n:]]
        if not found:
            break
        length, occurrences = n, found
    if length < min_match:
        return [], 0.0
    limit = min(k, math.floor(options.match_factor * length + options.match_offset))
    tokens, score, prob = [], 0.0, 1.0
    while len(tokens) < limit and occurrences:
        following = [seqs[i][e + 1] for i, e in occurrences if e + 1 < len(seqs[i])]
        if not following:
            break
        counts = Counter(following)
        best = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[best] / len(occurrences)
        if prob < options.min_token_prob:
            break
        tokens.append(best)
        score += prob
        occurrences = [(i, e + 1) for i, e in occurrences
                       if e + 1 < len(seqs[i]) and seqs[i][e + 1] == best]
    return tokens, score


def reference_propose(sequence: list[int], responses: list[list[int]], k: int, options) -> list[int]:
    own, own_score = reference_continuation([sequence], sequence, k, options)
    cached, cached_score = reference_continuation(responses, sequence, k, options, min_match=2)
    return cached if cached_score > own_score else own


@pytest.mark.parametrize("options", [
    SuffixOptions(),
    SuffixOptions(min_token_prob=0.0, max_match_tokens=3, max_cached_responses=4),
    SuffixOptions(match_factor=2.0, match_offset=1, min_token_prob=0.3, max_cached_tokens=80),
], ids=["default", "short-matches", "long-guesses"])
def test_proposals_equal_a_count_over_every_occurrence(options):
    """Sequences over a 6-token alphabet (many repeats), growing one step at a time, with
    responses finishing into the cache (past its bounds) as they go."""
    rng = random.Random(7)
    proposer = SuffixProposer(options)
    finished: list[list[int]] = []
    checked = drafted = 0
    for seq_id in range(30):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        tokens = prompt + [rng.randrange(6)]
        proposer.start(seq_id, seed=seq_id)
        for _ in range(rng.randrange(1, 25)):
            k = rng.randrange(0, 9)
            [got] = proposer.propose([DraftRequest(seq_id, tokens, k)])
            kept = [r for r in finished if len(r) + 1 <= options.max_cached_tokens]
            cache = []  # what the cache should hold: the newest responses within both bounds
            for r in reversed(kept):
                if len(cache) == options.max_cached_responses or \
                        sum(len(c) + 1 for c in cache) + len(r) + 1 > options.max_cached_tokens:
                    break
                cache.append(r)
            assert got.token_ids == (reference_propose(tokens, cache, k, options) if k else []), \
                (seq_id, tokens, k)
            checked += 1
            drafted += bool(got.token_ids)
            tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        proposer.learn(tokens, len(prompt))
        proposer.finish(seq_id)
        finished.append(tokens[len(prompt):])
    assert checked > 200 and drafted > checked // 4
    assert not proposer.sequences


def test_the_cache_keeps_the_last_responses_within_its_bounds_and_its_memory_with_them():
    """Fill the cache far past both bounds: it holds exactly the newest responses that fit,
    and its memory stays within a constant per cached token."""
    options = SuffixOptions(max_cached_responses=50, max_cached_tokens=5000)
    proposer = SuffixProposer(options)
    rng = np.random.default_rng(3)
    responses = [rng.integers(0, 40, rng.integers(20, 300)).tolist() for _ in range(2000)]
    peak = 0
    for response in responses:
        proposer.learn([1, 2, 3] + response, prompt_len=3)
        cache = proposer.cache
        assert cache.num_responses <= 50 and cache.num_tokens <= 5000
        peak = max(peak, cache.nbytes)
    kept, total = [], 0
    for r in reversed(responses):
        if len(kept) == 50 or total + len(r) + 1 > 5000:
            break
        kept.insert(0, r)
        total += len(r) + 1
    live = cache.view()[cache.base:]
    assert live.tolist() == [t for r in kept for t in (*r, SEP)]
    # 4 bytes of token and 8 of index per cached token, at most 3x that with the array's
    # growth and the evicted tokens that wait for the next compaction.
    assert peak <= 36 * options.max_cached_tokens + 16_384, peak
    # Every live position is indexed or in the scanned tail: a lookup finds each occurrence
    # of a pair (a small alphabet: pairs recur, in old and new responses), and nothing else.
    pairs = {(r[i], r[i + 1]) for r in (kept[0], kept[-1]) for i in range(len(r) - 2)}
    tokens = live.tolist()
    for prev, last in pairs:
        expected = {cache.base + i for i in range(1, len(tokens) - 1)
                    if (tokens[i - 1], tokens[i]) == (prev, last) and tokens[i + 1] != SEP}
        assert set(cache.ends(prev, last).tolist()) == expected and expected


def test_a_response_longer_than_the_token_bound_is_not_cached_and_zero_responses_is_none():
    proposer = SuffixProposer(SuffixOptions(max_cached_tokens=10))
    proposer.learn(list(range(20)), prompt_len=5)
    assert proposer.cache.num_responses == 0
    proposer = SuffixProposer(SuffixOptions(max_cached_responses=0))
    proposer.learn(list(range(20)), prompt_len=5)
    assert proposer.cache.num_responses == 0


def test_a_miss_proposes_nothing_and_a_match_proposes_what_followed():
    proposer = SuffixProposer(SuffixOptions(min_token_prob=0.5))
    proposer.start(0, seed=0)
    text = [5, 6, 7, 8, 9, 10, 11, 40, 41, 5, 6, 7]
    [hit] = proposer.propose([DraftRequest(seq_id=0, token_ids=text, k=4)])
    assert hit.token_ids == [8, 9, 10]  # capped by the match length (3) x factor 1
    proposer.start(1, seed=0)
    [miss] = proposer.propose([DraftRequest(seq_id=1, token_ids=[60, 61, 62], k=4)])
    assert miss.token_ids == []


def test_the_cache_can_start_from_a_file_of_earlier_responses(tmp_path):
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps({"token_ids": r}) + "\n" for r in ([7, 8, 9, 10], [3, 4])))
    proposer = SuffixProposer(SuffixOptions(cache_file=str(path)))
    assert proposer.cache.num_responses == 2
    proposer.start(0, seed=0)
    [p] = proposer.propose([DraftRequest(seq_id=0, token_ids=[1, 7, 8], k=4)])
    assert p.token_ids == [9, 10]


def test_the_registry_row_is_the_configuration():
    """speculative.suffix comes from the registry's options: defaults, bounds, no other keys."""
    spec = SpeculativeConfig.model_validate({"method": "suffix", "suffix": {"max_cached_responses": 9}})
    assert spec.suffix.max_cached_responses == 9 and spec.suffix.min_token_prob == 0.1
    for bad in ({"min_token_prob": 1.5}, {"max_cached_responses": -1}, {"depth": 3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculativeConfig.model_validate({"method": "suffix", "suffix": bad})
    hybrid = SpeculativeConfig.model_validate(
        {"method": "eagle", "first": "suffix", "draft": {"source": "embedded-eagle"}})
    assert hybrid.first_method == "suffix"
    with pytest.raises(ValueError, match="first needs a draft model method"):
        SpeculativeConfig.model_validate({"method": "ngram", "first": "suffix"})


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_is_target_only_output_cold_and_warm(k):
    """The same prompts twice through one proposer: the second pass has a warm global cache
    (the first pass's responses) and drafts more; both give target-only's tokens."""
    target = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)
    batch = prompts(6, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    reference = SpecDecodeEngine(worker_of(target), make_tiny_tokenizer(), eos_token_ids=EOS)
    expected = [c.output_token_ids for c in reference.generate(batch, greedy)]
    proposer = SuffixProposer(SuffixOptions(min_token_prob=0.05))
    engine = SpecDecodeEngine(worker_of(target), make_tiny_tokenizer(), eos_token_ids=EOS,
                              proposer=proposer, num_speculative_tokens=k)
    cold = [c.output_token_ids for c in engine.generate(batch, greedy)]
    accepted_cold = engine.counters.spec.num_accepted_tokens
    warm = [c.output_token_ids for c in engine.generate(batch, greedy)]
    assert cold == expected and warm == expected
    assert engine.counters.spec.num_accepted_tokens - accepted_cold > accepted_cold  # the cache paid
    assert proposer.cache.num_responses == len(batch) * 2 and not proposer.sequences


def test_the_doctests_hold():
    import doctest

    from specserve.engine.drafts import suffix

    assert doctest.testmod(suffix).failed == 0


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_output_has_the_target_distribution(seeded):
    """8000 samples of the first two tokens through a suffix proposer whose global cache fills
    with the earlier samples' responses as it goes (point-mass drafts, accepted and rejected):
    chi-square against target-only's exact joint distribution, as in test_spec_decode."""
    import torch

    from tests.engine.test_spec_decode import (
        SAMPLED,
        _sample_pairs,
        chi_square_pvalue,
        exact_joint,
        sampling_prompt,
    )

    torch.manual_seed(20261123)  # unseeded requests draw from the global generator
    target = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)
    params = SAMPLED[1].model_copy(update={"max_tokens": 3})
    proposer = SuffixProposer(SuffixOptions(min_token_prob=0.0))
    engine = SpecDecodeEngine(worker_of(target, 256), make_tiny_tokenizer(), eos_token_ids=frozenset(),
                              proposer=proposer, num_speculative_tokens=3)
    prompt = list(sampling_prompt(target))
    pvalue = chi_square_pvalue(_sample_pairs(engine, prompt, params, seeded),
                               exact_joint(target, prompt, params))
    assert engine.counters.spec.num_draft_tokens > 0 and 0.0 < engine.counters.spec.acceptance_rate < 0.95
    assert pvalue > 1e-3


def test_the_cache_is_reported_as_proposer_state_on_metrics():
    """Proposer.state() reaches /metrics as specserve:proposer_state{name=...} (a hybrid
    reports its first proposer's)."""
    from prometheus_client.parser import text_string_to_metric_families
    from specserve.engine.drafts.base import Proposer
    from specserve.engine.drafts.hybrid import HybridProposer
    from specserve.serve.metrics import exposition
    from specserve.serve.unit_messages import UnitSnapshot

    class Model(Proposer):
        method = "eagle"

        def propose(self, requests):
            return []

    proposer = SuffixProposer()
    proposer.learn([1, 2, 3, 4, 5, 6], prompt_len=2)
    state = HybridProposer(proposer, Model()).state()
    assert state == {"suffix_cache_responses": 1, "suffix_cache_tokens": 5,
                     "suffix_cache_bytes": proposer.cache.nbytes}
    numbers = dict.fromkeys(("num_requests_running", "num_requests_waiting", "free_slots", "num_slots",
                             "draft_available", "target_available", "target_restarts",
                             "estimated_speedup", "speculation_length_current",
                             "concurrency_gate_open", "requests_admitted", "requests_aborted"), 0)
    snap = UnitSnapshot(method="eagle", router_decisions={}, proposer_state=state, **numbers)
    families = {f.name: f for f in text_string_to_metric_families(exposition({"u1": snap}).decode())}
    got = {s.labels["name"]: s.value for s in families["specserve:proposer_state"].samples}
    assert got == {name: float(v) for name, v in state.items()}
