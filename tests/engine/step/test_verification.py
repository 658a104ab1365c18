"""The engine's verification helpers as pure functions: padding ragged rows, p and q, and
which (seed, position) draws each kind of row uses. Losslessness end to end is in
``test_spec_decode.py``."""

from __future__ import annotations

import pytest
import torch
from specserve.config import SamplingParams
from specserve.engine.step.acceptance import PLACEHOLDER, draft_probs, pad_drafts, target_probs
from specserve.engine.step.proposal import Proposal
from specserve.engine.step.sampling import compute_probs, position_noise, sample_from
from specserve.engine.step.verification import (
    judge,
    verify_greedy,
    verify_sampled,
    verify_seeded,
)
from specserve.engine.step.verify_batch import VerifyRow

V = 16
SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def verify_row(proposal: Proposal, params: SamplingParams = GREEDY, seed: int = 0,
               position: int = 1) -> VerifyRow:
    """A decode row of ``proposal`` whose first draft is at ``position``, drawing from ``seed``."""
    return VerifyRow(0, position - 1, [0, *proposal.token_ids], proposal, (params, seed))


def one_hot_logits(token_ids: list[int]) -> torch.Tensor:
    """``[len, V]`` logits whose argmax is ``token_ids``."""
    return torch.nn.functional.one_hot(torch.tensor(token_ids), V).float()


def random_logits(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2  # [n, V]


def test_pad_drafts_pads_ragged_rows_with_zeros():
    drafts = pad_drafts([Proposal([5, 9, 2]), Proposal([]), Proposal([3])])
    assert drafts.tolist() == [[5, 9, 2, 3], [0, 0, 0, 0], [3, 0, 0, 1]]  # then the count


def test_greedy_rows_of_any_length_argmax_ids_or_logits():
    # Row 0 is the rejection sampler's worked example (K = 3), given as argmax ids.
    proposals = [Proposal([5, 9, 2]), Proposal([]), Proposal([3])]
    logits = [torch.tensor([5, 9, 7, 4]), one_hot_logits([6]), one_hot_logits([3, 8])]
    out = verify_greedy([verify_row(p) for p in proposals], logits)
    assert [out.emitted(i) for i in range(3)] == [[5, 9, 7], [6], [3, 8]]
    assert out.output_token_ids[1].tolist() == [6, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]
    decodes = verify_greedy([verify_row(Proposal([]))] * 2, [one_hot_logits([6]), torch.tensor([3])])
    assert [(decodes.emitted(i), decodes.accepted(i)) for i in range(2)] == [([6], 0), ([3], 0)]


def test_target_probs_are_padded_with_zero_rows():
    logits = [random_logits(3, 0), random_logits(1, 1)]
    p = target_probs([SAMPLED, SamplingParams(temperature=0.5, top_k=4)], logits, 2)
    assert p.shape == (2, 3, V)
    assert torch.allclose(p[0].sum(-1), torch.ones(3)) and (p[1, 0] > 0).sum() == 4
    assert (p[1, 1:] == 0).all()


def test_draft_probs_none_when_deterministic_else_one_hot_rows():
    drafts = pad_drafts([Proposal([4, 1]), Proposal([2])])[:, :-1]
    assert draft_probs([Proposal([4, 1]), Proposal([2])], drafts, V) is None
    q1 = torch.softmax(random_logits(1, 2), -1)
    q = draft_probs([Proposal([4, 1]), Proposal([2], q1)], drafts, V)
    assert q.shape == (2, 2, V)
    assert q[0, 0, 4] == 1 and q[0, 1, 1] == 1 and q[0].sum() == 2
    assert torch.equal(q[1, 0], q1[0]) and (q[1, 1] == 0).all()


def test_seeded_rows_emit_the_seeds_target_only_tokens_whatever_the_draft():
    seed, position = 7, 11
    logits = random_logits(4, 3)  # [K + 1, V], K = 3
    p = compute_probs(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4))
    truth = [int(sample_from(p[j], position_noise(seed, position + j, V))) for j in range(4)]
    params = SamplingParams(temperature=1.0, seed=seed)

    def row(drafts: list[int]) -> VerifyRow:
        return verify_row(Proposal(drafts), params, seed, position)

    assert verify_seeded([row(truth[:3])], [logits]).emitted(0) == truth
    wrong = [(truth[1] + 1) % V]
    assert verify_seeded([row(truth[:1] + wrong)], [logits[:3]]).emitted(0) == truth[:2]
    assert verify_seeded([row([])], [logits[:1]]).emitted(0) == truth[:1]


def test_sampled_row_without_drafts_samples_its_position():
    seed, position = 3, 20
    logits = random_logits(1, 4)
    p = compute_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    out = verify_sampled([verify_row(Proposal([]), SAMPLED, seed, position)], [logits])
    assert out.emitted(0) == [int(sample_from(p[0], position_noise(seed, position, V)))]


