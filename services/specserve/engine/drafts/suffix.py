"""Suffix decoding: propose the most frequent continuation of the sequence's own suffix, found
in the sequence so far and in earlier responses (SuffixDecoding, Oliaro et al., NeurIPS 2025;
Snowflake ArcticInference's ``suffix`` method, which vLLM serves since PR #25784).

Two kinds of token store are searched: the sequence itself (its prompt and the tokens
generated so far) and a global store of the responses of the last ``max_cached_responses``
finished requests (FIFO, at most ``max_cached_tokens`` tokens). To propose, the longest
suffix of the sequence (at most ``max_match_tokens``) that occurs in a store is matched; from
there the most frequent next token among its occurrences is taken, the occurrences that
continue with it are kept, and so on, while the estimated probability of the whole
continuation (the product of ``count(next) / count(occurrences)``) stays at or above
``min_token_prob``, for at most ``match_factor * match length + match_offset`` tokens (a long
match earns a long guess; one token of match, little). Of the two stores' continuations the
one with the higher expected accepted length (the sum of its cumulative probabilities) wins.
No match, or none likely enough, proposes nothing: K = 0, a miss costs nothing.

How it is stored. SuffixDecoding keeps a suffix tree whose nodes carry these counts; walking
the tree from the matched node along the most frequent child is the same walk as above, with
a node's count being the number of occurrences of its path. Here the counts are computed when
asked, from the occurrences themselves: a store is one ``int32`` array of tokens (responses
separated by -1) plus, for the global store, its token pairs' end positions sorted by a hash
of the pair (an index rebuilt as it grows, the newest responses scanned directly until the
next rebuild), so a cached token costs about 12 bytes (up to 3x that with the array's growth
and evicted tokens awaiting compaction) where a Python suffix tree of depth 32 took 6.9 KB
(measured). The matching starts from the occurrences of the last token (in the sequence) or
of the last two (in the cache: one token recurs everywhere in a large cache, and a match of
one token earns a one-token guess at most) and narrows them one earlier token at a time with
vectorised numpy filters, so the work per step grows with how often the matched suffix
occurs, not with the store's size (``make bench-suffix`` measures it).

Proposals are point masses (no ``q``), so sampled requests keep the target's distribution
through the rejection sampler, as for n-gram lookup. Responses are user data: the global store
lives in the coordinator's memory only, and seeding it from a file (``cache_file``, JSON lines
``{"token_ids": [...]}`` of earlier responses) is opt-in.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from pathlib import Path

import numpy as np

from specserve.config import PROPOSER_OPTIONS
from specserve.engine.drafts.base import Proposer
from specserve.engine.step.proposal import DraftRequest, Proposal

SEP = -1  # between responses: never equal to a token, so no match or continuation crosses it


# speculative.suffix: its fields, bounds and defaults are the registry's (specserve.methods).
SuffixOptions = PROPOSER_OPTIONS["suffix"]


def match(store: np.ndarray, ends: np.ndarray, context: np.ndarray, max_len: int,
          length: int = 1) -> tuple[int, np.ndarray]:
    """The longest suffix of ``context`` (at most ``max_len``) that ends at one of ``ends``
    in ``store``: ``(its length, where it ends)``. ``ends`` are the positions where the last
    ``length`` tokens of ``context`` end, followed by a token.

    >>> store = np.array([1, 2, 3, 9, 2, 3, 7, SEP], dtype=np.int32)
    >>> match(store, np.array([2, 5]), np.array([5, 1, 2, 3]), max_len=8)
    (3, array([2]))
    """
    while length < min(max_len, len(context)):
        before = ends - length
        inside = before >= 0
        kept = ends[inside][store[before[inside]] == context[-1 - length]]
        if kept.size == 0:
            break
        ends, length = kept, length + 1
    return length, ends


def continuation(store: np.ndarray, ends: np.ndarray, limit: int,
                 min_token_prob: float) -> tuple[list[int], list[float]]:
    """Up to ``limit`` tokens: at each step the most frequent next token after ``ends``
    (ties: the smaller id), while the cumulative probability stays >= ``min_token_prob``;
    with the cumulative probability after each token. ``store`` ends with ``SEP``.

    >>> store = np.array([4, 5, 6, SEP, 4, 5, 8, SEP, 4, 5, 6, SEP], dtype=np.int32)
    >>> continuation(store, np.array([0, 4, 8]), limit=3, min_token_prob=0.0)
    ([5, 6], [1.0, 0.6666666666666666])
    """
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < limit and ends.size:
        following = store[ends + 1]
        values, counts = np.unique(following[following != SEP], return_counts=True)
        if values.size == 0:
            break
        best = int(np.argmax(counts))  # np.unique sorts: the first maximum is the smallest id
        prob *= int(counts[best]) / ends.size  # occurrences that end there count as "not this"
        if prob < min_token_prob:
            break
        tokens.append(int(values[best]))
        probs.append(prob)
        ends = ends[following == values[best]] + 1
    return tokens, probs


def continuation_tree(store: np.ndarray, ends: np.ndarray, budget: int, max_depth: int,
                      min_token_prob: float) -> tuple[list[int], list[int], list[float]]:
    """Up to ``budget`` nodes of the continuations after ``ends``, likeliest first: a node's
    probability is its parent's times the share of the parent's occurrences it follows; the
    likeliest unexpanded node is added next, while its probability is >= ``min_token_prob``
    and its depth <= ``max_depth``. Returns ``(tokens, parents, probs)`` in the order added
    (topological; siblings likeliest first; parent -1: after the context). The chain of
    :func:`continuation` is the path of the likeliest child at each depth.

    >>> store = np.array([4, 5, 6, SEP, 4, 5, 8, SEP, 4, 5, 6, SEP], dtype=np.int32)
    >>> continuation_tree(store, np.array([0, 4, 8]), budget=3, max_depth=3, min_token_prob=0.0)
    ([5, 6, 8], [-1, 0, 0], [1.0, 0.6666666666666666, 0.3333333333333333])
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    heap: list[tuple[float, int, int, int, np.ndarray]] = []  # (-prob, order, token, parent, ends)
    order = 0

    def expand(node: int, prob: float, at: np.ndarray, depth: int) -> None:
        nonlocal order
        if depth > max_depth or at.size == 0:
            return
        following = store[at + 1]
        values, counts = np.unique(following[following != SEP], return_counts=True)
        for value, count in zip(values.tolist(), counts.tolist()):
            p = prob * count / at.size
            if p >= min_token_prob:
                heapq.heappush(heap, (-p, order, value, node, at[following == value] + 1))
                order += 1

    expand(-1, 1.0, ends, 1)
    depth = {-1: 0}
    while heap and len(tokens) < budget:
        neg, _, token, parent, at = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg)
        depth[node] = depth[parent] + 1
        expand(node, -neg, at, depth[node] + 1)
    return tokens, parents, probs


