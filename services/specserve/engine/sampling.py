"""Turning logits into the distributions p (target) and q (draft), and drawing randomness.

The same transform (temperature, then top-k, then top-p: the order ``transformers`` and vLLM
use) is applied to draft and target logits. Speculative sampling then reproduces sampling
from the *transformed* target distribution exactly, which is what a target-only run with the
same settings samples from.

Randomness is per request: each sequence owns a ``torch.Generator`` (seeded when the request
gives a seed), and every draw of a step comes from it in a fixed order. A sequence's output
therefore depends only on its seed and its own settings, never on what else is in the batch.
"""

from __future__ import annotations

import os

import torch


def compute_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature / top-k / top-p, per row.

    logits: ``[N, V]``; temperature, top_k, top_p: ``[N]`` (top_k ≤ 0 and top_p ≥ 1 disable
    them). Rows with temperature 0 are greedy and must not be passed here.
    Returns ``[N, V]`` float32 rows that sum to 1.
    """
    assert logits.ndim == 2 and temperature.shape == (logits.shape[0],)
    assert bool((temperature > 0).all()), "greedy rows have no sampling distribution"
    logits = logits.float() / temperature[:, None]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside the top-k and the top-p nucleus (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]   # [1, V]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]            # [N, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before* it
    # already does. The first token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one index per row with the exponential race: ``argmax(probs / noise)``.

    With ``noise ~ Exp(1)`` i.i.d. this picks index i with probability ``probs[i]`` (the
    Gumbel-max trick in another guise) and needs no normalisation: ``probs`` may be any
    non-negative weights. probs, noise: ``[N, V]``; returns ``[N]``.
    """
    return (probs / noise).argmax(dim=-1)


def draw_exponential(generators: list[torch.Generator | None], vocab: int) -> torch.Tensor:
    """``[B, V]`` Exp(1) noise, row i from ``generators[i]``."""
    return torch.stack([torch.empty(vocab).exponential_(generator=g) for g in generators])


def make_generator(seed: int) -> torch.Generator:
    """A sequence's generator. Every sequence has a seed: the request's, or a random one."""
    return torch.Generator().manual_seed(seed)


def random_seed() -> int:
    """A fresh seed for a request that gave none (62 bits of OS entropy)."""
    return int.from_bytes(os.urandom(8), "little") >> 2


def draft_seed(seed: int) -> int:
    """The seed of a sequence's *draft* generator, derived from its request seed.

    The draft samples in its own process, so it cannot share the coordinator's generator; a
    fixed mixing of the request seed (one LCG step) keeps "same seed, same output" true for a
    draft anywhere.
    """
    return (seed * 6364136223846793005 + 1442695040888963407) % (1 << 63)
