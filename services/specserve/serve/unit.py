"""SpeculationUnit: one Serve replica = one speculation coordinator with its two groups.

The replica runs in bundle 0 of its placement group (``[coordinator, (draft), target ranks]``,
STRICT_PACK) and starts the draft and target groups as child actors in the other bundles.
Requests arrive as a :class:`~specserve.serve.protocol.UnitRequest` (token ids: the ingress
tokenizes and validates) and leave as a stream: a :class:`~specserve.serve.protocol.StreamStart`
with the speculation decision, then :class:`~specserve.serve.protocol.StreamDelta` chunks, the
last one with usage.
Scaling replicas scales whole units; KV caches never cross units.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from specserve.config import UnitConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.sequence import StepOutput
from specserve.serve.draft_group import DraftGroup
from specserve.serve.engine_loop import EngineLoop
from specserve.serve.metrics import UnitReporter
from specserve.serve.policy import SpeculationPolicy
from specserve.serve.protocol import (
    Decision,
    StreamDelta,
    StreamStart,
    Timing,
    UnitRequest,
    UnitSnapshot,
)
from specserve.serve.target_group import TargetGroup

log = logging.getLogger(__name__)


class SpeculationUnit:
    """Serve deployment class (options are set by ``deploy/app.py``: the deployment class
    itself stays free of wiring)."""

    def __init__(self, config: dict) -> None:
        cfg = UnitConfig.model_validate(config)
        self.cfg = cfg
        pg = ray.util.get_current_placement_group()
        spec = cfg.engine.speculative
        self.method = spec.method
        context = serve.get_replica_context()
        self.unit_id = context.replica_id.unique_id
        self.draft_name = f"draft-{self.unit_id}"
        # The target first: the draft drafts over the target's vocabulary (its own may be
        # padded differently, draft_model.py).
        self.target = TargetGroup(cfg, pg, 2 if cfg.draft_in_bundle else 1,
                                        name=f"target-{self.unit_id}")
        self.draft = (DraftGroup.launch(cfg, pg, 1, name=self.draft_name,
                                                 target_vocab_size=self.target.vocab_size)
                      if cfg.has_draft_group else None)
        tokenizer = load_tokenizer(resolve(cfg.engine.target.source, cfg.engine.target.cache_dir))
        self.engine = assemble_engine(self.target, tokenizer,
                                      frozenset(self.target.info["eos_token_ids"]), spec,
                                      draft=self.draft)
        self.policy = SpeculationPolicy(cfg.router, method=spec.method,
                                        default_k=spec.num_speculative_tokens,
                                        adaptive=self.engine.controller is not None,
                                        max_num_seqs=cfg.engine.max_num_seqs)
        self.decisions: dict[tuple[str, str], int] = {}  # Decision.key -> requests, since start
        self.reporter = UnitReporter(context.app_name, self.unit_id, self.metrics_snapshot)
        self.core = EngineLoop(self.engine, max_queue_len=cfg.max_queue_len,
                                draft_probe=self.draft.probe if self.draft else None,
                                draft_retry_s=cfg.draft_retry_s,
                                draft_max_retry_s=cfg.draft_retry_max_s,
                                restart_target=self.target.restart,
                                max_restarts=cfg.target_restart_attempts)

    async def generate(self, request: UnitRequest) -> AsyncIterator[StreamStart | StreamDelta]:
        """One :class:`StreamStart`, then :class:`StreamDelta` chunks; the last carries the
        ``usage`` and, for the ingress's metrics, the ``timing``."""
        params = request.params
        self.core.check_admission()
        decision = self.policy.decide(request.speculation, max_tokens=params.max_tokens,
                                      load=self.core.num_streams, key=request.class_key,
                                      draft_available=self.engine.draft_available)
        self.decisions[decision.key] = self.decisions.get(decision.key, 0) + 1
        yield StreamStart(decision)
        # A client that does not stream gets one chunk: every yielded chunk is a Ray message,
        # and per token they cost the forward pass CPU time on a small machine.
        completion_tokens, pending, logprobs, prompt_logprobs = 0, [], [], None
        clock = _Clock(time.perf_counter())
        async for out in self.core.generate(request.prompt_token_ids, params,
                                            num_speculative_tokens=decision.num_speculative_tokens,
                                            adaptive=decision.adaptive):
            completion_tokens += len(out.new_token_ids)
            clock.output(time.perf_counter(), len(out.new_token_ids))
            pending.append(out.text_delta)
            if out.logprobs is not None:
                logprobs += [(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.logprobs)]
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            if not request.stream and out.finish_reason is None:
                continue
            text, pending = "".join(pending), []
            chunk_logprobs, logprobs = (logprobs if params.logprobs is not None else None), []
            scored, prompt_logprobs = prompt_logprobs, None
            if out.finish_reason is None:
                yield StreamDelta(text, logprobs=chunk_logprobs, prompt_logprobs=scored)
                continue
            self.policy.observe(request.class_key, decision, out.stats.num_draft_tokens,
                                out.stats.num_accepted_tokens, self._break_even())
            yield StreamDelta(text, out.finish_reason,
                              usage=_usage(len(request.prompt_token_ids), completion_tokens, out,
                                           decision, self._estimated_speedup()),
                              timing=clock.timing(completion_tokens), logprobs=chunk_logprobs,
                              prompt_logprobs=scored)

    def metrics_snapshot(self) -> UnitSnapshot:
        """Live numbers for the metrics hub (``serve/metrics.py`` names them)."""
        engine, ctl = self.engine, self.engine.controller
        spec = engine.stats
        return UnitSnapshot(
            method=self.method or "none",
            num_requests_running=self.core.num_running,
            num_requests_waiting=self.core.num_waiting,
            free_slots=engine.target.num_free_slots,
            num_slots=self.cfg.engine.max_num_seqs,
            draft_available=int(engine.draft_available),
            target_available=int(self.core.target_available),
            target_restarts=self.core.num_target_restarts,
            estimated_speedup=ctl.estimated_speedup if ctl is not None and ctl.calibrated else 1.0,
            speculation_length_current=ctl.k if ctl is not None else
            (engine.num_speculative_tokens if self.method else 0),
            concurrency_gate_open=int(self.policy.gate.open),
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            accepted_per_position=list(spec.accepted_per_position),
            draft_fallbacks=engine.num_draft_fallbacks,
            requests_admitted=self.core.num_admitted,
            requests_aborted=self.core.num_aborted,
            router_decisions=dict(self.decisions),
            k_counts=dict(engine.k_counts),
            proposer_state=engine.proposer.state() if engine.proposer is not None else {},
            by_proposer={name: (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
                         for name, s in engine.by_proposer.items()},
            tree_sizes=dict(spec.tree_sizes), tree_depths=dict(spec.tree_depths),
            tree_ranks=_by_rank(spec.tree_ranks),
            received={name: (group.received.bytes, group.received.calls)
                      for name, group in (("target", self.target), ("draft", self.draft))
                      if group is not None},
        )

    def _break_even(self) -> float | None:
        ctl = self.engine.controller
        return ctl.break_even_acceptance() if ctl is not None else None

    def _estimated_speedup(self) -> float | None:
        ctl = self.engine.controller
        return round(ctl.estimated_speedup, 4) if ctl is not None and ctl.calibrated else None

    def record_routing_stats(self) -> dict:
        return {"load": self.core.load, "free_slots": self.engine.target.num_free_slots}

    def stats(self) -> dict:
        """Live numbers of this unit: the JSON body of ``/v1/units/stats`` (the ingress passes
        it through; tests and operators read it)."""
        return {"running": self.core.num_running, "waiting": self.core.num_waiting,
                "requests_admitted": self.core.num_admitted,
                "requests_aborted": self.core.num_aborted,
                "free_slots": self.engine.target.num_free_slots,
                "num_slots": self.cfg.engine.max_num_seqs,
                "draft_available": self.engine.draft_available,
                "draft_fallbacks": self.engine.num_draft_fallbacks,
                "draft_probes": self.core.draft_watch.num_probes if self.core.draft_watch else 0,
                "target_available": self.core.target_available,
                "target_restarts": self.core.num_target_restarts,
                "spec": self.engine.stats.as_dict(),
                "spec_by_proposer": {name: s.as_dict() for name, s in self.engine.by_proposer.items()},
                "spec_tree_drafts": self.engine.num_tree_drafts,
                "times": self.engine.times.as_dict(),
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
        return self.draft_name if self.draft else None

    def target_actor_names(self) -> list[str]:
        """The current target ranks' names in the ``specserve`` namespace (fault injection)."""
        return self.target.rank_names()

    def inject_fault_token(self, token_id: int | None) -> None:
        """Fault injection (handle call only, not HTTP): a request whose prompt holds
        ``token_id`` makes its step raise, as a request-caused failure would (None: off)."""
        self.engine.fault_token = token_id

    def stall(self, seconds: float) -> None:
        """Fault injection (handle call only, not HTTP): hang the engine for ``seconds``."""
        self.core.stall(min(float(seconds), 60.0))

    def check_health(self) -> None:
        if not self.core._thread.is_alive():
            raise RuntimeError("the coordinator loop has stopped")
        if self.core.draft_watch is not None and not self.core.draft_watch._thread.is_alive():
            raise RuntimeError("the draft watch has stopped")
        if self.core.broken:
            raise RuntimeError("the target group could not be restarted")

    def __del__(self) -> None:
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()


class _Clock:
    """A request's latencies as the unit sees them (arrival to outputs), for the metrics."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []

    def output(self, now: float, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def timing(self, num_tokens: int) -> Timing:
        if self.first is None:
            return Timing()
        tpot = (self.last - self.first) / (num_tokens - 1) if num_tokens > 1 else None
        return Timing(ttft_s=self.first - self.arrival, itl_s=self.gaps, tpot_s=tpot,
                      e2e_s=self.last - self.arrival)


def _usage(prompt_tokens: int, completion_tokens: int, out: StepOutput, decision: Decision,
           estimated_speedup: float | None) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "speculation": {"enabled": decision.enabled, "reason": decision.reason,
                            "method": decision.method,
                            "num_speculative_tokens": decision.num_speculative_tokens,
                            "k_mode": "adaptive" if decision.adaptive else "fixed",
                            "mean_speculation_length": round(out.mean_speculation_length, 4),
                            "estimated_speedup": estimated_speedup,
                            **out.stats.as_dict()}}


def _by_rank(ranks: dict[tuple[int, int], int]) -> dict[int, int]:
    """Kept tree nodes per sibling rank, over every depth (the per-depth counts are in
    ``/v1/units/stats``; a depth label on /metrics would multiply its series)."""
    out: dict[int, int] = {}
    for (_, rank), n in ranks.items():
        out[rank] = out.get(rank, 0) + n
    return out
