"""EAGLE proposer: a draft head that reads the target's hidden states (``draft_head.DraftHead``
of kind ``eagle``).

Head position t holds the pair ``(x_{t+1}, f_t)``: token t+1 and the target's final hidden
state at t. The engine sends, with each request, the target features that became final since
the last one (``DraftRequest.hidden``; it asks the target for them in the verify forward).
A sequence of n + 1 tokens whose target cache holds n of them has features f_0..f_{n-1}, so
the head catches up on pairs up to ``(x_n, f_{n-1})`` and its output there drafts x_{n+1}.
Each further draft feeds the head its own predicted feature with the token it just drafted.

State per sequence: a slot in the head's cache, the features received but not yet fed, and
``real``, how many pairs in the cache are built from real (not predicted) features. After
verification the cache is rolled back to ``real``; the next request brings the features of
the tokens the target kept. A sequence whose features were lost (a restarted draft actor)
cannot be caught up: the engine leaves it target-only (``Proposer.needs_hidden``).

With ``speculative.eagle.tree`` the head drafts a token tree instead of a chain (EAGLE-2's
dynamic tree, :mod:`~specserve.engine.drafts.tree_growth`): after the catch-up forward, each
level is one more forward of the head over the ``tree_topk`` best nodes of every row, each fed
with its parent's predicted feature and masked to its ancestors in the head's cache; the K
(the node budget) best-scored nodes are drafted. The head's tree nodes are predicted pairs, so
:meth:`commit` drops them as it drops a chain's.
"""

from __future__ import annotations

import itertools

import torch

from specserve.config import PROPOSER_OPTIONS
from specserve.engine.drafts.draft_model import DraftModelProposer
from specserve.engine.drafts.tree_growth import TreeGrowth
from specserve.engine.grammar import allocate_bitmask, masked
from specserve.engine.runtime.forward_batch import ForwardBatch, device_index, queued
from specserve.engine.step.proposal import DraftRequest, Proposal
from specserve.engine.step.sampling import compute_probs_rows, draft_view
from specserve.errors import InvalidRequestError

# speculative.eagle: its fields, bounds and defaults are the registry's (specserve.methods).
EagleOptions = PROPOSER_OPTIONS["eagle"]


