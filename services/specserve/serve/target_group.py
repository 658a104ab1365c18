"""The tensor-parallel target group: Ray actors in the unit's placement group, and the
coordinator-side client that makes them look like an in-process
:class:`~specserve.engine.worker.ModelWorker`.

N :class:`TargetRank` actors form one ``torch.distributed`` process group
(NCCL on GPUs, gloo on CPU, rendezvous on rank 0's node address: 127.0.0.1 locally). Only
rank 0 is called; it broadcasts each batch to the others over the process group (one Ray call
per step, however large N is), every rank runs its shard, and rank 0, which has the full
logits after the last all-reduce, runs the rejection sampler next to them
(:meth:`~specserve.engine.worker.ModelWorker.verify`) and returns only what each row keeps:
no logits tensor crosses a process boundary. The coordinator sends token ids, the draft's
proposals (ids, and for sampled rows a truncated q, :class:`~specserve.engine.step.proposal.TopK`)
and each sequence's sampling parameters once, when its slot first verifies. The
coordinator owns the slot table and sends each row's start length, so rollback costs nothing.
A rank that dies or a step slower than ``target_step_timeout_s`` raises
:class:`~specserve.errors.TargetUnavailable` within that bound (every rank has a ``watch``
call outstanding that fails the moment the rank dies); :meth:`TargetGroup.restart` then kills
the rest and starts a fresh group in the same bundles. Ray cannot restart one rank on its
own: a new process cannot rejoin the old NCCL / gloo group, so the group restarts whole.

On CUDA the coordinator launches a step of plain decodes before it reads the last
(:meth:`TargetGroup.launch`): rank 0 keeps each launched step by number and feeds
the next step's rows from its verdicts on the device, so the GPU has step N + 1 queued while
the coordinator reads and streams step N.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import threading
import time
from dataclasses import replace
from typing import NamedTuple

import ray
import torch
import torch.distributed as dist

from specserve.config import EngineConfig, UnitConfig
from specserve.engine.drafts.draft_head import eagle3_target_layers
from specserve.engine.gguf_blocks import resident_weights
from specserve.engine.kv.kv_cache import SlotTable
from specserve.engine.kv.kv_manager import KVManager
from specserve.engine.loader import load_model
from specserve.engine.runtime.forward_batch import ForwardBatch, Forwarded
from specserve.engine.step.verify_batch import VerifyBatch
from specserve.engine.worker import Launched, ModelWorker, SlotOwner, Verified
from specserve.errors import TargetUnavailable
from specserve.serve.placement import (
    ACTOR_NAMESPACE,
    in_bundle,
    process_group_backend,
    resolved_layout,
    target_device,
    target_rank_gpus,
)
from specserve.serve.wire import Traffic, host_only

log = logging.getLogger(__name__)

PG_TIMEOUT = datetime.timedelta(seconds=120)


def _threads(share: int) -> None:
    """Give this actor its share of the node's cores (the loop runs groups one at a time)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // share))


