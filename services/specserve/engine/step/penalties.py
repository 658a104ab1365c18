"""Presence, frequency and repetition penalties, at every verified position.

A penalty reads the tokens so far: the output's (presence and frequency), the prompt's too
(repetition). At a verify's position j those are the output plus the drafts before j (a tree
node's row: the path to it), which is what they are wherever that position decides a token:
it is reached only when those drafts were accepted. So each position is decided on the
logits target-only decoding would have penalized there, and greedy and seeded outputs stay
target-only's, samples its distribution.

The formulas are vLLM's (``apply_penalties``), after the logit bias and before a mask, the
temperature and the truncations: with ``c`` a token's count in the output so far, the logit
``x`` becomes ``x / r`` (``x > 0``) or ``x * r`` for a token of the prompt or the output, then
``x - frequency * c - presence * (c > 0)``.

The coordinator holds the tokens; a verify carries each penalized row's :class:`History`
(its output, and the prompt's distinct tokens where repetition reads them), so a unit's
rank 0, which verifies, needs no state of its own. A step of a penalized row is not launched
ahead (``target_calls.decode_ahead``): its history would need the token the step before emits.
A model draft applies the same formulas to the chain it draws (:class:`DraftCounts`), so it
drafts what the penalties leave likely; its q is what it drew from, so that changes only
how often its drafts are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import SamplingParams
from specserve.engine.runtime.forward_batch import queued


@dataclass(frozen=True)
class History:
    """What a penalized row's penalties read, besides its drafts."""

    output: tuple[int, ...]   # the output tokens so far
    prompt: tuple[int, ...]   # the prompt's distinct tokens (repetition only; else empty)


def history(params: SamplingParams, prompt: list[int], output: list[int]) -> History | None:
    """A sequence's :class:`History`; None where its request has no penalty."""
    if not params.penalized:
        return None
    return History(tuple(output), tuple(sorted(set(prompt))) if params.repetition_penalty != 1 else ())


def prefixes(token_ids: list[int], parents: list[int] | None) -> list[list[int]]:
    """The drafts before each verified position: a chain's row j the first j drafts; a tree's
    row 0 none, and node i's row the path from the root to node i, node i included."""
    if parents is None:
        return [token_ids[:j] for j in range(len(token_ids) + 1)]
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):  # a parent comes before its children
        paths.append((paths[parent] if parent != -1 else []) + [token_ids[i]])
    return [[], *paths]


def penalize(logits: torch.Tensor, params: SamplingParams, past: History,
             token_ids: list[int], parents: list[int] | None) -> torch.Tensor:
    """``logits`` (``[drafts + 1, V]``, the rows of a verify of ``token_ids``) penalized, each
    row for the tokens before it (module docstring): a new tensor. The output's counts are
    made once for every row, then each row's drafts added (counts are whole numbers: the same
    values in any order); the tokens and the prompt go to the device in a small copy each."""
    n, vocab = logits.shape
    rows, tokens = [], []
    for j, prefix in enumerate(prefixes(token_ids, parents)):
        rows += [j] * len(prefix)
        tokens += prefix
    pairs = queued(torch.tensor([rows, tokens], dtype=torch.long), logits.device)
    counts = output_counts(past.output, vocab, logits.device).to(logits.dtype).expand(n, vocab).clone()
    counts.index_put_((pairs[0], pairs[1]), torch.ones_like(pairs[0], dtype=logits.dtype),
                      accumulate=True)
    prompt = queued(torch.tensor(past.prompt, dtype=torch.long), logits.device)
    return apply_penalties(logits, params, counts, prompt)


def output_counts(output: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """``[1, V]`` float32: each token's count in ``output``, on ``device`` (one copy)."""
    counts = torch.zeros(1, vocab, device=device)
    ids = queued(torch.tensor(output, dtype=torch.long), device)
    return counts.index_add_(1, ids, torch.ones(1, len(output), device=device))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor,
                    prompt: torch.Tensor) -> torch.Tensor:
    """The formulas (module docstring) on ``logits`` ``[n, V]``, each row with its ``counts``
    row (``[n, V]``: each token's count in the output so far), the ``prompt``'s distinct
    tokens (device ids; repetition only): a new tensor."""
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        repeated = seen.clone()
        repeated[:, prompt] = True
        r = params.repetition_penalty
        logits = torch.where(repeated, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * seen.to(logits.dtype)


class DraftCounts:
    """What a model draft's penalties read while it drafts a chain (a draft that applies the
    request's penalties drafts what the target will not push down: the penalties reject a
    repeat): each row's output counts and prompt tokens on the draft's device, one copy each,
    then each drawn token counted where it was drawn (no read back)."""

    def __init__(self, params: SamplingParams, token_ids: list[int], output_start: int,
                 vocab: int, device: torch.device) -> None:
        self.params = params
        past = history(params, token_ids[:output_start], token_ids[output_start:])
        self.counts = output_counts(past.output, vocab, device)
        self.prompt = queued(torch.tensor(past.prompt, dtype=torch.long), device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[1, V]`` penalized for the output and the drafts so far."""
        return apply_penalties(logits, self.params, self.counts.to(logits.dtype), self.prompt)

    def drew(self, token: torch.Tensor) -> None:
        """Count a drawn token (``[1]``, on the device)."""
        self.counts.index_add_(1, token, torch.ones(1, 1, device=self.counts.device))
