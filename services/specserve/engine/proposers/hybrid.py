"""Prompt lookup first, a draft model for the rest (``speculative.ngram_first``).

Where the sequence's last n >= 2 tokens occurred before, the tokens that followed are a
cheap and often long draft (summaries, code, and the loops small models fall into); only
the other rows ask the draft model. Both are drafts like any other to the rejection sampler
(an n-gram draft is deterministic: its q is one-hot), so mixing them per row keeps the
output exactly the target's.

Rows the n-gram lookup serves still reach the model proposer with ``k = 0`` when it reads the
target's features: EAGLE must receive every feature once, in order, even on steps where it
drafts nothing.
"""

from __future__ import annotations

import dataclasses

from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer
from specserve.engine.proposers.ngram import propose_ngram


class NgramFirstProposer(Proposer):
    def __init__(self, model: Proposer, *, min_n: int = 2, max_n: int = 4) -> None:
        assert 2 <= min_n <= max_n
        self.model = model
        self.method = model.method
        self.needs_hidden = model.needs_hidden
        self.min_n, self.max_n = min_n, max_n

    def start(self, seq_id: int, seed: int) -> None:
        self.model.start(seq_id, seed)

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        self.model.commit(seq_id, num_valid_tokens)

    def finish(self, seq_id: int) -> None:
        self.model.finish(seq_id)

    def reset(self) -> None:
        self.model.reset()

    def flush(self) -> None:
        self.model.flush()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        looked = [propose_ngram(r.token_ids, min_n=self.min_n, max_n=self.max_n, k=r.k) if r.k else []
                  for r in requests]
        asks = [dataclasses.replace(r, k=0) if hit else r for r, hit in zip(requests, looked)]
        rows = [i for i, r in enumerate(asks) if r.k > 0 or (self.needs_hidden and r.hidden is not None)]
        drafted = dict(zip(rows, self.model.propose([asks[i] for i in rows]))) if rows else {}
        return [Proposal(hit) if hit else drafted.get(i, Proposal([])) for i, hit in enumerate(looked)]
