"""Verify batches for the tests that drive a worker directly, given column by column."""

from __future__ import annotations

from specserve.engine.step.proposal import Proposal
from specserve.engine.step.verify_batch import VerifyBatch, VerifyRow


def verify_batch(worker, slots: list[int], token_ids: list[list[int]], proposals: list[Proposal],
                 sampling: list[tuple], *, follows: list[int] | None = None,
                 histories: list | None = None) -> VerifyBatch:
    """Row i: ``slots[i]`` from where ``worker``'s cache holds it, feeding ``token_ids[i]``
    (pending tokens, then ``proposals[i]``'s drafts), under ``sampling[i]``."""
    columns = zip(slots, token_ids, proposals, sampling, strict=True)
    return VerifyBatch([
        VerifyRow(slot, worker.length(slot), ids, proposal, row,
                  history=None if histories is None else histories[i],
                  follows=-1 if follows is None else follows[i])
        for i, (slot, ids, proposal, row) in enumerate(columns)])
