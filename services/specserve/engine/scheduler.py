"""A step's token budget: chunked prefill (issue 34).

Without a budget a step takes every prompt whole, so one long prompt holds every running
stream of the unit for its whole prefill (7 s for 1,400 tokens on the project's CPU). With
``max_num_batched_tokens`` (vLLM's name and rule) the step's tokens go first to the rows
that are decoding (each its verify: the last token and its drafts), then, in arrival order,
to rows still prefilling: a prompt whose rest fits verifies this step (its last token
samples, as before); the first that does not fit takes what is left as a **chunk** (a
forward that only writes its keys and values) and continues next step; those after it wait.
So a running stream waits at most one chunk's forward longer than a decode.

A prompt always moves: when the decoding rows use the whole budget, the first prefilling row
still gets ``min_chunk`` tokens. Chunk boundaries depend on the budget and the decoding rows'
verify widths, which speculation changes: that is harmless because a chunked prefill yields
the same bits as a whole one on the row-invariant kernels (``tests/engine/test_paged_kv.py``);
on a GPU, where shapes change rounding, it is one more thing identity there does not promise.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BudgetRow:
    """A running sequence as the budget sees it."""
    decoding: bool    # its prompt is in the cache: it verifies (never chunked)
    tokens: int       # decoding: its verify's width (1 + K); prefilling: tokens not yet computed


@dataclass
class StepPlan:
    verify: list[int] = field(default_factory=list)             # rows (indices) that verify
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (row, tokens) prefilling a chunk
    waiting: list[int] = field(default_factory=list)            # prefilling rows left for later


def plan_step(rows: list[BudgetRow], budget: int | None, min_chunk: int = 16) -> StepPlan:
    """Which rows verify, which prefill a chunk (how long), which wait (module docstring).
    ``budget`` None: every row verifies (no chunking).

    >>> decode, prompt = BudgetRow(True, 5), BudgetRow(False, 300)
    >>> p = plan_step([decode, prompt, BudgetRow(False, 40), decode], 256)
    >>> p.verify, p.chunks, p.waiting
    ([0, 3], [(1, 246)], [2])
    >>> plan_step([BudgetRow(False, 30), BudgetRow(False, 40)], 256).verify
    [0, 1]
    >>> plan_step([decode] * 3 + [prompt], 8).chunks  # decodes ate the budget: it still moves
    [(3, 16)]
    """
    assert min_chunk >= 1
    plan = StepPlan()
    if budget is None:
        plan.verify = list(range(len(rows)))
        return plan
    left = max(budget - sum(r.tokens for r in rows if r.decoding), min_chunk)
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
