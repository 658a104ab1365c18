"""The engine's link to its proposer: which sequences it drafts for, the proposer call, the
target features it reads, and what happens when it stops answering.

A sequence that speculates is **attached** when it is admitted (``Proposer.start``) or forked
(``Proposer.fork``), told how far its tokens are final after each verify (``commit``), and
**detached** when it ends (``learn`` when it ended normally, then ``finish``) or gives its KV
back (preemption). A proposer that reads target features (EAGLE: ``needs_hidden``) gets the
final hidden states of every attached sequence's final tokens with its next request: the
link queues them on the sequence (``Sequence.hidden``) and ships them whether it drafts that
step or not, so none pile up.

**A lost draft costs speed, never output.** A proposer that lives elsewhere raises
:class:`~specserve.errors.ProposerUnavailable` when it cannot answer; the link then detaches
every sequence and the engine decodes target-only (lossless without a draft) until the unit
re-attaches it (:meth:`DraftLink.reattach`), after which every running sequence starts on it
again and catches up from its tokens, except those whose features it never got.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from specserve.engine.drafts.base import Proposer
from specserve.engine.grammar import GrammarCompiler
from specserve.engine.step.proposal import DraftRequest
from specserve.engine.step.sequence import Sequence
from specserve.engine.step.stats import EngineCounters
from specserve.engine.step.step_batch import StepBatch, StepRow
from specserve.engine.worker import ModelWorker
from specserve.errors import ProposerUnavailable

log = logging.getLogger(__name__)


class DraftLink:
    """The proposer (None: target-only) as the engine's step sees it (module docstring)."""

    def __init__(self, proposer: Proposer | None, target: ModelWorker, counters: EngineCounters,
                 grammars: GrammarCompiler | None = None) -> None:
        self.proposer = proposer
        self.target = target
        self.counters = counters
        self.available = proposer is not None  # False from a loss until reattach()
        self.needs_hidden = proposer is not None and proposer.needs_hidden
        self.attached: dict[int, Sequence] = {}
        if proposer is not None and grammars is not None:  # a model draft drafts within the
            proposer.use_grammars(grammars)  # grammar: the engine's compiler, so compiled once

    # -- sequences on and off ---------------------------------------------------------------
    def attach(self, seq: Sequence) -> None:
        """``seq`` (admitted, speculating) starts on the proposer."""
        try:
            self.proposer.start(seq.seq_id, seq.sample_seed)
        except ProposerUnavailable:
            self.lost()
            return
        self._on(seq)

    def fork(self, seq: Sequence, first: Sequence, shared: int, start: int,
             hidden: torch.Tensor | None) -> None:
        """``seq``, one of ``first``'s samples, starts from a copy of ``first``'s draft state
        over its ``shared`` prompt tokens. ``start``: where ``first``'s verify began;
        ``hidden``: its kept features (a proposer that reads them needs the prompt's, which a
        retried step no longer has: then ``seq`` stays target-only)."""
        if seq.num_speculative_tokens == 0 or not self.available:
            return
        if self.needs_hidden and (start != 0 or hidden is None):
            return
        try:
            self.proposer.fork(seq.seq_id, first.seq_id, seq.sample_seed, shared)
        except ProposerUnavailable:
            self.lost()
            return
        self._on(seq)
        if self.needs_hidden:
            seq.hidden = [hidden[:shared]]

    def commit(self, seq: Sequence, num_valid_tokens: int) -> None:
        """``seq``'s first ``num_valid_tokens`` tokens are final (the proposer drops the rest)."""
        if seq.draft_attached:
            self.call(self.proposer.commit, seq.seq_id, num_valid_tokens)

    def detach(self, seq: Sequence, *, learn: bool = False) -> None:
        """``seq`` leaves the proposer: it ended (``learn``: normally, so a proposer that drafts
        from earlier responses may keep its text) or it gave its KV back."""
        seq.hidden = []
        if not seq.draft_attached:
            return
        self._off(seq)
        if learn:
            self.call(self.proposer.learn, seq.token_ids, seq.prompt_len)
        self.call(self.proposer.finish, seq.seq_id)

    def _on(self, seq: Sequence) -> None:
        seq.draft_attached = True
        self.attached[seq.seq_id] = seq

    def _off(self, seq: Sequence) -> None:
        seq.draft_attached = False
        self.attached.pop(seq.seq_id, None)

    # -- the step ---------------------------------------------------------------------------
    def propose(self, rows: list[StepRow]) -> None:
        """Each row's drafts (``proposal``, and the ``source`` that drafted them): at most
        its ``k`` (a proposer that ``drafts_to_cap``: its ``cap``); none where the row asked
        for none, or for every row when the proposer is lost."""
        if self.proposer is None:
            return
        to_cap = self.proposer.drafts_to_cap
        requests = [self._request(row) for row in rows]
        active = [i for i, r in enumerate(requests) if r.k > 0 or (to_cap and r.cap > 0)]
        if self.needs_hidden:  # features go out every step, drafting or not: none pile up here
            asked = set(active)
            active = [i for i, row in enumerate(rows)
                      if i in asked or (row.seq.draft_attached and row.seq.hidden)]
            for i in active:
                if rows[i].seq.hidden:
                    requests[i].hidden = torch.cat(rows[i].seq.hidden)
                    rows[i].seq.hidden = []
        for row in rows:
            row.source = self.proposer.method
        if not active:
            return
        try:
            drafted = self.proposer.propose([requests[i] for i in active])
        except ProposerUnavailable:
            self.lost()
            return  # this step is target-only; nobody's output changes
        for i, proposal in zip(active, drafted):
            limit = requests[i].cap if to_cap else requests[i].k
            assert len(proposal.token_ids) <= limit, "proposer drafted too many"
            rows[i].proposal, rows[i].source = proposal, proposal.source or self.proposer.method

    @staticmethod
    def _request(row: StepRow) -> DraftRequest:
        seq = row.seq
        return DraftRequest(seq.seq_id, seq.token_ids, row.k, seq.params, cap=row.cap,
                            grammar=seq.grammar.spec if seq.grammar is not None else None,
                            output_start=seq.prompt_len)

    def wants_features(self, seq: Sequence) -> bool:
        """Whether the target's features of ``seq``'s positions go to the proposer."""
        return self.needs_hidden and seq.draft_attached

    def keep_features(self, batch: StepBatch) -> None:
        """Queue the target features of each row's tokens that are now final (positions from
        the step's start to the cache length after rollback)."""
        for row in batch.rows:
            seq = row.seq
            if row.hidden is not None and seq.draft_attached and seq.finish_reason is None:
                seq.hidden.append(row.hidden[:self.target.length(seq.slot) - row.start])

    # -- availability -----------------------------------------------------------------------
    def call(self, method, *args) -> None:
        """One bookkeeping call to the proposer; a proposer that does not answer is lost."""
        try:
            method(*args)
        except ProposerUnavailable:
            self.lost()

    def lost(self) -> None:
        """The proposer stopped answering: every sequence decodes target-only until
        :meth:`reattach`."""
        if self.available:
            self.counters.num_draft_fallbacks += 1
        self.available = False
        for seq in self.attached.values():
            seq.draft_attached = False
            seq.hidden = []
        self.attached.clear()

    def reattach(self, running: Iterable[Sequence]) -> None:
        """The proposer is back (a restarted draft actor has no state): start every running
        sequence on it again; it catches up from the tokens on its first proposal. A proposer
        that reads target features cannot catch up on features it never got: sequences past
        their prefill stay target-only, new ones speculate. The proposer first forgets
        everything it held: a draft that was slow rather than dead still has the slots of
        sequences that ended while it was away."""
        self.available = self.proposer is not None
        if self.available:
            self.call(self.proposer.reset)
        for seq in list(running):
            lost = self.needs_hidden and self.target.length(seq.slot) > 0
            wants = seq.num_speculative_tokens > 0 and not seq.draft_attached
            if wants and self.available and not lost:
                self.attach(seq)

    def flush(self) -> None:
        """Deliver the proposer's buffered bookkeeping (the unit is idle)."""
        if self.proposer is not None and self.available:
            self.proposer.flush()
