"""What crosses between a proposer and the target: a sequence's request for drafts
(:class:`DraftRequest`), the drafts (:class:`Proposal`) and their q (:class:`TopK`).

Plain data, imported by both sides (the proposers of ``drafts/`` and the target's
``worker.py`` / ``verification.py``), so neither imports the other; each crosses a process
boundary to or from a draft actor as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specserve.config import SamplingParams
from specserve.engine.grammar import GrammarSpec
from specserve.engine.runtime.forward_batch import queued

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DraftRequest:
    """One sequence asking for up to ``k`` drafts.

    ``token_ids`` is the whole sequence so far (prompt + output); ``params`` are the
    request's, so a model proposer samples from the same transform as the target (temperature
    0: greedy). Everything here is plain data: the request can cross a process boundary to a
    draft actor.
    """

    seq_id: int
    token_ids: list[int]
    k: int
    params: SamplingParams = GREEDY
    hidden: torch.Tensor | None = None  # for needs_hidden proposers: target features since last time
    # The most the row may draft at all this step (its request's K, max_tokens and context);
    # ``k`` <= ``cap`` is what the coordinator chose. Only a proposer with ``drafts_to_cap``
    # drafts past ``k`` (a hybrid's model-free part: drafting costs it nothing, and its own
    # confidence limits it). None: ``k``.
    cap: int | None = None
    # A structured output's grammar, which the drafts should follow (a proposer with a model
    # masks its draws with it; the coordinator cuts drafts it forbids either way), and where
    # the output (which the grammar constrains) begins in ``token_ids``.
    grammar: GrammarSpec | None = None
    output_start: int = 0


class TopK:
    """A draft's q at each drafted position, truncated to its ``k`` likeliest ids: ``ids`` and
    ``probs``, both ``[n, k]`` (a model draft samples from exactly this renormalised top-k, so
    it *is* q, and the rejection test stays exact). What crosses from a draft actor to the
    target's rank 0: ``n * k * 8`` bytes (int32 ids, float32 probabilities) instead of ``n * V
    * 4``; it pickles as raw bytes, never as a device tensor.
    """

    __slots__ = ("ids", "probs")

    def __init__(self, ids: torch.Tensor, probs: torch.Tensor) -> None:
        assert ids.shape == probs.shape and ids.ndim == 2
        self.ids = ids.to("cpu", torch.int32)
        self.probs = probs.to("cpu", torch.float32)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def dense(self, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[n, vocab]`` float32 q on ``device``: zero outside each row's k ids."""
        ids, probs = queued(self.ids.long(), device), queued(self.probs, device)  # no wait
        return torch.zeros(len(self), vocab, device=device).scatter_(1, ids, probs)

    def __getstate__(self) -> tuple:
        return tuple(self.ids.shape), self.ids.numpy().tobytes(), self.probs.numpy().tobytes()

    def __setstate__(self, state: tuple) -> None:
        shape, ids, probs = state
        self.ids = torch.frombuffer(bytearray(ids), dtype=torch.int32).reshape(shape)
        self.probs = torch.frombuffer(bytearray(probs), dtype=torch.float32).reshape(shape)


@dataclass
class Proposal:
    """Up to ``k`` drafted tokens. ``probs`` is q at each drafted position, present only for
    unseeded sampled requests of a proposer with a model: a :class:`TopK` (what model drafts
    send) or a dense ``[len, V]`` tensor (in-process callers and tests).

    ``parents``: the drafts form a token tree: ``parents[i]`` is the index of token
    i's parent among them, -1 for a child of the row's last token, in topological order,
    siblings in the order they were drawn (``token_tree``'s convention; ``probs[i]`` is
    then the q token i was drawn from given its earlier siblings). None: a chain."""

    token_ids: list[int]
    probs: TopK | torch.Tensor | None = None
    # The proposer's own estimate of how many of token_ids the target keeps (suffix decoding:
    # from its counts); None: no estimate. A hybrid compares it with the model's (hybrid.py).
    expected_accepted: float | None = None
    # The registry method that drafted it, where a proposer combines several (a hybrid's first
    # or model part); None: the proposer's own. Acceptance is measured per source.
    source: str | None = None
    parents: list[int] | None = None

    def prefix(self, n: int) -> Proposal:
        """The chain's first ``n`` drafts (a grammar forbade the next)."""
        assert self.parents is None and 0 <= n <= len(self.token_ids)
        probs = self.probs
        if isinstance(probs, TopK):
            probs = TopK(probs.ids[:n], probs.probs[:n])
        elif probs is not None:
            probs = probs[:n]
        return replace(self, token_ids=self.token_ids[:n], probs=probs)

    def subtree(self, kept: list[int]) -> Proposal:
        """The tree's nodes ``kept`` (increasing, each one's parent kept too), renumbered."""
        assert self.parents is not None and self.probs is None, "trees are one-hot"
        new = {old: j for j, old in enumerate(kept)}
        assert all(self.parents[j] == -1 or self.parents[j] in new for j in kept)
        return replace(self, token_ids=[self.token_ids[j] for j in kept],
                       parents=[-1 if self.parents[j] == -1 else new[self.parents[j]] for j in kept])