def bigram_keys(prev: np.ndarray, last: np.ndarray) -> np.ndarray:
    """A 31-bit hash of each token pair (collisions are told apart by reading the tokens)."""
    return ((prev.astype(np.int64) * 1_000_003 + last) & 0x7FFFFFFF).astype(np.int32)


class _Sequence:
    """One sequence's tokens as an array ending in ``SEP`` (appended as it grows: committed
    tokens never change)."""

    __slots__ = ("tokens", "size")

    def __init__(self) -> None:
        self.tokens = np.full(256, SEP, dtype=np.int32)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array of ``token_ids`` (the sequence so far), followed by ``SEP``."""
        n = len(token_ids)
        if n < self.size:  # not this sequence's continuation (a restarted id): start over
            self.size = 0
        if n + 1 > len(self.tokens):
            grown = np.full(max(2 * len(self.tokens), n + 1), SEP, dtype=np.int32)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[self.size:n] = token_ids[self.size:n]
        self.tokens[n] = SEP
        self.size = n
        return self.tokens[:n + 1]


class ResponseCache:
    """The global store: the last responses, oldest first, each followed by ``SEP``.

    Positions below ``base`` belong to evicted responses; they are dropped when they are half
    the array (compaction). ``order`` holds the positions p in [1, ``indexed``) sorted by
    the hash of the pair ending there (``keys``; stable: ascending positions per key); later
    positions are scanned directly until the unindexed tail is 4096 tokens plus 1/64 of the
    store, when the index is rebuilt.
    """

    def __init__(self, max_responses: int, max_tokens: int) -> None:
        self.max_responses, self.max_tokens = max_responses, max_tokens
        self.tokens = np.full(1024, SEP, dtype=np.int32)
        self.size = self.base = self.indexed = 0
        self.order = np.zeros(0, dtype=np.int32)
        self.keys = np.zeros(0, dtype=np.int32)
        self.spans: deque[tuple[int, int]] = deque()  # (start, end) of each response, with its SEP

    @property
    def num_responses(self) -> int:
        return len(self.spans)

    @property
    def num_tokens(self) -> int:
        """Tokens of the cached responses, separators included."""
        return self.size - self.base

    @property
    def nbytes(self) -> int:
        """Memory the cache holds: the token array and the index."""
        return self.tokens.nbytes + self.order.nbytes + self.keys.nbytes

    def add(self, response: list[int] | np.ndarray) -> None:
        n = len(response) + 1
        if self.max_responses == 0 or n > self.max_tokens:
            return
        while self.spans and (len(self.spans) >= self.max_responses
                              or self.num_tokens + n > self.max_tokens):
            self.base = self.spans.popleft()[1]
        if self.base * 2 >= self.size and self.base:
            self._compact()
        if self.size + n > len(self.tokens):
            grown = np.full(max(2 * len(self.tokens), self.size + n), SEP, dtype=np.int32)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[self.size:self.size + n - 1] = response
        self.tokens[self.size + n - 1] = SEP
        self.spans.append((self.size, self.size + n))
        self.size += n
        if self.size - self.indexed > 4096 + self.num_tokens // 64:
            self._reindex()

    def ends(self, prev: int, last: int) -> np.ndarray:
        """Live positions holding ``last`` right after ``prev`` that are followed by a token."""
        key = bigram_keys(np.array([prev]), np.array([last]))  # int32, as the keys: no cast
        found = self.order[np.searchsorted(self.keys, key, "left")[0]:
                           np.searchsorted(self.keys, key, "right")[0]]
        start = max(self.indexed, 1)
        tail = self.tokens[start - 1:self.size]
        hits = np.flatnonzero((tail[:-1] == prev) & (tail[1:] == last)) + start
        ends = np.concatenate([found, hits]) if hits.size else found
        ends = ends[ends > self.base]  # the pair lies in live responses
        ends = ends[(self.tokens[ends] == last) & (self.tokens[ends - 1] == prev)]  # not a collision
        return ends[self.tokens[ends + 1] != SEP]

    def view(self) -> np.ndarray:
        """The whole array, up to and including the newest response's ``SEP``."""
        return self.tokens[:self.size]

    def _compact(self) -> None:
        live = self.tokens[self.base:self.size].copy()
        self.tokens[:len(live)] = live
        self.tokens[len(live):self.size] = SEP
        self.spans = deque((s - self.base, e - self.base) for s, e in self.spans)
        self.size, self.base = len(live), 0
        capacity = max(1024, 2 * self.size)
        if len(self.tokens) > 2 * capacity:  # shrink what an earlier, larger cache left
            self.tokens = self.tokens[:capacity].copy()
        self._reindex()

    def _reindex(self) -> None:
        pairs = bigram_keys(self.tokens[:self.size - 1], self.tokens[1:self.size])  # ending at 1..
        self.order = np.argsort(pairs, kind="stable").astype(np.int32)
        self.keys = pairs[self.order]
        self.order += 1
        self.indexed = self.size


