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
"""

from __future__ import annotations

import torch

from specserve.engine.proposers.base import DraftRequest, Proposal
from specserve.engine.proposers.draft_model import DraftModelProposer


class EagleProposer(DraftModelProposer):
    method = "eagle"
    needs_hidden = True
    CATCH_UP_BACKLOG = 16  # features waiting for a row that drafts nothing before they are fed

    def __init__(self, worker) -> None:
        super().__init__(worker)
        assert getattr(worker.runtime, "uses_features", False), "an EAGLE proposer needs an eagle head"
        self.pending: dict[int, list[torch.Tensor]] = {}  # seq_id -> features not yet fed
        self.real: dict[int, int] = {}                     # seq_id -> pairs from real features

    @classmethod
    def from_draft(cls, draft, *, target_vocab_size: int | None = None) -> EagleProposer:
        """The head drafts over the target's own embedding and LM head ids: no mapping."""
        return cls(draft)

    def start(self, seq_id: int, seed: int) -> None:
        super().start(seq_id, seed)
        self.pending[seq_id], self.real[seq_id] = [], 0

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
        return self._draft(requests, feeds, silent)

    def _forward(self, slots: list[int], feeds: list[tuple[list[int], torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [t for t, _ in feeds]
        logits, hidden = self.worker.runtime(
            self.worker.cache, slots, tokens, [1] * len(feeds),
            features=torch.cat([f for _, f in feeds]), return_hidden=True)
        last = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        return logits, hidden[last]  # f-hat at each row's newest position

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
        # Features arrive on the CPU from a remote target; the head may sit on a GPU.
        return r.token_ids[real + 1:n + 1], features[:use].to(self.worker.runtime.embed.weight)
