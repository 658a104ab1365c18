"""The scheduler: the engine's queue and its admission, a step's prefill budget (chunked
prefill) and preemption.

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
(``tests/engine/kv/test_paged_kv.py``); on a GPU, where shapes change rounding, it is one more
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from specserve.engine.step.sequence import Sequence
from specserve.engine.step.stats import EngineCounters
from specserve.engine.step.step_batch import ChunkRow, StepBatch, StepRow


class TargetSlots(Protocol):
    """What the scheduler asks of the target's KV cache: an in-process
    :class:`~specserve.engine.worker.ModelWorker` or a unit's target group."""

    @property
    def num_free_slots(self) -> int: ...
    @property
    def paged(self) -> bool: ...
    def allocate(self) -> int: ...
    def free(self, slot: int) -> None: ...
    def length(self, slot: int) -> int: ...
    def match(self, slot: int, tokens: list[int], salt: str | None = None) -> int: ...
    def kv_shortfall(self, needs: list[tuple[int, int]], extra_blocks: int = 0) -> int: ...
    def fork(self, src: int, dst: int, length: int) -> None: ...


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
    the step's rows with preemption (module docstring), and the ``n`` samples of a request
    that wait for its first to share its prefill (:meth:`fork`).

    It knows nothing of drafts: what they need of it comes in as two answers. ``lookahead``:
    the positions a row's drafts may take beyond its tokens this step (the K planner's cap),
    which its blocks must hold; ``match_prefix``: whether a new sequence may start from the
    prefix cache (not where the proposer reads target features: cached positions' are not
    kept). The engine hands the sequences it admits, preempts and releases to the draft link."""

    def __init__(self, target: TargetSlots, counters: EngineCounters, chunked_prefill_size: int | None,
                 *, lookahead: Callable[[Sequence], int] = lambda seq: 0,
                 match_prefix: bool = True) -> None:
        self.target, self.counters = target, counters
        self.chunked_prefill_size = chunked_prefill_size
        self.lookahead, self.match_prefix = lookahead, match_prefix
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
    def admit(self) -> list[Sequence]:
        """Waiting requests in order, while slots are free and (a paged cache) the blocks
        their first step needs beside the running rows': a request of ``n`` samples takes
        its ``n`` slots at once (its first prefills; the others wait in them). Returns the
        sequences that started running."""
        admitted = []
        while self.waiting and self._room_for(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.slot = self.target.allocate()
            cached = self._match(seq)
            if not seq.num_preemptions:  # usage reports the prompt's hit, not a recompute's
                seq.num_cached_tokens = cached
            for sibling in self.forks.get(seq.seq_id, []):
                sibling.slot = self.target.allocate()
            self.running[seq.seq_id] = seq
            admitted.append(seq)
        return admitted

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
        preemption. Zero for a request that wants every prompt position's logprobs, and
        without ``match_prefix``."""
        if seq.params.prompt_logprobs is not None or not self.match_prefix:
            return 0
        return self.target.match(seq.slot, seq.token_ids, seq.params.cache_salt)

    # -- the step's rows --------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        """The step's rows (:func:`plan_step`): those that verify, the prompt chunks. Where a
        paged cache lacks the blocks they need, the newest rows are preempted
        (:meth:`_preempt`; :attr:`StepBatch.preempted`) until it does not; the last row
        always runs (the pool holds a sequence of ``max_model_len``)."""
        seqs = list(self.running.values())
        plan = self._budget(seqs)
        preempted = []
        while self._short_of_blocks(seqs, plan):
            victim = newest_preemptable([s.params.prompt_logprobs is None or not s.output_token_ids
                                         for s in seqs])  # prompt scores already sent: not again
            if victim is None:
                break
            preempted.append(self._preempt(seqs.pop(victim)))
            plan = self._budget(seqs)
        return StepBatch(rows=[StepRow(seqs[i], self.held(seqs[i])) for i in plan.verify],
                         chunks=[ChunkRow(seqs[i], self.held(seqs[i]), n) for i, n in plan.chunks],
                         preempted=preempted)

    def _budget(self, seqs: list[Sequence]) -> StepPlan:
        rows = [StepRow(s, self.held(s)) for s in seqs]  # (what each would verify: its pending tokens)
        return plan_step([BudgetRow(True, 0) if r.decoding
                          else BudgetRow(r.seq.params.prompt_logprobs is not None,  # scored whole
                                         r.num_pending)
                          for r in rows], self.chunked_prefill_size)

    def _short_of_blocks(self, seqs: list[Sequence], plan: StepPlan) -> bool:
        """Whether a paged cache lacks the blocks ``plan``'s forwards need: per row it runs,
        its slot and the positions it holds after the forward, drafts included (-1: a
        sequence not admitted yet); and the blocks its pending forks copy (one each)."""
        if not self.target.paged:
            return False
        needs = [(seqs[i].slot, self.held(seqs[i]) + n) for i, n in plan.chunks]
        needs += [(seqs[i].slot, len(seqs[i].token_ids) + self.lookahead(seqs[i]))
                  for i in plan.verify]
        forked = sum(len(self.forks.get(seqs[i].seq_id, ())) for i in plan.verify)
        return self.target.kv_shortfall(needs, forked) > 0

    def _preempt(self, seq: Sequence) -> Sequence:
        """``seq`` gives its KV blocks back (and its samples not forked yet, their slots) and
        waits at the head of the queue; admitted again, it recomputes its KV from its tokens."""
        del self.running[seq.seq_id]
        for s in (seq, *self.forks.get(seq.seq_id, ())):
            self.target.free(s.slot)
            s.slot = -1
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def held(self, seq: Sequence) -> int:
        """Positions the target holds for ``seq`` (none before it is admitted)."""
        return self.target.length(seq.slot) if seq.slot >= 0 else 0

    # -- samples, endings -------------------------------------------------------------------
    def fork(self, first: Sequence) -> Iterator[Sequence]:
        """``first`` has verified its prompt: its samples start from copies of its target
        cache over the prompt but its last token (which each feeds itself, as a decoding row
        does, and samples its first token from with its own seed). Yields each sample once it
        runs, for the engine to start its draft; one at a time, so a fork that raises leaves
        the rest to the retry."""
        shared = first.prompt_len - 1
        siblings = self.forks[first.seq_id]
        while siblings:
            seq = siblings[0]
            self.target.fork(first.slot, seq.slot, shared)
            self.running[seq.seq_id] = siblings.pop(0)
            self.counters.num_forked_tokens += shared
            yield seq
        del self.forks[first.seq_id]

    def release(self, seq: Sequence) -> None:
        """``seq`` ended (its ``finish_reason`` says how): its slot goes."""
        self.running.pop(seq.seq_id, None)
        self.target.free(seq.slot)

    def drop_samples(self, seq_id: int, finish_reason: str) -> list[Sequence]:
        """End the samples still waiting to share ``seq_id``'s prefill; they are returned."""
        siblings = self.forks.pop(seq_id, [])
        for sibling in siblings:
            sibling.finish_reason = finish_reason
            if sibling.slot >= 0:
                self.target.free(sibling.slot)
        return siblings

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is; frees its slots. Returns the sequence, None if it
        is unknown or done. Aborting the first of ``n`` samples before its prefill was shared
        aborts the samples waiting for it (the API aborts all of a request's samples together)."""
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
        return seq

    def _abort_sample(self, seq_id: int) -> Sequence | None:
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
                    return seq
        return None
