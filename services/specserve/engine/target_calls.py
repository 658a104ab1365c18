"""What a step asks of the target (:class:`TargetCalls`): its verify, read back into the
step's rows, with the prompts' chunks prefilled in the same forward; and launching ahead.

**Launching ahead.** Where the target queues work on a device that runs beside the host (a
CUDA worker in this process), a plain decode step is launched before the one before it is
read: the device runs step N + 1 while the host reads and advances step N, which on a GPU
hides the host's part of a step. Only plain decodes take part (no drafts, grammar, forks or
features: :func:`decode_ahead`), so the tokens are those of steps run one after the other.
Its parts: here, when it goes and the rows it launches (each ``VerifyRow.follows`` its row of
step N); in ``worker.py``, the verify launched after another, its rows fed the tokens step N
emitted, taken on the device (``ModelWorker.launch``'s ``after``, ``Launched.feeds``); in
``serve/target_group.py``, a tensor-parallel group's share (rank 0 sends those tokens to the
other ranks). The engine reads the step launched ahead (:meth:`TargetCalls.take`) and keeps
the position it wrote. On a CPU it is off: a forward runs as it is called, and a token would
only come back one forward later.
"""

from __future__ import annotations

from collections.abc import Callable

from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.step.proposal import Proposal
from specserve.engine.step.scheduler import Scheduler
from specserve.engine.step.sequence import Sequence
from specserve.engine.step.stats import EngineCounters
from specserve.engine.step.step_batch import ChunkRow, StepBatch, StepRow
from specserve.engine.step.verify_batch import VerifyBatch, VerifyRow
from specserve.engine.worker import Launched, Verified


class TargetCalls:
    """What a step asks of the target: its verify, read back into the batch's rows, with the
    prompts' chunks prefilled in the same forward (or alone, in a step with no row), and
    where it can go, the next decode step launched before this one is read (module
    docstring): where the next step needs nothing of this one on the host
    (:func:`decode_ahead`), nothing waits to be admitted and the KV cache has room.
    ``wants_features``: whether the proposer reads a sequence's target features (the draft
    link's); ``launch_ahead`` None: where the target queues work (``ModelWorker.queues_work``)."""

    def __init__(self, target, scheduler: Scheduler, wants_features: Callable[[Sequence], bool],
                 counters: EngineCounters, launch_ahead: bool | None = None) -> None:
        self.target, self.scheduler, self.counters = target, scheduler, counters
        self.wants_features = wants_features
        if launch_ahead is None:
            launch_ahead = getattr(target, "queues_work", False)
        self.launch_ahead = launch_ahead and hasattr(target, "launch")
        self._next: tuple[StepBatch, Launched] | None = None  # launched, not read yet

    def launch(self, batch: StepBatch) -> Launched | Verified:
        """``batch``'s verify, its rows and chunks in row groups (:meth:`StepBatch.arrange`),
        so a running stream waits for one forward, not a chunk's and then its own (the stall
        ``make bench-prefix`` measures): launched where steps launch ahead (:meth:`read`
        reads it), else its result."""
        batch.hidden = any(self.wants_features(seq)
                           for seq in (*batch.seqs, *(chunk.seq for chunk in batch.chunks)))
        batch.arrange()
        if self.launch_ahead:
            return self.target.launch(batch.to_verify())
        return self.target.verify(batch.to_verify())

    def after(self, batch: StepBatch, launched: Launched | Verified, max_model_len: int) -> bool:
        """Launch the step after ``batch`` where it can go now (class docstring); whether it
        went (:meth:`take` hands it to the next step)."""
        if (not self.launch_ahead or isinstance(launched, Verified) or self.scheduler.waiting
                or self.scheduler.forks):
            return False
        nxt = decode_ahead(batch, self.scheduler.running, max_model_len)
        if nxt is None or (self.target.paged and self.target.kv_shortfall(
                [(row.seq.slot, row.start + 1) for row in nxt[0].rows])):
            return False
        self._next = nxt[0], self.target.launch(nxt[1], after=launched)
        return True

    def take(self) -> tuple[StepBatch, Launched] | None:
        """The step launched ahead, if any (and none after)."""
        nxt, self._next = self._next, None
        return nxt

    def read(self, batch: StepBatch, launched: Launched | Verified) -> None:
        """``batch``'s verify read back: every row's verdict (and, for a proposer that reads
        them, the features of its tokens that are now final); its chunks done."""
        result = launched if isinstance(launched, Verified) else launched.result()
        batch.clock.sample_s = result.sample_s
        for i, row in enumerate(batch.rows):
            row.verdict = result.verdicts[i]
            row.hidden = result.hidden[i] if batch.hidden else None
        for j, chunk in enumerate(batch.chunks):
            if self.wants_features(chunk.seq):
                chunk.seq.hidden.append(result.chunk_hidden[j])
            self._chunk_done(chunk)

    def prefill_chunks(self, chunks: list[ChunkRow]) -> None:
        """Prefill prompt chunks in forwards of their own (a step with no row to verify)."""
        for chunk in chunks:
            seq = chunk.seq
            if self.wants_features(seq):
                seq.hidden.append(self.target.forward(
                    ForwardBatch([seq.slot], [chunk.input_ids], [1], hidden=True, argmax=True)).hidden)
            else:
                self.target.forward(ForwardBatch([seq.slot], [chunk.input_ids], [1], argmax=True))
            self._chunk_done(chunk)

    def _chunk_done(self, chunk: ChunkRow) -> None:
        """After a chunk's forward: its full blocks join the prefix cache; counters."""
        self.target.commit(chunk.seq.slot, chunk.seq.token_ids)
        self.counters.num_prefill_tokens += chunk.num_tokens
        self.counters.num_prefill_chunks += 1


