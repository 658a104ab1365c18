"""EAGLE-2's dynamic tree (engine/drafts/tree_growth.py) against a synthetic draft: the
worked example, best-first topological proposals, nested budgets, and pruning that never
expands a node whose children could not be drafted."""

from __future__ import annotations

import math

import pytest
import torch
from specserve.engine.drafts.tree_growth import TreeGrowth
from specserve.engine.runtime.token_tree import validate_tree

VOCAB = 16


def logprobs_after(path: tuple[int, ...]) -> torch.Tensor:
    """A synthetic draft: ``[V]`` log-probabilities after a path of tokens, fixed by the path."""
    gen = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.log_softmax(3 * torch.randn(VOCAB, generator=gen), dim=-1)


def grow(topk: int, budget: int, levels: int) -> tuple[TreeGrowth, int]:
    """Grow a tree with the synthetic draft; returns it and how many nodes were fed."""
    tree = TreeGrowth(logprobs_after(()), None, topk=topk, budget=budget)
    fed = 0
    while tree.depth < levels and tree.frontier:
        tokens, _, parents = tree.feed()
        fed += len(tokens)
        assert parents[0] == -1 and len(parents) == 1 + fed
        paths = [_path(tree, i) for i in tree.frontier]
        tree.expand(torch.stack([logprobs_after(p) for p in paths]), [None] * len(paths))
    return tree, fed


def _path(tree: TreeGrowth, i: int) -> tuple[int, ...]:
    out = []
    while i != -1:
        out.append(tree.nodes[i].token)
        i = tree.nodes[i].parent
    return tuple(reversed(out))


def test_the_worked_example():
    """The module docstring's example: a 0.6, b 0.3 after the root; c 0.9, d 0.05 after a;
    e 0.5, f 0.4 after b; budget 4 drafts a, c, b, e."""
    a, b, c, d, e, f = 1, 2, 3, 4, 5, 6
    root = torch.full((VOCAB,), -math.inf)
    root[a], root[b] = math.log(0.6), math.log(0.3)
    tree = TreeGrowth(root, None, topk=2, budget=4)
    tree.feed()
    after = torch.full((2, VOCAB), -math.inf)
    after[0, c], after[0, d], after[1, e], after[1, f] = map(math.log, (0.9, 0.05, 0.5, 0.4))
    tree.expand(after, [None, None])
    assert tree.proposal() == ([a, c, b, e], [-1, 0, -1, 2])


@pytest.mark.parametrize("topk", [1, 2, 4, 8])
def test_proposals_are_best_first_trees_and_nested(topk):
    """Parents come first, scores never increase along the proposal, and a smaller budget
    drafts a prefix of a larger one's nodes (what lets the cost model count by node index)."""
    big, _ = grow(topk, 16, 5)
    tokens, parents = big.proposal()
    parents = parents if parents is not None else list(range(-1, len(tokens) - 1))
    validate_tree(parents, tokens, VOCAB)
    assert len(tokens) == min(16, len(big.nodes))
    for budget in (1, 2, 4, 8):
        small, _ = grow(topk, budget, 5)
        got, _ = small.proposal()
        assert got == tokens[:budget], budget


def test_pruning_feeds_only_nodes_whose_children_could_be_drafted():
    """A budget of 2 feeds one node per level at most (only the best node's best child can
    join it), and a budget of 1 feeds nothing: its tree is the root's best child."""
    tree, fed = grow(topk=4, budget=2, levels=5)
    assert fed <= 4 and len(tree.proposal()[0]) == 2
    tree, fed = grow(topk=4, budget=1, levels=5)
    assert fed == 0 and tree.proposal() == ([int(logprobs_after(()).argmax())], None)


def test_a_topk_of_one_is_the_greedy_chain():
    tree, _ = grow(topk=1, budget=5, levels=5)
    tokens, parents = tree.proposal()
    want, path = [], ()
    for _ in range(5):
        want.append(int(logprobs_after(path).argmax()))
        path = (*path, want[-1])
    assert parents is None and tokens == want
