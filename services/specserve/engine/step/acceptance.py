"""Acceptance: which drafts the target keeps and which token it adds, for chains and token
trees: the arithmetic, as pure functions (:mod:`~specserve.engine.step.verification` picks each
row's rule, stages its inputs and keys its draws by the row's seed and positions).

The words (draft, p and q, chain and tree, accepted, recovered, bonus and emitted tokens,
``PLACEHOLDER``) are the engine's vocabulary, defined once in the package docstring
(:mod:`specserve.engine`); this module and ``verification.py`` use them as defined there.

**Chains and trees.** A chain rule verifies B rows at once: drafts ``[B, K]``, p
``[B, K + 1, V]`` (position K the bonus position), output :class:`RejectionOutput`
(``[B, K + 1]`` tokens). A tree rule walks one row on the host (a Python loop over the
accepted path and the tried siblings; batching rows is the caller's): N nodes,
``parents[i] < i`` (-1: a child of the **root**, the row's last committed token), siblings in
the order they were drawn, p ``[N + 1, V]`` with row 0 after the root and row i + 1 after node
i, output the row's :class:`~specserve.engine.step.verify_batch.Verdict` (its path and
emitted tokens). A chain of K drafts is the tree ``chain_parents(K)``; on it every tree rule
agrees with its chain rule (greedy and seeded token for token, sampled in distribution:
tests/engine/step/test_acceptance.py).

The three rules, each for a chain and for a tree (verification.py picks: **greedy** for
greedy rows, ``SamplingParams.greedy``: temperature 0 or ``top_k`` 1; **seeded** for sampled
rows with a seed; **sampled** for the rest):

**1. Greedy.** Exactly target-only greedy decoding, token for token (the same ``argmax``).

- Chain (:func:`greedy_rejection_sample`): keep drafts while they equal the target argmax,
  then emit the target argmax. Worked example, K = 3: drafts ``[5, 9, 2]``, target argmax at
  the four positions ``[5, 9, 7, 4]`` → drafts 5 and 9 accepted, 2 rejected, recovered token
  7: the step emits ``[5, 9, 7]`` and ``num_accepted_tokens = 2``.
- Tree (:func:`tree_accept_greedy`): from the root, move to the child whose token is the
  target argmax at the current node while there is one, then emit that argmax. Worked
  example: ``parents = [-1, -1, 0, 0, 1]``, ``tokens = [7, 5, 2, 9, 4]`` (the root has children
  7 and 5; 7 has children 2 and 9; 5 has child 4) and target argmax per row
  ``[5, 3, 8, 0, 0, 6]``: at the root the argmax is 5 → node 1; its argmax 8 is no child's
  token (node 4 carries 4) → stop. ``path = [1]``, ``emitted = [5, 8]``, ``num_accepted = 1``.

**2. Seeded** (drafter-invariant; Daliri, Musco and Suresh 2024, "Coupling without
Communication and Drafter-Invariant Speculative Decoding"). The target's token at each
position is decided by a Gumbel race with noise fixed by (seed, position) alone,
``t_i = argmax(p_i / E_i)`` (:func:`~specserve.engine.step.sampling.position_noise`), and the
greedy rule runs with that token in place of the argmax.

- Chain (:func:`drafter_invariant_sample`): keep drafts while they equal ``t_i``, then emit
  ``t_i`` of the first mismatch (of the bonus position if none).
- Tree (:func:`tree_accept_seeded`): the target's token at a node of depth d (the root's is
  0) is the race of its p row against the noise of ``position + d``, the chain's draw for
  that position (siblings share it); move to the child carrying it.

The emitted text is then *identical* to a target-only run with the same seed, whatever the
draft, K, the tree or the batch (the tree's is the chain's), and so exactly distributed as
sampling from ``p``. A model draft that samples with the same noise (``argmax(q_i / E_i)``)
agrees with the target with probability at least ``(1 - TV) / (1 + TV)``, below the
``1 - TV`` of the rejection test below: seeded requests trade a little acceptance for
reproducibility; unseeded ones keep the higher acceptance.

**3. Sampled** (the rejection test). The emitted tokens are distributed exactly as sampling
from p one token at a time.

- Chain (:func:`rejection_sample`; Leviathan et al. 2023, "Fast Inference from Transformers
  via Speculative Decoding", Alg. 1, and Chen et al. 2023): draft ``x_i`` is kept with
  probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the recovered token is
  sampled from ``norm(max(0, p_i - q_i))``; if all K drafts are kept the bonus token is
  sampled from ``p_{K+1}``.
- Tree (:func:`tree_accept_sampled`, multi-candidate rejection): at node c the residual starts
  as ``r = p_c``; its children ``x_1, x_2, ...`` are tried in sibling order: ``x_i`` is
  accepted with probability ``min(1, r(x_i) / q_i(x_i))`` (then the walk moves to it and
  ``r`` becomes its p row), else ``r <- norm(max(0, r - q_i))`` and the next sibling is
  tried. When every child is rejected the recovered token is sampled from ``r``; at a leaf
  ``r = p_c`` and this is the bonus token. With one child per node this is the chain's rule.
  It is SpecInfer's multi-step speculative sampling with i.i.d. siblings, ``q_i = q`` (Miao
  et al. 2024, "SpecInfer: Accelerating Large Language Model Serving with Tree-based
  Speculative Inference and Verification"), and Recursive Speculative Decoding's siblings
  drawn without replacement, ``q_i = q`` with the earlier siblings' tokens removed and
  renormalised (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference
  via Sampling Without Replacement"; :func:`without_replacement`).

For a point-mass draft (q None) the test is ``u < p(x)`` (a tree: ``u < r(x)``) and the
residual is p (r) with x removed.

**The condition** for exactness on a tree: ``q_i`` is the distribution ``x_i`` was actually
drawn from, given its path from the root and its earlier siblings (by induction over the
siblings, the output at c is then ``min(q_i, r) + max(0, r - q_i) = r``). Whether to draw a
further sibling or to expand a node may depend on what was drawn before; a drawn token may
*not* be discarded for its value (sample eight, keep the three likeliest): the kept ones are
no longer distributed as q. A token chosen deterministically from the context (an EAGLE-style
top-k expansion, a suffix-tree branch) is a point mass: pass None for it.

**Code order**: the two outputs (with the helpers that lay out a chain batch), a chain
batch's inputs (drafts, p and q padded to ``[B, K (+ 1)]``), then one section per rule in the
order above, its chain function first and its tree function right
after it, each private helper next to its caller (the walk that greedy and seeded trees
share, :func:`tree_accept_matching`, closes the greedy section).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specserve.config import SamplingParams
from specserve.engine.runtime.forward_batch import HostCopy, queued
from specserve.engine.runtime.kernels import argmax as row_argmax
from specserve.engine.runtime.token_tree import tree_children, tree_depths, validate_tree
from specserve.engine.step.proposal import Proposal, TopK
from specserve.engine.step.sampling import compute_probs_rows, exponential_noise, position_noise, sample_from
from specserve.engine.step.verify_batch import Verdict

PLACEHOLDER = -1  # output positions after the emitted token


# ---------------------------------------------------------------------------------------------
# The output of a batch of chains (a tree's is its row's Verdict)


@dataclass
class RejectionOutput:
    output_token_ids: torch.Tensor   # [B, K + 1] long, PLACEHOLDER after each row's last token
    num_accepted_tokens: torch.Tensor       # [B] long, 0..num_draft_tokens
    _host: list[list[int]] | None = field(default=None, repr=False, compare=False)
    _packed: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _copy: HostCopy | None = field(default=None, repr=False, compare=False)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> RejectionOutput:
        """From ``[B, 1 + K + 1]`` on the device, each row's count then its output ids (what
        a compiled graph's verdict returns: :func:`greedy_in_bucket`), read back as
        it is."""
        return cls(packed[:, 1:], packed[:, 0], _packed=packed)

    def emitted(self, row: int) -> list[int]:
        """The ``num_accepted_tokens + 1`` tokens row ``row`` emits this step."""
        count, *ids = self._read()[row]
        return ids[:count + 1]

    def accepted(self, row: int) -> int:
        """Row ``row``'s ``num_accepted_tokens``, on the host."""
        return self._read()[row][0]

    def send(self) -> None:
        """Queue the batch's result's one copy to the host now (:class:`HostCopy`): a worker
        does so when it launches the step, before it launches the next (queued after it, the
        copy would wait for that step too)."""
        if self._copy is None and self._host is None:
            packed = self._packed if self._packed is not None else torch.cat(
                [self.num_accepted_tokens[:, None], self.output_token_ids], 1)
            self._copy = HostCopy(packed)

    def _read(self) -> list[list[int]]:
        """Each row's count, then its output ids: the batch's result read back to the host
        in one copy (on a GPU, one wait for it: :meth:`send`), the first time anything asks."""
        if self._host is None:
            self.send()
            self._host = self._copy.tolist()
        return self._host


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


