"""K per row each step, and what each step tells the K controller (``adaptive.py``).

A row's K is capped so its step can overrun neither ``max_tokens`` nor the context
(:meth:`Scheduler.draft_len <specserve.engine.scheduler.Scheduler.draft_len>`); an adaptive
request's decoding rows draft the controller's K under that cap. After the step the
controller learns what it cost and what it bought: the forward's shape and time, each row's
accepted drafts, and the propose and accept phases' times.
"""

from __future__ import annotations

from specserve.engine.adaptive import Row, SpecLengthController
from specserve.engine.draft_link import DraftLink
from specserve.engine.proposal import Proposal
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence
from specserve.engine.stats import EngineCounters
from specserve.engine.verification import Verdict


class KPlanner:
    """The step's K per row (:meth:`plan`) and the controller's observations (None: fixed K)."""

    def __init__(self, controller: SpecLengthController | None, scheduler: Scheduler,
                 draft: DraftLink, counters: EngineCounters) -> None:
        self.controller = controller
        if controller is not None:
            controller.k_source = draft.proposer.method  # K governs it (adaptive.py)
        self.scheduler, self.draft, self.counters = scheduler, draft, counters

    def plan(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """K per row for this step: its cap, or the controller's K for adaptive decoding
        rows (rows still in prefill draft at the controller's current K); and the caps.

        A prefill row drafts (its prompt and drafts in one forward) only where the target is
        row-invariant: elsewhere (``library`` and ``compiled`` kernels, every GPU) a prompt
        run with drafts after it is a GEMM of other rows than the target-only prefill, and
        its keys and values round otherwise: far more greedy outputs then part from
        target-only's, from the first tokens on (docs/BENCHMARKS.md, "The GPU path")."""
        decoding = [i for i, s in enumerate(seqs) if self.scheduler.decoding(s)]
        caps = [self.scheduler.draft_len(s) if s.draft_attached else 0 for s in seqs]
        if not self.scheduler.target.row_invariant:
            caps = [c if i in decoding else 0 for i, c in enumerate(caps)]
        ks = list(caps)
        if self.controller is not None:
            ks = [min(c, self.controller.k) if s.adaptive else c for s, c in zip(seqs, caps)]
            planned = self.controller.plan([
                Row(self.scheduler.held(seqs[i]), caps[i], seqs[i].adaptive,
                    not seqs[i].params.greedy,
                    seqs[i].num_speculative_tokens if seqs[i].draft_attached else 0)
                for i in decoding])
            for i, k in zip(decoding, planned):
                ks[i] = k
        for i in decoding:
            seqs[i].k_counts[ks[i]] = seqs[i].k_counts.get(ks[i], 0) + 1
            self.counters.count_k(ks[i])
        return ks, caps

    def observe_forward(self, lengths: list[int], contexts: list[int], seconds: float,
                        padded: int) -> None:
        """The verify forward: each row's new tokens and the context they attend to (the
        tokens after them included), its time without the sampler, its padded token rows
        (the engine calls it only with a controller)."""
        self.controller.observe_forward(len(lengths), sum(lengths),
                                        sum(n * c for n, c in zip(lengths, contexts)), seconds, padded)

    def observe_step(self, seqs: list[Sequence], ks: list[int], proposals: list[Proposal],
                     verdicts: list[Verdict], propose_s: float, accept_s: float) -> None:
        """The step's acceptance per row and its propose and accept phases' costs."""
        ctl = self.controller
        if ctl is None:
            return
        asked = [k for k in ks if k > 0]
        if asked and self.draft.available:
            ctl.observe_propose(max(asked), len(asked), propose_s)
        for k, prop, verdict in zip(ks, proposals, verdicts):
            # (a proposer that drafts to the cap was, in effect, asked for what it drafted)
            accepted = verdict.path if verdict.path is not None else verdict.num_accepted
            ctl.observe_draft(max(k, len(prop.token_ids)), len(prop.token_ids), accepted,
                              self.draft.source(prop))
        sampled = sum(len(p.token_ids) + 1 for s, p in zip(seqs, proposals) if not s.params.greedy)
        ctl.observe_accept(len(seqs), sampled, accept_s)
