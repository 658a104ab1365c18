"""What crosses the hop between the ingress and a unit (a Ray call and the stream it returns):
:class:`UnitRequest` in, :class:`StreamStart` then :class:`StreamDelta` chunks back, and
:class:`UnitSnapshot` to the metrics hub; each defined once and never re-validated on the
way (the API's request models are in :mod:`~specserve.serve.protocol`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.engine.request import EngineRequest
from specserve.engine.step.stats import EngineCounters
from specserve.serve.protocol import SpeculationOptions


@dataclass(frozen=True)
class UnitRequest:
    """A request as the ingress hands it to a unit: the engine's request (tokenized,
    checked), and what the unit decides with."""

    request: EngineRequest                  # prompt, parameters, n (choices), grammar
    speculation: SpeculationOptions | None  # the client's control; None: the policy decides
    stream: bool                            # False: the unit sends one chunk per choice, at its end
    class_key: str                          # the acceptance class: route|key id|user|traffic class|shape
    token_ids: bool = False                 # the chunks carry their output token ids (return_token_ids)


@dataclass(frozen=True)
class Decision:
    """The speculation policy's answer for one request (``serve/policy.py``), which the
    client sees in the ``x-speculation`` header and ``usage.speculation``."""

    enabled: bool
    reason: str
    method: str | None
    num_speculative_tokens: int  # K for this request (the most, when adaptive); 0 when off
    adaptive: bool = False       # the coordinator picks K per step, up to num_speculative_tokens

    @property
    def key(self) -> tuple[str, str]:
        """``("on" | "off", reason)``: how decisions are counted (the metric's labels)."""
        return ("on" if self.enabled else "off", self.reason)

    def header(self) -> str:
        """The ``x-speculation`` header value, e.g. ``on; reason=default; method=ngram; k=4;
        k_mode=adaptive``."""
        parts = [self.key[0], f"reason={self.reason}"]
        if self.enabled:
            parts += [f"method={self.method}", f"k={self.num_speculative_tokens}",
                      f"k_mode={'adaptive' if self.adaptive else 'fixed'}"]
        return "; ".join(parts)


@dataclass(frozen=True)
class StreamStart:
    """A unit's first chunk for a request: the decision, before any text."""

    decision: Decision


@dataclass(frozen=True)
class Timing:
    """A request's latencies as its unit measured them (arrival to outputs), in seconds."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    e2e_s: float | None = None


@dataclass(frozen=True)
class StreamDelta:
    """Text a unit produced for one choice; a choice's last chunk has its ``finish_reason``,
    and the request's last chunk also the ``usage`` object of the response (OpenAI's, with
    our ``speculation`` block) and the ``timing`` for metrics."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timing: Timing | None = None
    # with SamplingParams.logprobs: the chunk's tokens, (token, logprob, [(token, logprob)...])
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # with SamplingParams.prompt_logprobs, on a choice's first chunk: prompt tokens 1..,
    # (logprob, top)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    index: int = 0  # the choice (of the request's n) this chunk belongs to
    num_tokens: int = 0  # the choice's output tokens so far, this chunk's included
    token_ids: list[int] | None = None  # with UnitRequest.token_ids: this chunk's output tokens


@dataclass(frozen=True)
class UnitSnapshot:
    """A unit's live numbers, sent to the metrics hub every few seconds: its own (each field a
    metric of ``serve/metrics.py`` of the same name, ``docs/METRICS.md``) and its engine's
    counters whole (``engine``: ``metrics.py`` names the metrics it feeds)."""

    method: str
    num_requests_running: int
    num_requests_waiting: int
    free_slots: int
    num_slots: int
    draft_available: int
    target_available: int
    target_restarts: int
    estimated_speedup: float
    speculation_length_current: int
    concurrency_gate_open: int
    requests_admitted: int
    requests_aborted: int
    router_decisions: dict[tuple[str, str], int]  # Decision.key -> requests
    engine: EngineCounters = field(default_factory=EngineCounters)  # a copy (snapshot())
    autoscaling_load: float = 0.0      # its load by unit autoscaling's rule (serve/autoscaling.py)
    kv_blocks_total: int = 0           # a paged target's KV blocks (0: the slot layout)
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0      # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0         # ... found there (not computed)
    proposer_state: dict[str, float] = field(default_factory=dict)  # Proposer.state()
    # what the unit received from each group: source -> (bytes, messages)
    received: dict[str, tuple[int, int]] = field(default_factory=dict)
