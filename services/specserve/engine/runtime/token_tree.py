"""The shape of a token tree of drafts (pure functions on parent lists).

A row's tree has N nodes in topological order: ``parents[i] < i``, :data:`ROOT` (-1) for a
child of the **root**, the row's last committed token. Siblings are ordered by index, the
order they were drawn in. The target's output over a tree has N + 1 **rows**: row 0 after the
root, row i + 1 after node i. A chain of K drafts is the tree :func:`chain_parents` ``(K)``.

The acceptance rules (:mod:`~specserve.engine.step.acceptance`) walk trees of this shape; the
runtime places and masks them (a node of depth d sits at ``root_position + d`` and attends to
its ancestors: :func:`tree_depths`, :func:`tree_ancestors`) and validates a request's tree
(:func:`validate_tree`) without importing the rules; stats rank accepted nodes among their
siblings (:func:`tree_children`).
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = -1  # the parent index of the root's children


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
