"""A model and its KV cache (slots or paged blocks): what a target rank or a draft model holds.

The speculation loop only talks to this interface (``verify`` / ``allocate`` / ``free`` /
``rollback`` / ``keep`` / ``fork`` / ``length``), which is why the same loop drives an in-process model
here and a tensor-parallel group of Ray actors in the Serve units.

``verify`` is the target's half of a step: the forward *and* the rejection sampler, so the
logits never leave the process (and device) that computed them. What comes back is
:class:`Verified`: the tokens each row keeps, as plain data, and for a proposer that reads
them the kept tokens' final hidden states, on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from specserve.config import KVCacheConfig
from specserve.engine.kv.kv_cache import SlotTable
from specserve.engine.runtime.forward_batch import ForwardBatch, Forwarded, Upload, device_index, row_index
from specserve.engine.runtime.malloc import keep_freed_memory
from specserve.engine.runtime.model import LlamaRuntime
from specserve.engine.step.acceptance import RejectionOutput, greedy_in_bucket
from specserve.engine.step.proposal import Proposal
from specserve.engine.step.verification import (
    Outcome,
    judge,
    prompt_token_logprobs,
    send,
    stage,
    verdicts,
)
from specserve.engine.step.verify_batch import Verdict, VerifyBatch, VerifyRow


@dataclass
class Verified:
    """A verify call's result, per row in call order."""

    verdicts: list[Verdict]
    # per row, the final hidden states of its tokens that are now final (the tokens before
    # the drafts, then the accepted drafts, in path order for a tree), CPU; None: not asked
    hidden: list[torch.Tensor] | None
    forward_s: float   # the forward, measured where it ran
    sample_s: float    # the rejection sampler, ditto
    # per prompt chunk the call prefilled beside the rows (``chunks``), the final hidden
    # states of its tokens, CPU; None: not asked
    chunk_hidden: list[torch.Tensor] | None = None


class SlotOwner:
    """The slot half of the worker interface, answered from ``self.table``."""

    table: SlotTable

    @property
    def num_free_slots(self) -> int:
        return self.table.num_free_slots

    def allocate(self) -> int:
        return self.table.allocate()

    def free(self, slot: int) -> None:
        self.table.free(slot)

    def length(self, slot: int) -> int:
        return self.table.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        self.table.rollback(slot, length)

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def match(self, slot: int, tokens: list[int], salt: str | None = None) -> int:
        """A new sequence in ``slot`` starts with the longest cached prefix of its prompt
        ``tokens`` among those cached with the same ``salt``; returns its length (0 without
        a prefix cache: the slot layout)."""
        return self.table.match(slot, tokens, salt)

    @property
    def paged(self) -> bool:
        """Whether the cache is paged: capacity in blocks, :meth:`kv_shortfall` meaningful."""
        return self.table.paged

    def kv_shortfall(self, needs: list[tuple[int, int]], extra_blocks: int = 0) -> int:
        """KV blocks missing for every ``(slot, positions)`` of ``needs`` to hold that many
        (slot -1: a sequence not admitted yet) plus ``extra_blocks``; 0 when they fit."""
        return self.table.kv_shortfall(needs, extra_blocks)

    def commit(self, slot: int, tokens: list[int]) -> None:
        """``tokens``, the sequence's committed tokens, may be cached (a paged cache's full
        blocks; nothing in the slot layout)."""
        self.table.commit(slot, tokens)