# ---------------------------------------------------------------------------------------------
# The inputs of a batch of chains: drafts, p and q padded to [B, K (+ 1)]


def pad_drafts(proposals: list[Proposal]) -> torch.Tensor:
    """``[B, K + 1]`` on the host: each row's draft token ids padded with 0 to the most any
    row has (K), then its number of drafts."""
    assert proposals
    max_spec_len = max(len(p.token_ids) for p in proposals)
    drafts = torch.zeros(len(proposals), max_spec_len + 1, dtype=torch.long)
    for i, p in enumerate(proposals):
        drafts[i, : len(p.token_ids)] = torch.tensor(p.token_ids, dtype=torch.long)
        drafts[i, -1] = len(p.token_ids)
    return drafts


def target_probs(params: list[SamplingParams], logits: list[torch.Tensor],
                 max_spec_len: int, settings: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, K + 1, V]`` p after each row's temperature / top-k / top-p (rows padded with 0).
    ``settings``: as :func:`~specserve.engine.step.sampling.compute_probs_each` takes them.

    logits[i]: ``[num_draft_tokens_i + 1, V]``, at most K + 1 rows; params[i] is not greedy.
    """
    assert len(params) == len(logits)
    assert all(x.ndim == 2 and x.shape[0] <= max_spec_len + 1 for x in logits)
    return torch.stack([pad_rows(x, max_spec_len + 1, 0.0)
                        for x in compute_probs_rows(logits, params, settings)])


def pad_rows(x: torch.Tensor, n: int, value) -> torch.Tensor:
    """Pad dim 0 of ``x`` (``[m, ...]``, m ≤ n) to ``n`` rows with ``value``."""
    assert x.shape[0] <= n
    if x.shape[0] == n:
        return x
    pad = x.new_full((n - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, pad])


def draft_probs(proposals: list[Proposal], draft_token_ids: torch.Tensor,
                vocab: int) -> torch.Tensor | None:
    """``[B, K, V]`` q for model proposers, on ``draft_token_ids``' device; None when every
    proposal is deterministic. A deterministic row inside a model batch (no probs) gets its
    one-hot q; a :class:`TopK` q is scattered into the vocabulary.

    draft_token_ids: ``[B, K]``, :func:`pad_drafts`' first K columns.
    """
    assert draft_token_ids.ndim == 2 and draft_token_ids.shape[0] == len(proposals)
    if all(p.probs is None for p in proposals):
        return None
    device = draft_token_ids.device
    q = torch.zeros(len(proposals), draft_token_ids.shape[1], vocab, device=device)
    for i, p in enumerate(proposals):
        n = len(p.token_ids)
        if isinstance(p.probs, TopK):
            q[i, :n] = p.probs.dense(vocab, device)  # [n, V]
        elif p.probs is not None:
            q[i, :n] = queued(p.probs, device)
        elif n:
            q[i, torch.arange(n, device=device), draft_token_ids[i, :n]] = 1.0
    return q


# ---------------------------------------------------------------------------------------------
# 1. Greedy


def greedy_rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                            target_argmax: torch.Tensor) -> RejectionOutput:
    """Greedy verification of a batch of chains.

    draft_token_ids: ``[B, K]``; num_draft_tokens: ``[B]``; target_argmax: ``[B, K + 1]``
    (the target's argmax after each prefix, position K being the bonus position).
    """
    assert draft_token_ids.ndim == 2 and target_argmax.shape[1] == draft_token_ids.shape[1] + 1
    if draft_token_ids.shape[1] == 0:  # no drafts (decodes): each row emits its argmax
        return RejectionOutput(target_argmax, torch.zeros_like(target_argmax[:, 0]))
    num_accepted_tokens = _num_leading_true(draft_token_ids == target_argmax[:, :-1], num_draft_tokens)
    final = target_argmax.gather(1, num_accepted_tokens[:, None])[:, 0]
    return _assemble(draft_token_ids, num_accepted_tokens, final)


def greedy_in_bucket(tokens: torch.Tensor, argmax: torch.Tensor, first: torch.Tensor,
                     count: torch.Tensor) -> torch.Tensor:
    """Greedy verification of a compiled bucket's rows, inside its graph (the forward's
    verdict: ``compiled.GraphVerdict``). Row r asked for logits at its last ``count[r]`` new
    tokens, from column ``first[r]`` of ``tokens`` (``[R, W]``); the tokens after the first of
    them are its drafts, each kept while it equals the ``argmax`` before it
    (:func:`greedy_rejection_sample`, as ``verification.verify_greedy`` calls it). Returns
    ``[R, 1 + W]``: each row's number of accepted drafts, then its emitted tokens,
    PLACEHOLDER after them (the packing :class:`RejectionOutput` reads back in one copy).
    Fixed shapes: a row's columns past its own are gathered clamped and never kept.

    >>> tokens = torch.tensor([[5, 7, 8, 9], [3, 0, 0, 0]])  # row 0: 5 pending, drafts 7 8 9
    >>> argmax = torch.tensor([[7, 8, 4, 6], [2, 1, 1, 1]])  # 7 and 8 kept; 4 after them
    >>> greedy_in_bucket(tokens, argmax, torch.tensor([0, 0]), torch.tensor([4, 1])).tolist()
    [[2, 7, 8, 4, -1], [0, 2, -1, -1, -1]]
    """
    width = tokens.shape[1]
    cols = first[:, None] + torch.arange(width, device=tokens.device)  # [R, W]
    target = argmax.gather(1, cols.clamp(max=width - 1))                # after each verified token
    drafts = tokens.gather(1, cols[:, 1:].clamp(max=width - 1))         # [R, W - 1]
    out = greedy_rejection_sample(drafts, (count - 1).clamp(min=0), target)
    return torch.cat([out.num_accepted_tokens[:, None], out.output_token_ids], dim=1)


def tree_accept_greedy(parents: Sequence[int], tokens: Sequence[int],
                       target: torch.Tensor) -> Verdict:
    """Greedy verification of a tree.

    target: ``[N + 1, V]`` logits (or probabilities), or ``[N + 1]`` argmax ids, row 0 after the
    root and row i + 1 after node i. The argmax is the chain's call (``verify_greedy``), over all
    rows at once: ties go where a chain's go.
    """
    assert target.ndim in (1, 2) and target.shape[0] == len(parents) + 1, "one target row per node, + 1"
    argmax = (target if target.ndim == 1 else row_argmax(target)).tolist()  # [N + 1]
    return tree_accept_matching(parents, tokens, argmax.__getitem__)


def tree_accept_matching(parents: Sequence[int], tokens: Sequence[int],
                         target_token: Callable[[int], int]) -> Verdict:
    """Walk from the root while a child carries the target's token, then emit that token.

    ``target_token(row)`` is the target's token at a row of its output (0: the root; i + 1:
    node i), asked only along the walk. Among siblings carrying the same token the first wins.
    Greedy and seeded verification are this walk with different target tokens.
    """
    validate_tree(parents, tokens)
    children = tree_children(parents)
    path: list[int] = []
    row = 0
    while True:
        token = target_token(row)
        match = next((child for child in children[row] if tokens[child] == token), None)
        if match is None:
            return Verdict([tokens[i] for i in path] + [token], len(path), path)
        path.append(match)
        row = match + 1


# ---------------------------------------------------------------------------------------------
# 2. Seeded (drafter-invariant)


def drafter_invariant_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                             target_probs: torch.Tensor, noise: torch.Tensor) -> RejectionOutput:
    """Drafter-invariant verification of a batch of chains (module docstring): keep drafts
    while they equal the target's own sample under the position's noise, then emit that sample.

    draft_token_ids: ``[B, K]``; num_draft_tokens: ``[B]``; target_probs p: ``[B, K + 1, V]``;
    noise: ``[B, K + 1, V]`` Exp(1), row i column j fixed by the row's seed and the position
    of its j-th token (positions after a row's first disagreement may hold anything positive:
    they are never emitted).
    """
    assert noise.shape == target_probs.shape and target_probs.shape[1] == draft_token_ids.shape[1] + 1
    return greedy_rejection_sample(draft_token_ids, num_draft_tokens,
                                   sample_from(target_probs, noise))  # [B, K + 1] target's tokens


def seeded_chains(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                  target_probs: torch.Tensor, keys: torch.Tensor, drawn_at: torch.Tensor) -> RejectionOutput:
    """:func:`drafter_invariant_sample` with its noise drawn here, from each verified
    position's key (``sampling.noise_key``: the row's seed and the position), so the text is
    the seed's target-only text.

    keys: ``[N]``, each row's ``num_draft_tokens + 1`` positions in turn, row after row;
    drawn_at: ``[N]``, where each key's draw goes in ``target_probs`` viewed as
    ``[B * (K + 1), V]``. Every row's positions are drawn in one call: what follows a
    disagreement is never emitted, and drawing it costs less than deciding where to stop.
    """
    vocab = target_probs.shape[-1]
    drawn = exponential_noise(keys, vocab, target_probs.device)   # [N, V]
    noise = torch.ones_like(target_probs)  # [B, K + 1, V]; the padding positions are never emitted
    noise.view(-1, vocab)[drawn_at] = drawn  # (an index, not a mask: no wait)
    return drafter_invariant_sample(draft_token_ids, num_draft_tokens, target_probs, noise)


def tree_accept_seeded(parents: Sequence[int], tokens: Sequence[int], target_probs: torch.Tensor,
                       seed: int, position: int) -> Verdict:
    """Drafter-invariant verification of a tree (module docstring).

    target_probs p: ``[N + 1, V]``, after the request's transform (``compute_probs``);
    ``position``: that of the step's first new token (the sequence's length before the step),
    which row 0 decides; a node of depth d's row decides ``position + d``. Noise is drawn only
    for the rows the walk reaches, one per depth: the chain's draws at the chain's positions.
    """
    assert target_probs.ndim == 2 and target_probs.shape[0] == len(parents) + 1
    vocab = target_probs.shape[1]
    depths = [0, *tree_depths(parents)]  # per row of p

    noises: dict[int, torch.Tensor] = {}  # per depth: siblings share their position's draw

    def target_token(row: int) -> int:
        depth = depths[row]
        if depth not in noises:
            noises[depth] = position_noise(seed, position + depth, vocab, device=target_probs.device)  # [V]
        return int(sample_from(target_probs[row], noises[depth]))

    return tree_accept_matching(parents, tokens, target_token)


# ---------------------------------------------------------------------------------------------
# 3. Sampled (the rejection test)


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, noise: torch.Tensor) -> RejectionOutput:
    """Stochastic verification of a batch of chains (Leviathan / Chen), with the random draws
    given.

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


