"""Token bans: the masks a request's own rules put on each verified position, beside a
grammar's (``engine/grammar.py``), in the same packed form (``[n, W]`` int32, allowed bits set).

- ``allowed_token_ids`` (vLLM's): only those tokens, at every position (EOS too: it ends the
  output only if listed).
- ``min_tokens``: the tokens that would stop the output banned where they would come before
  it (:meth:`Sequence.stop_bans <specserve.engine.step.sequence.Sequence.stop_bans>`).
- ``bad_words`` (vLLM's): a word's last token banned where the output so far ends with its
  other tokens (a one-token word: everywhere). A word is banned as it is tokenized alone and
  after a space, the spelling it has inside a text (:func:`word_token_ids`). At a verify's
  position j "the output so far" is the output plus the drafts before j (a tree node's row:
  the path to it), which is the output wherever that position decides a token, as for the
  penalties (``penalties.py``); so each position is decided as target-only decoding decides
  it, greedy and seeded outputs stay target-only's, samples its distribution.

They narrow a row's mask in order of precedence: the grammar, ``allowed_token_ids``,
``min_tokens``, ``bad_words``. A rule that would leave a position nothing allowed is dropped
there (:func:`narrowed`): a grammar whose output is complete allows only a stop, which
``min_tokens`` bans, and its request ends complete; a bad word that is the only allowed token
is emitted. A draft of a banned token stays: its target probability is 0 there, so the
verification rejects it.
"""

from __future__ import annotations

from typing import Any

import torch

from specserve.engine.grammar import num_words
from specserve.engine.step.penalties import prefixes


def packed(banned: list[list[int]], vocab_size: int) -> torch.Tensor:
    """``[len(banned), W]`` int32: row i allows every token but ``banned[i]``'s (each
    distinct list packed once: a verify's rows mostly ban the same tokens)."""
    masks = torch.full((len(banned), num_words(vocab_size)), -1, dtype=torch.int32)
    made: dict[tuple[int, ...], torch.Tensor] = {}
    for i, tokens in enumerate(banned):
        if tokens:
            key = tuple(tokens)
            if key not in made:
                made[key] = _words(tokens, masks.shape[1], allowed=False)
            masks[i] = made[key]
    return masks


def allowed_mask(token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """``[W]`` int32: ``token_ids`` allowed, nothing else."""
    return _words(list(token_ids), num_words(vocab_size), allowed=True)


def _words(tokens: list[int], width: int, *, allowed: bool) -> torch.Tensor:
    """The packed words with ``tokens``' bits set (``allowed``) or with only those cleared."""
    ids = torch.tensor(sorted(set(tokens)), dtype=torch.int64)
    bits = torch.zeros(width, dtype=torch.int64)
    bits.index_add_(0, ids // 32, torch.ones_like(ids) << (ids % 32))  # (distinct: an OR)
    words = bits if allowed else ~bits & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, int32


def narrowed(mask: torch.Tensor | None, bans: torch.Tensor) -> torch.Tensor:
    """``mask`` (``[n, W]``; None: everything allowed) and ``bans`` (``[n, W]``) together,
    except at a position where together they allow nothing: there ``mask`` stays (module
    docstring: the rule of higher precedence wins)."""
    if mask is None:
        return bans
    both = mask & bans
    return torch.where((both != 0).any(dim=1, keepdim=True), both, mask)


def word_token_ids(tokenizer: Any, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids, as it is tokenized alone (the output's first word) and after
    a space (any later word); each distinct sequence once. vLLM keeps the second spelling
    only where it has as many tokens as the first; here both are banned, so a word is banned
    wherever it comes."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return tuple(seqs)


def word_bans(words: tuple[tuple[int, ...], ...], output: list[int], token_ids: list[int],
              parents: list[int] | None, vocab_size: int) -> torch.Tensor | None:
    """The masks of a verify of ``token_ids`` (a tree's ``parents``) banning, at each
    position, each word's last token where the output and the drafts before the position end
    with its other tokens; None where no position bans anything."""
    if not words:
        return None
    recent = output[-max(map(len, words)):]  # (a word's other tokens are at most that many)
    banned = [[w[-1] for w in words if w[-1] < vocab_size and _ends_with(recent + drafts, w[:-1])]
              for drafts in prefixes(token_ids, parents)]
    return packed(banned, vocab_size) if any(banned) else None


def _ends_with(tokens: list[int], end: tuple[int, ...]) -> bool:
    return len(end) <= len(tokens) and tuple(tokens[len(tokens) - len(end):]) == end
