"""K per row each step, and what each step tells the K controller (``adaptive.py``): every
decision about how many tokens a row drafts is here.

A row's K is capped so its step can overrun neither ``max_tokens`` nor the context
(:meth:`KPlanner.cap`, which the scheduler also reads to reserve the drafts' KV blocks); an
adaptive request's decoding rows draft the controller's K under that cap. After the step
the controller learns what it cost and what it bought: the forward's shape and time, each
row's accepted drafts, and the propose and accept phases' times.
"""

from __future__ import annotations

from specserve.engine.step.adaptive import Row, SpecLengthController
from specserve.engine.step.sequence import Sequence
from specserve.engine.step.stats import EngineCounters
from specserve.engine.step.step_batch import StepBatch, StepRow


class KPlanner:
    """The step's K per row (:meth:`plan`) and the controller's observations (None: fixed K).
    ``k_source``: the proposer method K governs (the controller's ``k_source``);
    ``row_invariant``: the target's kernels are (prefill rows may draft: :meth:`plan`)."""

    def __init__(self, controller: SpecLengthController | None, counters: EngineCounters, *,
                 max_model_len: int, row_invariant: bool, k_source: str | None = None) -> None:
        self.controller, self.counters = controller, counters
        self.max_model_len, self.row_invariant = max_model_len, row_invariant
        if controller is not None:
            controller.k_source = k_source  # K governs it (adaptive.py)

    def cap(self, seq: Sequence) -> int:
        """The most drafts ``seq`` may have this step: its request's K, and never more than
        can be emitted. A step emits up to K + 1 tokens; they must fit in both
        ``max_tokens`` and the context."""
        remaining = self.max_model_len - len(seq.token_ids)
        if seq.params.max_tokens is not None:
            remaining = min(remaining, seq.params.max_tokens - len(seq.output_token_ids))
        return max(0, min(seq.num_speculative_tokens, remaining - 1))

    def plan(self, rows: list[StepRow]) -> None:
        """Each row's ``cap`` and ``k``: its cap, or the controller's K for adaptive decoding
        rows (rows still in prefill draft at the controller's current K).

        A prefill row drafts (its prompt and drafts in one forward) only where the target is
        row-invariant: elsewhere (``library`` and ``compiled`` kernels, every GPU) a prompt
        run with drafts after it is a GEMM of other rows than the target-only prefill, and
        its keys and values round otherwise: far more greedy outputs then part from
        target-only's, from the first tokens on (docs/BENCHMARKS.md, "The GPU path")."""
        for row in rows:
            drafts = row.seq.draft_attached and (row.decoding or self.row_invariant)
            row.cap = self.cap(row.seq) if drafts else 0
            row.k = row.cap
        decoding = [row for row in rows if row.decoding]
        ctl = self.controller
        if ctl is not None:
            for row in rows:
                if row.seq.adaptive:
                    row.k = min(row.cap, ctl.k)
            planned = ctl.plan([Row(r.start, r.cap, r.seq.adaptive, not r.seq.params.greedy,
                                    r.seq.num_speculative_tokens if r.seq.draft_attached else 0)
                                for r in decoding])
            for row, k in zip(decoding, planned):
                row.k = k
        for row in decoding:
            row.seq.k_counts[row.k] = row.seq.k_counts.get(row.k, 0) + 1
            self.counters.count_k(row.k)

    def observe(self, batch: StepBatch, *, drafted: bool) -> None:
        """What the step cost and bought (``drafted``: the proposer answered): the verify
        forward's shape and time without the sampler, each row's acceptance, the propose and
        accept phases' times."""
        ctl = self.controller
        if ctl is None:
            return
        lengths, contexts = batch.shape  # as the forward ran it: the rows have advanced since
        ctl.observe_forward(len(lengths), sum(lengths), sum(n * c for n, c in zip(lengths, contexts)),
                            batch.clock.verify_s, batch.padded)
        asked = [row.k for row in batch.rows if row.k > 0]
        if asked and drafted:
            ctl.observe_propose(max(asked), len(asked), batch.clock.propose_s)
        for row in batch.rows:
            # (a proposer that drafts to the cap was, in effect, asked for what it drafted)
            verdict, drafts = row.verdict, len(row.proposal.token_ids)
            accepted = verdict.path if verdict.path is not None else verdict.num_accepted
            ctl.observe_draft(max(row.k, drafts), drafts, accepted, row.source)
        sampled = sum(len(r.proposal.token_ids) + 1 for r in batch.rows if not r.seq.params.greedy)
        ctl.observe_accept(len(batch.rows), sampled, batch.clock.accept_s)
