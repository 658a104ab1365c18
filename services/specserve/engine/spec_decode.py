"""The speculative generation loop over a batch of sequences (continuous batching per step).

One :meth:`SpecDecodeEngine.step` (this module schedules it; where a piece lives elsewhere,
the step names the module):

1. **schedule**: admit waiting requests while KV slots (and blocks) are free, and build the
   step's :class:`~specserve.engine.step.step_batch.StepBatch`: which rows verify, which prefill
   a prompt's chunk, which are preempted (``scheduler.py``); every phase below fills its
   fields of the same rows;
2. **draft**: ask the proposer (``drafts/``, through ``drafts/draft_link.py``) for up to K tokens
   per running sequence (K is capped so the step can neither overrun ``max_tokens`` nor the
   context; for adaptive requests the controller of ``adaptive.py`` picks K under that cap:
   ``k_planner.py``), then cut the drafts a structured output's grammar forbids
   (``grammar.constrain``);
3. **verify**: one target forward over each row's pending tokens plus its drafts, with
   logits at the last ``num_draft_tokens + 1`` positions (ragged: every row its own length),
   and ``verification.py`` turning those logits and the proposals into the tokens each row
   emits (the rules of ``acceptance.py`` keep a prefix of the drafts, or a path of a tree, and
   add one recovered or bonus token). Both happen in the target's ``verify``
   (``worker.py``), where the logits are: on a tensor-parallel group that is rank 0, and
   only the emitted tokens come back;
4. **accept**: ``Sequence.append_tokens`` (``sequence.py``)
   appends them one at a time through the stop checks (EOS, stop token ids, stop strings,
   max_tokens, context), so a stop inside a draft window truncates exactly where
   target-only decoding would have stopped;
5. **roll back** both caches to the tokens that are now final, and free finished slots;
   everything counted goes to the engine's :class:`~specserve.engine.step.stats.EngineCounters`.

**A plain decode step is launched before the one before it is read** where the target
queues work on a device that runs beside the host (a CUDA worker in this process): the
device runs step N + 1, its tokens taken there from step N's verdicts, while the host reads
and advances step N (``target_calls.py``, where it is decided and built).

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

from specserve.config import SamplingParams
from specserve.engine.drafts.base import Proposer
from specserve.engine.drafts.draft_link import DraftLink
from specserve.engine.grammar import CompiledGrammar, constrain, structured_outputs
from specserve.engine.request import EngineRequest, RequestLimits, check_request
from specserve.engine.step.adaptive import SpecLengthController
from specserve.engine.step.bans import allowed_mask, narrowed, word_bans, word_token_ids
from specserve.engine.step.k_planner import KPlanner
from specserve.engine.step.sampling import random_seed
from specserve.engine.step.scheduler import Scheduler
from specserve.engine.step.sequence import Completion, Sequence, StepOutput
from specserve.engine.step.stats import EngineCounters
from specserve.engine.step.step_batch import ChunkRow, StepBatch, StepRow
from specserve.engine.target_calls import TargetCalls
from specserve.engine.tokenizer import IncrementalDetokenizer
from specserve.engine.worker import Launched, ModelWorker
from specserve.errors import InvalidRequestError, RequestFailed, TargetUnavailable

log = logging.getLogger(__name__)


class SpecDecodeEngine:
    """Drives a target :class:`ModelWorker` and an optional :class:`Proposer`: the step of the
    module docstring over its named parts: the :class:`Scheduler` (which sequences run), the
    :class:`DraftLink` (the proposer), the :class:`KPlanner` (K per row) and the
    :class:`EngineCounters` that every step fills."""

    def __init__(self, target: ModelWorker, tokenizer, *, eos_token_ids: frozenset[int],
                 proposer: Proposer | None = None, num_speculative_tokens: int = 4,
                 controller: SpecLengthController | None = None,
                 chunked_prefill_size: int | None = None, launch_ahead: bool | None = None) -> None:
        assert num_speculative_tokens >= 1
        self.target, self.tokenizer, self.eos_token_ids = target, tokenizer, eos_token_ids
        self.num_speculative_tokens = num_speculative_tokens
        self.counters = EngineCounters()
        self.grammars = structured_outputs(tokenizer, target.vocab_size, eos_token_ids)  # one cache
        self.draft = DraftLink(proposer, target, self.counters, self.grammars)
        self.k = KPlanner(controller if proposer is not None else None, self.counters,
                          max_model_len=target.max_seq_len, row_invariant=target.row_invariant,
                          k_source=proposer.method if proposer is not None else None)
        self.scheduler = Scheduler(target, self.counters, chunked_prefill_size, lookahead=self.k.cap,
                                   match_prefix=not self.draft.needs_hidden)
        self.fault_token: int | None = None  # tests: a prompt with it fails its step (_inject_fault)
        self._ids = itertools.count()
        self.calls = TargetCalls(target, self.scheduler, self.draft.wants_features, self.counters,
                                 launch_ahead)

    # -- requests ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.target.max_seq_len

    @property
    def limits(self) -> RequestLimits:  # what its requests are checked against (check_request)
        return RequestLimits(self.target.vocab_size, self.target.max_seq_len, self.target.num_slots)

    @property
    def controller(self) -> SpecLengthController | None:
        """The K controller (the K planner's: it is the one place that holds it)."""
        return self.k.controller

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, **options) -> int:
        """Queue a request in process (the command line, benchmarks, tests): checked as the
        API checks it (:func:`check_request`), then :meth:`submit` (``options``: its)."""
        return self.add_parallel(prompt_token_ids, params, 1, **options)[0]

    def add_parallel(self, prompt_token_ids: list[int], params: SamplingParams, n: int, *,
                     grammar: CompiledGrammar | None = None, **options) -> list[int]:
        """:meth:`add_request` of ``n`` samples of one prompt (OpenAI's ``n``)."""
        return self.submit(check_request(prompt_token_ids, params, self.limits, n=n,
                                         grammar=grammar.spec if grammar else None), grammar, **options)

    def submit(self, request: EngineRequest, grammar: CompiledGrammar | None = None, *,
               num_speculative_tokens: int | None = None, adaptive: bool = False) -> list[int]:
        """Queue a checked request's ``n`` samples (sequence ids in order: their
        :attr:`StepOutput.index`), one prefill shared (module docstring). Sample i draws with
        ``params.seed + i`` (:attr:`Sequence.sample_seed`: it equals the single request of
        that seed), an unseeded one with a random seed. ``grammar``: the request's, compiled
        (a matcher per sample). ``num_speculative_tokens``: K (0: off; default the engine's);
        ``adaptive``: the controller (if any) picks K per step, at most that."""
        assert (grammar.spec if grammar is not None else None) == request.grammar
        assert num_speculative_tokens is None or num_speculative_tokens >= 0
        prompt, params = request.prompt_token_ids, request.params
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        allowed = (None if params.allowed_token_ids is None
                   else allowed_mask(params.allowed_token_ids, self.target.vocab_size))
        seqs = [Sequence(
            seq_id=next(self._ids), prompt_len=len(prompt), token_ids=list(prompt), params=params,
            num_speculative_tokens=k if self.draft.proposer is not None else 0,
            adaptive=adaptive and self.controller is not None,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt, stop=params.stop, min_tokens=params.min_tokens,
                skip_special_tokens=params.skip_special_tokens,
                include_stop=params.include_stop_str_in_output),
            sample_seed=random_seed() if params.seed is None else params.seed + i, index=i,
            grammar=grammar.matcher() if grammar is not None else None, allowed=allowed,
            bad_words=word_token_ids(self.tokenizer, params.bad_words))
            for i in range(request.n)]
        self.scheduler.add(seqs)
        return [s.seq_id for s in seqs]

    def abort(self, seq_id: int) -> bool:
        """Drop a request wherever it is (:meth:`Scheduler.abort`); False if it is unknown or done."""
        seq = self.scheduler.abort(seq_id)
        if seq is not None:
            self.draft.detach(seq)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reattach_proposer(self) -> None:
        """The proposer answers again: running sequences start on it (:meth:`DraftLink.reattach`)."""
        self.draft.reattach(self.scheduler.running.values())

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        for seq in self.scheduler.admit():
            if seq.num_speculative_tokens > 0 and self.draft.available:
                self.draft.attach(seq)
        batch, ahead = None, self.calls.take()
        if not self.scheduler.running:  # (every row launched ahead was aborted)
            return []
        try:
            if ahead is not None:  # launched by the step before (TargetCalls.after)
                batch = ahead[0]
                return self._step(*ahead)
            batch = self.scheduler.schedule()
            for seq in batch.preempted:
                self.draft.detach(seq)
            if not batch.rows:  # nothing to verify: the chunks alone
                self.calls.prefill_chunks(batch.chunks)
                return []
            return self._step(batch)
        except Exception as exc:  # noqa: BLE001  whose fault? Each row alone tells (module docstring)
            self.calls.take()  # a step launched ahead is undone with this one's: _restore
            if isinstance(exc, TargetUnavailable):
                raise
            rows = self._rows_alone(batch)
            log.exception("a step of %d rows failed; stepping each row alone", len(rows))
            return self._step_alone(rows)

    def _step(self, batch: StepBatch, launched: Launched | None = None) -> list[StepOutput]:
        """Plan, draft, verify, sample: nothing of a sequence changes until every row has its
        verdict, so a failure up to there leaves only caches to restore. Then each row
        advances on its own, and a row that fails there fails alone. ``launched``: its verify,
        launched ahead by the step before (rows whose sequence ended meanwhile are skipped)."""
        _inject_fault(self.fault_token, batch)
        clock = batch.clock
        clock.lap()
        if launched is None:
            self.k.plan(batch.rows)
            self.draft.propose(batch.rows)
            for row in batch.rows:
                if row.seq.grammar is not None:
                    row.proposal, row.mask = constrain(row.seq.grammar, row.seq.params, row.proposal)
                self._ban(row)
            clock.propose_s = clock.lap()
            launched = self.calls.launch(batch)
        ahead = self.calls.after(batch, launched, self.max_model_len)
        self.calls.read(batch, launched)
        clock.verify_s = clock.lap() - clock.sample_s
        self.counters.num_prefill_tokens += sum(row.num_pending for row in batch.rows  # not forks
                                                if row.start < row.seq.prompt_len and row.seq.index == 0)
        for row in batch.rows:  # before advancing: that may end and free the first
            if row.seq.seq_id in self.scheduler.forks:
                self._fork(row)
        live = [row for row in batch.rows if self.scheduler.running.get(row.seq.seq_id) is row.seq]
        outputs = [out for row in live for out in self._advance_or_fail(row, ahead)]
        clock.advance_s = clock.lap()
        try:  # bookkeeping of the unit, not of a request: it must not fail the outputs above
            if batch.hidden:
                self.draft.keep_features(batch)
            self.counters.times.add(clock.propose_s, clock.verify_s, clock.accept_s, decoding=batch.decoding)
            self.k.observe(batch, drafted=self.draft.available)
        except Exception:  # noqa: BLE001
            log.exception("step bookkeeping failed; the draft starts afresh")
            self.draft.lost()
        return outputs

    def _ban(self, row: StepRow) -> None:
        """The request's own bans on the row's mask (``step/bans.py``), after its grammar's:
        ``allowed_token_ids``, then where the output is short of its ``min_tokens`` the tokens
        that would stop it (:meth:`Sequence.stop_bans`), then its ``bad_words`` after the
        output and the drafts before each position; a rule that would leave a position
        nothing allowed is dropped there (:func:`narrowed`: a grammar that allows only a stop
        wins over min_tokens). A draft of a banned token stays: its target probability is 0
        there, so the verification rejects it, greedy, seeded or not."""
        seq, proposal, vocab = row.seq, row.proposal, self.target.vocab_size
        n = len(proposal.token_ids) + 1
        for bans in (None if seq.allowed is None else seq.allowed.repeat(n, 1),
                     seq.stop_bans(proposal.parents, n - 1, vocab, self.eos_token_ids),
                     word_bans(seq.bad_words, seq.output_token_ids, proposal.token_ids,
                               proposal.parents, vocab)):
            if bans is not None:
                row.mask = narrowed(row.mask, bans)

    def _fork(self, row: StepRow) -> None:
        """``row``'s sequence verified its prompt: its samples start from its caches
        (:meth:`Scheduler.fork`), and on the draft from its draft state
        (:meth:`DraftLink.fork`: its kept features, for a proposer that reads them)."""
        first = row.seq
        for seq in self.scheduler.fork(first):
            self.draft.fork(seq, first, first.prompt_len - 1, row.start, row.hidden)

    def _advance_or_fail(self, row: StepRow, ahead: bool = False) -> list[StepOutput]:
        try:
            return [self._advance(row, ahead)]
        except Exception as exc:  # noqa: BLE001  this row's own fault
            log.exception("request %d failed while advancing; ending it", row.seq.seq_id)
            return self._fail(row.seq, exc)

    def _advance(self, row: StepRow, ahead: bool = False) -> StepOutput:
        """Append the emitted tokens through the stop checks, then roll caches back (past
        the position the next step, launched ahead, wrote: ``ahead``, unless the row ends)."""
        seq, proposal, verdict = row.seq, row.proposal, row.verdict
        num_before = len(seq.token_ids)
        num_draft_tokens, num_accepted_tokens = len(proposal.token_ids), verdict.num_accepted
        tree = (proposal.parents, verdict.path) if verdict.path is not None else None
        seq.stats.observe(num_draft_tokens, num_accepted_tokens, tree)
        self.counters.observe(row.source if num_draft_tokens else "",
                              num_draft_tokens, num_accepted_tokens, tree, proposal.parents is not None)
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
        held = num_before + num_accepted_tokens
        self.target.rollback(seq.slot, held + (1 if ahead and not seq.finish_reason else 0))
        self.target.commit(seq.slot, seq.token_ids)
        if seq.finish_reason:
            self._release(seq)
        else:
            self.draft.commit(seq, held)
        return seq.step_output(verdict.prompt_logprobs)

    def _release(self, seq: Sequence) -> None:
        """``seq`` ended: its slot (the scheduler) and its draft state (``learn``: a proposer
        that drafts from earlier responses keeps one that ended normally) go."""
        self.scheduler.release(seq)
        self.draft.detach(seq, learn=seq.finish_reason not in ("abort", "error"))

    # -- one request's fault (module docstring) ---------------------------------------------
    def _rows_alone(self, batch: StepBatch | None) -> list[StepRow | ChunkRow]:
        """The rows of a failed step, to step one at a time: its rows and chunks (every
        running sequence, where the step failed before it had rows)."""
        if batch is not None:
            return [*batch.rows, *batch.chunks]
        return [StepRow(seq, self.scheduler.held(seq)) for seq in self.scheduler.running.values()]

    def _step_alone(self, rows: list[StepRow | ChunkRow]) -> list[StepOutput]:
        """After a failed step: restore the caches, then step every row on its own (a chunk
        row, its chunk); a row that fails alone fails, with its error."""
        self._restore([row.seq for row in rows])
        outputs = []
        for row in rows:
            seq = row.seq
            try:
                if isinstance(row, ChunkRow):
                    self.calls.prefill_chunks([ChunkRow(seq, self.scheduler.held(seq), row.num_tokens)])
                else:
                    outputs += self._step(StepBatch([StepRow(seq, self.scheduler.held(seq))], []))
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
            if seq.seq_id not in self.scheduler.running:
                continue
            final = max(0, len(seq.token_ids) - 1)
            self.target.rollback(seq.slot, min(self.target.length(seq.slot), final))
            self.draft.commit(seq, final)

    def _fail(self, seq: Sequence, exc: Exception) -> list[StepOutput]:
        """End ``seq`` with ``exc`` (our own 4xx errors as they are, anything else a 500),
        and the samples that were to share its prefill with it."""
        seq.finish_reason = "error"
        if self.scheduler.running.get(seq.seq_id) is seq:
            self._release(seq)
        error = exc if isinstance(exc, InvalidRequestError) else RequestFailed(
            "the server could not process this request")
        failed = [seq, *self.scheduler.drop_samples(seq.seq_id, "error")]
        return [StepOutput(s.seq_id, [], "", "error", s.stats, error=error, index=s.index)
                for s in failed]

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
        seqs = {s.seq_id: s for s in self.scheduler.waiting if s.seq_id in wanted}
        done: dict[int, Completion] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finish_reason is not None:
                    done[out.seq_id] = seqs[out.seq_id].completion(out.finish_reason)
        return [done[i] for i in ids]


def _inject_fault(fault_token: int | None, batch: StepBatch) -> None:
    """Fault injection (tests): a step whose rows hold a prompt with ``fault_token`` raises,
    as a request-caused failure would (``SpecDecodeEngine.fault_token``)."""
    if fault_token is not None and any(fault_token in s.token_ids[:s.prompt_len] for s in batch.seqs):
        raise RuntimeError("injected fault (fault_token)")
