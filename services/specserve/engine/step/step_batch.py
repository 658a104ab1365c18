"""The step batch: one step's rows, built once by the engine and read by every part.

A step (``spec_decode.py``) has two kinds of row. A :class:`StepRow` **verifies**: it feeds
its pending tokens (the last one of a decoding sequence; the rest of a prompt) and then its
drafts, and the target decides which drafts it keeps. A :class:`ChunkRow` only **prefills**
a chunk of a long prompt (chunked prefill: ``scheduler.py``): it writes keys and values and
asks for no logits.

Each part of the step fills its own fields of the same rows, in this order:

1. the scheduler picks the rows (``start``, the chunk sizes);
2. the K planner (``k_planner.py``) sets each verifying row's ``cap`` and ``k``;
3. the draft link (``draft_link.py``) sets its ``proposal``; a structured output's grammar
   cuts what it forbids and sets its ``mask`` (``grammar.constrain``);
4. :meth:`StepBatch.arrange` puts the rows in **forward order** (the row groups of
   :func:`layout_forward`); everything after reads them in that order, and nothing is
   permuted back;
5. the target's verify (``worker.py``) fills each row's ``verdict`` and, for a proposer that
   reads target features, ``hidden``;
6. the engine advances each row's sequence and does the step's bookkeeping, with the phases'
   times in :attr:`StepBatch.clock`.

What crosses to the target is not this object (it holds the engine's sequences) but the
plain data :meth:`StepBatch.to_verify` copies out of it, once: a :class:`VerifyBatch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.engine.step.penalties import history
from specserve.engine.step.proposal import Proposal
from specserve.engine.step.sequence import Sequence
from specserve.engine.step.verify_batch import Verdict, VerifyBatch, VerifyRow


@dataclass(eq=False)
class StepRow:
    """A sequence that verifies this step."""

    seq: Sequence
    start: int                      # positions the target holds: where its first new token goes
    cap: int = 0                    # the most drafts it may have (its K, max_tokens, the context)
    k: int = 0                      # drafts asked of the proposer (<= cap)
    proposal: Proposal = field(default_factory=lambda: Proposal([]))
    source: str | None = None       # the proposer method that drafted it (a hybrid: its part)
    mask: torch.Tensor | None = None     # [num drafts + 1, W] int32 bitmask (grammar, min_tokens); None: free
    verdict: Verdict | None = None       # what the target kept (after verify)
    hidden: torch.Tensor | None = None   # [kept tokens, H] target features (after verify), CPU

    @property
    def decoding(self) -> bool:
        """It feeds one token (the target holds all but its last; so does a fork of ``n > 1``):
        a decode row. A prefix-cache hit or a chunked prompt with more to compute prefills."""
        return len(self.seq.token_ids) - self.start <= 1

    @property
    def num_pending(self) -> int:
        """Its tokens the target does not hold yet (1 for a decode row)."""
        return len(self.seq.token_ids) - self.start

    @property
    def input_ids(self) -> list[int]:
        """What the forward appends: its pending tokens, then its drafts."""
        return self.seq.token_ids[self.start:] + self.proposal.token_ids

    @property
    def tree(self) -> list[int] | None:
        """Its token tree over :attr:`input_ids` (None: a chain): the pending tokens as a
        chain, then the drafts' tree."""
        parents = self.proposal.parents
        if parents is None:
            return None
        before = self.num_pending
        return [-1, *range(before - 1)] + [before - 1 if p == -1 else before + p for p in parents]


@dataclass(eq=False)
class ChunkRow:
    """A prompt chunk prefilled this step (no logits, no verdict)."""

    seq: Sequence
    start: int                           # positions the target holds before the chunk
    num_tokens: int                      # prompt tokens this chunk prefills
    hidden: torch.Tensor | None = None   # [num_tokens, H] target features (after verify), CPU

    @property
    def input_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens]


@dataclass
class StepClock:
    """A step's phases, in seconds: drafting (K, the proposer, the grammar), the verify as
    the engine waits for it less the rejection sampler (the forward, and on a unit the hop to
    rank 0), the sampler (measured where it ran) and advancing the rows."""

    propose_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    advance_s: float = 0.0
    _mark: float = field(default_factory=time.perf_counter, repr=False)

    def lap(self) -> float:
        """Seconds since the last lap (or the clock's start)."""
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        return seconds

    @property
    def accept_s(self) -> float:
        """The accept phase the K controller fits: the sampler, then advancing the rows."""
        return self.sample_s + self.advance_s


