"""A step's prefill budget: chunked prefill (issue 34).

Without a budget a step takes every prompt whole, so one long prompt holds every running
stream of the unit for its whole prefill (7 s for 1,400 tokens on the project's CPU). With
``chunked_prefill_size`` (SGLang's name) a step prefills at most that many prompt tokens:
rows that are decoding always verify; rows still prefilling share the budget in arrival
order: a prompt whose rest fits verifies this step (its last token samples, as before); the
first that does not fit takes what is left as a **chunk** (a forward that only writes its
keys and values) and continues next step; those after it wait. So a running stream waits at
most one chunk's forward longer than a decode, and a burst of short prompts starts a budget's
worth a step. (vLLM's ``max_num_batched_tokens`` counts the decoding rows' tokens in the same
budget; on a CPU, where a budget must stay small for the pause to, that starved prompts
behind a few hundred decoding rows.)

Chunk boundaries depend on the budget and the arrival order, not on speculation; and a
chunked prefill yields the same bits as a whole one on the row-invariant kernels
(``tests/engine/test_paged_kv.py``); on a GPU, where shapes change rounding, it is one more
thing identity there does not promise.
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
