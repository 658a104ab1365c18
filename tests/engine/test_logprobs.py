"""Log-probabilities of the output tokens (issue 22, first part: the engine). Computed on the
target's side of verify from the logits row that decided each token, accepted drafts and
bonus tokens alike, so with speculation on they are the target-only run's, bit for bit, for
every proposer; and they are the engine's own forward's."""

from __future__ import annotations

import pytest
import torch
from specserve.config import SamplingParams
from specserve.engine.runtime.forward_batch import ForwardBatch

from tests.engine.test_spec_decode import make_engine, prompts
from tests.models import perturbed, runtime_of

GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_k=30, max_tokens=24, logprobs=3, seed=11)


@pytest.fixture(scope="module")
def reference(target_hf):
    """Target-only completions of the batch, greedy and seeded."""
    batch = prompts(4, seed=12)
    engine = make_engine(target_hf, None)
    return batch, {p.temperature: engine.generate(batch, p) for p in (GREEDY, SEEDED)}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle", "eagle-tree",
                                    "suffix-tree"])
def test_logprobs_with_speculation_equal_target_only(target_hf, reference, method, params):
    batch, expected = reference
    expected = expected[params.temperature]
    engine = make_engine(target_hf, method, 4, draft_hf=perturbed(target_hf, scale=0.3))
    done = engine.generate(batch, params)
    assert engine.counters.spec.num_accepted_tokens > 0
    for got, want in zip(done, expected):
        assert got.output_token_ids == want.output_token_ids
        assert len(got.logprobs) == len(got.output_token_ids)
        assert got.logprobs == want.logprobs  # floats, exactly


def test_logprobs_are_the_engines_own_forward(target_hf, reference):
    """Greedy: each token's logprob is the log-softmax of one plain forward over the prompt
    and the output, at that token's position; its top alternatives are that row's top 5, in
    order, the chosen (argmax) token first."""
    batch, expected = reference
    runtime = runtime_of(target_hf)
    cache = runtime.make_cache(1, 256)
    for prompt, completion in zip(batch, expected[0.0]):
        out = completion.output_token_ids
        cache.rollback(0, 0)
        # [len(out), V]
        logits = runtime(cache, ForwardBatch([0], [prompt + out[:-1]], [len(out)])).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        truth = logp.gather(1, torch.tensor(out)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _ in completion.logprobs])
        assert torch.allclose(got, truth, atol=1e-5, rtol=0)
        for (lp, top), token, row in zip(completion.logprobs, out, logp):
            assert [t for t, _ in top] == row.topk(5).indices.tolist() and top[0][0] == token
            assert top[0][1] == lp


def test_sampled_logprobs_are_those_of_the_transformed_distribution(reference):
    """Top-k 30: the alternatives are within the top 30, and their probabilities (and the
    chosen token's) sum to at most 1; the chosen token has a finite logprob."""
    _, expected = reference
    for completion in expected[SEEDED.temperature]:
        for lp, top in completion.logprobs:
            assert lp > float("-inf") and len(top) == 3
            assert sum(torch.tensor([v for _, v in top]).exp().tolist()) <= 1 + 1e-6
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_a_stop_inside_a_draft_window_keeps_logprobs_aligned(target_hf, reference):
    """max_tokens inside the window and a stop token: as many logprobs as output tokens."""
    batch, _ = reference
    engine = make_engine(target_hf, "draft_model", 8, draft_hf=perturbed(target_hf, scale=0.3))
    plain = make_engine(target_hf, None)
    for params in (GREEDY.model_copy(update={"max_tokens": 7}),
                   GREEDY.model_copy(update={"stop_token_ids": (5, 9, 17, 33)})):
        for got, want in zip(engine.generate(batch, params), plain.generate(batch, params)):
            assert got.output_token_ids == want.output_token_ids
            assert len(got.logprobs) == len(got.output_token_ids) and got.logprobs == want.logprobs


def test_no_logprobs_unless_asked(target_hf):
    done = make_engine(target_hf, "ngram").generate(prompts(2), SamplingParams(temperature=0, max_tokens=5))
    assert all(c.logprobs is None for c in done)


@pytest.mark.parametrize("method", [None, "draft_model", "eagle"])
def test_prompt_logprobs_score_the_prompt_with_the_engines_own_forward(target_hf, method):
    """``prompt_logprobs`` (what ``echo`` with ``logprobs`` and an evaluation harness's
    log-likelihoods read): prompt token j's log-softmax given tokens < j, from the prefill's
    logits, and its rank, the first token none; with ``max_tokens`` 0 nothing is generated and the slot is
    freed; generating too, the output is unchanged and speculation changes no value."""
    batch = prompts(3, seed=21)
    runtime = runtime_of(target_hf)
    cache = runtime.make_cache(1, 256)
    engine = make_engine(target_hf, method, 3, draft_hf=perturbed(target_hf, scale=0.3))
    scored = engine.generate(batch, SamplingParams(max_tokens=0, prompt_logprobs=2))
    for prompt, done in zip(batch, scored):
        cache.rollback(0, 0)
        logits = runtime(cache, ForwardBatch([0], [prompt], [len(prompt)])).logits
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        truth = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert done.output_token_ids == [] and done.finish_reason == "length"
        assert len(done.prompt_logprobs) == len(prompt) - 1
        assert torch.allclose(torch.tensor([lp for lp, _, _ in done.prompt_logprobs]), truth, atol=1e-5)
        assert all(len(top) == 2 and top[0][1] >= top[1][1] for _, top, _ in done.prompt_logprobs)
        ranks = (logp > truth[:, None]).sum(dim=1) + 1  # vLLM's rank: 1 the likeliest
        assert [rank for _, _, rank in done.prompt_logprobs] == ranks.tolist()
        assert all(rank == 1 + [a for a, _ in top].index(t) for t, (_, top, rank)
                   in zip(prompt[1:], done.prompt_logprobs) if t in [a for a, _ in top])
    assert engine.target.num_free_slots == 8
    both = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=0, logprobs=1)
    plain = make_engine(target_hf, None).generate(batch, both)
    for got, want in zip(engine.generate(batch, both), plain):
        assert got.output_token_ids == want.output_token_ids
        assert got.prompt_logprobs == want.prompt_logprobs and got.logprobs == want.logprobs
