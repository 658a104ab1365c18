"""Suffix decoding: propose the most frequent continuation of the sequence's own suffix, found
in the sequence so far and in earlier responses (SuffixDecoding, Oliaro et al., NeurIPS 2025;
Snowflake ArcticInference's ``suffix`` method, which vLLM serves since PR #25784).

Two kinds of tree hold every substring of up to ``max_depth`` tokens with how often it
occurred: one per sequence (its prompt and the tokens generated so far, extended as it grows)
and one global tree over the responses of the last ``max_cached_responses`` finished requests
(FIFO: the oldest response's substrings are counted out again when it leaves). To propose, the
longest suffix of the sequence found in a tree is matched, and from there the most frequent
child is taken while the estimated probability of the whole continuation (the product of
``count(child) / count(node)``) stays at or above ``min_token_prob``, for at most
``match_factor * match_length + match_offset`` tokens (a long match earns a long guess; one
token of match, little). No match proposes nothing: K = 0, a miss costs nothing.

Proposals are point masses (no ``q``), so sampled requests keep the target's distribution
through the rejection sampler, as for n-gram lookup.

Status (issue 19, first part): the trees and the proposer, tested; not yet in the registry
(``specserve.methods``): its options need a place in the config that does not mean editing
``config.py`` for every proposer (see the issue).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTree:
    """Counts of every substring of at most ``max_depth`` tokens of what was added.

    >>> tree = SuffixTree(max_depth=4)
    >>> tree.add([1, 2, 3, 1, 2, 4])
    >>> tree.match([9, 1, 2])              # the longest suffix of the context found: [1, 2]
    2
    >>> tree.continuation([9, 1, 2], k=3, min_token_prob=0.0)  # after [1, 2]: 3 or 4, once each
    ([3, 1, 2], [0.5, 0.5, 0.5])
    >>> grown = SuffixTree(max_depth=4)  # the same counts, one token at a time
    >>> for end in range(1, 7):
    ...     grown.extend([1, 2, 3, 1, 2, 4], end)
    >>> grown.continuation([9, 1, 2], k=3, min_token_prob=0.0)
    ([3, 1, 2], [0.5, 0.5, 0.5])
    """

    def __init__(self, max_depth: int) -> None:
        assert max_depth >= 1
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 1

    def add(self, tokens: list[int], weight: int = 1) -> None:
        """Count every substring of ``tokens`` (up to ``max_depth`` long) ``weight`` more times
        (``weight=-1`` counts a sequence out again; nodes that reach 0 are dropped)."""
        for start in range(len(tokens)):
            self._walk_add(tokens[start:start + self.max_depth], weight)

    def _walk_add(self, path: list[int], weight: int) -> None:
        node = self.root
        node.count += weight
        for token in path:
            child = node.children.get(token)
            if child is None:
                assert weight > 0, "counting out a substring that was never added"
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += weight
            if child.count == 0:
                del node.children[token]
                self.num_nodes -= _size(child)
                return
            node = child

    def extend(self, tokens: list[int], end: int) -> None:
        """Count the substrings of ``tokens`` that end at ``end`` (exclusive), up to
        ``max_depth`` long: the occurrences that token ``end - 1`` adds to a tree holding
        ``tokens[:end - 1]`` (a growing sequence, one token at a time)."""
        for start in range(max(0, end - self.max_depth), end):
            node = self.root
            for token in tokens[start:end - 1]:  # counted when that token came
                node = node.children[token]
            child = node.children.get(tokens[end - 1])
            if child is None:
                child = node.children[tokens[end - 1]] = _Node()
                self.num_nodes += 1
            child.count += 1
        self.root.count += 1

    def match(self, context: list[int]) -> int:
        """Length of the longest suffix of ``context`` (at most ``max_depth - 1``) that
        occurs in the tree followed by something; 0 if none."""
        return self._longest(context)[0]

    def _longest(self, context: list[int]) -> tuple[int, _Node | None]:
        for length in range(min(len(context), self.max_depth - 1), 0, -1):
            node = self._find(context[len(context) - length:])
            if node is not None and node.children:
                return length, node
        return 0, None

    def continuation(self, context: list[int], *, k: int, min_token_prob: float,
                     match_factor: float = math.inf,
                     match_offset: int = 0) -> tuple[list[int], list[float]]:
        """The most frequent continuation of ``context``'s longest matched suffix, at most
        ``k`` tokens and ``match_factor * match length + match_offset``, while its estimated
        probability is at least ``min_token_prob``; with the cumulative probability after
        each token. The walk goes on past ``max_depth`` by re-matching the suffix it built."""
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        length, node = self._longest(context)
        limit = k if math.isinf(match_factor) else min(k, int(match_factor * length + match_offset))
        while node is not None and len(tokens) < limit:
            best = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            prob *= best[1].count / max(node.count, 1)
            if prob < min_token_prob:
                break
            tokens.append(best[0])
            probs.append(prob)
            _, node = self._longest(context + tokens)
        return tokens, probs

    def _find(self, path: list[int]) -> _Node | None:
        node = self.root
        for token in path:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


@dataclass(frozen=True)
class SuffixOptions:
    """How far a suffix match may speculate (names follow ArcticInference's)."""

    max_depth: int = 32              # longest substring the trees count
    match_factor: float = 1.0        # speculate at most match_factor * match length + offset
    match_offset: int = 0
    min_token_prob: float = 0.1      # stop once the continuation's estimated probability is lower
    max_cached_responses: int = 256  # the global tree's responses (FIFO); 0: no global tree


def propose_suffix(trees: list[SuffixTree], context: list[int], k: int,
                   options: SuffixOptions) -> list[int]:
    """The continuation with the highest expected accepted length (the sum of its cumulative
    probabilities) over ``trees``; [] when no tree matches ``context``'s suffix.

    >>> tree = SuffixTree(max_depth=8)
    >>> tree.add([5, 6, 7, 8, 9])
    >>> propose_suffix([tree], [1, 5, 6, 7], k=4, options=SuffixOptions(min_token_prob=0.5))
    [8, 9]
    """
    best: list[int] = []
    best_score = 0.0
    for tree in trees:
        tokens, probs = tree.continuation(context, k=k, min_token_prob=options.min_token_prob,
                                          match_factor=options.match_factor,
                                          match_offset=options.match_offset)
        if sum(probs) > best_score:
            best, best_score = tokens, sum(probs)
    return best


class SuffixProposer(Proposer):
    """Per-sequence trees over prompt and output, and a global tree over the outputs of the
    last ``max_cached_responses`` finished sequences (what a unit has answered: user data,
    kept in memory only)."""

    method = "suffix"

    def __init__(self, options: SuffixOptions = SuffixOptions()) -> None:
        self.options = options
        self.trees: dict[int, SuffixTree] = {}       # seq_id -> its own tree
        self.seen: dict[int, list[int]] = {}         # seq_id -> the tokens its tree holds
        self.prompt_lens: dict[int, int] = {}        # seq_id -> tokens before its output
        self.global_tree = SuffixTree(options.max_depth)
        self.responses: deque[list[int]] = deque()   # in the global tree, oldest first

    def start(self, seq_id: int, seed: int) -> None:
        self.trees[seq_id] = SuffixTree(self.options.max_depth)
        self.seen[seq_id] = []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            self._catch_up(r.seq_id, r.token_ids)
            trees = [self.trees[r.seq_id], self.global_tree] if r.seq_id in self.trees \
                else [self.global_tree]
            tokens = propose_suffix(trees, r.token_ids, r.k, self.options) if r.k > 0 else []
            out.append(Proposal(tokens))
        return out

    def _catch_up(self, seq_id: int, token_ids: list[int]) -> None:
        """Add to the sequence's tree what it does not hold yet. It holds every committed
        token but the last (committed tokens are never rolled back): the suffix being
        matched must not find itself at the end, with nothing after it and its count
        diluting what followed its earlier occurrences."""
        tree, seen = self.trees.get(seq_id), self.seen.get(seq_id)
        if tree is None:
            return
        self.prompt_lens.setdefault(seq_id, len(token_ids) - 1)  # the prefill emitted one
        for end in range(len(seen) + 1, len(token_ids)):
            tree.extend(token_ids, end)
        seen[:] = token_ids[:-1]

    def finish(self, seq_id: int) -> None:
        tree = self.trees.pop(seq_id, None)
        seen = self.seen.pop(seq_id, None)
        prompt_len = self.prompt_lens.pop(seq_id, None)
        if tree is None or not seen or prompt_len is None or self.options.max_cached_responses == 0:
            return
        response = seen[prompt_len:]  # (its last token is not in: a cache, not a record)
        if not response:
            return
        self.global_tree.add(response)
        self.responses.append(response)
        while len(self.responses) > self.options.max_cached_responses:
            self.global_tree.add(self.responses.popleft(), weight=-1)

    def reset(self) -> None:
        """Forget every sequence (the global tree of finished responses stays)."""
        self.trees.clear()
        self.seen.clear()
        self.prompt_lens.clear()
