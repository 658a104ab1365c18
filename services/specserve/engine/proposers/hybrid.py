"""A model-free proposer first, a draft model for the rest (``speculative.first``).

Where a model-free proposer is confident (prompt lookup: the sequence's last 2+ tokens
occurred before; suffix decoding: a match whose continuation is likely enough), its draft is
cheap and often long (summaries, code, revisions, the loops small models fall into); only the
other rows ask the draft model. Every draft is a draft like any other to the rejection
sampler (a model-free draft is deterministic: its q is one-hot), so mixing them per row keeps
the output exactly the target's.

Rows the first proposer serves still reach the model proposer with ``k = 0`` when it reads
the target's features: EAGLE must receive every feature once, in order, even on steps where
it drafts nothing.
"""

from __future__ import annotations

import dataclasses

from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer


class HybridProposer(Proposer):
    def __init__(self, first: Proposer, model: Proposer) -> None:
        self.first = first
        self.model = model
        self.method = model.method
        self.needs_hidden = model.needs_hidden

    def start(self, seq_id: int, seed: int) -> None:
        self.first.start(seq_id, seed)
        self.model.start(seq_id, seed)

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        self.first.commit(seq_id, num_valid_tokens)
        self.model.commit(seq_id, num_valid_tokens)

    def learn(self, token_ids: list[int], prompt_len: int) -> None:
        self.first.learn(token_ids, prompt_len)
        self.model.learn(token_ids, prompt_len)

    def finish(self, seq_id: int) -> None:
        self.first.finish(seq_id)
        self.model.finish(seq_id)

    def reset(self) -> None:
        self.first.reset()
        self.model.reset()

    def flush(self) -> None:
        self.model.flush()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        looked = [p.token_ids for p in self.first.propose(requests)]
        asks = [dataclasses.replace(r, k=0) if hit else r for r, hit in zip(requests, looked)]
        rows = [i for i, r in enumerate(asks) if r.k > 0 or (self.needs_hidden and r.hidden is not None)]
        drafted = dict(zip(rows, self.model.propose([asks[i] for i in rows]))) if rows else {}
        return [Proposal(hit) if hit else drafted.get(i, Proposal([])) for i, hit in enumerate(looked)]
