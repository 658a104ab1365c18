"""Lossless verification of a *token tree* of drafts, one row at a time (pure functions).

A chain drafts one continuation; a tree drafts several and lets the target keep the longest
that it agrees with (SpecInfer, Medusa, EAGLE). This module is the acceptance step: given the
tree and the target's output at each of its nodes, which path the row keeps and which tokens
it emits. The tree forward that produces that output is the runtime's business; it needs each
node's depth (its position) and ancestors (its attention mask): :func:`tree_depths`,
:func:`tree_ancestors`.

Vocabulary (that of :mod:`~specserve.engine.rejection_sampler`, extended): a row's tree has N
nodes in topological order, ``parents[i] < i`` (``-1``: a child of the **root**, the row's last
committed token) and ``tokens[i]`` its drafted token. Siblings are ordered by index, the order
they were drawn in. The target's output has N + 1 **rows**: row 0 after the root, row i + 1
after node i (so p, the probability rows, is ``[N + 1, V]``). A row emits the tokens of the
accepted path, then one final token: *recovered* where a node's children were all rejected,
*bonus* where the path ends at a leaf. ``num_accepted`` is the path's length.

- **Greedy** (:func:`tree_accept_greedy`): from the root, move to the child whose token is the
  target argmax at the current node while there is one, then emit that argmax. This is exactly
  target-only greedy decoding, token for token, as the chain is (same ``argmax`` call).
- **Seeded** (:func:`tree_accept_seeded`): drafter-invariant, as the chain (Daliri, Musco and
  Suresh 2024): the target's token at a node of depth d (the root's is 0) is the exponential
  race of its p row against the noise fixed by (seed, ``position + d``)
  (:func:`~specserve.engine.sampling.position_noise`, the chain's draw for that position); move
  to the child carrying it. The text is the target-only text of the seed, identical to the
  chain's, whatever the tree.
- **Sampled** (:func:`tree_accept_sampled`): multi-candidate rejection sampling. At node c the
  residual starts as ``r = p_c``; its children ``x_1, x_2, ...`` are tried in sibling order:
  ``x_i`` is accepted with probability ``min(1, r(x_i) / q_i(x_i))`` (then the walk moves to it
  and ``r`` becomes its p row), else ``r <- norm(max(0, r - q_i))`` and the next sibling is
  tried. When every child is rejected the recovered token is sampled from ``r``; at a leaf
  ``r = p_c`` and this is the bonus token. The emitted tokens are then distributed exactly as
  sampling from p one token at a time. This is SpecInfer's multi-step speculative sampling with
  i.i.d. siblings, ``q_i = q`` (Miao et al. 2024, "SpecInfer: Accelerating Large Language Model
  Serving with Tree-based Speculative Inference and Verification"), and Recursive Speculative
  Decoding's siblings drawn without replacement, ``q_i = q`` with the earlier siblings' tokens
  removed and renormalised (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM
  Inference via Sampling Without Replacement"; :func:`without_replacement`). A model-free
  proposer (suffix tree branches, n-gram) gives ``q_i = None``: a point mass on its token, so
  the test is ``u < r(x_i)`` and the residual is ``r`` with ``x_i`` removed.

  **The condition** for exactness: ``q_i`` is the distribution ``x_i`` was actually drawn from,
  given its path from the root and its earlier siblings (by induction over the siblings, the
  output at c is then ``min(q_i, r) + max(0, r - q_i) = r``). Whether to draw a further sibling
  or to expand a node may depend on what was drawn before; a drawn token may *not* be discarded
  for its value (sample eight, keep the three likeliest): the kept ones are no longer
  distributed as q. A token chosen deterministically from the context (an EAGLE-style top-k
  expansion, a suffix-tree branch) is a point mass: pass None for it.

Worked example, greedy: ``parents = [-1, -1, 0, 0, 1]``, ``tokens = [7, 5, 2, 9, 4]`` (the root
has children 7 and 5; 7 has children 2 and 9; 5 has child 4) and target argmax per row
``[5, 3, 8, 0, 0, 6]``: at the root the argmax is 5 → node 1; its argmax 8 is no child's token
(node 4 carries 4) → stop. ``path = [1]``, ``emitted = [5, 8]``, ``num_accepted = 1``.

A chain of K drafts is the tree ``parents = [-1, 0, ..., K - 2]`` (:func:`chain_parents`); on it
every function here agrees with its chain counterpart (greedy and seeded token for token,
sampled in distribution: tests/engine/test_tree_acceptance.py).

Each function walks one row on the host (a Python loop over the accepted path and the tried
siblings); batching rows is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.engine.sampling import position_noise, sample_from

ROOT = -1  # the parent index of the root's children


@dataclass(frozen=True)
class TreeAcceptance:
    """What one row keeps of its tree."""

    path: list[int]     # accepted node indices, the root's child first (each the parent of the next)
    emitted: list[int]  # the path's tokens, then the recovered or bonus token: num_accepted + 1

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def chain_parents(num_draft_tokens: int) -> list[int]:
    """The parents of a chain of K drafts: ``[-1, 0, 1, ..., K - 2]`` (``[]`` for K = 0)."""
    return list(range(-1, num_draft_tokens - 1))


def validate_tree(parents: Sequence[int], tokens: Sequence[int] | None = None,
                  vocab_size: int | None = None) -> None:
    """Raise ValueError unless every ``parents[i]`` is in ``[-1, i)`` (topological order), and
    where given, ``tokens`` has one id per node, each in ``[0, vocab_size)``."""
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a node's parent must be -1 (the root) or an "
                             f"earlier node, in [-1, {i})")
    if tokens is not None and len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tokens for {len(parents)} nodes")
    if tokens is not None and vocab_size is not None:
        for i, token in enumerate(tokens):
            if not 0 <= token < vocab_size:
                raise ValueError(f"tokens[{i}] = {token} is outside the vocabulary [0, {vocab_size})")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth, the root's children at 1 (the root is at 0). Node i sits at position
    ``root_position + depth[i]``; its row of the target's output decides the token after it.

    >>> tree_depths([-1, -1, 0, 0, 1])
    [1, 1, 2, 2, 2]
    """
    validate_tree(parents)
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def tree_ancestors(parents: Sequence[int]) -> list[list[int]]:
    """Each node's ancestors among the nodes, root side first, itself excluded: node i attends
    to the committed context, these nodes and itself.

    >>> tree_ancestors([-1, -1, 0, 0, 2])
    [[], [], [0], [0], [0, 2]]
    """
    validate_tree(parents)
    ancestors: list[list[int]] = []
    for parent in parents:
        ancestors.append([] if parent == ROOT else [*ancestors[parent], parent])
    return ancestors


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """``[N + 1]`` lists: entry 0 the root's children, entry i + 1 node i's, in sibling order
    (the entries line up with the rows of the target's output)."""
    validate_tree(parents)
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    return children


