"""The scheduler: the engine's queue and its admission, a step's prefill budget (chunked
prefill) and preemption (issue 34).

Without a budget a step takes every prompt whole, so one long prompt holds every running
stream of the unit for its whole prefill (7 s for 1,400 tokens on the project's CPU). With
``chunked_prefill_size`` (SGLang's name) a step prefills at most that many prompt tokens:
rows that are decoding always verify; rows still prefilling share the budget in arrival
order: a prompt whose rest fits verifies this step (its last token samples, as before); the
first that does not fit takes what is left as a **chunk** (rows that only write their keys
and values) and continues next step; those after it wait. The chunk runs in the step's one
forward beside the verifying rows (a row group of its own: ``LlamaRuntime.forward``), so a
running stream waits one forward holding a chunk, not a chunk's forward and then its own;
and a burst of short prompts starts a budget's worth a step. (vLLM's
``max_num_batched_tokens`` counts the decoding rows' tokens in the same budget; on a CPU,
where a budget must stay small for the pause to, that starved prompts behind a few hundred
decoding rows.)

Chunk boundaries depend on the budget and the arrival order, not on speculation; and a
chunked prefill yields the same bits as a whole one on the row-invariant kernels
(``tests/engine/test_paged_kv.py``); on a GPU, where shapes change rounding, it is one more
thing identity there does not promise.

**Preemption.** A paged cache may hold fewer blocks than every running sequence at its full
length (that is what it is for: concurrency by the tokens held, not by ``max_model_len``).
A step whose rows would need more blocks than are free preempts the newest rows
(:func:`newest_preemptable`) until the rest fit, as vLLM does: a preempted sequence gives its
blocks back and waits at the head of the queue, and when it is admitted again it recomputes
its KV from its tokens (prompt and output so far; its full blocks are likely still in the
prefix cache). Its output does not change: sampling is counter-based (a position's draw
depends on the seed and the position only) and the kernels are row-invariant. A request is
admitted only while the pool has the blocks its first step needs beside the running rows',
so a new request waits rather than push a running one out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specserve.engine.draft_link import DraftLink
from specserve.engine.sequence import Sequence
from specserve.engine.stats import EngineCounters
from specserve.engine.worker import ModelWorker


@dataclass(frozen=True)
class BudgetRow:
    """A running sequence as the budget sees it."""
    decoding: bool    # it verifies this step, outside the budget (its prompt is in the cache)
    tokens: int       # prefilling: prompt tokens not yet computed


@dataclass
class StepPlan:
    verify: list[int] = field(default_factory=list)             # rows (indices) that verify
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (row, tokens) prefilling a chunk
    waiting: list[int] = field(default_factory=list)            # prefilling rows left for later


def plan_step(rows: list[BudgetRow], budget: int | None) -> StepPlan:
    """Which rows verify, which prefill a chunk (how long), which wait (module docstring).
    ``budget`` None: every row verifies (no chunking).

    >>> decode, prompt = BudgetRow(True, 5), BudgetRow(False, 300)
    >>> p = plan_step([decode, prompt, BudgetRow(False, 40), decode], 256)
    >>> p.verify, p.chunks, p.waiting
    ([0, 3], [(1, 256)], [2])
    >>> plan_step([BudgetRow(False, 30), BudgetRow(False, 40)], 256).verify
    [0, 1]
    >>> plan_step([decode] * 300 + [prompt], 16).chunks  # decoding rows take none of it
    [(300, 16)]
    """
    plan = StepPlan()
    if budget is None:
        plan.verify = list(range(len(rows)))
        return plan
    left = budget
    for i, row in enumerate(rows):
        if row.decoding:
            plan.verify.append(i)
        elif left <= 0:
            plan.waiting.append(i)
        elif row.tokens <= left:
            plan.verify.append(i)
            left -= row.tokens
        else:
            plan.chunks.append((i, left))
            left = 0
    return plan


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


def newest_preemptable(preemptable: list[bool]) -> int | None:
    """The row to preempt: the newest (last admitted) that may be, never the only row left.

    >>> newest_preemptable([True, True, False]), newest_preemptable([True])
    (1, None)
    """
    if len(preemptable) < 2:
        return None
    return next((i for i in range(len(preemptable) - 1, -1, -1) if preemptable[i]), None)


class Scheduler:
    """The engine's sequences and which of them each step runs: the queue and its admission,
    the step's plan with preemption (module docstring), and the ``n`` samples of a request
    that wait for its first to share its prefill (:meth:`fork`)."""

    def __init__(self, target: ModelWorker, draft: DraftLink, counters: EngineCounters,
                 chunked_prefill_size: int | None) -> None:
        self.target, self.draft, self.counters = target, draft, counters
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.forks: dict[int, list[Sequence]] = {}  # a request's first sample -> its others

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's samples: the first waits, the others wait for its prefill."""
        self.waiting.append(seqs[0])
        if len(seqs) > 1:
            self.forks[seqs[0].seq_id] = seqs[1:]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)  # (a waiting sibling's first is in either)

    # -- admission --------------------------------------------------------------------------
    def admit(self) -> None:
        """Waiting requests in order, while slots are free and (a paged cache) the blocks
        their first step needs beside the running rows': a request of ``n`` samples takes
        its ``n`` slots at once (its first prefills; the others wait in them)."""
        while self.waiting and self._room_for(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.slot = self.target.allocate()
            cached = self._match(seq)
            if not seq.num_preemptions:  # usage reports the prompt's hit, not a recompute's
                seq.num_cached_tokens = cached
            for sibling in self.forks.get(seq.seq_id, []):
                sibling.slot = self.target.allocate()
            self.running[seq.seq_id] = seq
            if seq.num_speculative_tokens > 0 and self.draft.available:
                self.draft.attach(seq)

    def _room_for(self, seq: Sequence) -> bool:
        """Slots for ``seq`` and its samples, and (a paged cache) the blocks its first step
        needs beside the running rows'."""
        if self.target.num_free_slots < 1 + len(self.forks.get(seq.seq_id, ())):
            return False
        if not self.target.paged or not self.running:  # alone it fits (KVCacheConfig's check)
            return True
        rows = [*self.running.values(), seq]
        return not self._short_of_blocks(rows, self._budget(rows))

    def _match(self, seq: Sequence) -> int:
        """The tokens ``seq`` finds in the target's prefix cache (its slot starts with them;
        the engine prefills the rest): of its prompt, or of its prompt and output after a
        preemption. Zero for a request that wants every prompt position's logprobs, and (so
        far) where the proposer reads target features: those of cached positions are not kept."""
        if seq.params.prompt_logprobs is not None or self.draft.needs_hidden:
            return 0
        return self.target.match(seq.slot, seq.token_ids, seq.params.cache_salt)

    # -- the step's plan --------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], StepPlan]:
        """The step's rows and plan (:func:`plan_step`). Where a paged cache lacks the blocks
        they need, the newest rows are preempted (:meth:`_preempt`) until it does not; the
        last row always runs (the pool holds a sequence of ``max_model_len``)."""
        seqs = list(self.running.values())
        plan = self._budget(seqs)
        while self._short_of_blocks(seqs, plan):
            victim = newest_preemptable([s.params.prompt_logprobs is None or not s.output_token_ids
                                         for s in seqs])  # prompt scores already sent: not again
            if victim is None:
                break
            self._preempt(seqs.pop(victim))
            plan = self._budget(seqs)
        return seqs, plan

    def _budget(self, seqs: list[Sequence]) -> StepPlan:
        rows = [BudgetRow(True, 0) if self.decoding(s)
                else BudgetRow(s.params.prompt_logprobs is not None,  # scored whole, never chunked
                               len(s.token_ids) - self.held(s))
                for s in seqs]
        return plan_step(rows, self.chunked_prefill_size)

    def _short_of_blocks(self, seqs: list[Sequence], plan: StepPlan) -> bool:
        """Whether a paged cache lacks the blocks ``plan``'s forwards need: per row it runs,
        its slot and the positions it holds after the forward, drafts included (-1: a
        sequence not admitted yet); and the blocks its pending forks copy (one each)."""
        if not self.target.paged:
            return False
        needs = [(seqs[i].slot, self.held(seqs[i]) + n) for i, n in plan.chunks]
        needs += [(seqs[i].slot, len(seqs[i].token_ids) + self.draft_len(seqs[i]))
                  for i in plan.verify]
        forked = sum(len(self.forks.get(seqs[i].seq_id, ())) for i in plan.verify)
        return self.target.kv_shortfall(needs, forked) > 0

    def _preempt(self, seq: Sequence) -> None:
        """``seq`` gives its KV blocks back (and its samples not forked yet, their slots) and
        waits at the head of the queue; admitted again, it recomputes its KV from its tokens."""
        del self.running[seq.seq_id]
        for s in (seq, *self.forks.get(seq.seq_id, ())):
            self.target.free(s.slot)
            s.slot = -1
        self.draft.detach(seq)
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(seq)

    def held(self, seq: Sequence) -> int:
        """Positions the target holds for ``seq`` (none before it is admitted)."""
        return self.target.length(seq.slot) if seq.slot >= 0 else 0

    def decoding(self, seq: Sequence) -> bool:
        """Whether ``seq`` feeds one token this step (a decoding row: the target holds all
        but its last token; so does a fork of ``n > 1``). A prefix-cache hit or a chunked
        prompt with more of it to compute still prefills."""
        return len(seq.token_ids) - self.held(seq) <= 1

    def draft_len(self, seq: Sequence) -> int:
        """K for this step: at most the request's K, and never more than can be emitted.
        A step emits up to K + 1 tokens; they must fit in both ``max_tokens`` and the context."""
        remaining = self.target.max_seq_len - len(seq.token_ids)
        if seq.params.max_tokens is not None:
            remaining = min(remaining, seq.params.max_tokens - len(seq.output_token_ids))
        return max(0, min(seq.num_speculative_tokens, remaining - 1))

    # -- samples, endings -------------------------------------------------------------------
    def fork(self, first: Sequence, start: int, hidden: torch.Tensor | None) -> None:
        """``first`` has verified its prompt: its samples start from copies of its caches over
        the prompt but its last token (which each feeds itself, as a decoding row does, and
        samples its first token from with its own seed). ``start``: where ``first``'s verify
        began; ``hidden``: its kept features, for a proposer that reads them."""
        shared = first.prompt_len - 1
        siblings = self.forks[first.seq_id]
        while siblings:  # one at a time: a fork that raises leaves the rest to the retry
            seq = siblings[0]
            self.target.fork(first.slot, seq.slot, shared)
            self.running[seq.seq_id] = siblings.pop(0)
            self.counters.num_forked_tokens += shared
            self.draft.fork(seq, first, shared, start, hidden)
        del self.forks[first.seq_id]

    def release(self, seq: Sequence) -> None:
        """``seq`` ended (its ``finish_reason`` says how): its slot and its draft state go."""
        self.running.pop(seq.seq_id, None)
        self.target.free(seq.slot)
        self.draft.detach(seq, learn=seq.finish_reason not in ("abort", "error"))

    def drop_samples(self, seq_id: int, finish_reason: str) -> list[Sequence]:
        """End the samples still waiting to share ``seq_id``'s prefill; they are returned."""
        siblings = self.forks.pop(seq_id, [])
        for sibling in siblings:
            sibling.finish_reason = finish_reason
            if sibling.slot >= 0:
                self.target.free(sibling.slot)
        return siblings

    def abort(self, seq_id: int) -> bool:
        """Drop a request wherever it is; frees its slots. False if it is unknown or done.
        Aborting the first of ``n`` samples before its prefill was shared aborts the samples
        waiting for it (the API aborts all of a request's samples together)."""
        seq = next((s for s in self.waiting if s.seq_id == seq_id), None)
        if seq is not None:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        elif (seq := self.running.get(seq_id)) is not None:
            seq.finish_reason = "abort"
            self.release(seq)
        else:
            return self._abort_sample(seq_id)
        self.drop_samples(seq_id, "abort")
        return True

    def _abort_sample(self, seq_id: int) -> bool:
        """Abort a sample still waiting for its first to share the prefill."""
        for first, siblings in self.forks.items():
            for seq in siblings:
                if seq.seq_id == seq_id:
                    seq.finish_reason = "abort"
                    siblings.remove(seq)
                    if seq.slot >= 0:
                        self.target.free(seq.slot)
                    if not siblings:
                        del self.forks[first]
                    return True
        return False
