"""A request as the engine runs it, checked once where it enters.

Every way in builds an :class:`EngineRequest` with :func:`check_request`: the HTTP ingress
(against the deployment's :class:`RequestLimits`, before any unit is involved) and the
engine's in-process entry points for the command line, benchmarks and tests
(:meth:`SpecDecodeEngine.add_request <specserve.engine.spec_decode.SpecDecodeEngine.add_request>`,
against the loaded model's). Past it nothing refuses a request for its content: the engine
trusts what it is given and asserts only its own invariants. The one check left for later is
the grammar's compile, which needs the target's vocabulary and so happens where the masks are
filled (the unit, once per request; a draft in another process builds its own matcher from
the same spec), with the refusal naming the field that asked (:attr:`EngineRequest.grammar_param`).

The checks, each here and nowhere else: a prompt that is empty, holds a token id outside the
vocabulary or leaves no room for one output token; a ``logit_bias`` token outside the
vocabulary; ``min_tokens`` above ``max_tokens``; ``n`` beyond the
samples a unit runs side by side; a seed whose samples leave the seed range (sample ``i``
draws with ``seed + i``). The bounds of each field alone are its type's
(:class:`~specserve.config.SamplingParams`, the API's request models); the server's own caps
on ``max_tokens`` (and OpenAI's refusal of a ``max_tokens`` past the context, where the
engine would stop at the context) are the ingress's.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import MAX_SEED, SamplingParams
from specserve.engine.grammar import GrammarSpec
from specserve.errors import ContextLengthExceeded, InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's and the unit's sizes."""

    vocab_size: int     # token ids are in [0, vocab_size)
    max_model_len: int  # prompt + output tokens, at most
    max_num_seqs: int   # sequences a unit runs side by side: the most samples (n) of one prompt


@dataclass(frozen=True)
class EngineRequest:
    """One request, checked (:func:`check_request`): plain data that crosses the ingress /
    unit hop as it is."""

    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1                            # samples of the prompt, one sequence each
    grammar: GrammarSpec | None = None    # a structured output's, compiled where masks are filled
    grammar_param: str = "response_format"  # the API field that asked for it (its refusal names it)


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits, *,
                  n: int = 1, grammar: GrammarSpec | None = None,
                  grammar_param: str = "response_format") -> EngineRequest:
    """The request as the engine runs it, or :class:`~specserve.errors.InvalidRequestError`
    naming the API field at fault (``param``)."""
    prompt_len = len(prompt_token_ids)
    if not prompt_len:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= limits.vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {limits.vocab_size})", param="prompt")
    if prompt_len >= limits.max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {prompt_len}, which must leave room for at least one output token", param="prompt")
    if n < 1:
        raise InvalidRequestError("n: at least 1", param="n")
    if n > limits.max_num_seqs:
        raise InvalidRequestError(f"n: at most {limits.max_num_seqs} (the unit's max_num_seqs: the "
                                  "samples run side by side)", param="n")
    if params.logit_bias and max(t for t, _ in params.logit_bias) >= limits.vocab_size:
        raise InvalidRequestError(f"logit_bias: token ids must be in [0, {limits.vocab_size})",
                                  param="logit_bias")
    if params.allowed_token_ids and max(params.allowed_token_ids) >= limits.vocab_size:
        raise InvalidRequestError(f"allowed_token_ids: token ids must be in [0, {limits.vocab_size})",
                                  param="allowed_token_ids")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError(f"min_tokens: at most max_tokens ({params.max_tokens})",
                                  param="min_tokens")
    if params.seed is not None and params.seed + n - 1 > MAX_SEED:
        raise InvalidRequestError(f"seed: with n = {n}, at most {MAX_SEED - n + 1} (sample i draws "
                                  "with seed + i, which must stay at most 2**63 - 1)", param="seed")
    return EngineRequest(list(prompt_token_ids), params, n, grammar, grammar_param)
