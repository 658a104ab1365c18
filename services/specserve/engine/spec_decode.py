"""The speculative generation loop over a batch of sequences (continuous batching per step).

One :meth:`SpecDecodeEngine.step` (this module schedules it; where a piece lives elsewhere,
the step names the module):

1. admit waiting requests while KV slots are free;
2. **draft**: ask the proposer (``proposers/``) for up to K tokens per running sequence (K is
   capped so the step can neither overrun ``max_tokens`` nor the context; for adaptive
   requests the controller of ``adaptive.py`` picks K under that cap);
3. **verify**: one target forward over each row's pending tokens plus its drafts, with
   logits at the last ``num_draft_tokens + 1`` positions (ragged: every row its own length),
   and ``verification.py`` turning those logits and the proposals into the tokens each row
   emits (the rejection sampler of ``rejection_sampler.py`` keeps a prefix of the drafts and
   adds one recovered or bonus token). Both happen in the target's ``verify``
   (``worker.py``), where the logits are: on a tensor-parallel group that is rank 0, and
   only the emitted tokens come back;
4. **accept**: ``Sequence.append_tokens`` (``sequence.py``)
   appends them one at a time through the stop checks (EOS, stop token ids, stop strings,
   max_tokens, context), so a stop inside a draft window truncates exactly where
   target-only decoding would have stopped;
5. **roll back** both caches to the tokens that are now final, and free finished slots.

**One request's fault stays its own.** If a step raises anything but
:class:`~specserve.errors.TargetUnavailable` (a dead rank or a step timeout, which only the
unit can answer, by restarting the group), the caches are put back as they were before the
step and each of its rows is stepped again alone: a row that fails alone ends with its error
(:attr:`StepOutput.error`), the others go on as if nothing had happened.

**n samples of one prompt share its prefill** (:meth:`SpecDecodeEngine.add_parallel`). The
request takes its n slots at once; the first sample prefills as any request does, and right
after that verify the others start from copies of its caches over the prompt but its last
token (``fork`` on the target, which a tensor-parallel group applies on every rank with its
next forward, and on the proposer: a draft model's cache too). Each then feeds the last prompt
token itself, as a decoding row does, and samples its first token with its own seed. The
prompt is computed once (``num_prefill_tokens``; ``num_forked_tokens`` counts what was copied).

Invariant between steps: a running sequence's target cache holds all of its tokens but the
last (``length == len(token_ids) - 1``); a new sequence's cache is empty and its first forward
is the prefill. A step is one target forward: the rows in groups, each padded to its own
longest row (``LlamaRuntime.forward``'s ``groups``), so a prompt's prefill or chunk never
pads the decode rows to its length, and a running stream never waits for a second forward.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch

from specserve.config import SamplingParams
from specserve.engine.adaptive import Row, SpecLengthController
from specserve.engine.grammar import CompiledGrammar, GrammarCompiler
from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer
from specserve.engine.sampling import random_seed
from specserve.engine.scheduler import BudgetRow, StepPlan, layout_forward, newest_preemptable, plan_step
from specserve.engine.sequence import Completion, Sequence, StepOutput
from specserve.engine.stats import SpecStats, StepTimes
from specserve.engine.tokenizer import IncrementalDetokenizer
from specserve.engine.verification import Verdict
from specserve.engine.worker import ModelWorker, Verified
from specserve.errors import (
    ConfigError,
    InvalidRequestError,
    ProposerUnavailable,
    RequestFailed,
    TargetUnavailable,
)

log = logging.getLogger(__name__)


class SpecDecodeEngine:
    """Drives a target :class:`ModelWorker` and an optional :class:`Proposer`."""

    def __init__(self, target: ModelWorker, tokenizer, *, eos_token_ids: frozenset[int],
                 proposer: Proposer | None = None, num_speculative_tokens: int = 4,
                 controller: SpecLengthController | None = None,
                 chunked_prefill_size: int | None = None) -> None:
        assert num_speculative_tokens >= 1
        self.chunked_prefill_size = chunked_prefill_size  # chunked prefill (scheduler.py)
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.needs_hidden = proposer is not None and proposer.needs_hidden
        self.num_speculative_tokens = num_speculative_tokens
        self.controller = controller if proposer is not None else None
        if self.controller is not None:
            self.controller.k_source = proposer.method  # K governs it (adaptive.py)
        if proposer is not None and eos_token_ids:  # a model draft drafts within the grammar
            try:  # (the compiler reads the vocabulary at its first compile, not here)
                proposer.use_grammars(GrammarCompiler(tokenizer, target.vocab_size, eos_token_ids))
            except ConfigError as exc:
                log.warning("drafts will not follow structured outputs' grammars: %s", exc)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.stats = SpecStats()
        self.times = StepTimes()
        self.draft_available = proposer is not None
        self.num_draft_fallbacks = 0       # times the proposer became unavailable
        self.k_counts: dict[int, int] = {}  # decoding sequence-steps per K drafted, since start
        self.by_proposer: dict[str, SpecStats] = {}  # the stats per Proposal.source
        self.num_tree_drafts = 0  # verified drafts that were token trees (Proposal.parents)
        self.forks: dict[int, list[Sequence]] = {}  # a request's first sample -> its others
        self.num_prefill_tokens = 0  # prompt tokens the target computed in prefill rows
        self.num_prefill_chunks = 0  # chunks prefilled (part of a prompt; scheduler.py)
        self.num_forked_tokens = 0   # prompt tokens copied from a first sample instead (n > 1)
        self.num_preemptions = 0     # sequences sent back to wait for KV blocks (scheduler.py)
        # Fault injection (tests): a step whose rows include a prompt with this token raises,
        # as a request-caused failure would; only that request may fail.
        self.fault_token: int | None = None
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.target.max_seq_len

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                    num_speculative_tokens: int | None = None, adaptive: bool = False,
                    grammar: CompiledGrammar | None = None) -> int:
        """Queue a request; returns its sequence id. Refuses bad input before any state exists.

        ``num_speculative_tokens``: K for this request (0 turns speculation off); default the engine's K.
        ``adaptive``: let the controller (if any) pick K per step, at most ``num_speculative_tokens``.
        """
        return self.add_parallel(prompt_token_ids, params, 1, num_speculative_tokens=num_speculative_tokens,
                                 adaptive=adaptive, grammar=grammar)[0]

    def add_parallel(self, prompt_token_ids: list[int], params: SamplingParams, n: int, *,
                     num_speculative_tokens: int | None = None, adaptive: bool = False,
                     grammar: CompiledGrammar | None = None) -> list[int]:
        """Queue ``n`` samples of one prompt (OpenAI's ``n``); their sequence ids, in order
        (:attr:`StepOutput.index` says which is which). They share one prefill (module
        docstring). Sample i draws from seed ``params.seed + i``, so each is reproducible and
        equals the single request of that seed; unseeded ones get a random seed each.
        ``grammar``: a structured output's, which every sample's text follows (a matcher each)."""
        self._validate(prompt_token_ids, num_speculative_tokens)
        if not 1 <= n <= self.target.num_slots:
            raise InvalidRequestError(f"n must be in [1, {self.target.num_slots}] (this unit's "
                                      "max_num_seqs: the samples run side by side)")
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        seqs = [Sequence(
            seq_id=next(self._ids), prompt_len=len(prompt_token_ids),
            token_ids=list(prompt_token_ids), params=params,
            num_speculative_tokens=k if self.proposer is not None else 0,
            adaptive=adaptive and self.controller is not None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop=params.stop),
            seed=random_seed() if params.seed is None else (params.seed + i) % 2**63, index=i,
            grammar=grammar.matcher() if grammar is not None else None)
            for i in range(n)]
        self.waiting.append(seqs[0])
        if n > 1:
            self.forks[seqs[0].seq_id] = seqs[1:]
        return [s.seq_id for s in seqs]

    def _validate(self, prompt_token_ids: list[int], num_speculative_tokens: int | None) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context length is "
                f"{self.max_model_len}, which must also leave room for at least one output token")
        vocab = self.target.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= 64:
            raise InvalidRequestError("num_speculative_tokens must be in [0, 64]")

    def abort(self, seq_id: int) -> bool:
        """Drop a request wherever it is; frees its slots. False if it is unknown or done.
        Aborting the first of ``n`` samples before its prefill was shared aborts the samples
        waiting for it (the API aborts all of a request's samples together)."""
        seq = next((s for s in self.waiting if s.seq_id == seq_id), None)
        if seq is not None:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        elif (seq := self.running.get(seq_id)) is not None:
            seq.finish_reason = "abort"
            self._release(seq)
        else:
            return self._abort_sibling(seq_id)
        for sibling in self.forks.pop(seq_id, []):
            sibling.finish_reason = "abort"
            if sibling.slot >= 0:
                self.target.free(sibling.slot)
        return True

    def _abort_sibling(self, seq_id: int) -> bool:
        """Abort a sample still waiting for its first to share the prefill."""
        for first, siblings in self.forks.items():
            for seq in siblings:
                if seq.seq_id == seq_id:
                    seq.finish_reason = "abort"
                    siblings.remove(seq)
                    if seq.slot >= 0:
                        self.target.free(seq.slot)
                    if not siblings:
                        del self.forks[first]
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)  # (a waiting sibling's first is in either)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._admit()
        seqs = list(self.running.values())
        if not seqs:
            return []
        chunks: list[tuple[Sequence, int]] = []
        try:
            seqs, plan = self._schedule(seqs)
            chunks = [(seqs[i], n) for i, n in plan.chunks]
            rows = [seqs[i] for i in plan.verify]
            if not rows:  # nothing to verify: the chunks alone
                self._prefill_chunks(chunks)
                return []
            return self._step(rows, chunks)
        except TargetUnavailable:
            raise
        except Exception:  # noqa: BLE001  whose fault? Each row alone tells (module docstring)
            log.exception("a step of %d rows failed; stepping each row alone", len(seqs))
            return self._step_alone(seqs, chunks)

    def _step_alone(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int]] = ()
                    ) -> list[StepOutput]:
        """After a failed step: restore the caches, then step every row on its own (a row
        that was prefilling a chunk, that chunk); a row that fails alone fails, with its
        error."""
        self._restore(seqs)
        chunk_of = {seq.seq_id: n for seq, n in chunks}
        outputs = []
        for seq in seqs:
            try:
                if seq.seq_id in chunk_of:
                    self._prefill_chunks([(seq, chunk_of[seq.seq_id])])
                else:
                    outputs += self._step([seq])
            except TargetUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001  this row's own fault
                log.exception("request %d failed alone; ending it", seq.seq_id)
                self._restore([seq])
                outputs += self._fail(seq, exc)
        return outputs

    def _restore(self, seqs: list[Sequence]) -> None:
        """Caches back to the step invariant: target and draft hold every token but the last
        (the drafts of the failed step are dropped)."""
        for seq in seqs:
            if seq.seq_id not in self.running:
                continue
            final = max(0, len(seq.token_ids) - 1)
            self.target.rollback(seq.slot, min(self.target.length(seq.slot), final))
            if seq.draft_attached:
                self._proposer_call(self.proposer.commit, seq.seq_id, final)

    def _fail(self, seq: Sequence, exc: Exception) -> list[StepOutput]:
        """End ``seq`` with ``exc`` (our own 4xx errors as they are, anything else a 500),
        and the samples that were to share its prefill with it."""
        if self.running.get(seq.seq_id) is seq:
            self._release(seq)
        error = exc if isinstance(exc, InvalidRequestError) else RequestFailed(
            "the server could not process this request")
        failed = [seq]
        for sibling in self.forks.pop(seq.seq_id, []):
            self.target.free(sibling.slot)
            failed.append(sibling)
        for s in failed:
            s.finish_reason = "error"
        return [StepOutput(s.seq_id, [], "", "error", s.stats, error=error, index=s.index)
                for s in failed]

    def _schedule(self, seqs: list[Sequence]) -> tuple[list[Sequence], StepPlan]:
        """The step's rows and plan (:meth:`_budget`). Where a paged cache lacks the blocks
        they need, the newest rows are preempted (:meth:`_preempt`) until it does not; the
        last row always runs (the pool holds a sequence of ``max_model_len``)."""
        plan = self._budget(seqs)
        while self._short_of_blocks(seqs, plan):
            victim = newest_preemptable([s.params.prompt_logprobs is None or not s.output_token_ids
                                         for s in seqs])  # prompt scores already sent: not again
            if victim is None:
                break
            self._preempt(seqs.pop(victim))
            plan = self._budget(seqs)
        return seqs, plan

    def _budget(self, seqs: list[Sequence]) -> StepPlan:
        """The step's prefill budget (:func:`~specserve.engine.scheduler.plan_step`)."""
        rows = [BudgetRow(True, 0) if self._decoding(s)
                else BudgetRow(s.params.prompt_logprobs is not None,  # scored whole, never chunked
                               len(s.token_ids) - self._held(s))
                for s in seqs]
        return plan_step(rows, self.chunked_prefill_size)

    def _short_of_blocks(self, seqs: list[Sequence], plan: StepPlan) -> bool:
        """Whether a paged cache lacks the blocks ``plan``'s forwards need (:meth:`_kv_needs`)."""
        return self.target.paged and self.target.kv_shortfall(*self._kv_needs(seqs, plan)) > 0

    def _kv_needs(self, seqs: list[Sequence], plan: StepPlan) -> tuple[list[tuple[int, int]], int]:
        """Per row the plan runs, its slot and the positions it holds after this step's
        forward, drafts included (-1: a sequence not admitted yet); and the blocks its
        pending forks copy (one each, a partly filled block)."""
        needs = [(seqs[i].slot, self._held(seqs[i]) + n) for i, n in plan.chunks]
        needs += [(seqs[i].slot, len(seqs[i].token_ids) + self._draft_len(seqs[i]))
                  for i in plan.verify]
        return needs, sum(len(self.forks.get(seqs[i].seq_id, ())) for i in plan.verify)

    def _preempt(self, seq: Sequence) -> None:
        """``seq`` gives its KV blocks back (and its samples not forked yet, their slots) and
        waits at the head of the queue; admitted again, it recomputes its KV from its tokens
        (``scheduler.py``)."""
        del self.running[seq.seq_id]
        for s in (seq, *self.forks.get(seq.seq_id, ())):
            self.target.free(s.slot)
            s.slot = -1
        if seq.draft_attached:
            seq.draft_attached = False
            self._proposer_call(self.proposer.finish, seq.seq_id)
        seq.hidden = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _prefill_chunks(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Prefill prompt chunks ``(row, tokens)`` in forwards of their own (a step with no
        row to verify; :meth:`_verify` takes them into its forward otherwise)."""
        for seq, n in chunks:
            ids = self._chunk_ids(seq, n)
            if self._chunk_hidden(seq):
                _, hidden = self.target.forward([seq.slot], [ids], [1], argmax_only=True,
                                                return_hidden=True)
                seq.hidden.append(hidden)
            else:
                self.target.forward([seq.slot], [ids], [1], argmax_only=True)
            self._chunk_done(seq, n)

    def _chunk_ids(self, seq: Sequence, n: int) -> list[int]:
        start = self.target.length(seq.slot)
        return seq.token_ids[start:start + n]

    def _chunk_hidden(self, seq: Sequence) -> bool:
        """Whether a chunk's target features go to the proposer (EAGLE reads them)."""
        return self.needs_hidden and seq.draft_attached

    def _chunk_done(self, seq: Sequence, n: int) -> None:
        """After a chunk's forward: its full blocks join the prefix cache; counters."""
        self.target.commit(seq.slot, seq.token_ids)
        self.num_prefill_tokens += n
        self.num_prefill_chunks += 1

    def _step(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int]] = ()) -> list[StepOutput]:
        """Plan, draft, verify, sample: nothing of a sequence changes until every row has its
        result, so a failure up to there leaves only caches to restore. Then each row
        advances on its own, and a row that fails there fails alone. ``chunks``: prompts'
        chunks ``(row, tokens)`` prefilled in the verify's forward."""
        t0 = time.perf_counter()
        ks, caps = self._plan(seqs)
        proposals = self._propose(seqs, ks, caps)
        masks = self._constrain(seqs, proposals)
        t1 = time.perf_counter()
        starts = [self.target.length(s.slot) for s in seqs]
        verdicts, hidden, sample_s = self._verify(seqs, proposals, masks, chunks)
        t2 = time.perf_counter() - sample_s  # the sampler ran inside verify; it is accept time
        self.num_prefill_tokens += sum(len(s.token_ids) - start for s, start in zip(seqs, starts)
                                       if start < s.prompt_len and s.index == 0)  # not forks
        for i, seq in enumerate(seqs):  # before advancing: that may end and free the first
            if seq.seq_id in self.forks:
                self._fork(seq, starts[i], hidden[i] if hidden is not None else None)
        outputs = [out for seq, prop, verdict in zip(seqs, proposals, verdicts)
                   for out in self._advance_or_fail(seq, prop, verdict)]
        t3 = time.perf_counter()
        try:  # bookkeeping of the unit, not of a request: it must not fail the outputs above
            if hidden is not None:
                self._keep_hidden(seqs, starts, hidden)
            self.times.add(t1 - t0, t2 - t1, t3 - t2)
            if self.controller is not None:
                self._observe(seqs, ks, proposals, verdicts, t1 - t0, t3 - t2)
        except Exception:  # noqa: BLE001
            log.exception("step bookkeeping failed; the draft starts afresh")
            self._draft_lost()
        return outputs

    def _advance_or_fail(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> list[StepOutput]:
        try:
            return [self._advance(seq, proposal, verdict)]
        except Exception as exc:  # noqa: BLE001  this row's own fault
            log.exception("request %d failed while advancing; ending it", seq.seq_id)
            return self._fail(seq, exc)

    def _admit(self) -> None:
        """Waiting requests in order, while slots are free and (a paged cache) the blocks
        their first step needs beside the running rows': a request of ``n`` samples takes
        its ``n`` slots at once (its first prefills; the others wait in them)."""
        while self.waiting and self._room_for(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.slot = self.target.allocate()
            cached = self._match(seq)
            if not seq.num_preemptions:  # usage reports the prompt's hit, not a recompute's
                seq.num_cached_tokens = cached
            for sibling in self.forks.get(seq.seq_id, []):
                sibling.slot = self.target.allocate()
            self.running[seq.seq_id] = seq
            if seq.num_speculative_tokens > 0 and self.draft_available:
                self._attach(seq)

    def _room_for(self, seq: Sequence) -> bool:
        """Slots for ``seq`` and its samples, and (a paged cache) the blocks its first step
        needs beside the running rows'."""
        if self.target.num_free_slots < 1 + len(self.forks.get(seq.seq_id, ())):
            return False
        if not self.target.paged or not self.running:  # alone it fits (KVCacheConfig's check)
            return True
        rows = [*self.running.values(), seq]
        return not self._short_of_blocks(rows, self._budget(rows))

    def _match(self, seq: Sequence) -> int:
        """The tokens ``seq`` finds in the target's prefix cache (its slot starts with them;
        the engine prefills the rest): of its prompt, or of its prompt and output after a
        preemption. Zero for a request that wants every prompt position's logprobs, and (so
        far) where the proposer reads target features: those of cached positions are not kept."""
        if seq.params.prompt_logprobs is not None or self.needs_hidden:
            return 0
        return self.target.match(seq.slot, seq.token_ids, seq.params.cache_salt)

    def _held(self, seq: Sequence) -> int:
        """Positions the target holds for ``seq`` (none before it is admitted)."""
        return self.target.length(seq.slot) if seq.slot >= 0 else 0

    def _decoding(self, seq: Sequence) -> bool:
        """Whether ``seq`` feeds one token this step (a decoding row: the target holds all
        but its last token; so does a fork of ``n > 1``). A prefix-cache hit or a chunked
        prompt with more of it to compute still prefills."""
        return len(seq.token_ids) - self._held(seq) <= 1

    def _fork(self, first: Sequence, start: int, hidden: torch.Tensor | None) -> None:
        """``first`` has verified its prompt: its samples start from copies of its caches over
        the prompt but its last token (which each feeds itself, as a decoding row does, and
        samples its first token from with its own seed). ``start``: where ``first``'s verify
        began; ``hidden``: its kept features, for a proposer that reads them."""
        shared = first.prompt_len - 1
        siblings = self.forks[first.seq_id]
        while siblings:  # one at a time: a fork that raises leaves the rest to the retry
            seq = siblings[0]
            self.target.fork(first.slot, seq.slot, shared)
            self.running[seq.seq_id] = siblings.pop(0)
            self.num_forked_tokens += shared
            if seq.num_speculative_tokens == 0 or not self.draft_available:
                continue
            if self.needs_hidden and (start != 0 or hidden is None):
                continue  # the prompt's features are gone (a retried step): target-only
            try:
                self.proposer.fork(seq.seq_id, first.seq_id, seq.seed, shared)
            except ProposerUnavailable:
                self._draft_lost()
                continue
            seq.draft_attached = True
            if self.needs_hidden:
                seq.hidden = [hidden[:shared]]
        del self.forks[first.seq_id]

    def _draft_len(self, seq: Sequence) -> int:
        """K for this step: at most the request's K, and never more than can be emitted.

        A step emits up to K + 1 tokens; they must fit in both ``max_tokens`` and the context.
        """
        remaining = self.max_model_len - len(seq.token_ids)
        if seq.params.max_tokens is not None:
            remaining = min(remaining, seq.params.max_tokens - len(seq.output_token_ids))
        return max(0, min(seq.num_speculative_tokens, remaining - 1))

    def _plan(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """K per sequence for this step: its cap, or the controller's K for adaptive decoding
        rows (rows still in prefill draft at the controller's current K); and the caps.

        A prefill row drafts (its prompt and drafts in one forward) only where the target is
        row-invariant: elsewhere (``library`` and ``compiled`` kernels, every GPU) a prompt
        run with drafts after it is a GEMM of other rows than the target-only prefill, and
        its keys and values round otherwise, which flipped 6 of 16 greedy outputs against
        target-only on an H200 (1 or 2 of 16, late, without it; docs/BENCHMARKS.md, "GPU")."""
        decoding = [i for i, s in enumerate(seqs) if self._decoding(s)]
        caps = [self._draft_len(s) if s.draft_attached else 0 for s in seqs]
        if not self.target.row_invariant:
            caps = [c if i in decoding else 0 for i, c in enumerate(caps)]
        ks = list(caps)
        if self.controller is not None:
            ks = [min(c, self.controller.k) if s.adaptive else c for s, c in zip(seqs, caps)]
            planned = self.controller.plan([
                Row(self.target.length(seqs[i].slot), caps[i], seqs[i].adaptive,
                    not seqs[i].params.greedy,
                    seqs[i].num_speculative_tokens if seqs[i].draft_attached else 0)
                for i in decoding])
            for i, k in zip(decoding, planned):
                ks[i] = k
        for i in decoding:
            k = ks[i]
            seqs[i].k_counts[k] = seqs[i].k_counts.get(k, 0) + 1
            self.k_counts[k] = self.k_counts.get(k, 0) + 1
        return ks, caps

    def _observe(self, seqs, ks, proposals, verdicts, propose_s: float, accept_s: float) -> None:
        """Feed the step's acceptance and phase costs to the controller."""
        ctl = self.controller
        asked = [k for k in ks if k > 0]
        if asked and self.draft_available:
            ctl.observe_propose(max(asked), len(asked), propose_s)
        for k, prop, verdict in zip(ks, proposals, verdicts):
            # (a proposer that drafts to the cap was, in effect, asked for what it drafted)
            accepted = verdict.path if verdict.path is not None else verdict.num_accepted
            ctl.observe_draft(max(k, len(prop.token_ids)), len(prop.token_ids), accepted,
                              self._source(prop))
        sampled = sum(len(p.token_ids) + 1 for s, p in zip(seqs, proposals) if not s.params.greedy)
        ctl.observe_accept(len(seqs), sampled, accept_s)

    def _source(self, proposal: Proposal) -> str:
        """The registry method that drafted ``proposal`` (a hybrid names its part)."""
        return proposal.source or self.proposer.method

    def _keep_hidden(self, seqs: list[Sequence], starts: list[int],
                     hidden: list[torch.Tensor | None]) -> None:
        """Queue, for the proposer, the target features of the tokens that are now final
        (positions from the step's start to the cache length after rollback)."""
        for seq, start, rows in zip(seqs, starts, hidden):
            if rows is not None and seq.draft_attached and seq.finish_reason is None:
                seq.hidden.append(rows[:self.target.length(seq.slot) - start])

    def _propose(self, seqs: list[Sequence], ks: list[int], caps: list[int]) -> list[Proposal]:
        requests = [DraftRequest(s.seq_id, s.token_ids, k, s.params.temperature, s.params.top_k,
                                 s.params.top_p, seeded=s.params.seed is not None, cap=cap,
                                 grammar=s.grammar.spec if s.grammar is not None else None,
                                 output_start=s.prompt_len)
                    for s, k, cap in zip(seqs, ks, caps)]
        to_cap = self.proposer is not None and self.proposer.drafts_to_cap
        active = [i for i, r in enumerate(requests) if r.k > 0 or (to_cap and r.cap > 0)]
        if self.needs_hidden:  # features go out every step, drafting or not: none pile up here
            asked = set(active)
            active = [i for i, s in enumerate(seqs) if i in asked or (s.draft_attached and s.hidden)]
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
                limit = requests[i].cap if to_cap else requests[i].k
                assert len(proposal.token_ids) <= limit, "proposer drafted too many"
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
        their prefill stay target-only, new ones speculate. The proposer first forgets
        everything it held: a draft that was slow rather than dead still has the slots of
        sequences that ended while it was away."""
        self.draft_available = self.proposer is not None
        if self.draft_available:
            self._proposer_call(self.proposer.reset)
        for seq in list(self.running.values()):
            lost = self.needs_hidden and self.target.length(seq.slot) > 0
            wants = seq.num_speculative_tokens > 0 and not seq.draft_attached
            if wants and self.draft_available and not lost:
                self._attach(seq)

    def _constrain(self, seqs: list[Sequence], proposals: list[Proposal]) -> list[torch.Tensor | None]:
        """Structured outputs: each constrained row's grammar masks at its verified positions
        (None for a free row), after cutting the drafts its grammar forbids (in place).

        A chain keeps its drafts up to the first forbidden one. That one is dropped too,
        except where the rejection test reads the draft's q (an unseeded sampled row with a
        model's probabilities): there it stays, certain to be rejected (p = 0 under the mask),
        so the recovered token comes from the residual ``norm(max(0, p - q))`` as the test
        needs; the position after it is never reached (its mask allows everything). Greedy
        and seeded rows decide each position from p alone, and a one-hot q's residual is p
        itself, so dropping it there changes nothing. A tree loses its forbidden nodes and
        their subtrees (tree proposals are one-hot: same argument)."""
        masks: list[torch.Tensor | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            if seq.grammar is None:
                continue
            proposal = proposals[i]
            if proposal.parents is not None:
                rows, allowed = seq.grammar.walk_tree(proposal.token_ids, proposal.parents)
                kept = [j for j, ok in enumerate(allowed) if ok]
                proposals[i] = proposal.subtree(kept)
                masks[i] = rows[[0, *(j + 1 for j in kept)]]
                continue
            rows, num_allowed = seq.grammar.walk(proposal.token_ids)
            keep = num_allowed
            if num_allowed < len(proposal.token_ids) and keeps_forbidden(seq.params, proposal):
                keep += 1
                rows = torch.cat([rows, torch.full_like(rows[:1], -1)])  # (never reached)
            if keep < len(proposal.token_ids):
                proposals[i] = proposal.prefix(keep)
            masks[i] = rows
        return masks

    def _verify(self, seqs: list[Sequence], proposals: list[Proposal],
                masks: list[torch.Tensor | None] | None = None,
                chunks: list[tuple[Sequence, int]] = ()
                ) -> tuple[list[Verdict], list[torch.Tensor | None] | None, float]:
        """The target's verdict per row; for a proposer that reads them, the final hidden
        states of each row's tokens that are now final (None otherwise); and the seconds the
        rejection sampler took. One target call, whose forward holds every row and the
        prompts' ``chunks`` in row groups (:func:`~specserve.engine.scheduler.layout_forward`),
        so a running stream waits for one forward, not a chunk's and then its own (the stall
        ``make bench-prefix`` measures)."""
        want_hidden = self.needs_hidden and (any(s.draft_attached for s in seqs)
                                             or any(self._chunk_hidden(s) for s, _ in chunks))
        inputs = [s.token_ids[self.target.length(s.slot):] + p.token_ids
                  for s, p in zip(seqs, proposals)]
        trees = [_input_tree(len(inputs[i]) - len(p.token_ids), p.parents)
                 for i, p in enumerate(proposals)]
        chunk_ids = [self._chunk_ids(seq, n) for seq, n in chunks]
        layout = layout_forward([self._decoding(s) for s in seqs], [len(x) for x in inputs],
                                [len(ids) for ids in chunk_ids])
        order, chunk_order = layout.rows, layout.chunks
        if self.fault_token is not None and any(
                self.fault_token in seqs[i].token_ids[:seqs[i].prompt_len] for i in order):
            raise RuntimeError("injected fault (fault_token)")
        t0 = time.perf_counter()
        row_trees = [trees[i] for i in order]
        result: Verified = self.target.verify(
            [seqs[i].slot for i in order], [inputs[i] for i in order], [proposals[i] for i in order],
            [(seqs[i].params, seqs[i].seed) for i in order], return_hidden=want_hidden,
            trees=row_trees if any(row_trees) else None,
            masks=[masks[i] for i in order] if masks and any(masks[i] is not None for i in order)
            else None,
            chunks=[(chunks[j][0].slot, chunk_ids[j]) for j in chunk_order], groups=layout.groups)
        for j, k in enumerate(chunk_order):
            seq, n = chunks[k]
            if self._chunk_hidden(seq):
                seq.hidden.append(result.chunk_hidden[j])
            self._chunk_done(seq, n)
        if self.controller is not None:
            lengths = [len(inputs[i]) for i in order] + [len(ids) for ids in chunk_ids]
            contexts = ([len(seqs[i].token_ids) + len(proposals[i].token_ids) for i in order]
                        + [self.target.length(seq.slot) for seq, _ in chunks])
            self.controller.observe_forward(len(lengths), sum(lengths),
                                            sum(n * c for n, c in zip(lengths, contexts)),
                                            time.perf_counter() - t0 - result.sample_s, layout.padded)
        verdicts: list[Verdict | None] = [None] * len(seqs)
        hidden: list[torch.Tensor | None] = [None] * len(seqs)
        for j, i in enumerate(order):
            verdicts[i] = result.verdicts[j]
            if want_hidden:
                hidden[i] = result.hidden[j]
        return verdicts, hidden if want_hidden else None, result.sample_s

    def _advance(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> StepOutput:
        """Append the emitted tokens through the stop checks, then roll caches back."""
        num_before = len(seq.token_ids)
        num_draft_tokens = len(proposal.token_ids)
        num_accepted_tokens = verdict.num_accepted
        tree = (proposal.parents, verdict.path) if verdict.path is not None else None
        seq.stats.observe(num_draft_tokens, num_accepted_tokens, tree)
        self.stats.observe(num_draft_tokens, num_accepted_tokens, tree)
        self.num_tree_drafts += proposal.parents is not None
        if num_draft_tokens:
            source = self._source(proposal)
            if source not in self.by_proposer:
                self.by_proposer[source] = SpecStats()
            self.by_proposer[source].observe(num_draft_tokens, num_accepted_tokens, tree)
        if verdict.prompt_logprobs is not None:
            seq.prompt_logprobs = verdict.prompt_logprobs
        if seq.params.max_tokens == 0:  # the prompt was to be scored, nothing generated
            seq.finish_reason = "length"
        else:
            seq.append_tokens(verdict.emitted, eos_token_ids=self.eos_token_ids,
                              max_model_len=self.max_model_len)
        if verdict.logprobs is not None:  # those of the tokens the stop checks let through
            seq.logprobs += verdict.logprobs[:len(seq.token_ids) - num_before]
        if verdict.path is not None:  # a tree: its accepted path moves next to the root
            self.target.keep(seq.slot, [num_before + n for n in verdict.path], num_before)
        # Everything before the last emitted token is final; that token is fed next step.
        # Rolled back first even when the sequence ends: the cache then holds committed
        # tokens only, which the prefix cache may keep (never a rejected draft's keys).
        self.target.rollback(seq.slot, num_before + num_accepted_tokens)
        self.target.commit(seq.slot, seq.token_ids)
        if seq.finish_reason:
            self._release(seq)
        elif seq.draft_attached:
            self._proposer_call(self.proposer.commit, seq.seq_id, num_before + num_accepted_tokens)
        new_tokens = seq.output_token_ids[seq.num_emitted_tokens:]
        logprobs = (seq.logprobs[seq.num_emitted_tokens:] if seq.params.logprobs is not None
                    else None)
        seq.num_emitted_tokens += len(new_tokens)
        delta = seq.detokenizer.pop_delta(final=seq.finish_reason is not None)
        out = StepOutput(seq.seq_id, new_tokens, delta, seq.finish_reason, seq.stats,
                         logprobs=logprobs, prompt_logprobs=verdict.prompt_logprobs, index=seq.index)
        if seq.finish_reason is not None:
            out.k_counts, out.mean_speculation_length = dict(seq.k_counts), seq.mean_speculation_length
            out.num_cached_tokens = seq.num_cached_tokens
        return out

    def _release(self, seq: Sequence) -> None:
        self.running.pop(seq.seq_id, None)
        self.target.free(seq.slot)
        if seq.draft_attached:
            seq.draft_attached = False
            if seq.finish_reason not in ("abort", "error"):
                self._proposer_call(self.proposer.learn, seq.token_ids, seq.prompt_len)
            self._proposer_call(self.proposer.finish, seq.seq_id)

    def _proposer_call(self, method, *args) -> None:
        try:
            method(*args)
        except ProposerUnavailable:
            self._draft_lost()

    # -- convenience ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, num_speculative_tokens: int | None = None, adaptive: bool = False,
                 grammar: CompiledGrammar | None = None) -> list[Completion]:
        """Run prompts to completion (tests, CLI, benchmarks); results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, num_speculative_tokens=num_speculative_tokens, adaptive=adaptive,
                                grammar=grammar)
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
                        s.detokenizer.text, out.finish_reason, s.stats,
                        s.logprobs if s.params.logprobs is not None else None, s.prompt_logprobs)
        return [done[i] for i in ids]


def keeps_forbidden(params: SamplingParams, proposal: Proposal) -> bool:
    """Whether a chain keeps its first draft a grammar forbids, as a certain rejection
    (``SpecDecodeEngine._constrain``): where the rejection test reads the draft's q."""
    return proposal.probs is not None and not params.greedy and params.seed is None


def _input_tree(num_before: int, parents: list[int] | None) -> list[int] | None:
    """A row's tree over its forward's new tokens: the ``num_before`` tokens before the drafts
    (its last token, or a prompt's tail) as a chain, then the drafts' tree (None: a chain)."""
    if parents is None:
        return None
    return ([-1, *range(num_before - 1)]
            + [num_before - 1 if p == -1 else num_before + p for p in parents])
