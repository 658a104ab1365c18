"""Prompt lookup ("n-gram") proposer: no model, drafts by copying from the sequence itself.

If the last n tokens occurred earlier in the sequence, propose the tokens that followed that
earlier occurrence (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method). It costs
microseconds and is very effective when the output repeats the input: rewriting, editing code,
summaries that quote, retrieval answers.
"""

from __future__ import annotations

import numpy as np

from specserve.engine.drafts.base import Proposer
from specserve.engine.step.proposal import DraftRequest, Proposal


def propose_ngram(token_ids: list[int] | np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's suffix.

    Tries the longest suffix first (n = ``max_n`` down to ``min_n``): a longer match is more
    specific. Among matches of one length the most recent wins, because nearby context tends
    to continue the way the text is going right now.

    >>> propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], min_n=1, max_n=3, k=2)
    [4, 9]
    """
    assert 1 <= min_n <= max_n and k >= 0
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0..length-n-1, i.e. every occurrence except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Stateless: every call looks at the sequence as it is now."""

    method = "ngram"

    def __init__(self, *, min_n: int = 1, max_n: int = 4) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def from_config(cls, spec) -> NgramProposer:
        """In front of a model (``speculative.first``) a match of one token is too weak to
        take a row from the model: at least 2 there."""
        if spec.first_method == cls.method:
            return cls(min_n=max(2, spec.prompt_lookup_min), max_n=max(2, spec.prompt_lookup_max))
        return cls(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(propose_ngram(r.token_ids, min_n=self.min_n, max_n=self.max_n, k=r.k))
                for r in requests]