class EagleProposer(DraftModelProposer):
    method = "eagle"
    needs_hidden = True
    CATCH_UP_BACKLOG = 16  # features waiting for a row that drafts nothing before they are fed

    def __init__(self, worker, options: EagleOptions | None = None) -> None:
        self.options = options or EagleOptions()
        super().__init__(worker, q_top_k=self.options.q_top_k)
        assert getattr(worker.runtime, "uses_features", False), "an EAGLE proposer needs an eagle head"
        self.pending: dict[int, list[torch.Tensor]] = {}  # seq_id -> features not yet fed
        self.real: dict[int, int] = {}                     # seq_id -> pairs from real features

    @classmethod
    def from_draft(cls, draft, *, target_vocab_size: int | None = None,
                   options: dict | None = None) -> EagleProposer:
        """The head drafts over the target's own embedding and LM head ids: no mapping."""
        return cls(draft, EagleOptions.model_validate(options or {}))

    def start(self, seq_id: int, seed: int) -> None:
        super().start(seq_id, seed)
        self.pending[seq_id], self.real[seq_id] = [], 0

    def fork(self, seq_id: int, parent_id: int, seed: int, num_tokens: int) -> None:
        """Afresh: the parent's head cache is built from features the new sequence receives
        anyway (the engine hands it the parent's prompt features); the head is one layer."""
        self.start(seq_id, seed)

    def finish(self, seq_id: int) -> None:
        super().finish(seq_id)
        self.pending.pop(seq_id, None)
        self.real.pop(seq_id, None)

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        slot = self.slots.get(seq_id)
        if slot is not None:  # drafted pairs used predicted features: drop them all
            self.worker.rollback(slot, min(self.worker.length(slot), self.real[seq_id]))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Draft for rows with ``k > 0``. Rows with ``k = 0`` only deliver features; once
        ``CATCH_UP_BACKLOG`` of them wait, they are fed to the head's cache (in the same
        forward as the drafting rows, output unused), so a sequence that goes without drafts
        for long holds its features in the cache it has anyway, not in a growing queue."""
        feeds: dict[int, tuple[list[int], torch.Tensor]] = {}
        silent: set[int] = set()  # rows fed only to catch up
        for i, r in enumerate(requests):
            if r.hidden is not None and len(r.hidden):
                self.pending[r.seq_id].append(r.hidden)
            backlog = sum(len(h) for h in self.pending[r.seq_id])
            if (r.k > 0 or backlog >= self.CATCH_UP_BACKLOG) and (feed := self._catch_up(r)) is not None:
                feeds[i] = feed
                if r.k == 0:
                    silent.add(i)
        if self.options.tree:
            return self._draft_trees(requests, feeds, silent)
        return self._draft(requests, feeds, silent)

    def _draft_trees(self, requests: list[DraftRequest],
                     feeds: dict[int, tuple[list[int], torch.Tensor]], silent: set[int]) -> list[Proposal]:
        """A tree of up to ``k`` nodes per fed row (module docstring): the catch-up forward,
        then one forward per level for every row still growing."""
        proposals = [Proposal([]) for _ in requests]
        if not feeds:
            return proposals
        rows = list(feeds)
        logits, root_features = self._forward_grouped([self.slots[requests[i].seq_id] for i in rows],
                                                      [feeds[i] for i in rows])
        trees: dict[int, TreeGrowth] = {}
        levels: dict[int, int] = {}
        matchers = {i: m for i in rows if i not in silent and (m := self._matcher(requests[i]))}
        roots = [(j, i) for j, i in enumerate(rows) if i not in silent]
        scored = self._logprobs_of([requests[i] for _, i in roots], [logits[j:j + 1] for j, _ in roots])
        for (j, i), root in zip(roots, scored):
            if i in matchers:
                root = self._within_grammar(root, matchers[i], [[]])
            trees[i] = TreeGrowth(root[0], root_features[j:j + 1], topk=self.options.tree_topk,
                                  budget=requests[i].k)
            levels[i] = self._levels(requests[i])
        while growing := [i for i in trees if trees[i].depth < levels[i] and trees[i].frontier]:
            paths = {i: [_path(trees[i], n) for n in trees[i].frontier] for i in growing if i in matchers}
            fed = [trees[i].feed() for i in growing]
            counts = [len(tokens) for tokens, _, _ in fed]
            out = self.worker.forward(ForwardBatch(
                [self.slots[requests[i].seq_id] for i in growing], [tokens for tokens, _, _ in fed],
                counts, trees=[parents for _, _, parents in fed],
                features=torch.cat([f for _, features, _ in fed for f in features]), hidden=True))
            scored = self._logprobs_of([requests[i] for i in growing], list(out.logits.split(counts)))
            for i, x, h in zip(growing, scored, out.hidden.split(counts)):
                if i in matchers:
                    x = self._within_grammar(x, matchers[i], paths[i])
                trees[i].expand(x, h.split(1))
        for i, tree in trees.items():
            tokens, parents = tree.proposal()
            proposals[i] = Proposal(tokens, parents=parents)
        return proposals

    def _within_grammar(self, logprobs: torch.Tensor, matcher, paths: list[list[int]]) -> torch.Tensor:
        """``logprobs`` (``[len(paths), V]``) with the tokens the grammar forbids after each
        row's path of tree tokens (from the row's output so far) at -inf: they are never
        drafted. The matcher is back where it started."""
        masks = allocate_bitmask(len(paths), self.vocab_size)
        for j, path in enumerate(paths):
            for token in path:  # (each was drawn under the mask: allowed)
                matcher.advance(token)
            try:
                matcher.fill_mask(masks, j)
            except InvalidRequestError:  # past its fuel: this row's tree grows free (_masks)
                masks[j] = -1
            finally:
                matcher.rollback(len(path))
        return masked(logprobs, masks)

    def _levels(self, r: DraftRequest) -> int:
        """How deep row ``r``'s tree grows: ``tree_depth``, no deeper than its budget can
        reach, and only as many levels as the head's cache has room for."""
        room = self.worker.max_seq_len - self.worker.length(self.slots[r.seq_id])
        return max(1, min(self.options.tree_depth, r.k, 1 + room // self.options.tree_topk))

    def _logprobs_of(self, reqs: list[DraftRequest], logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per row, the ``[m_i, V]`` log-probabilities its tree is scored by, its request's
        ``logit_bias`` and ``allowed_token_ids`` applied (:func:`draft_view`): the draft's
        softmax for greedy rows, its distribution after the request's temperature / min-p /
        top-k / top-p otherwise. The greedy rows in one softmax and the sampled ones in one
        transform: both act on each logits row alone, so a row gets the values it gets by
        itself, for one call instead of one per row and level."""
        out: list[torch.Tensor | None] = [None] * len(reqs)
        for picked in ([i for i, r in enumerate(reqs) if r.params.greedy],
                       [i for i, r in enumerate(reqs) if not r.params.greedy]):
            if not picked:
                continue
            x = [draft_view(self._to_target_vocab(logits[i]), reqs[i].params) for i in picked]
            if reqs[picked[0]].params.greedy:
                scored = torch.log_softmax(torch.cat(x), dim=-1).split([len(r) for r in x])
            else:
                scored = [p.log() for p in compute_probs_rows(x, [reqs[i].params for i in picked])]
            for i, rows in zip(picked, scored):
                out[i] = rows
        return out

    def _forward(self, slots: list[int], feeds: list[tuple[list[int], torch.Tensor]],
                 fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [t for t, _ in feeds]
        out = self.worker.forward(ForwardBatch(slots, tokens, [1] * len(feeds), fed=fed,
                                               features=torch.cat([f for _, f in feeds]), hidden=True))
        last = device_index(list(itertools.accumulate(len(t) for t in tokens)), out.hidden.device) - 1
        return out.logits, out.hidden[last]  # f-hat at each row's newest position

    def _catch_up(self, r: DraftRequest) -> tuple[list[int], torch.Tensor] | None:
        """The pairs from ``real`` up to the sequence's last token, or None while the target
        has not produced the features for them (the step that prefills the prompt)."""
        seq, n = r.seq_id, len(r.token_ids) - 1
        real = self.real[seq]
        have = real + sum(len(h) for h in self.pending[seq])
        if n <= real or have < n:
            return None
        features = torch.cat(self.pending[seq])
        use = n - real
        self.pending[seq] = [features[use:]] if use < len(features) else []
        self.real[seq] = n
        # Features arrive on the CPU from a remote target; the head may sit on a GPU. An
        # EAGLE-3 head fuses the target layers' states into its own feature first.
        head = self.worker.runtime  # (queued: a pageable copy would wait for the device)
        up = queued(features[:use], head.embed.weight.device).to(head.embed.weight.dtype)
        return r.token_ids[real + 1:n + 1], head.from_target(up)


def _path(tree: TreeGrowth, node: int) -> list[int]:
    """The tokens from the root's child down to ``node`` of a growing tree."""
    tokens = []
    while node >= 0:
        tokens.append(tree.nodes[node].token)
        node = tree.nodes[node].parent
    return tokens[::-1]
