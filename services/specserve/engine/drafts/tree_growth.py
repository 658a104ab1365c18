"""Growing a draft token tree a level at a time and keeping its likeliest nodes: EAGLE-2's
dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees", section 4), as a small state object the EAGLE proposer drives.

A node's **score** is the draft's estimate that the target keeps it: the product of the draft
probabilities along its path from the root (summed as log-probabilities here). Because a
child's score is at most its parent's, the nodes with the highest scores always form a tree
(ties go to the shallower node, so a parent is never ranked after its child).

- **Expand**: level 1 is the ``topk`` likeliest tokens after the root. At each further level,
  the ``topk`` best-scored nodes of the level before are fed to the draft in one forward (all
  rows of the batch together; the draft's cache holds the tree so far, the runtime's
  ``trees=`` masks each node to its ancestors) and each gets its ``topk`` likeliest children.
  Expanding by score rather than in a fixed shape is what makes the tree *dynamic*: a
  confident path grows deep, an uncertain step grows wide.
  Only nodes that still rank among the ``budget - 1`` best made so far are expanded: a child
  ranks after its parent, and later levels only push ranks down, so the children of any other
  node could never be drafted (the forwards are smaller, and a small budget stops growing
  early; the frontier is never spent on nodes that cannot be drafted).
- **Rerank**: of every node made, the ``budget`` best-scored are drafted, best first. That
  order is topological (parents first) and is what the coordinator's acceptance statistics
  count by (``adaptive.py``: node i of every tree is "position" i), so a smaller budget drafts
  a prefix of a larger one's nodes and the budget can be chosen like K.

The nodes are chosen deterministically from the context, so for sampled requests each is a
point mass in multi-candidate rejection (``acceptance``): no q is sent.

Worked example, ``topk = 2``, budget 4: the root's likeliest children are a (p 0.6) and b
(0.3); expanding both gives a's children c (0.9 → score 0.54), d (0.05 → 0.03) and b's e (0.5 →
0.15), f (0.4 → 0.12). The best four are a 0.6, c 0.54, b 0.3, e 0.15: tokens ``[a, c, b, e]``,
parents ``[-1, 0, -1, 2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Node:
    token: int
    parent: int       # index among the tree's nodes; -1: a child of the root
    score: float      # log of the product of draft probabilities along the path
    depth: int        # 1: a child of the root
    feature: object   # what the draft reads with this node when it is fed (EAGLE: its parent's f-hat)
    fed: int = -1     # its index in the draft's tree of fed tokens (0 is the root); -1: not fed


class TreeGrowth:
    """One row's tree while it grows (module docstring). ``root_logprobs`` ``[V]``: the
    draft's log-probabilities after the row's last token; ``root_feature``: what the root's
    children are fed with."""

    def __init__(self, root_logprobs: torch.Tensor, root_feature, *, topk: int, budget: int) -> None:
        assert root_logprobs.ndim == 1 and topk >= 1 and budget >= 1
        self.topk, self.budget = topk, budget
        self.nodes: list[Node] = []
        self.frontier: list[int] = []   # nodes to feed at the next expansion
        self.num_fed = 1                # the draft's tree of fed tokens: the root, then the fed nodes
        self.fed_parents = [-1]         # ... their parents within it
        self.depth = 1
        [(values, ids)] = self._top(root_logprobs[None])
        self._add_children(-1, 0.0, 1, values, ids, root_feature)
        self._pick_frontier(1)

    def feed(self) -> tuple[list[int], list, list[int]]:
        """What the next expansion feeds the draft: the frontier's tokens, their features and
        the draft's tree after them (parents over every fed token, ``LlamaRuntime.forward``'s
        ``trees`` entry)."""
        for i in self.frontier:
            node = self.nodes[i]
            node.fed = self.num_fed
            self.num_fed += 1
            self.fed_parents.append(0 if node.parent == -1 else self.nodes[node.parent].fed)
        return ([self.nodes[i].token for i in self.frontier], [self.nodes[i].feature for i in self.frontier],
                list(self.fed_parents))

    def expand(self, logprobs: torch.Tensor, features) -> None:
        """The draft's output after the frontier just fed: ``logprobs`` ``[len(frontier), V]``
        and each fed node's own output feature (``features[j]``, what its children read)."""
        assert logprobs.ndim == 2 and logprobs.shape[0] == len(self.frontier)
        self.depth += 1
        for j, (i, (values, ids)) in enumerate(zip(self.frontier, self._top(logprobs))):
            self._add_children(i, self.nodes[i].score, self.depth, values, ids, features[j])
        self._pick_frontier(self.depth)

    def proposal(self) -> tuple[list[int], list[int] | None]:
        """The ``budget`` best nodes, best first: their tokens and parents among them (None
        where they form a chain)."""
        order = self._ranked()[:self.budget]
        index = {node: n for n, node in enumerate(order)}
        parents = [-1 if self.nodes[i].parent == -1 else index[self.nodes[i].parent] for i in order]
        chain = parents == list(range(-1, len(parents) - 1))
        return [self.nodes[i].token for i in order], None if chain else parents

    def _top(self, logprobs: torch.Tensor) -> list[tuple[list[float], list[int]]]:
        """Each row's ``topk`` likeliest tokens of ``logprobs`` ``[n, V]``: their log-probabilities
        and ids, read back in one read for the level (a read per node and kind waited for the
        device each time). Both travel as float64, which holds either exactly."""
        values, ids = logprobs.topk(min(self.topk, logprobs.shape[-1]), dim=-1)   # [n, k]
        both = torch.stack([values.double(), ids.double()], dim=1).tolist()       # [n][2][k]
        return [(v, [int(t) for t in i]) for v, i in both]

    def _add_children(self, parent: int, score: float, depth: int, values: list[float],
                      ids: list[int], feature) -> None:
        """The ``topk`` likeliest children of ``parent`` (``_top``'s); tokens the draft gives
        no probability (outside its vocabulary, or cut by the request's top-k / top-p) are not
        drafted."""
        for value, token in zip(values, ids):
            if value > float("-inf"):
                self.nodes.append(Node(token, parent, score + value, depth, feature))

    def _pick_frontier(self, depth: int) -> None:
        ranked = self._ranked()[:self.budget - 1]  # whose children could still be drafted
        level = [i for i in ranked if self.nodes[i].depth == depth]
        self.frontier = sorted(level, key=lambda i: (-self.nodes[i].score, i))[:self.topk]

    def _ranked(self) -> list[int]:
        """Every node, best first (score, then the shallower, then the earlier made)."""
        return sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
