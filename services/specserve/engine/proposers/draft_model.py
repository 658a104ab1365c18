"""Draft-model proposer: a smaller model of the same tokenizer, with its own slot cache.

Each step it catches its cache up with the sequence (the tokens the target accepted since the
last step, the first time the whole prompt), then decodes K tokens one at a time, sampling
from q, the same temperature / top-k / top-p transform the target uses (argmax for greedy).
After verification the coordinator calls :meth:`commit` with how many tokens are final and
the cache is rolled back to that, so a rejected draft never leaks into the next proposal.
"""

from __future__ import annotations

import torch

from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer
from specserve.engine.sampling import compute_probs, draft_seed, draw_exponential, make_generator, sample_from
from specserve.engine.worker import ModelWorker


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker
        self.slots: dict[int, int] = {}  # seq_id -> slot in the draft cache
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> the draft's own sampler

    def start(self, seq_id: int, seed: int) -> None:
        self.slots[seq_id] = self.worker.allocate()
        self.generators[seq_id] = make_generator(draft_seed(seed))

    def finish(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        self.generators.pop(seq_id, None)
        if slot is not None:
            self.worker.free(slot)

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        slot = self.slots.get(seq_id)
        if slot is None:  # a restarted draft actor never saw this sequence; nothing to drop
            return
        self.worker.rollback(slot, min(self.worker.length(slot), num_valid_tokens))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        # The first forward catches each cache up with its sequence; later ones feed the draft.
        return self._draft(requests, {i: (r.token_ids[self.worker.length(self.slots[r.seq_id]):], None)
                                      for i, r in enumerate(requests) if r.k > 0})

    def _draft(self, requests: list[DraftRequest], feeds: dict[int, tuple[list[int], torch.Tensor | None]],
               silent: frozenset[int] | set[int] = frozenset()) -> list[Proposal]:
        """Decode from ``feeds`` (row -> its input tokens and features, None for a model that
        reads none) until every fed row has its ``k`` drafts; ``silent`` rows are fed once and
        draft nothing. Each draft feeds back its token (and the model's predicted feature)."""
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        while feeds:
            rows = list(feeds)
            logits, predicted = self._forward([self.slots[requests[i].seq_id] for i in rows],
                                              [feeds[i] for i in rows])
            tokens, row_probs = self._sample([requests[i] for i in rows], logits)
            feeds = {}
            for j, i in enumerate(rows):
                if i in silent:
                    continue
                drafts[i].append(tokens[j])
                if row_probs[j] is not None:
                    probs[i].append(row_probs[j])
                if len(drafts[i]) < requests[i].k:
                    feeds[i] = ([tokens[j]], None if predicted is None else predicted[j:j + 1])
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _forward(self, slots: list[int], feeds: list[tuple[list[int], torch.Tensor | None]]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[n, V]`` after each row's last fed token, and the features to feed with
        the next drafts (None: this model reads no features)."""
        return self.worker.forward(slots, [tokens for tokens, _ in feeds], [1] * len(feeds)), None

    def _sample(self, requests: list[DraftRequest],
                logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row: argmax for greedy rows, a sample from q otherwise."""
        tokens = logits.argmax(dim=-1).tolist()
        row_probs: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [j for j, r in enumerate(requests) if r.temperature > 0]
        if sampled:
            reqs = [requests[j] for j in sampled]
            q = compute_probs(logits[sampled], torch.tensor([r.temperature for r in reqs]),
                              torch.tensor([r.top_k for r in reqs]),
                              torch.tensor([r.top_p for r in reqs]))  # [n, V]
            noise = draw_exponential([self.generators[r.seq_id] for r in reqs], q.shape[-1])
            picks = sample_from(q, noise)
            for n, j in enumerate(sampled):
                tokens[j], row_probs[j] = int(picks[n]), q[n]
        return tokens, row_probs
