"""A step's prefill budget (chunked prefill) and preemption (issue 34).

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

from dataclasses import dataclass, field


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
