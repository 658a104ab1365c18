"""The speculative generation loop over a batch of sequences (continuous batching per step).

One :meth:`SpecDecodeEngine.step`:

1. admit waiting requests while KV slots are free;
2. **draft**: ask the proposer for up to K tokens per running sequence (K is capped so the
   step can neither overrun ``max_tokens`` nor the context);
3. **verify**: one target forward over each row's pending tokens plus its drafts, asking for
   logits at the last ``num_drafts + 1`` positions (ragged: every row its own length);
4. **accept**: the rejection sampler keeps a prefix of the drafts and adds one recovered or
   bonus token; tokens are appended one at a time through the stop checks (EOS, stop token
   ids, stop strings, max_tokens, context), so a stop inside a draft window truncates exactly
   where target-only decoding would have stopped;
5. **roll back** both caches to the tokens that are now final, and free finished slots.

Invariant between steps: a running sequence's target cache holds all of its tokens but the
last (``length == len(token_ids) - 1``); a new sequence's cache is empty and its first forward
is the prefill. Prefill rows run in forwards of their own so a long prompt never pads the
decode rows to its length.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specserve.config import SamplingParams
from specserve.engine.adaptive import Row, SpecLengthController
from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer
from specserve.engine.rejection_sampler import (
    RejectionOutput,
    greedy_rejection_sample,
    rejection_sample,
)
from specserve.engine.sampling import compute_probs, draw_exponential, make_generator, random_seed
from specserve.engine.stats import SpecStats, StepTimes
from specserve.engine.tokenizer import IncrementalDetokenizer
from specserve.engine.worker import ModelWorker
from specserve.errors import InvalidRequestError, ProposerUnavailable


@dataclass
class Sequence:
    seq_id: int
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    spec_len: int                     # K for this sequence (the most, when adaptive); 0 = off
    adaptive: bool                    # the controller picks K per step (up to spec_len)
    detokenizer: IncrementalDetokenizer
    seed: int                         # the request's, or a random one
    generator: torch.Generator
    slot: int = -1
    draft_attached: bool = False       # the proposer holds state for this sequence
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    num_emitted_tokens: int = 0        # output tokens already reported by step()
    k_counts: dict[int, int] = field(default_factory=dict)  # decode steps per K asked
    hidden: list[torch.Tensor] = field(default_factory=list)  # target features not yet sent

    @property
    def mean_speculation_length(self) -> float:
        steps = sum(self.k_counts.values())
        return sum(k * n for k, n in self.k_counts.items()) / steps if steps else 0.0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


@dataclass
class StepOutput:
    """What one step produced for one sequence (streaming reads these)."""

    seq_id: int
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stats: SpecStats
    k_counts: dict[int, int] | None = None  # on the last output: decode steps per K drafted
    mean_speculation_length: float = 0.0    # on the last output: mean K over decode steps


@dataclass
class Completion:
    """A finished sequence, for callers that do not stream."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats


