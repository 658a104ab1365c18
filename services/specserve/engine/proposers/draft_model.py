"""Draft-model proposer: a smaller model of the same tokenizer, with its own slot cache.

Each step it catches its cache up with the sequence (the tokens the target accepted since the
last step, the first time the whole prompt), then decodes K tokens one at a time, sampling
from q, the same temperature / top-k / top-p transform the target uses (argmax for greedy).
After verification the coordinator calls :meth:`commit` with how many tokens are final and
the cache is rolled back to that, so a rejected draft never leaks into the next proposal.

Sampling noise is fixed by the request's seed and the drafted token's position
(:mod:`~specserve.engine.sampling`): the target's own noise for seeded requests (verified
drafter-invariantly, so the draft agrees with the target as often as shared noise allows),
a stream of its own otherwise (the rejection test needs q's samples independent of p's).

Vocabularies: a draft may have more or fewer embedding rows than the target while sharing its
tokenizer (Qwen2.5-0.5B has 151936, Qwen2.5-7B 152064: padding). Drafting is done over the
target's ids: draft logits beyond the target's vocabulary are dropped before sampling and ids
the draft lacks get probability 0, so q is a distribution over exactly the ids the target
verifies and the rejection test stays exact.
"""

from __future__ import annotations

import torch

from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer
from specserve.engine.sampling import DRAFT, NOISE, compute_probs, position_noise, sample_from
from specserve.engine.worker import ModelWorker


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, worker: ModelWorker, target_vocab_size: int | None = None) -> None:
        self.worker = worker
        self.vocab_size = target_vocab_size or worker.vocab_size  # ids the target verifies
        self.slots: dict[int, int] = {}  # seq_id -> slot in the draft cache
        self.seeds: dict[int, int] = {}  # seq_id -> the request's seed

    @classmethod
    def from_draft(cls, draft: ModelWorker, *, target_vocab_size: int | None = None,
                   options: dict | None = None) -> DraftModelProposer:
        return cls(draft, target_vocab_size=target_vocab_size)

    def start(self, seq_id: int, seed: int) -> None:
        self.finish(seq_id)  # a sequence started again (a re-attached draft) keeps one slot
        self.slots[seq_id] = self.worker.allocate()
        self.seeds[seq_id] = seed

    def finish(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        self.seeds.pop(seq_id, None)
        if slot is not None:
            self.worker.free(slot)

    def reset(self) -> None:
        for seq_id in list(self.slots):
            self.finish(seq_id)

    @property
    def num_slots_in_use(self) -> int:
        return len(self.slots)

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
            tokens, row_probs = self._sample([requests[i] for i in rows], logits,
                                             [len(requests[i].token_ids) + len(drafts[i]) for i in rows])
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
        # An id the draft's table lacks (one of the target's padding rows) is fed as id 0:
        # drafts after it are worse, never wrong (the target verifies them).
        limit = self.worker.vocab_size
        tokens = [[t if t < limit else 0 for t in ids] for ids, _ in feeds]
        return self.worker.forward(slots, tokens, [1] * len(feeds)), None

    def _sample(self, requests: list[DraftRequest], logits: torch.Tensor,
                positions: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row, for the token at ``positions[j]``: argmax for greedy rows,
        a sample from q otherwise (with q itself for the rejection test of unseeded rows)."""
        logits = self._to_target_vocab(logits)  # [n, V_target]
        tokens = logits.argmax(dim=-1).tolist()
        row_probs: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [j for j, r in enumerate(requests) if r.temperature > 0]
        if sampled:
            reqs = [requests[j] for j in sampled]
            q = compute_probs(logits[sampled], torch.tensor([r.temperature for r in reqs]),
                              torch.tensor([r.top_k for r in reqs]),
                              torch.tensor([r.top_p for r in reqs]))  # [n, V_target]
            noise = torch.stack([position_noise(self.seeds[r.seq_id], positions[j], q.shape[-1],
                                                NOISE if r.seeded else DRAFT)
                                 for r, j in zip(reqs, sampled)])
            picks = sample_from(q, noise)
            for n, (r, j) in enumerate(zip(reqs, sampled)):
                tokens[j] = int(picks[n])
                row_probs[j] = None if r.seeded else q[n]
        return tokens, row_probs

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V_draft]`` -> ``[n, V_target]``: extra rows dropped, missing ones -inf."""
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[:, :self.vocab_size]
        if extra > 0:
            return torch.cat([logits, logits.new_full((logits.shape[0], extra), float("-inf"))], dim=-1)
        return logits