class SuffixProposer(Proposer):
    """Matches each sequence against itself and against the unit's earlier responses."""

    method = "suffix"

    def __init__(self, options: SuffixOptions | None = None) -> None:
        self.options = options = options or SuffixOptions()
        self.sequences: dict[int, _Sequence] = {}
        self.cache = ResponseCache(options.max_cached_responses, options.max_cached_tokens)
        if options.cache_file:
            self.seed_cache(options.cache_file)

    @classmethod
    def from_config(cls, spec) -> SuffixProposer:
        return cls(spec.suffix)

    def seed_cache(self, path: str | Path) -> int:
        """Add the responses of a JSON-lines file (``{"token_ids": [...]}`` per line), oldest
        first; returns how many were read."""
        count = 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    self.cache.add([int(t) for t in json.loads(line)["token_ids"]])
                    count += 1
        return count

    def start(self, seq_id: int, seed: int) -> None:
        self.sequences[seq_id] = _Sequence()

    def finish(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)

    def reset(self) -> None:
        """Forget every sequence (the cache of finished responses stays)."""
        self.sequences.clear()

    def state(self) -> dict[str, float]:
        cache = self.cache
        return {"suffix_cache_responses": cache.num_responses, "suffix_cache_tokens": cache.num_tokens,
                "suffix_cache_bytes": cache.nbytes}

    def learn(self, token_ids: list[int], prompt_len: int) -> None:
        if len(token_ids) > prompt_len:
            self.cache.add(token_ids[prompt_len:])

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [self._propose(r) if r.k > 0 and len(r.token_ids) >= 2 else Proposal([])
                for r in requests]

    def _propose(self, r: DraftRequest) -> Proposal:
        """The better continuation of the two stores'; its score (the sum of its cumulative
        probabilities) is the expected accepted length, if the counts were the truth."""
        seq = self.sequences.get(r.seq_id) or _Sequence()
        own = seq.sync(r.token_ids)  # the sequence, then SEP
        context = own[:-1]
        last = int(context[-1])
        best: list[int] = []
        best_parents: list[int] | None = None
        best_score = 0.0
        # (store, where the context's last `length` tokens end in it, length)
        stores = [(own, np.flatnonzero(own[:-2] == last), 1)]  # not the suffix itself, at the end
        if self.cache.num_responses:
            stores.append((self.cache.view(), self.cache.ends(int(context[-2]), last), 2))
        for store, ends, length in stores:
            if ends.size == 0:
                continue
            length, ends = match(store, ends, context, self.options.max_match_tokens, length)
            limit = min(r.k, math.floor(self.options.match_factor * length + self.options.match_offset))
            if self.options.tree:  # up to K nodes, at most `limit` deep
                tokens, parents, probs = continuation_tree(store, ends, r.k, limit,
                                                           self.options.min_token_prob)
            else:
                (tokens, probs), parents = continuation(store, ends, limit, self.options.min_token_prob), None
            if sum(probs) > best_score:
                best, best_parents, best_score = tokens, parents, sum(probs)
        if not best:
            return Proposal([])
        return Proposal(best, expected_accepted=best_score, parents=best_parents)