class SpecDecodeEngine:
    """Drives a target :class:`ModelWorker` and an optional :class:`Proposer`."""

    def __init__(self, target: ModelWorker, tokenizer, *, eos_token_ids: frozenset[int],
                 proposer: Proposer | None = None, num_speculative_tokens: int = 4,
                 controller: SpecLengthController | None = None) -> None:
        assert num_speculative_tokens >= 1
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.needs_hidden = proposer is not None and proposer.needs_hidden
        self.num_speculative_tokens = num_speculative_tokens
        self.controller = controller if proposer is not None else None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.stats = SpecStats()
        self.times = StepTimes()
        self.draft_available = proposer is not None
        self.num_draft_fallbacks = 0       # times the proposer became unavailable
        self.k_counts: dict[int, int] = {}  # decoding sequence-steps per K drafted, since start
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.target.max_seq_len

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                    spec_len: int | None = None, adaptive: bool = False) -> int:
        """Queue a request; returns its sequence id. Refuses bad input before any state exists.

        ``spec_len``: K for this request (0 turns speculation off); default the engine's K.
        ``adaptive``: let the controller (if any) pick K per step, at most ``spec_len``.
        """
        self._validate(prompt_token_ids, spec_len)
        k = self.num_speculative_tokens if spec_len is None else spec_len
        seed = random_seed() if params.seed is None else params.seed
        seq = Sequence(
            seq_id=next(self._ids), prompt_len=len(prompt_token_ids),
            token_ids=list(prompt_token_ids), params=params,
            spec_len=k if self.proposer is not None else 0,
            adaptive=adaptive and self.controller is not None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop=params.stop),
            seed=seed, generator=make_generator(seed))
        self.waiting.append(seq)
        return seq.seq_id

    def _validate(self, prompt_token_ids: list[int], spec_len: int | None) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context length is "
                f"{self.max_model_len}, which must also leave room for at least one output token")
        vocab = self.target.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if spec_len is not None and not 0 <= spec_len <= 64:
            raise InvalidRequestError("num_speculative_tokens must be in [0, 64]")

    def abort(self, seq_id: int) -> bool:
        """Drop a request wherever it is; frees its slots. False if it is unknown or done."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                return True
        seq = self.running.get(seq_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self._release(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._admit()
        seqs = list(self.running.values())
        if not seqs:
            return []
        t0 = time.perf_counter()
        ks = self._plan(seqs)
        proposals = self._propose(seqs, ks)
        t1 = time.perf_counter()
        starts = [self.target.length(s.slot) for s in seqs]
        logits, hidden = self._verify(seqs, proposals)
        t2 = time.perf_counter()
        results = self._sample(seqs, proposals, logits)
        outputs = [self._advance(seq, prop, res, row)
                   for seq, prop, (res, row) in zip(seqs, proposals, results)]
        if hidden is not None:
            self._keep_hidden(seqs, starts, hidden)
        t3 = time.perf_counter()
        self.times.add(t1 - t0, t2 - t1, t3 - t2)
        if self.controller is not None:
            self._observe(seqs, ks, proposals, results, t1 - t0, t3 - t2)
        return outputs

    def _admit(self) -> None:
        while self.waiting and self.target.num_free_slots > 0:
            seq = self.waiting.popleft()
            seq.slot = self.target.allocate()
            self.running[seq.seq_id] = seq
            if seq.spec_len > 0 and self.draft_available:
                self._attach(seq)

    def _draft_len(self, seq: Sequence) -> int:
        """K for this step: at most the request's K, and never more than can be emitted.

        A step emits up to K + 1 tokens; they must fit in both ``max_tokens`` and the context.
        """
        remaining = self.max_model_len - len(seq.token_ids)
        if seq.params.max_tokens is not None:
            remaining = min(remaining, seq.params.max_tokens - len(seq.output_token_ids))
        return max(0, min(seq.spec_len, remaining - 1))

    def _plan(self, seqs: list[Sequence]) -> list[int]:
        """K per sequence for this step: its cap, or the controller's K for adaptive decoding
        rows (rows still in prefill draft at the controller's current K)."""
        caps = [self._draft_len(s) if s.draft_attached else 0 for s in seqs]
        decoding = [i for i, s in enumerate(seqs) if self.target.length(s.slot) > 0]
        ks = list(caps)
        if self.controller is not None:
            ks = [min(c, self.controller.k) if s.adaptive else c for s, c in zip(seqs, caps)]
            planned = self.controller.plan([
                Row(self.target.length(seqs[i].slot), caps[i], seqs[i].adaptive,
                    not seqs[i].params.greedy, seqs[i].spec_len if seqs[i].draft_attached else 0)
                for i in decoding])
            for i, k in zip(decoding, planned):
                ks[i] = k
        for i in decoding:
            k = ks[i]
            seqs[i].k_counts[k] = seqs[i].k_counts.get(k, 0) + 1
            self.k_counts[k] = self.k_counts.get(k, 0) + 1
        return ks

    def _observe(self, seqs, ks, proposals, results, propose_s: float, accept_s: float) -> None:
        """Feed the step's acceptance and phase costs to the controller."""
        ctl = self.controller
        asked = [k for k in ks if k > 0]
        if asked and self.draft_available:
            ctl.observe_propose(max(asked), len(asked), propose_s)
        for k, prop, (res, row) in zip(ks, proposals, results):
            ctl.observe_draft(k, len(prop.token_ids), int(res.num_accepted[row]))
        sampled = sum(len(p.token_ids) + 1 for s, p in zip(seqs, proposals) if not s.params.greedy)
        ctl.observe_accept(len(seqs), sampled, accept_s)

    def _keep_hidden(self, seqs: list[Sequence], starts: list[int],
                     hidden: list[torch.Tensor | None]) -> None:
        """Queue, for the proposer, the target features of the tokens that are now final
        (positions from the step's start to the cache length after rollback)."""
        for seq, start, rows in zip(seqs, starts, hidden):
            if rows is not None and seq.draft_attached and seq.finish_reason is None:
                seq.hidden.append(rows[:self.target.length(seq.slot) - start])

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        requests = [DraftRequest(s.seq_id, s.token_ids, k, s.params.temperature, s.params.top_k,
                                 s.params.top_p)
                    for s, k in zip(seqs, ks)]
        active = [i for i, r in enumerate(requests) if r.k > 0]
        if self.needs_hidden:  # features go out every step, drafting or not: none pile up here
            active = [i for i, s in enumerate(seqs) if requests[i].k > 0 or (s.draft_attached and s.hidden)]
            for i in active:
                if seqs[i].hidden:
                    requests[i].hidden = torch.cat(seqs[i].hidden)
                    seqs[i].hidden = []
        proposals = [Proposal([]) for _ in seqs]
        if active:
            try:
                drafted = self.proposer.propose([requests[i] for i in active])
            except ProposerUnavailable:
                self._draft_lost()
                return proposals  # this step is target-only; nobody's output changes
            for i, proposal in zip(active, drafted):
                assert len(proposal.token_ids) <= requests[i].k, "proposer drafted too many"
                proposals[i] = proposal
        return proposals

    # -- draft availability -----------------------------------------------------------------
    def _attach(self, seq: Sequence) -> None:
        try:
            self.proposer.start(seq.seq_id, seq.seed)
            seq.draft_attached = True
        except ProposerUnavailable:
            self._draft_lost()

    def _draft_lost(self) -> None:
        """The proposer stopped answering: decode target-only until :meth:`reattach_proposer`.
        Losslessness does not depend on the draft, so no request notices but in speed."""
        if self.draft_available:
            self.num_draft_fallbacks += 1
        self.draft_available = False
        for seq in self.running.values():
            seq.draft_attached = False
            seq.hidden = []

    def reattach_proposer(self) -> None:
        """The proposer is back (a restarted draft actor has no state): start every running
        sequence on it again; it catches up from the tokens on its first proposal. A proposer
        that reads target features cannot catch up on features it never got: sequences past
        their prefill stay target-only, new ones speculate."""
        self.draft_available = self.proposer is not None
        for seq in list(self.running.values()):
            lost = self.needs_hidden and self.target.length(seq.slot) > 0
            if seq.spec_len > 0 and not seq.draft_attached and self.draft_available and not lost:
                self._attach(seq)

    def _verify(self, seqs: list[Sequence], proposals: list[Proposal]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None]:
        """Target logits ``[num_drafts + 1, V]`` per row (``[num_drafts + 1]`` argmax ids when
        every row is greedy), and for a proposer that reads them the target's hidden states of
        every input token per row (None otherwise). Decode rows share one forward; prefill rows
        share one per input length, so no row is padded to a prompt's length."""
        argmax_only = all(s.params.greedy for s in seqs)
        want_hidden = self.needs_hidden and any(s.draft_attached for s in seqs)
        inputs = [s.token_ids[self.target.length(s.slot):] + p.token_ids
                  for s, p in zip(seqs, proposals)]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            key = 0 if self.target.length(s.slot) > 0 else len(inputs[i])  # 0: decode rows
            groups.setdefault(key, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        hidden: list[torch.Tensor | None] = [None] * len(seqs)
        for rows in groups.values():
            counts = [len(proposals[i].token_ids) + 1 for i in rows]
            t0 = time.perf_counter()
            result = self.target.forward([seqs[i].slot for i in rows], [inputs[i] for i in rows],
                                         counts, argmax_only, return_hidden=want_hidden)
            if self.controller is not None:
                tokens = sum(len(inputs[i]) for i in rows)
                attention = sum(len(inputs[i]) * (len(seqs[i].token_ids) + len(proposals[i].token_ids))
                                for i in rows)
                self.controller.observe_forward(len(rows), tokens, attention, time.perf_counter() - t0,
                                                len(rows) * max(len(inputs[i]) for i in rows))
            logits = result[0] if want_hidden else result
            for i, chunk in zip(rows, logits.split(counts)):
                out[i] = chunk
            if want_hidden:
                for i, chunk in zip(rows, result[1].split([len(inputs[i]) for i in rows])):
                    hidden[i] = chunk
        return out, hidden if want_hidden else None

    def _sample(self, seqs: list[Sequence], proposals: list[Proposal],
                logits: list[torch.Tensor]) -> list[tuple[RejectionOutput, int]]:
        """Run the rejection sampler on the greedy rows and on the sampled rows (one call
        each); returns, per sequence, its sampler output and its row in that output."""
        results: list[tuple[RejectionOutput, int] | None] = [None] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        for rows, fn in ((greedy, self._greedy_rows), (sampled, self._sampled_rows)):
            if rows:
                res = fn([seqs[i] for i in rows], [proposals[i] for i in rows],
                         [logits[i] for i in rows])
                for j, i in enumerate(rows):
                    results[i] = (res, j)
        return results

    @staticmethod
    def _greedy_rows(seqs, proposals, logits) -> RejectionOutput:
        drafts, num_drafts = _pad_drafts(proposals)
        k = drafts.shape[1]
        argmax = torch.stack([_pad_rows(x if x.ndim == 1 else x.argmax(dim=-1), k + 1, 0)
                              for x in logits])  # [B, K+1]
        return greedy_rejection_sample(drafts, num_drafts, argmax)

    @staticmethod
    def _sampled_rows(seqs, proposals, logits) -> RejectionOutput:
        drafts, num_drafts = _pad_drafts(proposals)
        bsz, k = drafts.shape
        counts = [x.shape[0] for x in logits]
        per_row = lambda values: torch.tensor(  # noqa: E731  one value per logits row
            [v for v, n in zip(values, counts) for _ in range(n)])
        probs = compute_probs(torch.cat(logits), per_row([s.params.temperature for s in seqs]),
                              per_row([s.params.top_k for s in seqs]),
                              per_row([s.params.top_p for s in seqs]))  # [sum(K_i + 1), V]
        vocab = probs.shape[-1]
        target_probs = torch.stack([_pad_rows(p, k + 1, 0.0) for p in probs.split(counts)])
        draft_probs = _draft_probs(proposals, drafts, k, vocab)
        # Each row draws exactly its own K uniforms, then its noise: independent of the batch.
        generators = [s.generator for s in seqs]
        uniform = torch.ones(bsz, k)
        for i, (g, n) in enumerate(zip(generators, num_drafts.tolist())):
            uniform[i, :n] = torch.rand(n, generator=g)
        noise = draw_exponential(generators, vocab)
        return rejection_sample(drafts, num_drafts, target_probs, draft_probs, uniform, noise)

    def _advance(self, seq: Sequence, proposal: Proposal, res: RejectionOutput,
                 row: int) -> StepOutput:
        """Append the emitted tokens through the stop checks, then roll caches back."""
        num_before = len(seq.token_ids)
        num_drafts = len(proposal.token_ids)
        num_accepted = int(res.num_accepted[row])
        seq.stats.observe(num_drafts, num_accepted)
        self.stats.observe(num_drafts, num_accepted)
        for token in res.emitted(row):
            seq.token_ids.append(token)
            seq.detokenizer.add(token)
            seq.finish_reason = self._stop_reason(seq, token)
            if seq.finish_reason:
                break
        if seq.finish_reason:
            self._release(seq)
        else:
            # Everything before the last emitted token is final; that token is fed next step.
            self.target.rollback(seq.slot, num_before + num_accepted)
            if seq.draft_attached:
                self._proposer_call(self.proposer.commit, seq.seq_id, num_before + num_accepted)
        new_tokens = seq.output_token_ids[seq.num_emitted_tokens:]
        seq.num_emitted_tokens += len(new_tokens)
        delta = seq.detokenizer.pop_delta(final=seq.finish_reason is not None)
        out = StepOutput(seq.seq_id, new_tokens, delta, seq.finish_reason, seq.stats)
        if seq.finish_reason is not None:
            out.k_counts, out.mean_speculation_length = dict(seq.k_counts), seq.mean_speculation_length
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) \
                or token in params.stop_token_ids or seq.detokenizer.stop_reason is not None:
            return "stop"
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length"
        if len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _release(self, seq: Sequence) -> None:
        self.running.pop(seq.seq_id, None)
        self.target.free(seq.slot)
        if seq.draft_attached:
            seq.draft_attached = False
            self._proposer_call(self.proposer.finish, seq.seq_id)

    def _proposer_call(self, method, *args) -> None:
        try:
            method(*args)
        except ProposerUnavailable:
            self._draft_lost()

    # -- convenience ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, spec_len: int | None = None, adaptive: bool = False) -> list[Completion]:
        """Run prompts to completion (tests, CLI, benchmarks); results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, spec_len=spec_len, adaptive=adaptive)
               for p, sp in zip(prompts, params_list)]
        wanted = set(ids)
        seqs = {s.seq_id: s for s in self.waiting if s.seq_id in wanted}
        done: dict[int, Completion] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finish_reason is not None:
                    s = seqs[out.seq_id]
                    done[out.seq_id] = Completion(
                        s.seq_id, s.token_ids[:s.prompt_len], s.output_token_ids,
                        s.detokenizer.text, out.finish_reason, s.stats)
        return [done[i] for i in ids]


def _pad_drafts(proposals: list[Proposal]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, K]`` draft ids (padded with 0) and ``[B]`` counts."""
    k = max(len(p.token_ids) for p in proposals)
    drafts = torch.zeros(len(proposals), k, dtype=torch.long)
    for i, p in enumerate(proposals):
        drafts[i, : len(p.token_ids)] = torch.tensor(p.token_ids, dtype=torch.long)
    return drafts, torch.tensor([len(p.token_ids) for p in proposals])


def _pad_rows(x: torch.Tensor, n: int, value) -> torch.Tensor:
    """Pad dim 0 of ``x`` to ``n`` rows with ``value``."""
    if x.shape[0] == n:
        return x
    pad = x.new_full((n - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, pad])


def _draft_probs(proposals: list[Proposal], drafts: torch.Tensor, k: int,
                 vocab: int) -> torch.Tensor | None:
    """``[B, K, V]`` q for model proposers; None when every proposal is deterministic.
    A deterministic row inside a model batch (no probs) gets its one-hot q."""
    if all(p.probs is None for p in proposals):
        return None
    q = torch.zeros(len(proposals), k, vocab)
    for i, p in enumerate(proposals):
        n = len(p.token_ids)
        if p.probs is not None:
            q[i, :n] = p.probs
        elif n:
            q[i, torch.arange(n), drafts[i, :n]] = 1.0
    return q
