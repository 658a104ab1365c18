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


def newest_preemptable(preemptable: list[bool]) -> int | None:
    """The row to preempt: the newest (last admitted) that may be, never the only row left.

    >>> newest_preemptable([True, True, False]), newest_preemptable([True])
    (1, None)
    """
    if len(preemptable) < 2:
        return None
    return next((i for i in range(len(preemptable) - 1, -1, -1) if preemptable[i]), None)
