"""Turning logits into the distributions p (target) and q (draft), and drawing randomness.

The same transform (temperature, then top-k, then top-p: the order ``transformers`` and vLLM
use) is applied to draft and target logits. Speculative sampling then reproduces sampling
from the *transformed* target distribution exactly, which is what a target-only run with the
same settings samples from.

Randomness is counter-based: every draw is a function of the request's seed, the **position**
of the token it decides (its index in the sequence, prompt included) and a stream name
(:data:`NOISE`, :data:`UNIFORM`, :data:`DRAFT`), never of how many tokens were drafted, how
many steps came before, or what else is in the batch. Seeded requests rely on it for
"same seed, same text, with or without speculation, at any K" (see
:func:`~specserve.engine.rejection_sampler.drafter_invariant_sample`).
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


# Streams of the counter-based generator: one per kind of draw, so no two kinds of draw at
# one position share random numbers (the rejection test's uniform, the target's sampling
# noise and a draft's own sampling noise must be independent for sampling to stay exact).
NOISE, UNIFORM, DRAFT, TREE = 0, 1, 2, 3
_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int, stream: int) -> int:
    """A 64-bit generator seed from (seed, position, stream): SplitMix64's finaliser over a
    combination of the three, so neighbouring positions get unrelated seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB
         + 0x2545F4914F6CDD1D) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_noise(seed: int, position: int, vocab: int, stream: int = NOISE) -> torch.Tensor:
    """``[V]`` Exp(1) noise deciding the token at ``position`` of a sequence seeded ``seed``
    (``sample_from(probs, noise)`` samples it). Same arguments, same noise, in any process."""
    g = torch.Generator().manual_seed(_mix(seed, position, stream))
    return torch.empty(vocab).exponential_(generator=g)


def position_uniform(seed: int, position: int) -> float:
    """The U[0, 1) of the rejection test of the draft at ``position``."""
    g = torch.Generator().manual_seed(_mix(seed, position, UNIFORM))
    return float(torch.rand(1, generator=g))


def step_generator(seed: int, position: int) -> torch.Generator:
    """The generator of a token tree's rejection draws at a step whose first new token is at
    ``position`` (the uniforms of the tried siblings, the final token's noise, in the order
    :func:`~specserve.engine.tree_acceptance.tree_accept_sampled` takes them)."""
    return torch.Generator().manual_seed(_mix(seed, position, TREE))


def random_seed() -> int:
    """A fresh seed for a request that gave none (62 bits of OS entropy)."""
    return int.from_bytes(os.urandom(8), "little") >> 2