def in_own_thread(fn, timeout_s: float | None = None):
    """``fn()``, run in a thread that ends with it. OpenMP keeps a pool of threads for each
    thread that ran a parallel region, for as long as that thread lives; while a process has
    more pooled threads than cores, libgomp hardly spins at its barriers, and each of the
    forward's parallel regions then waits for its threads to wake (measured: a one-stream
    token 23 ms in the unit against 12 alone). So the target loads and warms up in a thread of
    its own, and the engine thread's pool is the only one left. Past ``timeout_s``,
    :class:`TimeoutError` (the thread, which nothing can stop, is left to end the process's
    way: the caller fails its start). The bound is read off this clock, not off whether the
    thread is still running when the wait returns: a thread that ran to its end before the
    caller got the interpreter back (its whole warm-up inside one switch interval) still
    took as long as it took."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
            box["error"] = exc

    thread = threading.Thread(target=run, name="target-load", daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or (timeout_s is not None and time.monotonic() - start > timeout_s):
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} took over {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _table(cfg: UnitConfig) -> SlotTable | KVManager:
    """The coordinator's bookkeeping of the ranks' caches: lengths per slot, or with a paged
    cache the block tables too, and the prefix cache (the ranks follow: :meth:`TargetRank._prepare`)."""
    engine = cfg.engine
    kv = engine.kv_cache
    if kv.layout != "paged":
        return SlotTable(engine.max_num_seqs)
    return KVManager(num_blocks=kv.pool_blocks(engine.max_num_seqs, engine.max_model_len),
                     block_size=kv.block_size,
                     num_slots=engine.max_num_seqs, max_seq_len=engine.max_model_len,
                     prefix_caching=kv.prefix_caching)


class RankStep(NamedTuple):
    """What rank 0 broadcasts to the other ranks each step: the forward, and what brings each
    rank's cache to the coordinator's view before it (:meth:`TargetRank._prepare`)."""

    batch: ForwardBatch
    starts: list[int]                  # [rows]: each row's slot length before the forward
    moves: list | None = None          # token-tree compactions (slot, positions, at)
    forks: list | None = None          # slot copies (src, dst, length); paged: (src_block, dst_block)
    tables: list | None = None         # paged: [rows] each row's block table


class TargetRank:
    """One tensor-parallel rank of the target: a :data:`RankActor`, or at TP = 1 on a CPU an
    object in the coordinator's own process (:attr:`TargetGroup.local`)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker: ModelWorker | None = None
        self.sampling: dict[int, tuple] = {}  # slot -> its sequence's (params, seed)
        self._launched: dict[int, Launched] = {}  # rank 0: steps launched, not read yet
        _threads(world_size)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address every rank joins (this node's; loopback on a laptop)."""
        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def setup(self, engine: dict, host: str, port: int, backend: str) -> dict:
        """Join the process group (``backend``: the coordinator's choice, the same for every
        rank) and load this rank's shard onto the device ``engine`` names."""
        cfg = EngineConfig.model_validate(engine)
        if self.world_size > 1:
            if host.startswith("127."):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world_size, timeout=PG_TIMEOUT)
        # Each rank reads only its shard of the checkpoint (engine/shard_loader.py).
        group = dist.group.WORLD if self.world_size > 1 else None
        loaded = load_model(cfg.target, max_model_len=cfg.max_model_len, tp_group=group,
                            verify_tokens=cfg.verify_tokens)
        runtime = loaded.runtime
        # An EAGLE-3 head reads the residual stream entering some layers: the features this
        # group returns (each rank holds the whole stream after its all-reduces).
        runtime.feature_layers = eagle3_target_layers(cfg.speculative, runtime.arch.num_layers)
        self.worker = ModelWorker(runtime, num_slots=cfg.max_num_seqs, max_seq_len=cfg.max_model_len,
                                  kv=cfg.kv_cache)
        return {"name": loaded.name, "vocab_size": runtime.arch.vocab_size,
                "eos_token_ids": sorted(loaded.eos_token_ids),
                "row_invariant": self.worker.row_invariant, "weights": resident_weights(runtime)}

    def warm_up(self) -> dict:
        """Every rank at once, after :meth:`setup`: run a forward in every shape serving will
        use, so ``kernels: compiled`` compiles and captures its graphs now, under the unit's
        ``compile_timeout_s``, and never inside a step bounded by ``target_step_timeout_s``
        (the ranks run the same forwards, so their all-reduces pair up). Then ranks > 0 start
        following rank 0. Returns this rank's report (``LlamaRuntime.warm_up``)."""
        report = self.worker.warm_up()
        # What lives as long as the rank (the model's modules and tensors, transformers' and
        # torch's own: about 400,000 objects for the embedded model) frozen out of Python's
        # collector: a full collection walked them all, 167 ms on a 2-core Zen 4, inside
        # whatever step it fell in. Later objects are collected as before.
        gc.collect()
        gc.freeze()
        if self.rank > 0:
            threading.Thread(target=self._follow, name="tp-follower", daemon=True).start()
        return report

    def verify(self, batch: VerifyBatch, starts: list[int], sampling: dict[int, tuple],
               moves: list | None = None, forks: list | None = None,
               tables: list | None = None) -> Verified:
        """Rank 0: broadcast the forward, run this rank's shard and the rejection sampler;
        return the rows' verdicts (CPU hidden states of kept tokens with ``batch.hidden``).
        ``batch`` comes without its sampling: ``sampling`` is slot -> (params, seed) for the
        sequences new since the last call (this rank keeps them per slot). ``starts``: the
        coordinator's lengths of the rows' and then the chunks' slots; ``tables``: a paged
        cache's block tables of those slots, and then ``forks`` are block copies
        ``(src_block, dst_block)`` (:meth:`_prepare`)."""
        return host_only(self.verdicts(batch, starts, sampling, moves, forks, tables))

    def verdicts(self, batch: VerifyBatch, starts: list[int], sampling: dict[int, tuple],
                 moves: list | None = None, forks: list | None = None,
                 tables: list | None = None) -> Verified:
        """:meth:`verify`'s verdicts, as they are (in the coordinator's process nothing
        crosses a boundary, so nothing is checked or counted)."""
        step = RankStep(batch.forward(), starts, moves, forks, tables)
        return self._launch(batch, sampling, step).result()

    def launch(self, number: int, batch: VerifyBatch, starts: list[int], sampling: dict[int, tuple],
               moves: list | None, forks: list | None, tables: list | None,
               after: int | None) -> None:
        """Rank 0: :meth:`verify` launched and kept as step ``number``, not read back
        (:meth:`result` reads it): the coordinator launches the next step before it asks for
        this one's result, so the device has it queued while the host reads this one. Rows
        that follow step ``after`` (:attr:`VerifyRow.follows`) take their token
        from its verdicts, here on the device (``ModelWorker.launch``); the other ranks get
        those tokens from this one. Steps before ``number - 1`` are dropped: the coordinator
        reads a step before it launches the one after next, or has given it up."""
        prior = None if after is None else self._launched[after]
        self._launched = {n: s for n, s in self._launched.items() if n >= number - 1}
        forward = batch.forward()
        if batch.followers:
            forward = replace(forward, fed_rows=batch.followers)
        self._launched[number] = self._launch(
            batch, sampling, RankStep(forward, starts, moves, forks, tables), prior)

    def result(self, number: int) -> Verified:
        """Rank 0: step ``number``'s verdicts (:meth:`launch`), read back as :meth:`verify`'s."""
        return host_only(self._launched.pop(number).result())

    def _launch(self, batch: VerifyBatch, sampling: dict[int, tuple], step: RankStep,
                after: Launched | None = None) -> Launched:
        """Rank 0: broadcast ``step`` (and the tokens its followers take from ``after``),
        bring the cache to the coordinator's view and launch the verify."""
        self.sampling.update(sampling)
        fed = None if after is None else after.feeds(batch)
        if self.world_size > 1:
            dist.broadcast_object_list([step], src=0)
            if fed is not None:  # before the forward: its all-reduces must pair up
                dist.broadcast(fed, src=0)
        self._prepare(step)
        batch = replace(batch, rows=[replace(r, sampling=self.sampling[r.slot]) for r in batch.rows])
        return self.worker.launch(batch, fed=fed)

    def forward(self, batch: ForwardBatch, starts: list[int], moves: list | None = None,
                forks: list | None = None, tables: list | None = None) -> Forwarded:
        """Rank 0: broadcast the batch, run this rank's shard, return what the batch asks for
        on the CPU (hidden states: every rank has them in full after the last all-reduce).
        ``starts``: the coordinator's length of each row's slot; ``moves``: its pending
        token-tree compactions ``(slot, positions, at)`` and ``forks`` its pending slot copies
        ``(src, dst, length)`` (``n > 1``), applied before the batch (like rollback, they ride
        on the next forward); ``tables``: :meth:`verify`'s. For tests and tools: serving
        verifies (:meth:`verify`), and logits stay here."""
        step = RankStep(batch, starts, moves, forks, tables)
        if self.world_size > 1:
            dist.broadcast_object_list([step], src=0)
        return self._run(step).cpu()

    def _prepare(self, step: RankStep) -> None:
        """Bring this rank's cache to the coordinator's view before ``step``'s forward."""
        batch, starts, moves, forks, tables = step
        cache = self.worker.cache
        for fork in forks or ():  # first: a fork's source may be in the batch
            if tables is None:
                self.worker.fork(*fork)      # (src, dst, length) slots
            else:
                cache.copy_block(*fork)      # (src_block, dst_block): the coordinator's tables
        for slot, positions, at in moves or ():
            self.worker.keep(slot, positions, at)
        for i, (slot, start) in enumerate(zip(batch.slots, starts)):  # the coordinator's lengths
            if tables is None:
                self.worker.rollback(slot, start)  # rollback for free
            else:
                cache.follow(slot, start, tables[i])

    def _run(self, step: RankStep) -> Forwarded:
        """Every rank's forward of a step (rank 0's verify runs the same one: the followers
        need not know what rank 0 does with its logits)."""
        self._prepare(step)
        return self.worker.forward(step.batch)

    def _follow(self) -> None:
        """Ranks > 0: run whatever rank 0 broadcasts, for as long as the actor lives."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            step = box[0]
            if step.batch.fed_rows is not None:  # rows fed from rank 0's last verdicts
                fed = torch.empty(len(step.batch.fed_rows), dtype=torch.long,
                                  device=self.worker.runtime.embed.weight.device)
                dist.broadcast(fed, src=0)
                step = step._replace(batch=replace(step.batch, fed=fed))
            self._run(step)

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


# The rank as a Ray actor: its processes keep the title ``ray::TargetRank`` (tools find them by it).
RankActor = ray.remote(concurrency_groups={"watch": 1})(TargetRank)


class TargetGroup(SlotOwner):
    """Coordinator-side client of the target ranks; the engine sees a ``ModelWorker``.

    Constructing one starts the ranks in bundles ``first_bundle..`` of ``pg`` and waits until
    they are loaded. ``name``: rank actors are named ``{name}-g{generation}-r{rank}`` in the
    ``specserve`` namespace (fault-injection tests kill them by name).

    Where the unit's config puts the target in the unit (:attr:`UnitConfig.target_here`: TP =
    1 on a CPU), its one rank is :attr:`local`, a :class:`TargetRank` in this process: each step is
    a call, not a Ray task, its threads run the forward, and there is no actor to watch or
    name (one stream's gap over HTTP: docs/BENCHMARKS.md, "One stream's gap, process by
    process")."""

    def __init__(self, cfg: UnitConfig, pg, first_bundle: int, name: str | None = None) -> None:
        cfg = resolved_layout(cfg)  # the ranks get a definite layout: the tables' own
        self.cfg, self.pg, self.first_bundle, self.name = cfg, pg, first_bundle, name
        self.table = _table(cfg)
        self.max_seq_len = cfg.engine.max_model_len
        self.step_timeout_s = cfg.target_step_timeout_s
        self.generation = 0   # restarts so far
        self.ranks: list = []
        self.local: TargetRank | None = None  # rank 0 in this process (target_here), else None
        self._moves: dict[int, tuple[list[int], int]] = {}  # slot -> a kept path not yet sent
        self._forks: list[tuple[int, int, int]] = []  # (src, dst, length) not yet sent
        self._sampling: dict[int, tuple] = {}  # slot -> the (params, seed) rank 0 holds for it
        self._steps = 0  # verifies so far: a launched step's number on rank 0
        self.received = Traffic()  # what rank 0 sent back
        self._launch()

    def _launch(self) -> None:
        cfg, world = self.cfg, self.cfg.tensor_parallel_size
        if cfg.target_here:
            engine = cfg.engine.model_dump()
            engine["target"]["device"] = target_device(cfg)
            self.local = TargetRank(0, 1)
            self._watch = {}
            self.info = in_own_thread(lambda: self.local.setup(engine, "", 0, "gloo"))
            try:
                self.warm_up_report = in_own_thread(self.local.warm_up, cfg.compile_timeout_s)
            except TimeoutError:
                raise self._warm_up_too_long() from None
            return
        self.ranks = [RankActor.options(**in_bundle(cfg, self.pg, self.first_bundle + r,
                                                     target_rank_gpus(cfg, r)),
                                         **self._named(r)).remote(r, world) for r in range(world)]
        host, port = ray.get(self.ranks[0].rendezvous.remote())
        engine = cfg.engine.model_dump()
        engine["target"]["device"] = target_device(cfg)
        backend = process_group_backend(cfg)
        self.info = ray.get([r.setup.remote(engine, host, port, backend) for r in self.ranks])[0]
        self._watch = {r.watch.remote(): i for i, r in enumerate(self.ranks)}
        self.warm_up_report = self._warm_up()

    def _warm_up(self) -> dict:
        """Every rank's :meth:`TargetRank.warm_up`, bounded by ``compile_timeout_s``; rank 0's
        report. A graph that inductor would not capture (``cudagraph_skips``) is logged: it
        runs, but at the launch-bound speed the compiled path exists to avoid."""
        refs = [r.warm_up.remote() for r in self.ranks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.compile_timeout_s)
        if len(ready) < len(refs):
            raise self._warm_up_too_long()
        report = ray.get(refs)[0]
        if report.get("cudagraph_skips"):
            log.warning("the target's compiled forward skipped CUDA graphs %d times: it runs "
                        "without them (report: %s)", report["cudagraph_skips"], report)
        elif report.get("buckets"):
            log.info("target warm-up: %d shapes in %.1f s", len(report["buckets"]),
                     sum(b["seconds"] for b in report["buckets"]))
        return report

    def _warm_up_too_long(self) -> TargetUnavailable:
        return TargetUnavailable(f"the target's warm-up (compiling every batch shape) took "
                                 f"longer than {self.cfg.compile_timeout_s:g} s (compile_timeout_s)")

    def _named(self, rank: int) -> dict:
        if not self.name:
            return {}
        return {"name": f"{self.name}-g{self.generation}-r{rank}", "namespace": ACTOR_NAMESPACE}

    def rank_names(self) -> list[str]:
        return [self._named(r)["name"] for r in range(len(self.ranks))] if self.name else []

    def restart(self) -> None:
        """Kill every rank and start a fresh group in the same bundles. The caller has ended
        every sequence first; their slots are free, and the new ranks' caches start empty."""
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.local = None
        self._moves.clear()
        self._forks.clear()
        self._sampling.clear()
        if self.paged:  # the new ranks' blocks hold nothing: no prefix is cached any more
            self.table.pool.reset_cache()
        self.generation += 1
        self._launch()

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

    @property
    def row_invariant(self) -> bool:
        """Whether the ranks' kernels are row-invariant
        (:attr:`~specserve.engine.worker.ModelWorker.row_invariant`)."""
        return self.info["row_invariant"]

    def keep(self, slot: int, positions: list[int], at: int) -> None:
        """A tree's accepted path: the ranks move it with the slot's next forward."""
        self._moves[slot] = (positions, at)
        self.table.rollback(slot, at + len(positions))

    def fork(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` starts as a copy of ``src``'s first ``length`` positions: every rank
        copies its shard with the next forward (before it, so ``src`` may be in it). Paged:
        ``dst`` shares ``src``'s full blocks, and the ranks copy only a partly filled one."""
        copy = self.table.fork(src, dst, length)
        if not self.paged:
            self._forks.append((src, dst, length))
        elif copy is not None:
            self._forks.append(copy)

    def _tables(self, slots: list[int], token_ids: list[list[int]]) -> list[list[int]] | None:
        """Paged: blocks for every row's new tokens, and the rows' block tables for the ranks."""
        if not self.paged:
            return None
        for slot, ids in zip(slots, token_ids):
            self.table.reserve(slot, self.table.lengths[slot] + len(ids))
        return self.table.table_rows(slots)

    def free(self, slot: int) -> None:
        self._moves.pop(slot, None)
        super().free(slot)

    def verify(self, batch: VerifyBatch) -> Verified:
        """:meth:`ModelWorker.verify <specserve.engine.worker.ModelWorker.verify>` on rank 0:
        a row's sampling parameters travel when its slot's holder changes, not every step;
        grammar masks (packed bits, ``V / 8`` bytes a position) with the rows that have one."""
        return self.launch(batch).result()

    def launch(self, batch: VerifyBatch, after: GroupStep | None = None) -> GroupStep:
        """:meth:`ModelWorker.launch <specserve.engine.worker.ModelWorker.launch>` on rank 0
        (launching ahead): rank 0 keeps the launched step and its result comes with
        :meth:`GroupStep.result`. A step goes to rank 0 when one is launched after it, else
        as one :meth:`verify` call when it is read: one Ray call a step where nothing
        launches ahead, two (launch, then result) where steps do."""
        new = {}
        for row in batch.rows:
            if self._sampling.get(row.slot) != row.sampling:
                new[row.slot] = self._sampling[row.slot] = row.sampling
        forward = batch.forward()
        starts = [self.table.lengths[s] for s in forward.slots]
        tables = self._tables(forward.slots, forward.token_ids)
        moves = [(s, *self._moves.pop(s)) for s in forward.slots if s in self._moves]
        forks, self._forks = self._forks, []
        for slot, ids in zip(forward.slots, forward.token_ids):
            self.table.lengths[slot] += len(ids)
        self._steps += 1
        step = GroupStep(self, self._steps,
                         (replace(batch, rows=[replace(r, sampling=None) for r in batch.rows]),
                          starts, new, moves, forks, tables))
        if after is not None:
            after.send()
            step.send(after.number)
        return step

    @property
    def queues_work(self) -> bool:
        """Whether launching the next step before reading this one pays
        (``target_calls.py``): on CUDA, where rank 0 queues it on the device while
        the coordinator reads and advances this one. On a CPU the ranks' threads and the
        coordinator share the cores, and the second Ray call a step costs more than the
        overlap gives (0.95x at batch 1 and 0.96x at 4, embedded model, 2 cores:
        docs/BENCHMARKS.md)."""
        return target_device(self.cfg).startswith("cuda")

    def forward(self, batch: ForwardBatch) -> Forwarded:
        """What the batch asks for, from rank 0, on the CPU (tests and tools; serving calls
        :meth:`verify`)."""
        starts = [self.table.lengths[s] for s in batch.slots]
        tables = self._tables(batch.slots, batch.token_ids)
        moves = [(s, *self._moves.pop(s)) for s in batch.slots if s in self._moves]
        forks, self._forks = self._forks, []
        out = self._rank0("forward", batch, starts, moves, forks, tables)
        for slot, ids in zip(batch.slots, batch.token_ids):
            self.table.lengths[slot] += len(ids)
        return out

    def _rank0(self, method: str, *args):
        """Rank 0's answer to ``method(*args)``: a call where it is :attr:`local`, else its
        actor's, as :meth:`_call` bounds it."""
        if self.local is not None:
            return getattr(self.local, method)(*args)
        return self._call(getattr(self.ranks[0], method).remote(*args))

    def _call(self, ref):
        """Rank 0's answer, or :class:`TargetUnavailable` when a rank dies or the step
        outlives ``target_step_timeout_s``."""
        ready, _ = ray.wait([ref, *self._watch], num_returns=1, timeout=self.step_timeout_s)
        if not ready:
            raise TargetUnavailable(f"a target step took longer than {self.step_timeout_s:g} s "
                                    "(target_step_timeout_s)")
        if ref not in ready:
            raise TargetUnavailable(f"target rank {self._watch[ready[0]]} died")
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise TargetUnavailable(f"target rank 0 died: {exc}") from exc

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)


class GroupStep:
    """A verify of a unit's target group (:meth:`TargetGroup.launch`), as the engine's
    ``Launched``: sent to rank 0 when a step is launched after it (:meth:`send`), or when it
    is read (:meth:`result`: then as one verify call)."""

    def __init__(self, group: TargetGroup, number: int, args: tuple) -> None:
        self.group, self.number, self.args = group, number, args
        self.launched = None  # rank 0's launch call, once sent

    def send(self, after: int | None = None) -> None:
        """Launch it on rank 0 (its rows that follow step ``after`` fed from that one there)."""
        if self.launched is not None:
            return
        group = self.group
        if group.local is not None:
            group.local.launch(self.number, *self.args, after)
            self.launched = True
        else:
            self.launched = group.ranks[0].launch.remote(self.number, *self.args, after)

    def result(self) -> Verified:
        """Its verdicts from rank 0 (:class:`TargetUnavailable` as :meth:`TargetGroup._call`)."""
        group = self.group
        if group.local is not None:  # nothing crosses a process boundary: nothing to count
            return (group.local.verdicts(*self.args) if self.launched is None
                    else group.local.result(self.number))
        if self.launched is None:  # nothing was launched after it: one call
            result = group._rank0("verify", *self.args)
        else:
            group._call(self.launched)  # its launch's error, if it had one
            result = group._rank0("result", self.number)
        group.received.add(result)
        return result
