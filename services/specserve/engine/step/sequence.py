"""A request's state inside the engine, what each step reports of it, and when it stops.

:class:`Sequence` is the engine's bookkeeping of one request (its tokens, slot, K, seed,
stats); :class:`StepOutput` is what one step produced for it (streaming reads these);
:class:`Completion` is a finished one, for callers that do not stream.

**Stopping.** A step emits up to K + 1 tokens at once, but a sequence must end exactly where
target-only decoding would have ended. :meth:`Sequence.append_tokens` therefore appends them
one at a time through :meth:`Sequence.stop_reason` (EOS, stop token ids, stop strings,
``max_tokens``, the context length, a structured output's grammar once it is complete), and
drops whatever follows the first token that stops it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.config import SamplingParams
from specserve.engine.grammar import Matcher
from specserve.engine.step.bans import packed
from specserve.engine.step.stats import SpecStats
from specserve.engine.tokenizer import IncrementalDetokenizer


@dataclass
class Sequence:
    """One request inside the engine, from :meth:`SpecDecodeEngine.add_request` to its end."""

    seq_id: int
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int                     # K for this sequence (the most, when adaptive); 0 = off
    adaptive: bool                    # the controller picks K per step (up to num_speculative_tokens)
    detokenizer: IncrementalDetokenizer
    sample_seed: int                  # the request's seed + index, or random: every draw derives from it
    index: int = 0                    # which of its request's n samples (``n > 1``) it is
    # structured output: the grammar's state after every output token (grammar.Matcher)
    grammar: Matcher | None = None
    # the request's own bans (bans.py): allowed_token_ids packed ([W]), bad_words as token ids
    allowed: torch.Tensor | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    slot: int = -1
    draft_attached: bool = False       # the proposer holds state for this sequence
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    num_emitted_tokens: int = 0        # output tokens already reported by step()
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache (not computed)
    num_preemptions: int = 0           # times it gave its KV blocks back to wait (scheduler.py)
    k_counts: dict[int, int] = field(default_factory=dict)  # decode steps per K asked
    hidden: list[torch.Tensor] = field(default_factory=list)  # target features not yet sent
    # per output token, with params.logprobs: (its logprob, [(token, logprob), ...] top ones)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with params.prompt_logprobs, after the prefill: prompt tokens 1.. (Verdict.prompt_logprobs)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def mean_speculation_length(self) -> float:
        steps = sum(self.k_counts.values())
        return sum(k * n for k, n in self.k_counts.items()) / steps if steps else 0.0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def plain(self) -> bool:
        """Every row it verifies from now on is **plain** (``VerifyRow.plain``: decided on the
        model's own logits), whatever it emits: no grammar, bans, ``min_tokens`` still to
        reach, penalties or ``logit_bias``."""
        params = self.params
        return (self.grammar is None and self.allowed is None and not self.bad_words
                and len(self.output_token_ids) >= params.min_tokens
                and not params.penalized and not params.logit_bias)

    def append_tokens(self, token_ids: list[int], *, eos_token_ids: frozenset[int],
                      max_model_len: int) -> None:
        """Append a step's emitted tokens up to the first that stops the sequence (module
        docstring); ``finish_reason`` says why it stopped, None if it did not."""
        for token in token_ids:
            self.token_ids.append(token)
            if not self._ends_on(token, eos_token_ids) or self.params.include_stop_str_in_output:
                self.detokenizer.add(token)  # (a stop token's text is left out: vLLM's)
            if self.grammar is not None:  # verification drew the token under its mask
                self.grammar.advance(token)
            self.finish_reason = self.stop_reason(token, eos_token_ids=eos_token_ids,
                                                  max_model_len=max_model_len)
            if self.finish_reason:
                break

    def stop_reason(self, token: int, *, eos_token_ids: frozenset[int],
                    max_model_len: int) -> str | None:
        """Why the sequence stops after ``token``, its newest token: ``"stop"`` (EOS, a stop
        token id or a stop string, once ``min_tokens`` are out), ``"length"`` (``max_tokens``
        or the context), else None."""
        params = self.params
        if self._ends_on(token, eos_token_ids) or (
                len(self.output_token_ids) >= params.min_tokens and self.detokenizer.stop_reason is not None):
            return "stop"
        if self.grammar is not None and self.grammar.is_terminated:
            return "stop"  # the structured output is complete: nothing but EOS may follow
        if params.max_tokens is not None and len(self.output_token_ids) >= params.max_tokens:
            return "length"
        if len(self.token_ids) >= max_model_len:
            return "length"
        return None

    def _ends_on(self, token: int, eos_token_ids: frozenset[int]) -> bool:
        """Whether ``token``, the newest output token, is a stop token that ends the output
        (EOS unless ``ignore_eos``, a stop token id; once ``min_tokens`` are out)."""
        params = self.params
        return len(self.output_token_ids) >= params.min_tokens and (
            (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids)

    def stop_bans(self, parents: list[int] | None, num_drafts: int, vocab_size: int,
                  eos_token_ids: frozenset[int]) -> torch.Tensor | None:
        """The masks of a verify of ``num_drafts`` drafts (a tree's ``parents``) banning the
        tokens that would stop the output (EOS unless ``ignore_eos``, the stop token ids)
        where they would come before ``min_tokens``: ``[num_drafts + 1, W]`` packed int32 as a
        grammar's (allowed bits set), row 0 deciding output token ``L`` (the output so far),
        a chain's row j token ``L + j``, a tree node's row token ``L`` + its depth. None where
        no verified position comes before ``min_tokens``."""
        params, done = self.params, len(self.output_token_ids)
        if done >= params.min_tokens:
            return None
        banned = {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}
        banned = sorted(t for t in banned if t < vocab_size)
        if parents is None:
            index = [done + j for j in range(num_drafts + 1)]
        else:
            depth: list[int] = []
            for parent in parents:  # a parent comes before its children
                depth.append(1 if parent == -1 else depth[parent] + 1)
            index = [done, *(done + d for d in depth)]
        return packed([banned if i < params.min_tokens else [] for i in index], vocab_size)

    def step_output(self, prompt_logprobs: list | None = None) -> StepOutput:
        """What the step that just advanced it produced: the output tokens (and logprobs) not
        reported yet and the text they complete; on its last, the request-level counts."""
        new_tokens = self.output_token_ids[self.num_emitted_tokens:]
        logprobs = self.logprobs[self.num_emitted_tokens:] if self.params.logprobs is not None else None
        self.num_emitted_tokens += len(new_tokens)
        delta = self.detokenizer.pop_delta(final=self.finish_reason is not None)
        out = StepOutput(self.seq_id, new_tokens, delta, self.finish_reason, self.stats,
                         logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=self.index)
        if self.finish_reason is not None:
            out.k_counts, out.mean_speculation_length = dict(self.k_counts), self.mean_speculation_length
            out.num_cached_tokens = self.num_cached_tokens
        return out

    def completion(self, finish_reason: str) -> Completion:
        """The finished sequence, for callers that do not stream."""
        return Completion(self.seq_id, self.token_ids[:self.prompt_len], self.output_token_ids,
                          self.detokenizer.text, finish_reason, self.stats,
                          self.logprobs if self.params.logprobs is not None else None,
                          self.prompt_logprobs)


@dataclass
class StepOutput:
    """What one step produced for one sequence (streaming reads these)."""

    seq_id: int
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stats: SpecStats
    k_counts: dict[int, int] | None = None  # on the last output: decode steps per K drafted
    num_cached_tokens: int | None = None    # on the last output: prompt tokens the cache had
    mean_speculation_length: float = 0.0    # on the last output: mean K over decode steps
    error: Exception | None = None          # finish_reason "error": why this request failed
    logprobs: list | None = None            # with params.logprobs: new_token_ids' (Sequence.logprobs)
    prompt_logprobs: list | None = None     # on the prefill's output: Sequence.prompt_logprobs
    index: int = 0                          # Sequence.index: the choice of its request


@dataclass
class Completion:
    """A finished sequence, for callers that do not stream."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    logprobs: list | None = None  # with params.logprobs: one (logprob, top) per output token
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: prompt tokens 1..