@dataclass(eq=False)
class StepBatch:
    """One step's rows (module docstring)."""

    rows: list[StepRow]                  # [rows] that verify; forward order after arrange()
    chunks: list[ChunkRow]               # [chunks] prompt chunks, after the rows in the forward
    groups: list[int] = field(default_factory=list)  # the forward's row groups: sizes over rows, then chunks
    padded: int = 0                      # token rows the forward computes (each group x its longest row)
    shape: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # forward_shape(), arranged
    decoding: bool = False               # no prompt token in the forward: every row decodes, arranged
    hidden: bool = False                 # the verify returns target features (a proposer reads them)
    preempted: list[Sequence] = field(default_factory=list)  # gave their KV back to make room
    clock: StepClock = field(default_factory=StepClock)

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    def arrange(self) -> None:
        """Rows and chunks into forward order, and the forward's groups (:func:`layout_forward`)."""
        decoding = [r.decoding for r in self.rows]
        layout = layout_forward(decoding, [len(r.input_ids) for r in self.rows],
                                [c.num_tokens for c in self.chunks])
        self.decoding = not self.chunks and all(decoding)
        self.rows = [self.rows[i] for i in layout.rows]
        self.chunks = [self.chunks[j] for j in layout.chunks]
        self.groups, self.padded = layout.groups, layout.padded
        self.shape = self.forward_shape()

    def to_verify(self) -> VerifyBatch:
        """What the target's verify takes: the rows as plain data, in forward order."""
        return VerifyBatch(
            [VerifyRow(r.seq.slot, r.start, r.input_ids, r.proposal, (r.seq.params, r.seq.sample_seed),
                       r.tree, r.mask, history(r.seq.params, r.seq.token_ids[:r.seq.prompt_len],
                                               r.seq.output_token_ids))
             for r in self.rows],
            chunks=[(c.seq.slot, c.input_ids) for c in self.chunks], groups=self.groups or None,
            hidden=self.hidden)

    def forward_shape(self) -> tuple[list[int], list[int]]:
        """The verify forward's new tokens per row and chunk, and the context each attends to
        (its new tokens included): what the K controller's cost fit reads, as :attr:`shape`,
        kept when the rows are arranged for the forward. Read after the rows advance, a row's
        pending tokens would include what it emitted (a K = 0 decode row counted 2 tokens)."""
        rows = [(len(r.input_ids), r.start + len(r.input_ids)) for r in self.rows]
        chunks = [(c.num_tokens, c.start + c.num_tokens) for c in self.chunks]
        return [n for n, _ in rows + chunks], [c for _, c in rows + chunks]


@dataclass(frozen=True)
class ForwardLayout:
    """Where a step's rows sit in its one target forward: consecutive row groups
    (``LlamaRuntime.forward``'s ``groups``), each padded to its own longest row."""

    rows: list[int]    # the verifying rows (indices), in forward order
    chunks: list[int]  # the prompt chunks (indices), in forward order, after the rows
    groups: list[int]  # sizes of the consecutive groups over rows, then chunks
    padded: int        # token rows the forward computes: each group x its longest row


def layout_forward(decoding: list[bool], lengths: list[int], chunk_lengths: list[int]) -> ForwardLayout:
    """Decode rows (``decoding[i]``, ``lengths[i]`` new tokens each) in one group, or two
    where a few long rows (an exploration probe, a big tree) would pad the others to their
    length (:func:`split_padded`); rows still prefilling, then chunks, one group per input
    length, so no row is padded to a prompt's length.

    >>> layout_forward([True, False, True], [5, 40, 1], [256])
    ForwardLayout(rows=[0, 2, 1], chunks=[0], groups=[2, 1, 1], padded=306)
    """
    groups: dict[int, list[int]] = {}
    for i, (decode, n) in enumerate(zip(decoding, lengths)):
        groups.setdefault(0 if decode else n, []).append(i)  # 0: decode rows
    if 0 in groups:
        groups[0], long_rows = split_padded(groups[0], lengths)
        if long_rows:
            groups[-1] = long_rows
    chunks = sorted(range(len(chunk_lengths)), key=lambda j: chunk_lengths[j])
    chunk_groups = {n: chunk_lengths.count(n) for n in sorted(set(chunk_lengths))}
    return ForwardLayout(
        rows=[i for rows in groups.values() for i in rows], chunks=chunks,
        groups=[len(rows) for rows in groups.values()] + list(chunk_groups.values()),
        padded=sum(len(rows) * max(lengths[i] for i in rows) for rows in groups.values())
        + sum(n * count for n, count in chunk_groups.items()))


# Splitting the decode rows in two costs a second group: on the invariant kernels an
# attention call per layer in the same pass, elsewhere (each group its own forward) about one
# decode of weight reads, which on this project's CPUs costs about as much as 16 padded token
# rows of compute (bench-tree's verify costs: 17 tokens at batch 1 cost 2.2 decodes).
# Splitting pays where it saves twice that; on the packed pass that is conservative.
SPLIT_MIN_PADDING = 32


def split_padded(rows: list[int], lengths: list[int],
                 min_saving: int = SPLIT_MIN_PADDING) -> tuple[list[int], list[int]]:
    """Decode rows as one group, or two: ``(short rows, long rows)``. A group computes
    every row at its longest row's length, so one row drafting 16 while seven draft nothing
    costs 8 x 17 token rows; apart, 7 x 1 and 1 x 17. Split at the length that saves the most
    padded token rows, when that is at least ``min_saving`` (the second group's own cost).

    >>> split_padded([0, 1, 2, 3], [1, 1, 17, 1])
    ([0, 1, 3], [2])
    >>> split_padded([0, 1], [3, 5])
    ([0, 1], [])
    """
    longest = max(lengths[i] for i in rows)
    best, cut = 0, None
    for length in sorted({lengths[i] for i in rows} - {longest}):
        short = [i for i in rows if lengths[i] <= length]
        saving = len(short) * (longest - length)
        if saving > best:
            best, cut = saving, length
    if cut is None or best < min_saving:
        return rows, []
    return ([i for i in rows if lengths[i] <= cut], [i for i in rows if lengths[i] > cut])
