"""SpeculationUnit: one Serve replica = one speculation coordinator with its two groups.

The replica runs in bundle 0 of its placement group (``[coordinator, (draft), target ranks]``,
STRICT_PACK) and starts the draft and target groups as child actors in the other bundles.
Requests arrive as token ids (the ingress tokenizes and validates them) and leave as a stream
of small dicts: first the speculation decision, then text deltas, the last one with usage.
Scaling replicas scales whole units; KV caches never cross units.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import ray
from ray import serve

from specserve.config import SamplingParams, UnitConfig
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.proposers.ngram import NgramProposer
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.stats import SpecStats
from specserve.serve.coordinator import AsyncEngine
from specserve.serve.groups import RemoteProposer, TargetGroup
from specserve.serve.policy import decide

log = logging.getLogger(__name__)


class SpeculationUnit:
    """Serve deployment class (options are set by ``deploy/app.py``: the deployment class
    itself stays free of wiring)."""

    def __init__(self, config: dict) -> None:
        cfg = UnitConfig.model_validate(config, context={"check_files": False})
        self.cfg = cfg
        pg = ray.util.get_current_placement_group()
        spec = cfg.engine.speculative
        self.method = spec.method
        self.draft_name = f"draft-{serve.get_replica_context().replica_id.unique_id}"
        self.draft = (RemoteProposer.start_group(cfg, pg, 1, name=self.draft_name)
                      if cfg.has_draft_group else None)
        self.target = TargetGroup.start(cfg, pg, 2 if cfg.has_draft_group else 1)
        proposer = self.draft or (NgramProposer(min_n=spec.prompt_lookup_min,
                                                max_n=spec.prompt_lookup_max)
                                  if spec.method == "ngram" else None)
        tokenizer = load_tokenizer(resolve(cfg.engine.target.source, cfg.engine.target.cache_dir))
        self.engine = SpecDecodeEngine(self.target, tokenizer,
                                       eos_token_ids=frozenset(self.target.info["eos_token_ids"]),
                                       proposer=proposer,
                                       num_speculative_tokens=spec.num_speculative_tokens)
        self.core = AsyncEngine(self.engine, max_queue_len=cfg.max_queue_len,
                                draft_probe=self.draft.ping if self.draft else None,
                                draft_retry_s=cfg.draft_retry_s)

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """``request``: ``{"prompt_token_ids", "params", "speculation"}``. Yields
        ``{"event": "start", "speculation": ...}``, then ``{"event": "delta", ...}`` chunks."""
        decision = decide(request.get("speculation"), method=self.method,
                          default_k=self.engine.num_speculative_tokens,
                          draft_available=self.engine.draft_available)
        yield {"event": "start", "speculation": {
            "enabled": decision.enabled, "reason": decision.reason, "method": decision.method,
            "num_speculative_tokens": decision.num_speculative_tokens, "header": decision.header()}}
        params = SamplingParams.model_validate(request["params"])
        # A client that does not stream gets one chunk: every yielded chunk is a Ray message,
        # and per token they cost the forward pass CPU time on a small machine.
        per_step = request.get("stream", True)
        completion_tokens, pending = 0, []
        async for out in self.core.generate(request["prompt_token_ids"], params,
                                            spec_len=decision.num_speculative_tokens):
            completion_tokens += len(out.new_token_ids)
            pending.append(out.text_delta)
            if not per_step and out.finish_reason is None:
                continue
            chunk = {"event": "delta", "text": "".join(pending), "finish_reason": out.finish_reason}
            pending = []
            if out.finish_reason is not None:
                chunk["usage"] = _usage(len(request["prompt_token_ids"]), completion_tokens,
                                        out.stats, decision)
            yield chunk

    def record_routing_stats(self) -> dict:
        return {"load": self.core.load, "free_slots": self.engine.target.num_free_slots}

    def stats(self) -> dict:
        """Live numbers of this unit (tests and the metrics exporter read them)."""
        return {"running": self.core.num_running, "waiting": self.core.num_waiting,
                "requests_admitted": self.core.num_admitted,
                "requests_aborted": self.core.num_aborted,
                "free_slots": self.engine.target.num_free_slots,
                "num_slots": self.cfg.engine.max_num_seqs,
                "draft_available": self.engine.draft_available,
                "draft_fallbacks": self.engine.num_draft_fallbacks,
                "spec": self.engine.stats.as_dict(), "times": self.engine.times.as_dict()}

    def draft_actor_name(self) -> str | None:
        """The draft actor's name in the ``specserve`` namespace (fault-injection tests)."""
        return self.draft_name if self.draft else None

    def check_health(self) -> None:
        if not self.core._thread.is_alive():
            raise RuntimeError("the coordinator loop has stopped")

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()


def _usage(prompt_tokens: int, completion_tokens: int, stats: SpecStats, decision) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "speculation": {"enabled": decision.enabled, "reason": decision.reason,
                            "method": decision.method,
                            "num_speculative_tokens": decision.num_speculative_tokens,
                            **stats.as_dict()}}
