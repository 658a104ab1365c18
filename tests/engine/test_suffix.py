"""Suffix decoding (issue 19, first part): the trees' counts, the global cache's FIFO bound, and
greedy output identical to target-only with a cold and a warm global tree."""

from __future__ import annotations

import pytest
from specserve.config import SamplingParams
from specserve.engine.proposers.base import DraftRequest
from specserve.engine.proposers.suffix import SuffixOptions, SuffixProposer, SuffixTree
from specserve.engine.spec_decode import SpecDecodeEngine

from tests.engine.test_spec_decode import EOS, prompts
from tests.models import random_sequences, tiny_hf_model, worker_of
from tests.tiny import make_tiny_tokenizer


def counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every substring the tree holds, with its count."""
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        out[path] = node.count
        stack += [((*path, t), c) for t, c in node.children.items()]
    return out


def test_counts_are_occurrences_and_counting_out_restores_the_tree():
    tree = SuffixTree(max_depth=3)
    tree.add([1, 2, 1, 2, 3])
    held = counts(tree)
    assert held[(1, 2)] == 2 and held[(2,)] == 2 and held[(1, 2, 3)] == 1 and held[()] == 5
    assert (1, 2, 1, 2) not in held  # deeper than max_depth
    tree.add([7, 1, 2])
    tree.add([7, 1, 2], weight=-1)
    assert counts(tree) == held and tree.num_nodes == len(held)


def test_a_sequence_tree_grown_token_by_token_equals_one_built_at_once():
    tokens = random_sequences((60,), seed=3)[0]
    tokens = [t % 7 for t in tokens]  # a small alphabet: many repeats
    proposer = SuffixProposer(SuffixOptions(max_depth=5))
    proposer.start(0, seed=0)
    for end in (10, 11, 30, 60):  # the engine asks with the sequence as it grows
        proposer.propose([DraftRequest(seq_id=0, token_ids=tokens[:end], k=0)])
    whole = SuffixTree(max_depth=5)
    whole.add(tokens[:-1])  # every token but the last (suffix.py, _catch_up)
    assert counts(proposer.trees[0]) == counts(whole)


def test_the_global_tree_holds_the_last_responses_only_and_its_size_is_bounded():
    options = SuffixOptions(max_depth=6, max_cached_responses=3)
    proposer = SuffixProposer(options)
    responses = random_sequences((20,) * 10, seed=5)
    for i, response in enumerate(responses):
        prompt = [1, 2, 3]
        proposer.start(i, seed=i)
        proposer.propose([DraftRequest(seq_id=i, token_ids=prompt + response[:1], k=2)])
        proposer.propose([DraftRequest(seq_id=i, token_ids=prompt + response, k=2)])
        proposer.finish(i)
    expected = SuffixTree(max_depth=6)
    for response in responses[-3:]:
        expected.add(response[:-1])
    assert counts(proposer.global_tree) == counts(expected)
    assert proposer.global_tree.num_nodes == len(counts(expected)) <= 1 + 3 * 19 * 6
    assert not proposer.trees and not proposer.seen  # finished sequences hold nothing


def test_a_miss_proposes_nothing_and_a_match_proposes_what_followed():
    options = SuffixOptions(max_depth=8, min_token_prob=0.5)
    proposer = SuffixProposer(options)
    proposer.start(0, seed=0)
    text = [5, 6, 7, 8, 9, 10, 11, 40, 41, 5, 6, 7]
    [hit] = proposer.propose([DraftRequest(seq_id=0, token_ids=text, k=4)])
    assert hit.token_ids == [8, 9, 10]  # capped by the match length (3) x factor 1
    proposer.start(1, seed=0)
    [miss] = proposer.propose([DraftRequest(seq_id=1, token_ids=[60, 61, 62], k=4)])
    assert miss.token_ids == []


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_is_target_only_output_cold_and_warm(k):
    """The same prompts twice through one proposer: the second pass has a warm global tree
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
    accepted_cold = engine.stats.num_accepted_tokens
    warm = [c.output_token_ids for c in engine.generate(batch, greedy)]
    assert cold == expected and warm == expected
    assert engine.stats.num_accepted_tokens - accepted_cold > accepted_cold  # the cache paid
    assert len(proposer.responses) == len(batch) * 2 and not proposer.trees


def test_the_doctests_hold():
    import doctest

    from specserve.engine.proposers import suffix

    assert doctest.testmod(suffix).failed == 0


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_output_has_the_target_distribution(seeded):
    """8000 samples of the first two tokens through a suffix proposer whose global tree fills
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
    assert engine.stats.num_draft_tokens > 0 and 0.0 < engine.stats.acceptance_rate < 0.95
    assert pvalue > 1e-3