def decode_ahead(batch: StepBatch, running: dict[int, Sequence], max_model_len: int
                 ) -> tuple[StepBatch, VerifyBatch] | None:
    """The step after ``batch`` as a verify that can be launched before ``batch`` is read
    (:meth:`TargetCalls.after`): where every ``running`` sequence is a row of ``batch``
    (rows whose sequence has ended since it was launched aside) that decodes without drafts
    or features, and is plain (``Sequence.plain``). A row that reaches its ``max_tokens`` or
    the context with ``batch`` has no next row; each other one feeds the token it emits
    now, taken on the device (:attr:`VerifyRow.follows`), at the position after it, and
    where ``batch`` ends it otherwise (EOS, a stop string, an abort) its next row is
    ignored. None where the next step must be scheduled after ``batch`` is read."""
    live = [j for j, row in enumerate(batch.rows) if running.get(row.seq.seq_id) is row.seq]
    if batch.chunks or batch.hidden or len(live) != len(running):
        return None
    follows = []
    for j in live:
        row, seq = batch.rows[j], batch.rows[j].seq
        if not row.decoding or row.proposal.token_ids or seq.draft_attached or not seq.plain:
            return None  # (the next row's mask or penalties would need this one's token)
        if (len(seq.output_token_ids) + 1 < (seq.params.max_tokens or max_model_len)
                and len(seq.token_ids) + 1 < max_model_len):  # (else this step ends it)
            follows.append(j)
    rows = [batch.rows[j] for j in follows]
    if not rows:
        return None
    ahead = [StepRow(row.seq, row.start + 1) for row in rows]
    # launched, never arranged: the forward it runs, one new token a row (what the K controller's
    # cost fit and the step times read; its rows' tokens are not in their sequences yet)
    shape = ([1] * len(ahead), [r.start + 1 for r in ahead])
    return (StepBatch(ahead, [], groups=[len(ahead)], padded=len(ahead), shape=shape, decoding=True),
            VerifyBatch([VerifyRow(r.seq.slot, r.start, [0], Proposal([]),
                                   (r.seq.params, r.seq.sample_seed), follows=j)
                         for r, j in zip(ahead, follows)]))
