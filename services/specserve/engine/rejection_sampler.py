"""Lossless verification of drafted tokens (pure functions).

Greedy rows keep drafts while they equal the target argmax, then emit the target argmax.
Sampled rows follow Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", Alg. 1) and Chen et al. 2023: draft ``x_i`` is kept with probability
``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a *recovered* token is sampled from
``norm(max(0, p_i - q_i))``; if all K drafts are kept a *bonus* token is sampled from
``p_{K+1}``. The emitted sequence is then distributed exactly as sampling from ``p`` one token
at a time. A proposer without a model (n-gram) proposes deterministically: ``q`` is one-hot on
its token, so the acceptance test is ``u < p(x)`` and the residual is ``p`` with ``x`` removed.

Worked example, K = 3, greedy: drafts ``[5, 9, 2]``, target argmax at the four positions
``[5, 9, 7, 4]`` → drafts 5 and 9 accepted, 2 rejected, recovered token 7: the step emits
``[5, 9, 7]`` and ``num_accepted_tokens = 2``.

**Drafter-invariant verification** (seeded requests; Daliri, Musco and Suresh 2024, "Coupling
without Communication and Drafter-Invariant Speculative Decoding"): the target's token at
each position is decided by a Gumbel race with noise fixed by (seed, position) alone,
``t_i = argmax(p_i / E_i)``, and a draft is kept while it equals that token. The emitted text
is then *identical* to a target-only run with the same seed, whatever the draft, K or the
batch, and so exactly distributed as sampling from ``p``. A model draft that samples with
the same noise (``argmax(q_i / E_i)``) agrees with the target with probability at least
``(1 - TV) / (1 + TV)``, below the ``1 - TV`` of the rejection test above: seeded requests
trade a little acceptance for reproducibility; unseeded ones keep the higher acceptance.

Shapes: B rows (sequences), K = ``max_spec_len`` columns; a row with fewer drafts is padded and
its ``num_draft_tokens`` says how many are real (0 is allowed: plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampling import sample_from

PLACEHOLDER = -1  # output positions after the emitted token


@dataclass
class RejectionOutput:
    output_token_ids: torch.Tensor   # [B, K + 1] long, PLACEHOLDER after each row's last token
    num_accepted_tokens: torch.Tensor       # [B] long, 0..num_draft_tokens
    # token trees (tree_acceptance): per row, the accepted nodes' indices; None: chains
    paths: list[list[int]] | None = None

    def emitted(self, row: int) -> list[int]:
        """The ``num_accepted_tokens + 1`` tokens row ``row`` emits this step."""
        return self.output_token_ids[row, : int(self.num_accepted_tokens[row]) + 1].tolist()


def _num_leading_true(accepted: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Length of the all-true prefix of each row, counting only real draft positions.

    accepted: ``[B, K]`` bool; num_draft_tokens: ``[B]``. Returns ``[B]`` long.
    """
    k = accepted.shape[1]
    real = torch.arange(k, device=accepted.device)[None, :] < num_draft_tokens[:, None]
    return (accepted & real).long().cumprod(dim=1).sum(dim=1)


def _assemble(draft_token_ids: torch.Tensor, num_accepted_tokens: torch.Tensor,
              final_token: torch.Tensor) -> RejectionOutput:
    """Row i: its first ``num_accepted_tokens[i]`` drafts, then ``final_token[i]``, then placeholders."""
    bsz, k = draft_token_ids.shape
    cols = torch.arange(k + 1, device=draft_token_ids.device)[None, :]  # [1, K + 1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((bsz, 1), PLACEHOLDER)], dim=1)
    out = torch.where(cols < num_accepted_tokens[:, None], padded, PLACEHOLDER)
    out = torch.where(cols == num_accepted_tokens[:, None], final_token[:, None], out)
    return RejectionOutput(out, num_accepted_tokens)


