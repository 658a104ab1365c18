"""A verify as plain data: what the target's verify takes, a :class:`VerifyBatch` of
:class:`VerifyRow` (built once from the step's rows: ``StepBatch.to_verify``), and what it
gives back of each row, a :class:`Verdict`. Both cross to a unit's rank 0 and back as they
are (picklable, no logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import SamplingParams
from specserve.engine.runtime.forward_batch import ForwardBatch, Upload
from specserve.engine.step.penalties import History
from specserve.engine.step.proposal import Proposal


@dataclass(frozen=True, eq=False)
class VerifyRow:
    """One verifying row as plain data (:meth:`StepBatch.to_verify`): what the target's
    verify reads of it, the forward and the verdict alike."""

    slot: int
    start: int                       # positions the target holds: where its first new token goes
    token_ids: list[int]             # [pending tokens, then drafts]
    proposal: Proposal               # the drafts, a tree's parents, q
    # (request parameters, seed); None on the way to a unit's rank 0, which keeps them per
    # slot (they travel when a slot's holder changes: ``TargetGroup.launch``)
    sampling: tuple[SamplingParams, int] | None
    tree: list[int] | None = None    # a tree over token_ids (StepRow.tree); None: a chain
    mask: torch.Tensor | None = None  # [drafts + 1, W] int32 bitmask (grammar, bans); None: free
    history: History | None = None   # a penalized row's tokens so far (penalties.py)
    # the row of the verify launched before this one whose last emitted token is this row's
    # one pending token (its token_ids a placeholder: ModelWorker.launch); -1: its own
    follows: int = -1

    @property
    def params(self) -> SamplingParams:
        return self.sampling[0]

    @property
    def seed(self) -> int:
        """The sequence's (``Sequence.sample_seed``): every draw of the row derives from it."""
        return self.sampling[1]

    @property
    def position(self) -> int:
        """Of its first draft (the token after its pending ones): the sequence's length
        before the step, where the draws of its verified positions start."""
        return self.start + len(self.token_ids) - len(self.proposal.token_ids)

    @property
    def num_logits(self) -> int:
        """Logits its verdict reads: one per draft, and one after the last."""
        return len(self.proposal.token_ids) + 1

    @property
    def scores_prompt(self) -> bool:
        """A prefill that asked for its prompt's logprobs: its forward scores every token."""
        return self.params.prompt_logprobs is not None and self.start == 0

    @property
    def num_asked(self) -> int:
        """Logits its forward asks for: :attr:`num_logits`, or every token's to score a prompt."""
        return len(self.token_ids) if self.scores_prompt else self.num_logits

    @property
    def plain(self) -> bool:
        """A **plain row**: decided on the model's own logits, nothing added or banned (no
        mask, ``logit_bias`` or penalties; ``Sequence.plain`` is the same of a sequence)."""
        return self.mask is None and self.history is None and not self.params.logit_bias

    @property
    def argmax_only(self) -> bool:
        """All its verdict needs of the forward is each position's argmax: plain, greedy,
        and asking for no log-probabilities."""
        return (self.plain and self.params.greedy and self.params.logprobs is None
                and not self.scores_prompt)


@dataclass(frozen=True)
class VerifyBatch:
    """A verify as plain data (:meth:`StepBatch.to_verify`): what the target's ``verify``
    takes, in process or on a unit's rank 0 (where it crosses as it is)."""

    rows: list[VerifyRow]                         # in forward order
    chunks: list[tuple[int, list[int]]] = ()      # [chunks] (slot, prompt tokens) prefilled beside the rows
    groups: list[int] | None = None               # the forward's row groups over rows, then chunks
    hidden: bool = False                          # the kept tokens' (and chunks') features come back

    def forward(self, *, asked: bool = False, argmax: bool = False, upload: Upload | None = None,
                fed: torch.Tensor | None = None) -> ForwardBatch:
        """The verify's one forward: the rows (:attr:`VerifyRow.num_logits` each, or with
        ``asked`` :attr:`VerifyRow.num_asked`), then the chunks (none), with their trees and
        groups; ``upload``: the verification's inputs, to go with the forward's; ``fed``: the
        pending tokens of the rows that follow another verify (:attr:`followers`)."""
        rows, trees = self.rows, [r.tree for r in self.rows]
        return ForwardBatch(
            [*(r.slot for r in rows), *(slot for slot, _ in self.chunks)],
            [*(r.token_ids for r in rows), *(ids for _, ids in self.chunks)],
            [*(r.num_asked if asked else r.num_logits for r in rows), *(0 for _ in self.chunks)],
            trees=[*trees, *(None for _ in self.chunks)] if any(trees) else None,
            groups=self.groups, hidden=self.hidden, argmax=argmax, upload=upload, fed=fed,
            fed_rows=None if fed is None else self.followers)

    @property
    def followers(self) -> list[int]:
        """The rows whose pending token is another verify's (:attr:`VerifyRow.follows`)."""
        return [i for i, row in enumerate(self.rows) if row.follows >= 0]


@dataclass(frozen=True)
class Verdict:
    """What one row keeps of a step, as plain data: what the target's rank 0 sends back to
    the coordinator (never logits)."""

    emitted: list[int]               # the accepted drafts, then the recovered or bonus token
    num_accepted: int
    path: list[int] | None = None    # a tree's accepted nodes (None: a chain)
    # per emitted token, with SamplingParams.logprobs: its log-probability under the target
    # and the top alternatives, ``(logprob, [(token, logprob), ...])``
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # a prefill with SamplingParams.prompt_logprobs: prompt tokens 1.. (token 0 has none),
    # ``(logprob, top, rank)`` (prompt_token_logprobs)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] | None = None