def test_a_rows_p_is_the_same_alone_or_beside_top_k_and_top_p_rows():
    """The transform runs on a batch's rows together (chains, and a step's sampled trees in
    one call since issue 35): a row without top-k or top-p gets the bits it gets alone. Its
    cumulative sum rounds to 1 before its tail here (one dominant token), which the top-p
    cut once read as "mass reached" and zeroed the tail when a top-p row shared the call."""
    x = torch.zeros(50_000)
    x[0] = 30.0  # p(0) rounds to 1 in float32; every other token keeps about 1e-13
    other = torch.linspace(-3, 3, 50_000)
    one = torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1)
    alone = compute_probs(x[None], *one)[0]
    beside = compute_probs(torch.stack([x, other]), torch.ones(2), torch.tensor([0, 20]),
                           torch.tensor([1.0, 0.9]))
    assert bool((alone[1:] > 0).all()) and torch.equal(beside[0], alone)
    assert int((beside[1] > 0).sum()) <= 20


def test_judge_verifies_each_kind_in_one_call():
    seeded = SamplingParams(temperature=1.0, seed=2)
    kinds = [(seeded, 2), (GREEDY, 1), (SAMPLED, 3), (GREEDY, 1), (seeded, 2)]
    proposals = [Proposal([1]), Proposal([2, 3]), Proposal([]), Proposal([4]), Proposal([])]
    rows = [verify_row(p, params, seed, 5) for p, (params, seed) in zip(proposals, kinds)]
    logits = {row: random_logits(row.num_logits, i) for i, row in enumerate(rows)}
    outcomes = judge(rows, [logits[row] for row in rows])
    results = [outcomes[row] for row in rows]
    assert [j for _, j, _ in results] == [0, 0, 0, 1, 1]
    assert results[0][0] is results[4][0] and results[1][0] is results[3][0]
    assert len({id(out) for out, _, _ in results}) == 3
    alone = verify_greedy([rows[1], rows[3]], [logits[rows[1]], logits[rows[3]]])
    assert torch.equal(results[1][0].output_token_ids, alone.output_token_ids)


def test_noise_is_exponential_and_a_function_of_its_key_alone():
    """The counter-based noise (``sampling.exponential_noise``): a row depends on its key
    only (not on the batch it is drawn in, so a verify on rank 0 and a draft in its own
    process draw the same noise for one position), and it is Exp(1) (Kolmogorov-Smirnov,
    fixed keys, so the outcome is fixed), independent across keys and across entries."""
    from scipy import stats
    from specserve.engine.step.sampling import NOISE, exponential_noise, noise_key

    rows = exponential_noise([5, 9, 5], 50_000)
    assert torch.equal(rows[0], rows[2]) and torch.equal(rows[0], exponential_noise([5], 50_000)[0])
    assert torch.equal(position_noise(3, 7, 50_000), exponential_noise([noise_key(3, 7, NOISE)], 50_000)[0])
    assert stats.kstest(rows[1].numpy(), "expon").pvalue > 1e-3
    assert bool((rows > 0).all()) and bool(rows.isfinite().all())
    assert abs(float(torch.corrcoef(rows[:2])[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([rows[1, :-1], rows[1, 1:]]))[0, 1])) < 0.02


def test_the_c_noise_is_the_torch_formulas(monkeypatch):
    """On a CPU with the C kernels, the noise comes from ``kernels.c`` in one pass; the same
    formula op by op in torch (the GPU's path, and the CPU's without a compiler) gives the
    same floats. libm's and torch's double ``log`` may part in the last place, which can
    move a float by one ulp: none did in 200 million entries here; the test allows one in a
    million, no more than one ulp."""
    from specserve.engine.runtime import native
    from specserve.engine.step.sampling import exponential_noise, noise_key

    if native.library() is None:
        pytest.skip(f"no C kernels here: {native.unavailable_reason()}")
    keys = [noise_key(seed, position) for seed in (0, 7, 2**40 + 3) for position in range(40)]
    fast = exponential_noise(keys, 20_000)
    monkeypatch.setattr(native, "library", lambda: None)
    torch_path = exponential_noise(keys, 20_000)
    differ = fast != torch_path
    assert int(differ.sum()) <= fast.numel() // 1_000_000
    assert bool(((fast - torch_path).abs() <= torch_path * 2.0 ** -23).all())


def test_topk_q_is_dense_where_verified_and_compact_on_the_wire():
    """A draft's truncated q (``TopK``): scattered into the vocabulary for the rejection test,
    pickled as raw bytes (8 per entry) and back unchanged."""
    import pickle

    from specserve.engine.step.proposal import TopK

    ids = torch.tensor([[3, 1], [0, 15]])
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    q = TopK(ids, probs)
    dense = q.dense(V)
    assert dense.shape == (2, V) and dense[0, 3] == 0.75 and dense[1, 15] == 0.5
    assert torch.allclose(dense.sum(-1), torch.ones(2))
    back = pickle.loads(pickle.dumps(q))
    assert torch.equal(back.ids, ids.int()) and torch.equal(back.probs, probs)
    assert len(pickle.dumps(q)) < 2 * 2 * 8 + 200
    p = draft_probs([Proposal([3, 15], q)], torch.tensor([[3, 15]]), V)
    assert torch.equal(p[0], dense)