def greedy_rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                            target_argmax: torch.Tensor) -> RejectionOutput:
    """Greedy verification.

    draft_token_ids: ``[B, K]``; num_draft_tokens: ``[B]``; target_argmax: ``[B, K + 1]``
    (the target's argmax after each prefix, position K being the bonus position).
    """
    assert draft_token_ids.ndim == 2 and target_argmax.shape[1] == draft_token_ids.shape[1] + 1
    num_accepted_tokens = _num_leading_true(draft_token_ids == target_argmax[:, :-1], num_draft_tokens)
    final = target_argmax.gather(1, num_accepted_tokens[:, None])[:, 0]
    return _assemble(draft_token_ids, num_accepted_tokens, final)


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, noise: torch.Tensor) -> RejectionOutput:
    """Stochastic verification (Leviathan / Chen), with the random draws given.

    draft_token_ids: ``[B, K]`` long; num_draft_tokens: ``[B]``;
    target_probs p: ``[B, K + 1, V]``; draft_probs q: ``[B, K, V]``, or None for a
    deterministic proposer (one-hot q); uniform: ``[B, K]`` in [0, 1);
    noise: ``[B, V]`` Exp(1), used for the one recovered or bonus token of each row.
    """
    bsz, k = draft_token_ids.shape
    assert noise.shape == (bsz, target_probs.shape[-1])
    num_accepted_tokens = stochastic_num_accepted(draft_token_ids, num_draft_tokens,
                                                  target_probs, draft_probs, uniform)  # [B]
    rows = torch.arange(bsz, device=draft_token_ids.device)
    p_at = target_probs[rows, num_accepted_tokens]                        # [B, V]
    rejected = num_accepted_tokens < num_draft_tokens                     # [B]
    q_at = _draft_probs_at(draft_token_ids, draft_probs, num_accepted_tokens, p_at)
    residual = torch.where(rejected[:, None], (p_at - q_at).clamp(min=0), p_at)
    # p == q exactly means a rejection could not have happened; guard the 0/0 anyway.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    return _assemble(draft_token_ids, num_accepted_tokens, sample_from(residual, noise))


def stochastic_num_accepted(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                            target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                            uniform: torch.Tensor) -> torch.Tensor:
    """``[B]`` drafts kept by the rejection test of :func:`rejection_sample` (the caller needs
    it first to draw the noise of the position its recovered or bonus token lands on)."""
    bsz, k = draft_token_ids.shape
    assert target_probs.shape[:2] == (bsz, k + 1) and uniform.shape == (bsz, k)
    index = draft_token_ids.clamp(min=0)[..., None]                       # [B, K, 1]
    p_draft = target_probs[:, :k].gather(2, index)[..., 0]                # [B, K]
    q_draft = (draft_probs.gather(2, index)[..., 0] if draft_probs is not None
               else torch.ones_like(p_draft))
    # u < p/q, written without a division (q > 0 where the draft was sampled from q).
    return _num_leading_true(uniform * q_draft < p_draft, num_draft_tokens)


def drafter_invariant_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                             target_probs: torch.Tensor, noise: torch.Tensor) -> RejectionOutput:
    """Drafter-invariant verification (module docstring): keep drafts while they equal the
    target's own sample under the position's noise, then emit that sample.

    draft_token_ids: ``[B, K]``; num_draft_tokens: ``[B]``; target_probs p: ``[B, K + 1, V]``;
    noise: ``[B, K + 1, V]`` Exp(1), row i column j fixed by the row's seed and the position
    of its j-th token (positions after a row's first disagreement may hold anything positive:
    they are never emitted).
    """
    assert noise.shape == target_probs.shape and target_probs.shape[1] == draft_token_ids.shape[1] + 1
    return greedy_rejection_sample(draft_token_ids, num_draft_tokens,
                                   sample_from(target_probs, noise))  # [B, K + 1] target's tokens


def _draft_probs_at(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                    position: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q at each row's ``position`` (``[B, V]``), zeros past the drafts, one-hot if no model."""
    bsz, k = draft_token_ids.shape
    rows = torch.arange(bsz, device=draft_token_ids.device)
    col = position.clamp(max=max(k - 1, 0))
    if k == 0:
        return torch.zeros_like(like)
    if draft_probs is not None:
        q = draft_probs[rows, col]
    else:
        q = torch.zeros_like(like).scatter(1, draft_token_ids[rows, col].clamp(min=0)[:, None], 1.0)
    return q
