"""Turning logits into the distributions p (target) and q (draft), and drawing randomness.

The same transform (temperature, then min-p, top-k and top-p: vLLM's order; ``transformers``
applies min-p last) is applied to draft and target logits. Speculative sampling then
reproduces sampling from the *transformed* target distribution exactly, which is what a
target-only run with the same settings samples from.

Randomness is counter-based: every draw is a function of the request's seed, the **position**
of the token it decides (its index in the sequence, prompt included) and a stream name
(:data:`NOISE`, :data:`UNIFORM`, :data:`DRAFT`), never of how many tokens were drafted, how
many steps came before, or what else is in the batch. Seeded requests rely on it for
"same seed, same text, with or without speculation, at any K" (see
:func:`~specserve.engine.step.acceptance.drafter_invariant_sample`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from specserve.engine.runtime import native
from specserve.engine.runtime.forward_batch import queued
from specserve.engine.runtime.kernels import argmax


def compute_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, *, min_p: torch.Tensor | None = None,
                  truncate: bool | None = None) -> torch.Tensor:
    """Probabilities after temperature / min-p / top-k / top-p, per row.

    logits: ``[N, V]``; temperature, top_k, top_p, min_p: ``[N]`` (top_k ≤ 0, top_p ≥ 1 and
    min_p 0 disable them; ``min_p`` None: no row has one). Rows with temperature 0 are greedy
    and must not be passed here. ``truncate``: whether any row has a top-k or a top-p, as the
    caller knows it on the host (None: read it off the tensors, which on a GPU waits for them).
    Returns ``[N, V]`` float32 rows that sum to 1.
    """
    assert logits.ndim == 2 and temperature.shape == (logits.shape[0],)
    if truncate is None:
        assert bool((temperature > 0).all()), "greedy rows have no sampling distribution"
        truncate = bool((top_k > 0).any()) or bool((top_p < 1).any())
    logits = logits.float() / temperature[:, None]
    if min_p is not None:
        logits = _min_p(logits, min_p)
    if truncate:
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf the tokens whose probability is below ``min_p`` times their row's largest
    (a row's min-p 0 drops nothing: its values stay as they are, beside any other row)."""
    probs = torch.softmax(logits, dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def with_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """``logits`` (``[n, V]``) with a request's ``logit_bias`` added to every row: a copy (the
    bias goes to the device in one small copy of its own); the same tensor without one."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(1, ids, values[None, :].expand(logits.shape[0], -1))


def draft_view(logits: torch.Tensor, params) -> torch.Tensor:
    """``logits`` (``[n, V]``, a model draft's in the target's vocabulary) with the request's
    rules that need no history: its ``logit_bias`` added, the tokens outside its
    ``allowed_token_ids`` at -inf. A draft that draws from them proposes what the target
    will keep (the target's verification applies the same), and its q is what it drew from."""
    logits = with_logit_bias(logits, params.logit_bias)
    if params.allowed_token_ids is None:
        return logits
    ids = torch.tensor(params.allowed_token_ids, device=logits.device)
    out = torch.full_like(logits, -torch.inf)
    out[:, ids] = logits[:, ids]
    return out


def compute_probs_rows(logits: list[torch.Tensor], params: Sequence,
                       settings: torch.Tensor | None = None) -> list[torch.Tensor]:
    """:func:`compute_probs` of several rows' logits (``[m_i, V]`` each), row ``i`` under
    ``params[i]``'s ``temperature``, ``top_k`` and ``top_p`` (request parameters or a
    draft request), all in one call: the transform acts on each logits row alone, so a row
    gets the values it gets by itself, without one sort per row. ``settings``: as
    :func:`compute_probs_each` takes them."""
    counts = [x.shape[0] for x in logits]
    return list(compute_probs_each(torch.cat(logits), params, counts, settings).split(counts))


def compute_probs_each(logits: torch.Tensor, params: Sequence, counts: list[int] | None = None,
                       settings: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`compute_probs` of ``[sum(counts), V]`` logits, each run of ``counts[i]`` rows
    (default: one) under ``params[i]``'s ``temperature``, ``top_k`` and ``top_p``.
    ``settings``: :func:`settings_host`'s of them, already on the logits' device (a verify
    sends them with its forward's inputs); None: sent here, in one copy."""
    counts = counts or [1] * len(params)
    assert not any(p.greedy for p in params), "greedy rows have no sampling distribution"
    truncate = any(p.top_k > 0 or p.top_p < 1 for p in params)
    if settings is None:
        settings = queued(settings_host(params, counts), logits.device)
    min_p = settings[:, 3].float() if any(p.min_p > 0 for p in params) else None
    return compute_probs(logits, settings[:, 0].float(), settings[:, 1].long(),
                         settings[:, 2].float(), min_p=min_p, truncate=truncate)  # [sum(counts), V]


SETTINGS = 4  # a row's sampling settings (settings_host)


def settings_host(params: Sequence, counts: list[int]) -> torch.Tensor:
    """``[sum(counts), 4]`` float64 on the host: each row's temperature, top-k, top-p and
    min-p, repeated once per logits row of it (float64 holds each exactly: a float32 of it
    is the float32 of the request's value)."""
    return torch.tensor([[p.temperature, p.top_k, p.top_p, p.min_p] for p, n in zip(params, counts)
                         for _ in range(n)], dtype=torch.float64).view(-1, SETTINGS)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside the top-k and the top-p nucleus (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]   # [1, V]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]            # [N, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before* it
    # already does. The first token always survives, and a row without top-p loses nothing
    # (its cumulative sum may round to 1 before its tail: batched beside a top-p row, it
    # must still be the row it is alone).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (ranks > 0) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one index per row with the exponential race: ``argmax(probs / noise)``.

    With ``noise ~ Exp(1)`` i.i.d. this picks index i with probability ``probs[i]`` (the
    Gumbel-max trick in another guise) and needs no normalisation: ``probs`` may be any
    non-negative weights. probs, noise: ``[N, V]``; returns ``[N]``.
    """
    return argmax(probs / noise)


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


def noise_key(seed: int, position: int, stream: int = NOISE) -> int:
    """The 64-bit key of the noise deciding the token at ``position`` of a sequence seeded
    ``seed``, in ``stream``."""
    return _mix(seed, position, stream)


def noise_keys(keys: list[int]) -> torch.Tensor:
    """:func:`noise_key`'s keys as the int64 tensor :func:`exponential_noise` takes, on the host."""
    return torch.tensor([_int64(k) for k in keys], dtype=torch.int64)


def _int64(value: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic: mask the sign fill)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


_GOLDEN, _M1, _M2 = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def exponential_noise(keys: list[int] | torch.Tensor, vocab: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(keys), V]`` Exp(1) noise on ``device``, row i a function of ``keys[i]`` alone
    (a list of keys, or :func:`noise_keys`'s int64 tensor, on ``device`` already).

    Counter-based, computed where it is used: entry j of a row is SplitMix64's finaliser of
    ``key + (j + 1) * golden`` (integer ops, which wrap the same on every device), its top 53
    bits a uniform u in (0, 1), the noise ``-log u``. So a verify on a GPU draws no random
    numbers on the host and copies none to the device, and the bits are the same on the CPU
    and the GPU (the final ``log`` may differ in the last place between them). On a CPU with
    the C kernels (:mod:`specserve.engine.runtime.native`) the same formula runs in one pass there,
    2.6x faster on a 2-core EPYC (1.6 ms for 768 x 512 entries); its ``log`` is libm's, so a
    rare entry may differ from this path's in the last place too. Either way a process
    computes every row with one of them."""
    if not isinstance(keys, torch.Tensor):
        keys = queued(noise_keys(keys), device)
    if torch.device(device).type == "cpu" and native.library() is not None:
        return native.exponential_noise(keys, vocab)
    key = keys[:, None]
    index = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)[None, :]
    z = key + index * _GOLDEN  # [N, V]; int64 products wrap, as uint64 ones would
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 11).double() + 0.5) * 2.0 ** -53  # (0, 1): never 0, so the noise is finite
    return (-torch.log(u)).float()


def position_noise(seed: int, position: int, vocab: int, stream: int = NOISE,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """``[V]`` Exp(1) noise deciding the token at ``position`` of a sequence seeded ``seed``
    (``sample_from(probs, noise)`` samples it). Same arguments, same noise, in any process
    and on any device (:func:`exponential_noise`)."""
    return exponential_noise([noise_key(seed, position, stream)], vocab, device)[0]


def position_uniform(seed: int, position: int) -> float:
    """The U[0, 1) of the rejection test of the draft at ``position``."""
    g = torch.Generator().manual_seed(_mix(seed, position, UNIFORM))
    return float(torch.rand(1, generator=g))


def step_generator(seed: int, position: int) -> torch.Generator:
    """The generator of a token tree's rejection draws at a step whose first new token is at
    ``position`` (the uniforms of the tried siblings, the final token's noise, in the order
    :func:`~specserve.engine.step.acceptance.tree_accept_sampled` takes them)."""
    return torch.Generator().manual_seed(_mix(seed, position, TREE))


def random_seed() -> int:
    """A fresh seed for a request that gave none (62 bits of OS entropy)."""
    return int.from_bytes(os.urandom(8), "little") >> 2