def sampled_chains(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                   target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   uniform: torch.Tensor, keys: torch.Tensor) -> RejectionOutput:
    """:func:`rejection_sample` with the noise of each row's recovered or bonus token drawn
    here, from the key of the position it lands on (keys: ``[N]``, as
    :func:`seeded_chains` takes them), chosen on the device: no read of the count."""
    num_accepted_tokens = stochastic_num_accepted(draft_token_ids, num_draft_tokens,
                                                  target_probs, draft_probs, uniform)  # [B]
    first = torch.cumsum(num_draft_tokens + 1, 0) - (num_draft_tokens + 1)  # [B] each row's first key
    noise = exponential_noise(keys[first + num_accepted_tokens], target_probs.shape[-1],
                              target_probs.device)  # [B, V]
    return rejection_sample(draft_token_ids, num_draft_tokens, target_probs, draft_probs, uniform, noise)


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


def tree_accept_sampled(parents: Sequence[int], tokens: Sequence[int], target_probs: torch.Tensor,
                        draft_probs: torch.Tensor | Sequence[torch.Tensor | None] | None,
                        generator: torch.Generator | None = None) -> Verdict:
    """Multi-candidate rejection sampling over a tree (module docstring).

    target_probs p: ``[N + 1, V]``, row 0 after the root, row i + 1 after node i;
    draft_probs: per node, ``q_i`` (``[V]``), the distribution ``tokens[i]`` was drawn from
    given its path and earlier siblings, or None for a point mass on it; an ``[N, V]`` tensor
    gives every node one; None alone: all point masses. ``generator`` supplies the uniform of
    each tried child and the exponential noise of the final token.

    Edge cases: ``r(x) = 0`` rejects x surely (``u * q < r`` is false for u ≥ 0); ``q(x) = 0``
    (x could not have been drawn from q: a caller's inconsistency) accepts x iff ``r(x) > 0``,
    the ratio being infinite, as the chain does. A residual ``max(0, r - q_i)`` that sums to 0
    means ``r == q_i``, where the rejection it follows has probability 0: only rounding gets
    there (``r`` and ``q_i`` a few ulps apart). Then ``r`` is kept as it was, as though ``x_i``
    had not been drafted: it is the law the output has at this point given the earlier
    rejections, and stays inside p's support (not p_c, which would give back the mass of the
    rejected siblings; the error is that of the rounding either way).
    """
    assert target_probs.ndim == 2 and target_probs.shape[0] == len(parents) + 1
    vocab = target_probs.shape[1]
    validate_tree(parents, tokens, vocab)
    if draft_probs is not None:
        assert len(draft_probs) == len(parents), "one q (or None) per node"
    children = tree_children(parents)
    path: list[int] = []
    row = 0
    while True:
        r = target_probs[row]  # [V]
        for child in children[row]:
            q = None if draft_probs is None else draft_probs[child]  # [V] or None
            if _accept(r, q, tokens[child], generator):
                path.append(child)
                row = child + 1
                break
            r = _residual_after_rejection(r, q, tokens[child])
        else:  # every child rejected, or a leaf: recovered or bonus token from r
            # drawn on the host (the generator is a CPU one on every device), used on r's
            noise = torch.empty(vocab, dtype=r.dtype).exponential_(generator=generator).to(r.device)
            return Verdict([tokens[i] for i in path] + [int(sample_from(r, noise))], len(path), path)


