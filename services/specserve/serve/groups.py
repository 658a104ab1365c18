"""The draft group and the tensor-parallel target group: Ray actors in the unit's placement
group, and the coordinator-side clients that make them look like an in-process
:class:`~specserve.engine.worker.ModelWorker` and :class:`~specserve.engine.proposers.Proposer`.

Target group: N :class:`TargetRank` actors form one ``torch.distributed`` process group
(NCCL on GPUs, gloo on CPU, rendezvous on rank 0's node address: 127.0.0.1 locally). Only
rank 0 is called; it broadcasts each batch to the others over the process group (one Ray call
per step, however large N is), every rank runs its shard, and rank 0 returns the logits. The
coordinator owns the slot table and sends each row's start length, so rollback costs nothing.
A rank that dies or a step slower than ``target_step_timeout_s`` raises
:class:`~specserve.errors.TargetUnavailable` within that bound (every rank has a ``watch``
call outstanding that fails the moment the rank dies); :meth:`TargetGroup.restart` then kills
the rest and starts a fresh group in the same bundles. Ray cannot restart one rank on its
own: a new process cannot rejoin the old NCCL / gloo group, so the group restarts whole.

Draft group: one :class:`~specserve.serve.draft_worker.DraftWorker` actor (draft TP = 1)
holding the draft-model proposer.
Sequence bookkeeping (start / commit / finish) is buffered and sent with the next proposal
request, so a step costs one round trip (and flushed when the unit goes idle, so an idle
draft holds no slots). Any failure or timeout becomes
:class:`~specserve.errors.ProposerUnavailable`, which the engine answers by decoding
target-only. When the draft is back, the coordinator's first message to it is ``reset``: it
drops every sequence it held, whatever bookkeeping was lost with the connection.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.config import EngineConfig, UnitConfig
from specserve.engine.kv_cache import SlotTable
from specserve.engine.loader import load_model
from specserve.engine.proposers.base import DraftRequest, Proposal, Proposer
from specserve.engine.tp import apply_tp
from specserve.engine.worker import ModelWorker, SlotOwner
from specserve.errors import ProposerUnavailable, TargetUnavailable
from specserve.methods import PROPOSERS
from specserve.serve.draft_worker import DraftWorker, process_start

log = logging.getLogger(__name__)

PG_TIMEOUT = datetime.timedelta(seconds=120)
DRAFT_NAMESPACE = "specserve"


def _threads(share: int) -> None:
    """Give this actor its share of the node's cores (the loop runs groups one at a time)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // share))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@ray.remote(concurrency_groups={"watch": 1})
