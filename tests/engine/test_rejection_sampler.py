"""The rejection sampler as pure functions: greedy, shapes, determinism, distribution."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from specserve.engine.rejection_sampler import (
    PLACEHOLDER,
    greedy_rejection_sample,
    rejection_sample,
)
from specserve.engine.sampling import compute_probs, sample_from


def test_greedy_docstring_example():
    out = greedy_rejection_sample(torch.tensor([[5, 9, 2]]), torch.tensor([3]),
                                  torch.tensor([[5, 9, 7, 4]]))
    assert out.output_token_ids.tolist() == [[5, 9, 7, PLACEHOLDER]]
    assert out.num_accepted_tokens.tolist() == [2]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_matches_a_reference_loop(k, batch):
    gen = torch.Generator().manual_seed(k * 100 + batch)
    argmax = torch.randint(0, 4, (batch, k + 1), generator=gen)  # small vocab: frequent matches
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, argmax[:, :k],
                         torch.randint(0, 4, (batch, k), generator=gen))
    num_draft_tokens = torch.randint(0, k + 1, (batch,), generator=gen)
    out = greedy_rejection_sample(drafts, num_draft_tokens, argmax)
    for b in range(batch):
        expected = []
        for i in range(int(num_draft_tokens[b])):
            if drafts[b, i] != argmax[b, i]:
                break
            expected.append(int(drafts[b, i]))
        expected.append(int(argmax[b, len(expected)]))
        assert out.emitted(b) == expected
        assert out.num_accepted_tokens[b] == len(expected) - 1
        assert (out.output_token_ids[b, len(expected):] == PLACEHOLDER).all()


def test_zero_drafts_is_plain_sampling():
    p = torch.tensor([[[0.0, 1.0, 0.0]]])  # [1, 1, 3]
    out = rejection_sample(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), p, None,
                           torch.zeros(1, 0), torch.ones(1, 3))
    assert out.emitted(0) == [1] and out.num_accepted_tokens.tolist() == [0]


def test_deterministic_for_given_draws():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 4, 10, generator=gen), -1)
    q = torch.softmax(torch.randn(4, 3, 10, generator=gen), -1)
    drafts = sample_from(q.reshape(-1, 10), torch.empty(12, 10).exponential_(generator=gen)).view(4, 3)
    u, noise = torch.rand(4, 3, generator=gen), torch.empty(4, 10).exponential_(generator=gen)
    args = (drafts, torch.tensor([3, 2, 1, 0]), p, q, u, noise)
    a, b = rejection_sample(*args), rejection_sample(*args)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


def test_identical_draft_and_target_accept_everything():
    p = torch.softmax(torch.randn(64, 4, 6), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 6), 1).view(64, 3)
    out = rejection_sample(drafts, torch.full((64,), 3), p, p[:, :3].clone(),
                           torch.rand(64, 3) * 0.999, torch.empty(64, 6).exponential_())
    assert (out.num_accepted_tokens == 3).all()


def _marginals_match(p, q, *, deterministic: bool, n: int = 400_000, seed: int = 0):
    """Run the sampler on ``n`` i.i.d. rows with context-free p (``[K+1, V]``) and q
    (``[K, V]``). For every position j, the token emitted at j, among rows that reached j,
    must be distributed as p_j. Returns the smallest chi-square p-value over positions."""
    gen = torch.Generator().manual_seed(seed)
    k, v = q.shape
    if deterministic:  # n-gram style: one fixed draft per position, one-hot q
        drafts = q.argmax(-1).expand(n, k)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, K]
        draft_probs = q.expand(n, k, v)
    out = rejection_sample(drafts, torch.full((n,), k), p.expand(n, k + 1, v), draft_probs,
                           torch.rand(n, k, generator=gen),
                           torch.empty(n, v).exponential_(generator=gen))
    pvalues = []
    for j in range(k + 1):
        reached = out.num_accepted_tokens >= j
        counts = torch.bincount(out.output_token_ids[reached, j], minlength=v).double()
        expected = p[j].double() / p[j].double().sum() * counts.sum()
        keep = expected > 0
        assert counts[~keep].sum() == 0, f"position {j} emitted a token p gives zero mass"
        pvalues.append(stats.chisquare(counts[keep], expected[keep]).pvalue)
    return min(pvalues)


@pytest.mark.parametrize("deterministic", [False, True])
def test_emitted_tokens_have_the_target_distribution(deterministic):
    """Chi-square goodness of fit per position, 400k rows, V = 6, K = 3; threshold 1e-3
    (seeded, so the outcome is fixed). ``test_power_of_the_distribution_test`` shows the
    same test rejects q at this kind of mismatch."""
    gen = torch.Generator().manual_seed(42)
    p = compute_probs(torch.randn(4, 6, generator=gen) * 1.5, torch.full((4,), 0.7),
                      torch.full((4,), 0), torch.full((4,), 1.0))
    q = torch.softmax(torch.randn(3, 6, generator=gen) * 1.5, -1)  # deliberately mismatched
    assert _marginals_match(p, q, deterministic=deterministic) > 1e-3


def test_power_of_the_distribution_test():
    """A sampler that always accepts the draft produces q, and the chi-square test on the
    emitted first token rejects that at p < 1e-6 with 20k rows."""
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(6, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(6, generator=gen) * 1.5, -1)
    draws = torch.multinomial(q, 20_000, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=6).double()
    assert stats.chisquare(counts, p.double() * 20_000).pvalue < 1e-6


def test_top_k_top_p_transform():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    one = torch.ones(1)
    probs = compute_probs(logits, one, torch.tensor([2]), one)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)[0]
    # top_p just above the top token's mass keeps exactly two tokens.
    probs = compute_probs(logits, one, torch.tensor([0]), torch.tensor([full[0].item() + 1e-3]))
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    probs = compute_probs(logits, one, torch.tensor([0]), torch.tensor([full[0].item() - 1e-3]))
    assert (probs[0] > 0).tolist() == [True, False, False, False, False]
