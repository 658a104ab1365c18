"""The draft group: one :class:`~specserve.serve.draft_worker.DraftWorker` actor (draft TP = 1)
holding the draft-model proposer, and :class:`DraftGroup`, its coordinator-side client, which
the engine sees as a proposer.

Sequence bookkeeping (start / fork / commit / finish) is buffered and sent with the next proposal
request, so a step costs one round trip (and flushed when the unit goes idle, so an idle
draft holds no slots). Any failure or timeout becomes
:class:`~specserve.errors.ProposerUnavailable`, which the engine answers by decoding
target-only. When the draft is back, the coordinator's first message to it is ``reset``: it
drops every sequence it held, whatever bookkeeping was lost with the connection.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.config import UnitConfig
from specserve.engine.drafts.base import Proposer
from specserve.engine.step.proposal import DraftRequest, Proposal
from specserve.errors import ProposerUnavailable
from specserve.methods import PROPOSERS
from specserve.serve.draft_worker import DraftWorker, process_start
from specserve.serve.placement import ACTOR_NAMESPACE, NODE_SLIVER, in_bundle, resolved_layout
from specserve.serve.wire import Traffic

log = logging.getLogger(__name__)


class DraftGroup(Proposer):
    """Coordinator-side client of the draft group: the engine sees a proposer."""

    MAX_BUFFERED_OPS = 64  # flush bookkeeping without waiting for a proposal beyond this
    POLL_S = 0.05  # a step waiting on a draft on this node checks its process this often

    def __init__(self, actor, *, method: str, timeout_s: float) -> None:
        self.actor = actor
        self.method = method
        self.needs_hidden = PROPOSERS[method].reads_features  # sent in each DraftRequest
        self.timeout_s = timeout_s
        self._ops: list[tuple] = []
        self._local: tuple[int, int | None] | None = None  # (pid, start) of a draft on this node
        self.received = Traffic()  # proposals as they arrived (compact: serve/wire.py)

    @classmethod
    def launch(cls, cfg: UnitConfig, pg, bundle: int, name: str | None = None,
               target_vocab_size: int | None = None,
               eos_token_ids: list[int] | None = None) -> DraftGroup:
        """Start the draft actor (Ray restarts it whenever it dies): in bundle ``bundle`` of the
        unit's placement group (its own, or target rank 0's with ``draft_gpu_fraction``), or,
        with ``draft_node_resource``, on a node advertising that resource (a separate draft
        worker group). ``name`` makes it findable (fault-injection
        tests kill it by name)."""
        engine = resolved_layout(cfg).engine  # the target's layout decides the draft's
        named = {"name": name, "namespace": ACTOR_NAMESPACE} if name else {}
        if cfg.draft_in_bundle:
            placement = in_bundle(cfg, pg, bundle)
        elif cfg.draft_shares_gpu:  # beside target rank 0, in its bundle, on its GPU
            placement = in_bundle(cfg, pg, bundle, cfg.draft_gpu_fraction)
        else:  # out of the replica's placement group, which would otherwise capture it
            placement = {**in_bundle(cfg, None, 0),
                         "resources": {cfg.draft_node_resource: NODE_SLIVER},
                         "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None)}
        actor = DraftWorker.options(max_restarts=-1, max_task_retries=0, **named,
                                    **placement).remote(
            engine.speculative.method, engine.speculative.draft.model_dump(),
            engine.target.model_dump(), engine.max_model_len, engine.max_num_seqs, target_vocab_size,
            options=engine.speculative.method_options, niced=cfg.accelerator == "cpu",
            eos_token_ids=eos_token_ids,
            kv=engine.draft_kv_cache.model_dump() if engine.draft_kv_cache else None)
        proposer = cls(actor, method=engine.speculative.method, timeout_s=cfg.draft_timeout_s)
        # The first load may dequantize a GGUF; then the draft warms up (compiles, on a GPU).
        if not proposer.ping(timeout_s=600 + cfg.compile_timeout_s):
            raise RuntimeError("the draft group did not start (loading and warming up its "
                               f"model took over 600 s + compile_timeout_s {cfg.compile_timeout_s:g} s)")
        proposer._identify()
        return proposer

    def _buffer(self, op: tuple) -> None:
        self._ops.append(op)
        if len(self._ops) >= self.MAX_BUFFERED_OPS:  # Ray keeps one caller's calls in order
            ops, self._ops = self._ops, []
            self.actor.apply.remote(ops)

    def start(self, seq_id: int, seed: int) -> None:
        self._buffer(("start", (seq_id, seed)))

    def fork(self, seq_id: int, parent_id: int, seed: int, num_tokens: int) -> None:
        self._buffer(("fork", (seq_id, parent_id, seed, num_tokens)))

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        self._buffer(("commit", (seq_id, num_valid_tokens)))

    def finish(self, seq_id: int) -> None:
        self._buffer(("finish", (seq_id,)))

    def reset(self) -> None:
        """The draft is back: what was buffered for the old one is moot; it drops everything."""
        self._ops = [("reset", ())]

    def flush(self) -> None:
        if self._ops:
            ops, self._ops = self._ops, []
            self.actor.apply.remote(ops)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        ops, self._ops = self._ops, []
        try:
            proposals = self._result(self.actor.step.remote(ops, requests))
        except Exception as exc:  # dead, restarting, timed out or broken: all mean "no draft"
            log.warning("draft group unavailable: %s", exc)
            raise ProposerUnavailable(str(exc)) from exc
        self.received.add(proposals)
        return proposals

    def _result(self, ref):
        """``ref``'s value within ``timeout_s``. Ray fails a call to an actor whose process died
        only once it has heard why (about 1.7 s, every step of the unit stalled meanwhile);
        for a draft on this node, the wait ends as soon as its process is gone."""
        local = self._local
        if local is None:
            return ray.get(ref, timeout=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([ref], timeout=max(0.0, min(self.POLL_S, left)))
            if ready:
                return ray.get(ref)
            if process_start(local[0]) != local[1]:
                raise ProposerUnavailable(f"the draft's process {local[0]} has exited")
            if left <= 0:
                raise ProposerUnavailable(f"no proposal within {self.timeout_s:g} s")

    def _identify(self) -> None:
        """Learn whether the draft runs on this node, and as which process (after each start
        and each probe that found it back: a restarted draft is a new process)."""
        try:
            node, pid, start = ray.get(self.actor.identity.remote(), timeout=self.timeout_s)
        except Exception:  # noqa: BLE001  unknown: wait on Ray alone
            self._local = None
            return
        here = ray.get_runtime_context().get_node_id()
        self._local = (pid, start) if node == here and start is not None else None

    def ping(self, timeout_s: float | None = None) -> bool:
        """True when the draft actor answers at all (start-up: the first load may be long)."""
        try:
            ray.get(self.actor.ping.remote(), timeout=timeout_s or self.timeout_s)
            return True
        except Exception:  # noqa: BLE001
            return False

    def probe(self) -> bool:
        """True when the draft answers a step within ``draft_timeout_s``: the call a real step
        makes, so a draft that answers pings but is too slow to draft stays lost. Called off
        the engine thread (``engine_loop.DraftWatch``); it sends no bookkeeping."""
        try:
            ray.get(self.actor.step.remote([], []), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            log.info("draft probe failed: %s", type(exc).__name__)
            return False
        self._identify()
        return True

    def shutdown(self) -> None:
        ray.kill(self.actor, no_restart=True)
