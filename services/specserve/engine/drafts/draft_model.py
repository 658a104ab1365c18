"""Draft-model proposer: a smaller model of the same tokenizer, with its own KV cache.

Each step it catches its cache up with the sequence (the tokens the target accepted since the
last step, the first time the whole prompt), then decodes K tokens one at a time, sampling
from q, the same temperature / top-k / top-p transform the target uses (argmax for greedy).
After verification the coordinator calls :meth:`commit` with how many tokens are final and
the cache is rolled back to that, so a rejected draft never leaks into the next proposal.

For unseeded sampled requests q is the draft's distribution truncated to its ``q_top_k``
likeliest ids and renormalised (``speculative.draft_model.q_top_k``): the draft samples from
exactly that and sends only those ids and probabilities (:class:`~.base.TopK`), so the
rejection test is exact and a drafted token costs ``8 * q_top_k`` bytes on the wire instead
of ``4 * V``. Greedy and seeded rows send token ids only.

Sampling noise is fixed by the request's seed and the drafted token's position
(:mod:`~specserve.engine.step.sampling`): the target's own noise for seeded requests (verified
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

from specserve.config import PROPOSER_OPTIONS
from specserve.engine.drafts.base import Proposer
from specserve.engine.grammar import GrammarCompiler, Matcher, allocate_bitmask, masked
from specserve.engine.runtime.forward_batch import ForwardBatch, queued, row_index
from specserve.engine.runtime.kernels import argmax
from specserve.engine.step.penalties import DraftCounts
from specserve.engine.step.proposal import DraftRequest, Proposal, TopK
from specserve.engine.step.sampling import (
    DRAFT,
    NOISE,
    compute_probs_each,
    draft_view,
    exponential_noise,
    noise_key,
    sample_from,
)
from specserve.engine.worker import ModelWorker
from specserve.errors import InvalidRequestError

# speculative.draft_model: its fields, bounds and defaults are the registry's (specserve.methods).
DraftModelOptions = PROPOSER_OPTIONS["draft_model"]


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, worker: ModelWorker, target_vocab_size: int | None = None, *,
                 q_top_k: int = DraftModelOptions().q_top_k) -> None:
        self.worker = worker
        self.vocab_size = target_vocab_size or worker.vocab_size  # ids the target verifies
        self.q_top_k = q_top_k
        self.slots: dict[int, int] = {}  # seq_id -> slot in the draft cache
        self.seeds: dict[int, int] = {}  # seq_id -> the request's seed
        self.grammars: GrammarCompiler | None = None  # use_grammars
        self.matchers: dict[int, Matcher] = {}  # seq_id -> its grammar's state after its output

    @classmethod
    def from_draft(cls, draft: ModelWorker, *, target_vocab_size: int | None = None,
                   options: dict | None = None) -> DraftModelProposer:
        q_top_k = DraftModelOptions.model_validate(options or {}).q_top_k
        return cls(draft, target_vocab_size=target_vocab_size, q_top_k=q_top_k)

    def warm_up(self) -> dict:
        return self.worker.warm_up()

    def start(self, seq_id: int, seed: int) -> None:
        self.finish(seq_id)  # a sequence started again (a re-attached draft) keeps one slot
        self.slots[seq_id] = self.worker.allocate()
        self.seeds[seq_id] = seed

    def fork(self, seq_id: int, parent_id: int, seed: int, num_tokens: int) -> None:
        """Start ``seq_id`` with a copy of the parent's cache over its first ``num_tokens``
        tokens, as far as the draft has them (the rest it catches up on as usual)."""
        self.start(seq_id, seed)
        parent = self.slots.get(parent_id)
        if parent is not None:
            self.worker.fork(parent, self.slots[seq_id], min(self.worker.length(parent), num_tokens))

    def use_grammars(self, compiler: GrammarCompiler | None) -> None:
        self.grammars = compiler
        self.matchers.clear()

    def finish(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        self.seeds.pop(seq_id, None)
        self.matchers.pop(seq_id, None)
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
        draft nothing. Each draft feeds back its token (and the model's predicted feature).
        A row with a grammar draws each draft under the grammar's mask (its q is the masked
        distribution), so its drafts stay within what the target may emit: the grammar
        follows each token on the host. Without one the chain stays on the device
        (:meth:`_draft_on_device`)."""
        matchers = {i: m for i in feeds if i not in silent and (m := self._matcher(requests[i]))}
        pens = self._penalties(requests, feeds, silent)
        if not matchers:
            return self._draft_on_device(requests, feeds, silent, pens)
        drafts: list[list[int]] = [[] for _ in requests]
        qs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in requests]
        try:
            while feeds:
                rows = list(feeds)
                logits, predicted = self._forward_grouped([self.slots[requests[i].seq_id] for i in rows],
                                                          [feeds[i] for i in rows])
                masks = self._masks(requests, rows, matchers, drafts)
                tokens, top = self._draw([requests[i] for i in rows], logits,
                                         [len(requests[i].token_ids) + len(drafts[i]) for i in rows],
                                         masks, [pens.get(i) for i in rows])
                tokens, row_q = tokens.tolist(), _row_q(len(rows), top)
                feeds = {}
                for j, i in enumerate(rows):
                    if i in silent:
                        continue
                    if i in matchers:
                        if not matchers[i].accepts(tokens[j]):  # (a mask the draft cannot meet)
                            continue
                        matchers[i].advance(tokens[j])
                    drafts[i].append(tokens[j])
                    if row_q[j] is not None:
                        qs[i].append(row_q[j])
                    if len(drafts[i]) < requests[i].k:
                        feeds[i] = ([tokens[j]], None if predicted is None else predicted[j:j + 1])
        finally:  # the grammar's state is the output's again: drafts are only proposals
            for i, matcher in matchers.items():
                matcher.rollback(len(drafts[i]))
        return _proposals(drafts, qs)

    def _draft_on_device(self, requests: list[DraftRequest],
                         feeds: dict[int, tuple[list[int], torch.Tensor | None]],
                         silent: frozenset[int] | set[int],
                         pens: dict[int, DraftCounts]) -> list[Proposal]:
        """:meth:`_draft` without grammars: each drawn token is fed to the next forward where
        it was drawn (``ForwardBatch.fed``), and the drafts (and unseeded rows' q) are read
        back once at the end (on a GPU the host does not wait for the device once per draft
        token). Without a grammar a row drafts exactly its ``k`` tokens, so
        which rows run each forward is known on the host without reading a token."""
        rows, fed, drawn = list(feeds), None, []
        while rows:
            logits, predicted = self._forward_grouped([self.slots[requests[i].seq_id] for i in rows],
                                                      [feeds[i] for i in rows], fed)
            tokens, top = self._draw([requests[i] for i in rows], logits,
                                     [len(requests[i].token_ids) + len(drawn) for i in rows],
                                     pens=[pens.get(i) for i in rows])
            drawn.append((rows, tokens, top))
            keep = [j for j, i in enumerate(rows) if i not in silent and requests[i].k > len(drawn)]
            feeds = {rows[j]: ([0], None if predicted is None else predicted[j:j + 1]) for j in keep}
            fed = tokens[row_index(keep, len(rows), tokens.device)] if keep else None
            rows = [rows[j] for j in keep]
        drafts: list[list[int]] = [[] for _ in requests]
        qs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in requests]
        if not drawn:
            return _proposals(drafts, qs)
        tops = [top for _, _, top in drawn if top is not None]
        tokens = torch.cat([t for _, t, _ in drawn]).tolist()  # the one read of the drafts
        ids = torch.cat([i for _, i, _ in tops]).cpu() if tops else None
        probs = torch.cat([p for _, _, p in tops]).cpu() if tops else None
        at = have = 0
        for rows, _, top in drawn:
            row_q = _row_q(len(rows), top and (top[0], ids[have:have + len(top[0])],
                                               probs[have:have + len(top[0])]))
            for j, i in enumerate(rows):
                if i not in silent:
                    drafts[i].append(tokens[at + j])
                    if row_q[j] is not None:
                        qs[i].append(row_q[j])
            at, have = at + len(rows), have + (len(top[0]) if top else 0)
        return _proposals(drafts, qs)

    def _matcher(self, r: DraftRequest) -> Matcher | None:
        """Row ``r``'s grammar state after its output so far (None: no grammar, or none this
        proposer can follow: it then drafts freely and the coordinator cuts what is forbidden)."""
        if r.grammar is None or self.grammars is None or r.k == 0:
            return None
        matcher = self.matchers.get(r.seq_id)
        output = r.token_ids[r.output_start:]
        try:
            if matcher is None or matcher.spec != r.grammar or matcher.num_tokens > len(output):
                matcher = self.matchers[r.seq_id] = self.grammars.compile(r.grammar).matcher()
            for token in output[matcher.num_tokens:]:
                matcher.advance(token)
        except (InvalidRequestError, ValueError):
            self.matchers.pop(r.seq_id, None)
            return None
        return matcher

    def _masks(self, requests: list[DraftRequest], rows: list[int], matchers: dict[int, Matcher],
               drafts: list[list[int]]) -> torch.Tensor | None:
        """``[len(rows), W]`` packed masks of this draft position (all-allowed for free rows).
        A grammar too costly to follow here (past its fuel) frees its row, here only: the
        coordinator's own mask fails that request alone, and the draft keeps drafting."""
        if not any(i in matchers for i in rows):
            return None
        masks = allocate_bitmask(len(rows), self.vocab_size)
        masks.fill_(-1)
        for j, i in enumerate(rows):
            if i in matchers:
                try:
                    matchers[i].fill_mask(masks, j)
                except InvalidRequestError:
                    matchers.pop(i).rollback(len(drafts[i]))
                    self.matchers.pop(requests[i].seq_id, None)
                    masks[j] = -1
        return masks

    # Rows feeding at most this many tokens (a step's catch-up: the accepted drafts and the
    # bonus token) share a forward; a longer feed (a new sequence's prompt) goes in its own,
    # per length, so it never pads the others to its length (memory: docs/MEMORY.md).
    SHORT_FEED = 16

    def _forward_grouped(self, slots: list[int], feeds: list[tuple[list[int], torch.Tensor | None]],
                         fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_forward` over ``feeds``, in forwards grouped by length (``SHORT_FEED``);
        the outputs in the order of ``feeds``. ``fed``: each row's one token, on the device
        (the feeds hold placeholders): one forward."""
        groups: dict[int, list[int]] = {}
        for j, (tokens, _) in enumerate(feeds):
            groups.setdefault(0 if len(tokens) <= self.SHORT_FEED else len(tokens), []).append(j)
        if len(groups) == 1:
            return self._forward(slots, feeds, fed)
        assert fed is None
        outs = [self._forward([slots[j] for j in rows], [feeds[j] for j in rows])
                for rows in groups.values()]
        order = torch.tensor([j for rows in groups.values() for j in rows])
        back = queued(order.argsort(), outs[0][0].device)  # row j's place in the groups' order
        logits = torch.cat([x for x, _ in outs])[back]
        features = None if outs[0][1] is None else torch.cat([f for _, f in outs])[back]
        return logits, features

    def _forward(self, slots: list[int], feeds: list[tuple[list[int], torch.Tensor | None]],
                 fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[n, V]`` after each row's last fed token (``fed``: those tokens on the
        device), and the features to feed with the next drafts (None: this model reads none)."""
        # An id the draft's table lacks (one of the target's padding rows) is fed as id 0:
        # drafts after it are worse, never wrong (the target verifies them).
        limit = self.worker.vocab_size
        tokens = [[t if t < limit else 0 for t in ids] for ids, _ in feeds]
        if fed is not None:
            fed = torch.where(fed < limit, fed, 0)
        return self.worker.forward(ForwardBatch(slots, tokens, fed=fed)).logits, None

    def _penalties(self, requests: list[DraftRequest], feeds: dict, silent) -> dict[int, DraftCounts]:
        """The penalty counts of the rows that draft under penalties (``penalties.py``)."""
        device = self.worker.runtime.embed.weight.device
        return {i: DraftCounts(r.params, r.token_ids, r.output_start, self.vocab_size, device)
                for i, r in enumerate(requests) if i in feeds and i not in silent and r.params.penalized}

    def _draw(self, requests: list[DraftRequest], logits: torch.Tensor, positions: list[int],
              masks: torch.Tensor | None = None, pens: list[DraftCounts | None] | None = None
              ) -> tuple[torch.Tensor, tuple[list[int], torch.Tensor, torch.Tensor] | None]:
        """One draft token per row, for the token at ``positions[j]``, on the device: argmax
        for greedy rows, a sample from q otherwise: seeded rows from the full q with the
        target's noise, unseeded ones from q's top ``q_top_k`` (renormalised). Returns the
        ``[n]`` tokens and, where unseeded rows drew, ``(their rows, [m, k] ids, [m, k] probs)``:
        that q, for the rejection test. The logits are the target's way first: the request's
        bias, its penalties (``pens``: each row's counts, which count the token it draws),
        ``masks`` (grammar masks, ``[n, W]`` packed)."""
        logits = self._biased(requests, self._to_target_vocab(logits))  # [n, V_target]
        pens = pens or [None] * len(requests)
        if any(pens):
            logits = torch.cat([x if pen is None else pen.apply(x)
                                for x, pen in zip(logits.split(1), pens)])
        if masks is not None:
            logits = masked(logits, masks)
        tokens, top = self._choose(requests, logits, positions)
        for j, pen in enumerate(pens):
            if pen is not None:
                pen.drew(tokens[j:j + 1])
        return tokens, top

    def _choose(self, requests: list[DraftRequest], logits: torch.Tensor, positions: list[int]
                ) -> tuple[torch.Tensor, tuple[list[int], torch.Tensor, torch.Tensor] | None]:
        """:meth:`_draw`'s tokens and q from its logits as the target would see them."""
        device = logits.device
        tokens = argmax(logits)
        sampled = [j for j, r in enumerate(requests) if not r.params.greedy]
        if not sampled:
            return tokens, None
        reqs, at = [requests[j] for j in sampled], row_index(sampled, len(requests), device)
        q = compute_probs_each(logits[at], [r.params for r in reqs])  # [n, V_target]
        # A seeded request is verified drafter-invariantly: its draft samples with the
        # target's noise of each position (``sampling.NOISE``) and sends no q.
        noise = exponential_noise([noise_key(self.seeds[r.seq_id], positions[j],
                                             NOISE if r.params.seed is not None else DRAFT)
                                   for r, j in zip(reqs, sampled)], q.shape[-1], device)  # [n, V_target]
        picks = sample_from(q, noise)                                       # seeded rows' tokens
        free = [n for n, r in enumerate(reqs) if r.params.seed is None]
        top = None
        if free:
            some = row_index(free, len(reqs), device)
            probs, ids = q[some].topk(min(self.q_top_k, q.shape[-1]), dim=-1)  # [m, k]
            probs = probs / probs.sum(dim=-1, keepdim=True)
            choice = sample_from(probs, noise[some].gather(1, ids))            # [m]
            picks[some] = ids.gather(1, choice[:, None])[:, 0]
            top = ([sampled[n] for n in free], ids, probs)
        tokens[at] = picks
        return tokens, top

    @staticmethod
    def _biased(requests: list[DraftRequest], logits: torch.Tensor) -> torch.Tensor:
        """Each row's logits with its request's ``logit_bias`` and ``allowed_token_ids``, as
        the target's will have them (:func:`draft_view`): a draft that draws from them
        proposes what the target keeps (a bias of 100 forcing a token is accepted instead of
        rejected), and its q is still what it drew from."""
        if not any(r.params.logit_bias or r.params.allowed_token_ids is not None for r in requests):
            return logits
        return torch.cat([draft_view(logits[j:j + 1], r.params) for j, r in enumerate(requests)])

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V_draft]`` -> ``[n, V_target]``: extra rows dropped, missing ones -inf."""
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[:, :self.vocab_size]
        if extra > 0:
            return torch.cat([logits, logits.new_full((logits.shape[0], extra), float("-inf"))], dim=-1)
        return logits


def _row_q(num_rows: int, top: tuple[list[int], torch.Tensor, torch.Tensor] | None
           ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per row of a draw, its q as CPU ``(ids, probs)``, or None (greedy and seeded rows)."""
    row_q: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_rows
    if top is not None:
        rows, ids, probs = top
        ids, probs = ids.cpu(), probs.cpu()
        for m, j in enumerate(rows):
            row_q[j] = (ids[m], probs[m])
    return row_q


def _proposals(drafts: list[list[int]], qs: list[list[tuple[torch.Tensor, torch.Tensor]]]
               ) -> list[Proposal]:
    return [Proposal(d, TopK(torch.stack([i for i, _ in q]), torch.stack([p for _, p in q]))
                     if q else None) for d, q in zip(drafts, qs)]