class TargetRank:
    """One tensor-parallel rank of the target."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker: ModelWorker | None = None
        _threads(world_size)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address every rank joins (this node's; loopback on a laptop)."""
        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def setup(self, engine: dict, host: str, port: int) -> dict:
        """Join the process group, load this rank's shard, and (ranks > 0) start following."""
        cfg = EngineConfig.model_validate(engine)
        if self.world_size > 1:
            if host.startswith("127."):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world_size, timeout=PG_TIMEOUT)
        loaded = load_model(cfg.target, max_model_len=cfg.max_model_len)
        runtime = apply_tp(loaded.runtime)
        self.worker = ModelWorker(runtime, num_slots=cfg.max_num_seqs, max_seq_len=cfg.max_model_len)
        if self.rank > 0:
            threading.Thread(target=self._follow, name="tp-follower", daemon=True).start()
        return {"name": loaded.name, "vocab_size": runtime.arch.vocab_size,
                "eos_token_ids": sorted(loaded.eos_token_ids)}

    def forward(self, slots: list[int], starts: list[int], token_ids: list[list[int]],
                num_logits: list[int], argmax_only: bool = False,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: broadcast the batch, run this rank's shard, return ``[N, V]`` CPU logits
        (``[N]`` token ids with ``argmax_only``; with ``return_hidden`` also the final hidden
        states, which every rank has in full after the last all-reduce)."""
        batch = (slots, starts, token_ids, num_logits)
        if self.world_size > 1:
            dist.broadcast_object_list([batch], src=0)
        out = self._run(batch, argmax_only, return_hidden)
        return (out[0].cpu(), out[1].cpu()) if return_hidden else out.cpu()

    def _run(self, batch, argmax_only: bool = False, return_hidden: bool = False):
        slots, starts, token_ids, num_logits = batch
        return self.worker.forward(slots, token_ids, num_logits, argmax_only, starts=starts,
                                   return_hidden=return_hidden)

    def _follow(self) -> None:
        """Ranks > 0: run whatever rank 0 broadcasts, for as long as the actor lives."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            self._run(box[0])

    def ping(self) -> bool:
        return self.worker is not None

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Never returns: the caller's reference resolves, with an error, when this rank dies."""
        threading.Event().wait()

    def describe(self) -> dict:
        """Where this rank runs (tests check the placement)."""
        return {"rank": self.rank, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device": str(self.worker.runtime.embed.weight.device)}


class TargetGroup(SlotOwner):
    """Coordinator-side client of the target ranks; the engine sees a ``ModelWorker``."""

    def __init__(self, cfg: UnitConfig, pg, first_bundle: int, name: str | None = None) -> None:
        self.cfg, self.pg, self.first_bundle, self.name = cfg, pg, first_bundle, name
        self.table = SlotTable(cfg.engine.max_num_seqs)
        self.max_seq_len = cfg.engine.max_model_len
        self.step_timeout_s = cfg.target_step_timeout_s
        self.generation = 0   # restarts so far
        self.ranks: list = []
        self._launch()

    @classmethod
    def start(cls, cfg: UnitConfig, pg, first_bundle: int, name: str | None = None) -> TargetGroup:
        """Start the ranks in bundles ``first_bundle..`` of ``pg`` and wait until they are
        loaded. ``name``: rank actors are named ``{name}-g{generation}-r{rank}`` in the
        ``specserve`` namespace (fault-injection tests kill them by name)."""
        return cls(cfg, pg, first_bundle, name)

    def _launch(self) -> None:
        cfg, world = self.cfg, self.cfg.tensor_parallel_size
        self.ranks = [TargetRank.options(**_in_bundle(cfg, self.pg, self.first_bundle + r),
                                         **self._named(r)).remote(r, world) for r in range(world)]
        host, port = ray.get(self.ranks[0].rendezvous.remote())
        engine = cfg.engine.model_dump()
        self.info = ray.get([r.setup.remote(engine, host, port) for r in self.ranks])[0]
        self._watch = {r.watch.remote(): i for i, r in enumerate(self.ranks)}

    def _named(self, rank: int) -> dict:
        if not self.name:
            return {}
        return {"name": f"{self.name}-g{self.generation}-r{rank}", "namespace": DRAFT_NAMESPACE}

    def rank_names(self) -> list[str]:
        return [self._named(r)["name"] for r in range(len(self.ranks))] if self.name else []

    def restart(self) -> None:
        """Kill every rank and start a fresh group in the same bundles. The caller has ended
        every sequence first; their slots are free, and the new ranks' caches start empty."""
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.generation += 1
        self._launch()

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

    def forward(self, slots: list[int], token_ids: list[list[int]], num_logits: list[int],
                argmax_only: bool = False,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        starts = [self.table.lengths[s] for s in slots]
        ref = self.ranks[0].forward.remote(slots, starts, token_ids, num_logits, argmax_only,
                                           return_hidden)
        ready, _ = ray.wait([ref, *self._watch], num_returns=1, timeout=self.step_timeout_s)
        if not ready:
            raise TargetUnavailable(f"a target step took longer than {self.step_timeout_s:g} s "
                                    "(target_step_timeout_s)")
        if ref not in ready:
            raise TargetUnavailable(f"target rank {self._watch[ready[0]]} died")
        try:
            logits = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise TargetUnavailable(f"target rank 0 died: {exc}") from exc
        for slot, ids in zip(slots, token_ids):
            self.table.lengths[slot] += len(ids)
        return logits

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)


class RemoteProposer(Proposer):
    """Coordinator-side client of the draft group."""

    MAX_BUFFERED_OPS = 64  # flush bookkeeping without waiting for a proposal beyond this
    POLL_S = 0.05  # a step waiting on a draft on this node checks its process this often

    def __init__(self, actor, *, method: str, timeout_s: float) -> None:
        self.actor = actor
        self.method = method
        self.needs_hidden = PROPOSERS[method].reads_features  # sent in each DraftRequest
        self.timeout_s = timeout_s
        self._ops: list[tuple] = []
        self._local: tuple[int, int | None] | None = None  # (pid, start) of a draft on this node

    @classmethod
    def start_group(cls, cfg: UnitConfig, pg, bundle: int, name: str | None = None,
                    target_vocab_size: int | None = None) -> RemoteProposer:
        """Start the draft actor (Ray restarts it whenever it dies): in bundle ``bundle`` of the
        unit's placement group, or, with ``draft_node_resource``, on a node advertising that
        resource (a separate draft worker group). ``name`` makes it findable (fault-injection
        tests kill it by name)."""
        engine = cfg.engine
        named = {"name": name, "namespace": DRAFT_NAMESPACE} if name else {}
        if cfg.draft_in_bundle:
            placement = _in_bundle(cfg, pg, bundle)
        else:  # out of the replica's placement group, which would otherwise capture it
            placement = {**_in_bundle(cfg, None, 0),
                         "resources": {cfg.draft_node_resource: NODE_SLIVER},
                         "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None)}
        actor = DraftWorker.options(max_restarts=-1, max_task_retries=0, **named,
                                    **placement).remote(
            engine.speculative.method, engine.speculative.draft.model_dump(),
            engine.target.model_dump(), engine.max_model_len, engine.max_num_seqs, target_vocab_size,
            niced=cfg.accelerator == "cpu")
        proposer = cls(actor, method=engine.speculative.method, timeout_s=cfg.draft_timeout_s)
        if not proposer.ping(timeout_s=600):  # first load may dequantize a GGUF
            raise RuntimeError("the draft group did not start")
        proposer._identify()
        return proposer

    def _buffer(self, op: tuple) -> None:
        self._ops.append(op)
        if len(self._ops) >= self.MAX_BUFFERED_OPS:  # Ray keeps one caller's calls in order
            ops, self._ops = self._ops, []
            self.actor.apply.remote(ops)

    def start(self, seq_id: int, seed: int) -> None:
        self._buffer(("start", (seq_id, seed)))

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
            return self._result(self.actor.step.remote(ops, requests))
        except Exception as exc:  # dead, restarting, timed out or broken: all mean "no draft"
            log.warning("draft group unavailable: %s", exc)
            raise ProposerUnavailable(str(exc)) from exc

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
        the engine thread (``coordinator.DraftWatch``); it sends no bookkeeping."""
        try:
            ray.get(self.actor.step.remote([], []), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            log.info("draft probe failed: %s", type(exc).__name__)
            return False
        self._identify()
        return True

    def shutdown(self) -> None:
        ray.kill(self.actor, no_restart=True)


NODE_SLIVER = 0.001  # of a node-marking custom resource: many actors fit, only there


def _in_bundle(cfg: UnitConfig, pg, index: int) -> dict:
    """Actor options placing it in bundle ``index`` of the unit's placement group."""
    options = {"num_cpus": cfg.cpus_per_actor, "num_gpus": 1 if cfg.accelerator == "gpu" else 0}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index)
    return options


def unit_bundles(cfg: UnitConfig) -> list[dict]:
    """``[coordinator, (draft), target rank 0..N-1]`` resource bundles for one unit (the
    draft's only when it shares the unit's node; see ``UnitConfig.draft_node_resource``)."""
    gpu = {"GPU": 1} if cfg.accelerator == "gpu" else {}
    node = {cfg.target_node_resource: NODE_SLIVER} if cfg.target_node_resource else {}
    group = {"CPU": cfg.cpus_per_actor, **gpu}
    draft = [dict(group)] if cfg.draft_in_bundle else []
    return [{"CPU": cfg.coordinator_cpus, **node}, *draft,
            *[{**group, **node} for _ in range(cfg.tensor_parallel_size)]]