def _accept(r: torch.Tensor, q: torch.Tensor | None, token: int, generator: torch.Generator | None) -> bool:
    """The test ``u < r(x) / q(x)``, written ``u * q(x) < r(x)`` as the chain writes it (no
    division; q(x) = 0 accepts iff r(x) > 0). r, q: ``[V]``; q None: a point mass on ``token``."""
    u = float(torch.rand((), generator=generator))
    q_x = 1.0 if q is None else float(q[token])
    return u * q_x < float(r[token])


def _residual_after_rejection(r: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """``norm(max(0, r - q))`` (r itself where that is all zeros: see ``tree_accept_sampled``).
    r, q: ``[V]``; q None: a point mass on ``token``, so the residual is r without ``token``."""
    if q is None:
        residual = r.clone()
        residual[token] = 0
    else:
        residual = (r - q.to(r)).clamp(min=0)
    total = float(residual.sum())
    return residual / total if total > 0 else r


def without_replacement(q: torch.Tensor, earlier: Sequence[int]) -> torch.Tensor:
    """The distribution a sibling is drawn from when its ``earlier`` siblings' tokens are
    excluded (sampling without replacement, Jeon et al. 2024): q without them, renormalised.
    q: ``[V]``; returns ``[V]`` (all zeros if the earlier siblings exhaust q's support).

    >>> without_replacement(torch.tensor([0.5, 0.25, 0.25]), [0]).tolist()
    [0.0, 0.5, 0.5]
    """
    assert q.ndim == 1
    kept = q.clone()
    kept[list(earlier)] = 0
    total = float(kept.sum())
    return kept / total if total > 0 else kept
