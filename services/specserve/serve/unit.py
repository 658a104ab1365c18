"""SpeculationUnit: one Serve replica and the two groups it starts = one unit.

The replica (the unit's coordinator process) runs in bundle 0 of its placement group
(``[coordinator, (draft), target ranks]``, STRICT_PACK) and starts the draft and target groups
as child actors in the other bundles. Requests arrive as a
:class:`~specserve.serve.unit_messages.UnitRequest` (token ids: the ingress tokenizes and validates)
and leave as a stream: a :class:`~specserve.serve.unit_messages.StreamStart` with the speculation
decision, then :class:`~specserve.serve.unit_messages.StreamDelta` chunks, the last one with usage.
Scaling replicas scales whole units; KV caches never cross units.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import ray
from ray import serve

from specserve.config import UnitConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.grammar import CompiledGrammar
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.request import EngineRequest
from specserve.engine.step.sequence import StepOutput
from specserve.engine.step.stats import SpecStats
from specserve.errors import InvalidRequestError
from specserve.serve.autoscaling import NO_GATE, Fleet
from specserve.serve.draft_group import DraftGroup
from specserve.serve.engine_loop import EngineLoop
from specserve.serve.metrics import UnitReporter
from specserve.serve.policy import SpeculationPolicy
from specserve.serve.target_group import TargetGroup
from specserve.serve.unit_messages import (
    Decision,
    StreamDelta,
    StreamStart,
    Timing,
    UnitRequest,
    UnitSnapshot,
)

log = logging.getLogger(__name__)


class SpeculationUnit:
    """Serve deployment class (options are set by ``deploy/app.py``: the deployment class
    itself stays free of wiring)."""

    def __init__(self, config: dict, *, in_ingress: bool = False) -> None:
        """``in_ingress``: built by the ingress in its own process (``LocalUnit``), which
        reads :meth:`metrics_snapshot` at each scrape: no metrics hub."""
        cfg = UnitConfig.model_validate(config)
        self.cfg = cfg
        pg = ray.util.get_current_placement_group()
        spec = cfg.engine.speculative
        self.method = spec.method
        context = serve.get_replica_context()
        self.unit_id = context.replica_id.unique_id
        self.draft_name = f"draft-{self.unit_id}"
        # The tokenizer loads (a second or two, mostly imports) while the ranks start in
        # their own processes; first, where the target loads here (transformers' lazy
        # imports are not safe from two threads at once). The target before the draft: the
        # draft drafts over the target's vocabulary (its own may be padded differently,
        # draft_model.py).
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, resolve(cfg.engine.target.source,
                                                            cfg.engine.target.cache_dir))
            if cfg.target_here:
                tokenizer.result()
            self.target_group = TargetGroup(cfg, pg, 2 if cfg.draft_in_bundle else 1,
                                            name=f"target-{self.unit_id}")
            self.draft_group = (
                DraftGroup.launch(cfg, pg, 1, name=self.draft_name,  # bundle 1: its own or rank 0's
                                  target_vocab_size=self.target_group.vocab_size,
                                  eos_token_ids=self.target_group.info["eos_token_ids"])
                if cfg.has_draft_group else None)
            tokenizer = tokenizer.result()
        self.engine = assemble_engine(self.target_group, tokenizer,
                                      frozenset(self.target_group.info["eos_token_ids"]), spec,
                                      draft=self.draft_group,
                                      chunked_prefill_size=cfg.engine.chunked_prefill_size)
        self.policy = SpeculationPolicy(cfg.router, method=spec.method,
                                        default_k=spec.num_speculative_tokens,
                                        adaptive=self.engine.controller is not None,
                                        max_num_seqs=cfg.engine.max_num_seqs)
        self.decisions: dict[tuple[str, str], int] = {}  # Decision.key -> requests, since start
        self.reporter = UnitReporter(context.app_name, self.unit_id, self.metrics_snapshot,
                                     to_hub=not in_ingress)
        self.loop = EngineLoop(self.engine, max_queue_len=cfg.max_queue_len,
                               draft_probe=self.draft_group.probe if self.draft_group else None,
                               draft_retry_s=cfg.draft_retry_s,
                               draft_max_retry_s=cfg.draft_retry_max_s,
                               restart_target=self.target_group.restart,
                               max_restarts=cfg.target_restart_attempts)

    async def generate(self, asked: UnitRequest) -> AsyncIterator[StreamStart | StreamDelta]:
        """One :class:`StreamStart`, then :class:`StreamDelta` chunks of the request's ``n``
        choices (``index``); each choice's last chunk has its ``finish_reason``, and the last
        one of all carries the ``usage`` (the prompt once, the completions summed, as
        OpenAI's) and, for the ingress's metrics, the ``timing``."""
        request = asked.request
        params, n = request.params, request.n
        load = self.loop.num_streams  # the unit's load before this request
        with self.loop.admission(n):  # 503 or 429 here, before the stream says 200
            grammar = None
            if request.grammar is not None:  # off the event loop: milliseconds, bounded by fuel
                grammar = await asyncio.to_thread(self._compile, request)
            decision = self.policy.decide(asked.speculation, max_tokens=params.max_tokens,
                                          load=load, key=asked.class_key,
                                          draft_available=self.engine.draft.available)
            self.decisions[decision.key] = self.decisions.get(decision.key, 0) + 1
            yield StreamStart(decision)
            # Closed when this generator is: a reader in this process (the ingress's, with
            # unit_in_ingress) ends it by closing it, not by cancelling its task.
            async with aclosing(self._stream(asked, decision, grammar)) as deltas:
                async for delta in deltas:
                    yield delta

    def _compile(self, request: EngineRequest) -> CompiledGrammar:
        """The request's grammar, compiled once (the engine's compiler, which an in-process
        draft shares), or the refusal naming the API field that asked for it."""
        if self.engine.grammars is None:
            raise InvalidRequestError(f"{request.grammar_param}: structured outputs are off on this "
                                      "server (its log says why)", param=request.grammar_param)
        try:
            return self.engine.grammars.compile(request.grammar)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{request.grammar_param}: {exc}",
                                      param=request.grammar_param) from None

    async def _stream(self, asked: UnitRequest, decision: Decision, grammar
                      ) -> AsyncIterator[StreamDelta]:
        """The request's chunks: per choice as its tokens come (streaming) or once, whole,
        when it finishes (``_Choice`` gathers them: the one place a choice is regrouped)."""
        request = asked.request
        params, n = request.params, request.n
        # A client that does not stream gets one chunk per choice: every yielded chunk is a
        # Ray message, and per token they cost the forward pass CPU time on a small machine.
        choices = [_Choice(time.perf_counter()) for _ in range(n)]
        prompt_logprobs, unfinished = None, n
        outs = self.loop.generate(request, grammar, adaptive=decision.adaptive,
                                  num_speculative_tokens=decision.num_speculative_tokens)
        async with aclosing(outs):  # (its ``finally`` aborts what is still running)
            async for out in outs:
                choice = choices[out.index]
                choice.add(out, time.perf_counter(), params.logprobs is not None, asked.token_ids)
                if out.prompt_logprobs is not None:  # the first choice's prefill scored the prompt
                    prompt_logprobs = out.prompt_logprobs
                if not asked.stream and out.finish_reason is None:
                    continue
                # echo: every choice begins with the prompt, whose scores go with its first chunk
                # (the first choice's prefill computed them, a step before any other's output)
                scored = None if choice.sent_prompt else prompt_logprobs
                choice.sent_prompt = True
                text, logprobs, ids = choice.pop(params.logprobs is not None, asked.token_ids)
                if out.finish_reason is None:
                    yield StreamDelta(text, logprobs=logprobs, prompt_logprobs=scored, index=out.index,
                                      num_tokens=choice.clock.num_tokens, token_ids=ids)
                    continue
                self.policy.observe(asked.class_key, decision, out.stats.num_draft_tokens,
                                    out.stats.num_accepted_tokens, self._break_even())
                unfinished -= 1
                usage = timing = None
                if unfinished == 0:
                    usage = _usage(len(request.prompt_token_ids), choices, decision,
                                   self._estimated_speedup())
                    timing = _Clock.merged([c.clock for c in choices])
                yield StreamDelta(text, out.finish_reason, usage=usage, timing=timing,
                                  logprobs=logprobs, prompt_logprobs=scored, index=out.index,
                                  num_tokens=choice.clock.num_tokens, token_ids=ids)

    def metrics_snapshot(self) -> UnitSnapshot:
        """Live numbers for the metrics hub (``serve/metrics.py`` names them)."""
        engine, ctl, kv = self.engine, self.engine.controller, self._kv_stats()
        return UnitSnapshot(
            method=self.method or "none",
            num_requests_running=self.loop.num_running,
            num_requests_waiting=self.loop.num_waiting,
            free_slots=engine.target.num_free_slots,
            num_slots=self.cfg.engine.max_num_seqs,
            draft_available=int(engine.draft.available),
            target_available=int(self.loop.target_available),
            target_restarts=self.loop.num_target_restarts,
            estimated_speedup=ctl.estimated_speedup if ctl is not None and ctl.calibrated else 1.0,
            speculation_length_current=ctl.k if ctl is not None else
            (engine.num_speculative_tokens if self.method else 0),
            concurrency_gate_open=int(self.policy.gate.open),
            requests_admitted=self.loop.num_admitted,
            requests_aborted=self.loop.num_aborted,
            router_decisions=dict(self.decisions),
            engine=engine.counters.snapshot(),
            autoscaling_load=Fleet.of_unit(self._autoscaling_signals(kv)).load(1),
            kv_blocks_total=kv.get("blocks_total", 0), kv_blocks_free=kv.get("blocks_free", 0),
            prefix_cache_queries=kv.get("prefix_cache_queries", 0),
            prefix_cache_hits=kv.get("prefix_cache_hits", 0),
            proposer_state=engine.draft.proposer.state() if engine.draft.proposer is not None else {},
            received={name: (group.received.bytes, group.received.calls)
                      for name, group in (("target", self.target_group), ("draft", self.draft_group))
                      if group is not None},
        )

    def _break_even(self) -> float | None:
        ctl = self.engine.controller
        return ctl.break_even_acceptance() if ctl is not None else None

    def _estimated_speedup(self) -> float | None:
        ctl = self.engine.controller
        return round(ctl.estimated_speedup, 4) if ctl is not None and ctl.calibrated else None

    def _kv_stats(self) -> dict:
        """The target's KV layout and, paged, its blocks and prefix cache (tokens looked up
        and found cached, as vLLM counts its prefix cache queries and hits)."""
        table = self.target_group.table
        if not hasattr(table, "pool"):
            return {"layout": "slots"}
        pool = table.pool
        return {"layout": "paged", "block_size": table.block_size, "blocks_total": pool.num_blocks,
                "blocks_free": pool.num_free, "blocks_cached": pool.num_cached,
                "prefix_cache_queries": table.stats.queries, "prefix_cache_hits": table.stats.hits,
                "evictions": pool.evictions}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The signals unit autoscaling scales on (``serve/autoscaling.py``), which Serve
        collects every ``autoscaling.metrics_interval_s`` and averages."""
        return self._autoscaling_signals(self._kv_stats())

    def _autoscaling_signals(self, kv: dict) -> dict[str, float]:
        ctl = self.engine.controller
        slots = self.cfg.engine.max_num_seqs
        used = (1 - kv["blocks_free"] / kv["blocks_total"] if kv.get("blocks_total")
                else 1 - self.engine.target.num_free_slots / slots)
        return {"seqs": float(self.loop.num_running + self.loop.num_waiting),
                "max_seqs": float(slots), "kv_used": float(used),
                "gate_off_at": float(self.policy.gate.off_at if self.method else NO_GATE),
                "speedup": float(ctl.estimated_speedup if ctl is not None and ctl.calibrated else 1.0)}

    def record_routing_stats(self) -> dict:
        return {"load": self.loop.load, "free_slots": self.engine.target.num_free_slots}

    def stats(self) -> dict:
        """Live numbers of this unit: the JSON body of ``/v1/units/stats`` (the ingress passes
        it through; tests and operators read it)."""
        loop, counters = self.loop, self.engine.counters.snapshot()
        return {"running": loop.num_running, "waiting": loop.num_waiting,
                "requests_admitted": loop.num_admitted, "requests_aborted": loop.num_aborted,
                "prefill_tokens": counters.num_prefill_tokens,
                "prefill_tokens_shared": counters.num_forked_tokens,
                "prefill_chunks": counters.num_prefill_chunks,
                "preemptions": counters.num_preemptions,
                "kv_cache": self._kv_stats(),
                "weights": self.target_group.info.get("weights"),  # rank 0's: bytes held, blocks
                "free_slots": self.engine.target.num_free_slots,
                "num_slots": self.cfg.engine.max_num_seqs,
                "draft_available": self.engine.draft.available,
                "draft_fallbacks": counters.num_draft_fallbacks,
                "draft_probes": loop.draft_watch.num_probes if loop.draft_watch else 0,
                "target_available": loop.target_available,
                "target_restarts": loop.num_target_restarts,
                "spec": counters.spec.as_dict(),
                "spec_by_proposer": {name: s.as_dict() for name, s in counters.by_proposer.items()},
                "spec_tree_drafts": counters.num_tree_drafts,
                "times": counters.times.as_dict(),
                "router": {"decisions": {f"{on}:{reason}": n
                                         for (on, reason), n in self.decisions.items()},
                           "concurrency_gate_open": self.policy.gate.open,
                           "concurrency_gate_flips": self.policy.gate.flips,
                           "low_acceptance_classes": sorted(
                               k for k, s in self.policy.acceptance.classes.items() if s.low),
                           "break_even_acceptance": self._break_even()},
                "controller": self._controller_stats()}

    def _controller_stats(self) -> dict | None:
        ctl = self.engine.controller
        if ctl is None:
            return None
        acc, got = ctl.acceptance.rates()
        return {"k": ctl.k, "calibrated": ctl.calibrated, "steps": ctl.steps,
                "estimated_speedup": round(ctl.estimated_speedup, 4),
                "k_source": ctl.k_source,
                "acceptance_by_position": [round(float(a), 4) for a in acc],
                "draft_yield_by_position": [round(float(g), 4) for g in got]}

    def draft_actor_name(self) -> str | None:
        """The draft actor's name in the ``specserve`` namespace (fault-injection tests)."""
        return self.draft_name if self.draft_group else None

    def target_actor_names(self) -> list[str]:
        """The current target ranks' names in the ``specserve`` namespace (fault injection)."""
        return self.target_group.rank_names()

    def inject_fault_token(self, token_id: int | None) -> None:
        """Fault injection (handle call only, not HTTP): a request whose prompt holds
        ``token_id`` makes its step raise, as a request-caused failure would (None: off)."""
        self.engine.fault_token = token_id

    def stall(self, seconds: float, release: str | None = None) -> str:
        """Fault injection (handle call only, not HTTP): hang the engine for ``seconds`` (at
        most a minute), or with ``release`` until that file exists (at most ten); returns
        this unit's id (which unit the call reached)."""
        self.loop.stall(min(float(seconds), 600.0 if release else 60.0), release)
        return self.unit_id

    def end_stall(self) -> None:
        """Fault injection: end a :meth:`stall` now."""
        self.loop.end_stall()

    def check_health(self) -> None:
        if not self.loop._thread.is_alive():
            raise RuntimeError("the engine loop has stopped")
        if self.loop.draft_watch is not None and not self.loop.draft_watch._thread.is_alive():
            raise RuntimeError("the draft watch has stopped")
        if self.loop.broken:
            raise RuntimeError("the target group could not be restarted")

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop reporting and stop the engine loop (Serve's replica stop, or the ingress's
        where the unit runs in it)."""
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()


class _Clock:
    """A choice's latencies as the unit sees them (arrival to outputs), for the metrics."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.num_tokens = 0

    def output(self, now: float, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.num_tokens += num_tokens

    @staticmethod
    def merged(clocks: list[_Clock]) -> Timing:
        """A request's timing over its choices: the first token of any, every choice's gaps,
        their mean time per output token, the last token of all."""
        ran = [c for c in clocks if c.first is not None]
        if not ran:
            return Timing()
        tpots = [(c.last - c.first) / (c.num_tokens - 1) for c in ran if c.num_tokens > 1]
        return Timing(ttft_s=min(c.first for c in ran) - ran[0].arrival,
                      itl_s=[g for c in ran for g in c.gaps],
                      tpot_s=sum(tpots) / len(tpots) if tpots else None,
                      e2e_s=max(c.last for c in ran) - ran[0].arrival)


class _Choice:
    """One of a request's ``n`` sequences, as the unit streams it."""

    def __init__(self, arrival: float) -> None:
        self.clock = _Clock(arrival)
        self.pending: list[str] = []
        self.logprobs: list = []
        self.token_ids: list[int] = []
        self.sent_prompt = False  # its first chunk (with an echo's prompt scores) went out
        self.last: StepOutput | None = None

    def add(self, out: StepOutput, now: float, logprobs: bool, token_ids: bool) -> None:
        self.clock.output(now, len(out.new_token_ids))
        self.pending.append(out.text_delta)
        if logprobs and out.logprobs is not None:
            self.logprobs += [(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.logprobs)]
        if token_ids:
            self.token_ids += out.new_token_ids
        self.last = out

    def pop(self, logprobs: bool, token_ids: bool) -> tuple[str, list | None, list[int] | None]:
        """The text (and logprobs items, and token ids) not yet sent."""
        text, self.pending = "".join(self.pending), []
        items, self.logprobs = (self.logprobs if logprobs else None), []
        ids, self.token_ids = (self.token_ids if token_ids else None), []
        return text, items, ids


def _usage(prompt_tokens: int, choices: list[_Choice], decision: Decision,
           estimated_speedup: float | None) -> dict:
    """OpenAI's usage (the prompt once, every choice's completion), with our ``speculation``
    block over all of them."""
    completion_tokens = sum(c.clock.num_tokens for c in choices)
    stats, k_counts = SpecStats(), {}
    for c in choices:
        stats.merge(c.last.stats)
        for k, count in (c.last.k_counts or {}).items():
            k_counts[k] = k_counts.get(k, 0) + count
    steps = sum(k_counts.values())
    mean_k = sum(k * count for k, count in k_counts.items()) / steps if steps else 0.0
    cached = max((c.last.num_cached_tokens or 0) for c in choices)  # n > 1: the first's prefill
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's: prefix-cache hits
            "speculation": {"enabled": decision.enabled, "reason": decision.reason,
                            "method": decision.method,
                            "num_speculative_tokens": decision.num_speculative_tokens,
                            "k_mode": "adaptive" if decision.adaptive else "fixed",
                            "mean_speculation_length": round(mean_k, 4),
                            "estimated_speedup": estimated_speedup,
                            **stats.as_dict()}}

