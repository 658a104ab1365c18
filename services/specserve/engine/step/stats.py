"""Speculation statistics, kept apart from whoever exports them (logs, Prometheus, usage).

Per sequence and in total: drafts, draft tokens, accepted tokens, and accepted tokens per
draft position (position 0 is the first drafted token). From these:
acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.

Token trees add, per verified tree: its size (nodes drafted), the depth its
accepted path reached (0: no node kept), and for every accepted node its depth and its rank
among its siblings (0: the first drafted child of its parent): where a tree's acceptance
comes from, beyond the chain's first choice. For a tree, "position" above is the node's
index in the proposal (best first for the proposers here), so accepted_per_position counts
the accepted nodes by index.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from specserve.engine.runtime.token_tree import tree_children


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    tree_sizes: dict[int, int] = field(default_factory=dict)       # nodes -> trees verified
    tree_depths: dict[int, int] = field(default_factory=dict)      # accepted depth -> trees
    tree_ranks: dict[tuple[int, int], int] = field(default_factory=dict)  # (depth, rank) -> nodes

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int,
                tree: tuple[list[int], list[int]] | None = None) -> None:
        """Record one verified draft of one sequence (a row with no drafts is not a draft).
        ``tree``: ``(parents, accepted path)`` where the draft was a token tree."""
        if num_draft_tokens == 0:
            return
        assert 0 <= num_accepted_tokens <= num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        _add_ones(self.drafted_per_position, num_draft_tokens)
        if tree is None:
            _add_ones(self.accepted_per_position, num_accepted_tokens)
            return
        parents, path = tree
        self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for node in path:
            self.accepted_per_position[node] += 1
        _count(self.tree_sizes, len(parents))
        _count(self.tree_depths, len(path))
        for depth, rank in enumerate(sibling_ranks(parents, path), start=1):
            _count(self.tree_ranks, (depth, rank))

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        for mine, theirs in ((self.tree_sizes, other.tree_sizes), (self.tree_depths, other.tree_depths),
                             (self.tree_ranks, other.tree_ranks)):
            for key, n in theirs.items():
                _count(mine, key, n)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            **({"tree_sizes": dict(sorted(self.tree_sizes.items())),
                "tree_accepted_depths": dict(sorted(self.tree_depths.items())),
                "tree_accepted_ranks": {f"{d}:{r}": n for (d, r), n in sorted(self.tree_ranks.items())}}
               if self.tree_sizes else {}),
        }


def sibling_ranks(parents: list[int], path: list[int]) -> list[int]:
    """Each accepted node's rank among its siblings (0: its parent's first child), root side
    first. ``parents``: the tree (``token_tree``'s convention); ``path``: accepted nodes.

    >>> sibling_ranks([-1, -1, 0, 0, 1], [0, 3])
    [0, 1]
    """
    children = tree_children(parents)  # the sibling order verification tried them in
    return [children[parents[node] + 1].index(node) for node in path]


def _count(counts: dict, key, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def _add_ones(counts: list[int], n: int) -> None:
    """counts[0..n-1] += 1, growing the list as needed."""
    counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1


@dataclass
class StepTimes:
    """Wall time spent in each phase of the engine's steps (the cost model's c and v come
    from these, measured at the batch size the engine actually ran)."""

    steps: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    # steps with no prompt tokens in them, and their verify phase: a decode's or a verify's
    # forward as it ran while serving, apart from prefills that would swamp its mean
    decode_steps: int = 0
    decode_verify_s: float = 0.0

    def add(self, propose_s: float, verify_s: float, accept_s: float, *, decoding: bool = False) -> None:
        self.steps += 1
        self.propose_s += propose_s
        self.verify_s += verify_s
        self.accept_s += accept_s
        if decoding:
            self.decode_steps += 1
            self.decode_verify_s += verify_s

    def as_dict(self) -> dict:
        return {"steps": self.steps, "propose_s": round(self.propose_s, 4),
                "verify_s": round(self.verify_s, 4), "accept_s": round(self.accept_s, 4),
                "decode_steps": self.decode_steps, "decode_verify_s": round(self.decode_verify_s, 4)}


@dataclass
class EngineCounters:
    """Everything an engine counts since it started, in one place: its step fills it, and the
    unit reads it whole (:meth:`snapshot`: a copy, which crosses the Ray hop to the metrics hub
    inside a ``UnitSnapshot`` and answers ``/v1/units/stats``)."""

    spec: SpecStats = field(default_factory=SpecStats)               # every verified draft
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)  # ... per Proposal.source
    times: StepTimes = field(default_factory=StepTimes)
    k_counts: dict[int, int] = field(default_factory=dict)  # decoding sequence-steps per K drafted
    num_tree_drafts: int = 0      # verified drafts that were token trees (Proposal.parents)
    num_prefill_tokens: int = 0   # prompt tokens the target computed in prefill rows
    num_prefill_chunks: int = 0   # chunks prefilled (part of a prompt each; scheduler.py)
    num_forked_tokens: int = 0    # prompt tokens copied from a first sample instead (n > 1)
    num_preemptions: int = 0      # sequences sent back to wait for KV blocks (scheduler.py)
    num_draft_fallbacks: int = 0  # times the proposer stopped answering (draft_link.py)

    def observe(self, source: str, num_draft_tokens: int, num_accepted_tokens: int,
                tree: tuple[list[int], list[int]] | None, is_tree: bool) -> None:
        """One row's verified draft (:meth:`SpecStats.observe`), drafted by ``source``."""
        self.spec.observe(num_draft_tokens, num_accepted_tokens, tree)
        self.num_tree_drafts += is_tree
        if num_draft_tokens:
            self.by_proposer.setdefault(source, SpecStats()).observe(
                num_draft_tokens, num_accepted_tokens, tree)

    def count_k(self, k: int) -> None:
        _count(self.k_counts, k)

    def snapshot(self) -> EngineCounters:
        return copy.deepcopy(self)
