"""The hybrid proposer (``speculative.first``): which proposer drafts a row, by measured
acceptance, and the bookkeeping both see."""

from __future__ import annotations

from specserve.engine.drafts.base import Proposer
from specserve.engine.drafts.hybrid import HybridProposer
from specserve.engine.step.proposal import DraftRequest, Proposal


class Scripted(Proposer):
    """Proposes ``tokens`` with ``estimate`` for every row that asks (k > 0); logs calls."""

    def __init__(self, method: str, tokens: list[int], estimate: float | None = None) -> None:
        self.method, self.tokens, self.estimate = method, tokens, estimate
        self.asked: list[int] = []
        self.calls: list[tuple] = []

    def propose(self, requests):
        self.asked += [r.k for r in requests]
        return [Proposal(self.tokens[:r.k], expected_accepted=self.estimate if r.k else None)
                for r in requests]

    def start(self, seq_id, seed):
        self.calls.append(("start", seq_id))

    def commit(self, seq_id, n):
        self.calls.append(("commit", seq_id, n))

    def learn(self, token_ids, prompt_len):
        self.calls.append(("learn", prompt_len))

    def finish(self, seq_id):
        self.calls.append(("finish", seq_id))


def step(hybrid: HybridProposer, accepted: int, length: int = 10) -> Proposal:
    """One row's step: propose, then commit ``accepted`` of the draft."""
    [p] = hybrid.propose([DraftRequest(seq_id=0, token_ids=list(range(length)), k=4)])
    hybrid.commit(0, length + accepted)
    return p


def test_a_proposer_without_an_estimate_takes_every_row_it_matches():
    first, model = Scripted("ngram", [7, 7]), Scripted("eagle", [1, 2, 3, 4])
    hybrid = HybridProposer(first, model)
    assert step(hybrid, 0).token_ids == [7, 7] and model.asked == []  # not asked at all
    first.tokens = []
    assert step(hybrid, 0).token_ids == [1, 2, 3, 4] and model.asked == [4]


def test_the_row_goes_to_the_proposer_expected_to_have_more_accepted():
    """The first proposer claims 2 tokens. While the model's drafts keep 3 per step, the model
    drafts; once they keep 1, the first does; its claims are scaled by how they came true."""
    first, model = Scripted("suffix", [7, 7, 7], estimate=2.0), Scripted("eagle", [1, 2, 3, 4])
    hybrid = HybridProposer(first, model)
    assert step(hybrid, 2).token_ids == [7, 7, 7]  # nothing measured yet: the free one
    first.tokens = []
    for _ in range(30):  # the model alone: 3 accepted per step
        step(hybrid, 3)
    first.tokens = [7, 7, 7]
    assert step(hybrid, 0).token_ids == [1, 2, 3, 4]  # 2.0 x 1.0 (calibration) < 3
    first.tokens = []
    for _ in range(60):  # the model falls to 1 per step
        step(hybrid, 1)
    first.tokens = [7, 7, 7]
    assert step(hybrid, 2).token_ids == [7, 7, 7]     # 2.0 x 1.0 >= 1
    for _ in range(60):  # ... but its claims come true a quarter of the time
        step(hybrid, 0)
        first.tokens = []
        step(hybrid, 1)
        first.tokens = [7, 7, 7]
    assert hybrid.first_calibration.value < 0.5
    assert step(hybrid, 1).token_ids == [1, 2, 3, 4]


def test_both_proposers_see_every_sequence_event():
    first, model = Scripted("suffix", [5], estimate=1.0), Scripted("eagle", [1])
    hybrid = HybridProposer(first, model)
    hybrid.start(3, seed=1)
    hybrid.commit(3, 12)
    hybrid.learn([1, 2, 3], prompt_len=1)
    hybrid.finish(3)
    for p in (first, model):
        assert p.calls == [("start", 3), ("commit", 3, 12), ("learn", 1), ("finish", 3)]


def test_a_refused_first_proposer_still_drafts_every_16th_row():
    """However badly its estimates went, the first proposer keeps being measured."""
    first, model = Scripted("suffix", [], estimate=0.5), Scripted("eagle", [1, 2, 3, 4])
    hybrid = HybridProposer(first, model)
    for _ in range(20):
        step(hybrid, 3)  # the model: 3 per step
    first.tokens = [7]
    got = []
    for _ in range(64):  # the model's drafts keep 3, the first's none
        [p] = hybrid.propose([DraftRequest(seq_id=0, token_ids=list(range(10)), k=4)])
        hybrid.commit(0, 10 + (0 if p.token_ids == [7] else 3))
        got.append(p.token_ids)
    assert got.count([7]) == 4 and got.count([1, 2, 3, 4]) == 60


def test_an_estimating_first_proposer_drafts_to_the_cap_the_others_to_k():
    """The coordinator chose k = 2 of a cap of 6: a draft limited by its own confidence may
    run to 6; prompt lookup and the model keep to 2."""
    request = DraftRequest(seq_id=0, token_ids=list(range(10)), k=2, cap=6)
    suffix = HybridProposer(Scripted("suffix", [7] * 8, estimate=5.0), Scripted("eagle", [1] * 8))
    assert suffix.propose([request])[0].token_ids == [7] * 6
    ngram = HybridProposer(Scripted("ngram", [7] * 8), Scripted("eagle", [1] * 8))
    assert ngram.propose([request])[0].token_ids == [7] * 2
    model = Scripted("eagle", [1] * 8)
    HybridProposer(Scripted("suffix", []), model).propose([request])
    assert model.asked == [2]