class ModelWorker(SlotOwner):
    """Owns a :class:`LlamaRuntime` and a KV cache shaped for it: a :class:`SlotKVCache`, or a
    :class:`~specserve.engine.kv.kv_cache.PagedKVCache` where ``kv`` resolves to paged."""

    def __init__(self, runtime: LlamaRuntime, *, num_slots: int, max_seq_len: int,
                 kv: KVCacheConfig | None = None) -> None:
        keep_freed_memory()
        self.runtime = runtime
        if kv is not None:  # layout auto: as the runtime's device and kernels allow
            kv = kv.resolved(str(runtime.embed.weight.device), runtime.kernels)
        if kv is not None and kv.layout == "paged":
            self.cache = self.table = runtime.make_paged_cache(
                num_slots, max_seq_len, block_size=kv.block_size,
                num_blocks=kv.pool_blocks(num_slots, max_seq_len), prefix_caching=kv.prefix_caching)
        else:
            self.cache = self.table = runtime.make_cache(num_slots, max_seq_len)
        if runtime.static is not None:  # a greedy step's verdict inside the compiled graph
            runtime.static.verdict = greedy_in_bucket

    @property
    def vocab_size(self) -> int:
        return self.runtime.arch.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    @property
    def queues_work(self) -> bool:
        """Whether the device runs a forward after the call that launched it returns (CUDA):
        where launching the next step before reading this one pays
        (``target_calls.py``)."""
        return self.runtime.embed.weight.device.type == "cuda"

    @property
    def row_invariant(self) -> bool:
        """Whether a token's logits are the same bits whatever else its forward holds (the
        ``invariant`` kernels; :class:`~specserve.engine.spec_decode.SpecDecodeEngine`
        drafts in a prefill only then)."""
        return self.runtime.kernels == "invariant"

    def warm_up(self) -> dict:
        """A forward in every shape serving will use, before the first request
        (:meth:`LlamaRuntime.warm_up <specserve.engine.runtime.model.LlamaRuntime.warm_up>`): the
        compiled kernels compile and capture here, not inside a step."""
        return self.runtime.warm_up(self.cache)

    def keep(self, slot: int, positions: list[int], at: int) -> None:
        """A verified token tree's accepted path moves to ``at, at + 1, ...`` (the cache's
        :meth:`~specserve.engine.kv.kv_cache.SlotKVCache.keep`)."""
        self.cache.keep(slot, positions, at)

    def fork(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` starts as a copy of ``src``'s first ``length`` positions (the cache's
        :meth:`~specserve.engine.kv.kv_cache.SlotKVCache.fork`)."""
        self.cache.fork(src, dst, length)

    def verify(self, batch: VerifyBatch) -> Verified:
        """One verify forward and its rejection sampling, here, next to the logits: the
        result of :meth:`launch`, read back.

        Each row (:class:`~specserve.engine.step.verify_batch.VerifyRow`) feeds its pending
        tokens, then its drafts, and is verified under its request's parameters and seed and,
        unless it is plain, its mask (a structured output, bans, ``min_tokens``),
        ``logit_bias`` and penalties. Where every row needs only the argmax
        (:attr:`VerifyRow.argmax_only`) the device computes that and nothing else. With ``hidden``
        the kept tokens' hidden states come back (:attr:`Verified.hidden`), and the prompt
        chunks' (prefilled in the same forward, after the rows: no logits, no verdict) in
        :attr:`Verified.chunk_hidden`. On the compiled path such a batch of chains is
        verified inside the forward's graph
        (:func:`~specserve.engine.step.acceptance.greedy_in_bucket`): its result is read back
        as the graph left it."""
        return self.launch(batch).result()

    def launch(self, batch: VerifyBatch, after: Launched | None = None, *,
               fed: torch.Tensor | None = None) -> Launched:
        """:meth:`verify`'s forward and sampler, queued on the device and not read back
        (:meth:`Launched.result` reads them): the host can build and launch the next step
        while the device runs this one. Rows of ``batch`` that follow ``after``
        (:attr:`VerifyRow.follows`: one pending token, a placeholder, and no drafts) feed
        the last token their row of ``after`` emitted, taken on the device; their positions
        count it already (``after``'s forward wrote its keys), so such a row is a decode that
        goes on as if ``after`` had been read, which the caller undoes for a row that
        ``after`` ended. ``fed``: those tokens already taken (:meth:`Launched.feeds`: a
        unit's rank 0 sends them to the other ranks first), instead of ``after``."""
        rows = batch.rows
        assert all(self.length(r.slot) == r.start for r in rows), "the cache is not at the rows' starts"
        clock = ForwardClock(self.runtime.embed.weight.device)
        argmax_only = all(r.argmax_only for r in rows)
        upload = Upload()  # the verification's inputs go to the device with the forward's
        staged = upload, stage(rows, upload)
        if batch.followers:
            assert (after is not None or fed is not None) and all(
                len(rows[i].token_ids) == 1 and not rows[i].proposal.token_ids
                for i in batch.followers), "a follower is a decode"
            fed = after.feeds(batch) if fed is None else fed
        out = self.forward(batch.forward(asked=True, argmax=argmax_only, upload=upload, fed=fed))
        logits, hidden = (out.token_ids if argmax_only else out.logits), out.hidden
        clock.forward_done()
        judged = None
        if argmax_only and out.verdict is not None and all(r.proposal.parents is None for r in rows):
            judged = RejectionOutput.unpack(out.verdict[:len(rows)])
        asked = list(logits.split([r.num_asked for r in rows]))
        outcomes = judge(rows, [x[-r.num_logits:] for r, x in zip(rows, asked)], staged, judged)
        send(outcomes)  # their read queued now, ahead of the next step's forward
        return Launched(batch, outcomes, asked, hidden, clock)

    def forward(self, batch: ForwardBatch) -> Forwarded:
        """Append ``batch``'s tokens to its slots in this worker's cache; what the batch asks
        for (:meth:`LlamaRuntime.forward <specserve.engine.runtime.model.LlamaRuntime.forward>`)."""
        return self.runtime(self.cache, batch)


class ForwardClock:
    """A verify call's forward time and the rest of its time, without a synchronisation of
    their own (the step's one read is the only wait). On CUDA two events bracket
    the forward on the stream, and are read after the sampler has read its result, which
    waited for the device anyway: the forward's device time, and the call's remaining wall
    time for the sampler. Elsewhere the host's clock (a CPU forward is done when it
    returns)."""

    def __init__(self, device: torch.device) -> None:
        self.start = time.perf_counter()
        self.events = None
        if device.type == "cuda" and torch.cuda.is_available():
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.events[0].record()

    def forward_done(self) -> None:
        if self.events is not None:
            self.events[1].record()
        else:
            self.forward_s = time.perf_counter() - self.start

    def split(self) -> tuple[float, float]:
        """``(forward seconds, the rest)``, once the forward's result has been read."""
        total = time.perf_counter() - self.start
        if self.events is not None:
            self.events[1].synchronize()  # done already: the result was read
            self.forward_s = self.events[0].elapsed_time(self.events[1]) / 1000
        return self.forward_s, max(total - self.forward_s, 0.0)


@dataclass
class Launched:
    """A verify on the device's queue (:meth:`ModelWorker.launch`): each row's outcome there
    (:func:`~specserve.engine.step.verification.judge`), the logits each row asked for
    (:attr:`VerifyRow.num_asked`), its hidden states; :meth:`result` reads it back."""

    batch: VerifyBatch
    outcomes: dict[VerifyRow, Outcome]
    asked: list[torch.Tensor]     # [rows] each row's asked logits (or argmax ids)
    hidden: torch.Tensor | None
    clock: ForwardClock

    def feeds(self, batch: VerifyBatch) -> torch.Tensor:
        """``[followers]``: the last token each row of ``batch`` that follows this verify
        (:attr:`VerifyRow.follows`: a chain row of it) emitted here, the one it feeds next,
        on the logits' device and gathered there, nothing read (``target_calls.py``,
        launching ahead). Each sampler call's ends are computed once; the rows index them."""
        rows = self.batch.rows
        device = self.outcomes[rows[0]][2].device
        ends: dict[int, tuple[int, torch.Tensor]] = {}  # a call's id -> its offset, its rows' ends
        index, width = [], 0
        for i in batch.followers:
            res, j, _ = self.outcomes[rows[batch.rows[i].follows]]
            assert isinstance(res, RejectionOutput), "a follower follows a chain"
            if id(res) not in ends:
                tokens = res.output_token_ids.gather(1, res.num_accepted_tokens[:, None])[:, 0]
                ends[id(res)] = width, tokens.to(device)
                width += tokens.shape[0]
            index.append(ends[id(res)][0] + j)
        flat = torch.cat([tokens for _, tokens in ends.values()])
        return flat[row_index(index, width, device)]

    def result(self) -> Verified:
        """The verify's :class:`Verified`: verdicts, prompt logprobs and kept features, read
        back to the host."""
        rows = self.batch.rows
        judged = verdicts(rows, self.outcomes)
        for i, (row, x) in enumerate(zip(rows, self.asked)):
            if row.scores_prompt:  # logits row j predicts prompt token j + 1
                prompt = row.token_ids[:len(row.token_ids) - row.num_logits + 1]
                logp = torch.log_softmax(x[:len(prompt) - 1].float(), dim=-1)
                judged[i] = replace(judged[i], prompt_logprobs=prompt_token_logprobs(
                    logp, prompt[1:], row.params.prompt_logprobs) if len(prompt) > 1 else [])
        kept = chunk_hidden = None
        if self.hidden is not None:  # every row's kept states and the chunks', in one read
            picks, start = [], 0
            for row, v in zip(rows, judged):
                picks.append([start + j for j in _kept_rows(len(row.token_ids), row.proposal, v)])
                start += len(row.token_ids)
            for _, ids in self.batch.chunks:
                picks.append(list(range(start, start + len(ids))))
                start += len(ids)
            flat = self.hidden[device_index([j for row in picks for j in row], self.hidden.device)]
            parts = list(flat.cpu().split([len(row) for row in picks]))
            kept, chunk_hidden = parts[:len(rows)], parts[len(rows):]
        return Verified(judged, kept, *self.clock.split(), chunk_hidden)


def _kept_rows(num_tokens: int, proposal: Proposal, verdict: Verdict) -> list[int]:
    """Of a row's ``num_tokens`` new tokens, those it keeps: the ones before the drafts, then
    the accepted drafts (a tree's in the order of its kept path, as a chain's would be)."""
    before = num_tokens - len(proposal.token_ids)
    accepted = verdict.path if verdict.path is not None else range(verdict.num_accepted)
    return [*range(before), *(before + n for n in accepted)]