def tree_accept_matching(parents: Sequence[int], tokens: Sequence[int],
                         target_token: Callable[[int], int]) -> TreeAcceptance:
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
            return TreeAcceptance(path, [tokens[i] for i in path] + [token])
        path.append(match)
        row = match + 1


def tree_accept_greedy(parents: Sequence[int], tokens: Sequence[int],
                       target: torch.Tensor) -> TreeAcceptance:
    """Greedy verification of a tree.

    target: ``[N + 1, V]`` logits (or probabilities), or ``[N + 1]`` argmax ids, row 0 after the
    root and row i + 1 after node i. The argmax is the chain's call (``verify_greedy``), over all
    rows at once: ties go where a chain's go.
    """
    assert target.ndim in (1, 2) and target.shape[0] == len(parents) + 1, "one target row per node, + 1"
    argmax = (target if target.ndim == 1 else target.argmax(dim=-1)).tolist()  # [N + 1]
    return tree_accept_matching(parents, tokens, argmax.__getitem__)


def tree_accept_seeded(parents: Sequence[int], tokens: Sequence[int], target_probs: torch.Tensor,
                       seed: int, position: int) -> TreeAcceptance:
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


def tree_accept_sampled(parents: Sequence[int], tokens: Sequence[int], target_probs: torch.Tensor,
                        draft_probs: torch.Tensor | Sequence[torch.Tensor | None] | None,
                        generator: torch.Generator | None = None) -> TreeAcceptance:
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
            return TreeAcceptance(path, [tokens[i] for i in path] + [int(sample_from(r, noise))])


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
