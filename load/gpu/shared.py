"""``shared.json``: a draft and a target on one GPU, each in its own process, with speculation
on (issue 73): the same tokens as target-only, and the memory both take against the estimate.

A unit whose draft shares target rank 0's GPU runs the draft as a Ray actor beside the rank,
on ``draft_gpu_fraction`` of its GPU: two processes, two CUDA contexts, one device. The lent
machine has no Ray, so here the draft's process is a ``multiprocessing`` child (spawned: CUDA
does not survive a fork) on the same device, which builds and warms up the draft while this
process builds the target, then answers the proposer's calls over a pipe
(:func:`serve_draft`); the engine in this process drafts through :class:`RemoteDraft`, which
buffers the bookkeeping and sends it with the next proposal, as the unit's
:class:`~specserve.serve.draft_group.DraftGroup` does: one round trip a step.

The target is step.py's model (on a GPU Llama-3-8B's layers, 4 of them, bfloat16, on the
``compiled`` kernels a target gets on CUDA); the draft a smaller model of its own shape and the
target's vocabulary, Llama-3.2-1B's on a GPU, on the kernels ``auto`` gives a draft
(``library`` on CUDA), random weights from their own seed. Random weights make the draft's
tokens the target's by chance only, so acceptance is near zero: what this step checks is the
identity (speculation on gives target-only's greedy tokens) and that drafts were made at all
(``draft_tokens`` > 0, else the comparison proves nothing), not a speedup. The entries, each
written the moment it is measured:

- ``target_only``: step.py's, the prompts greedy one at a time: the reference tokens, tokens/s.
- ``shared_draft``: the same prompts with the draft's process proposing K tokens a step:
  ``same_as_target_only``, ``num_same``, ``first_divergence``, ``draft_tokens``, tokens/s and
  ``speedup``. The child's build and warm-up are the report's ``draft``.
- ``memory``: the device's use (``mem_get_info``: total less free, both processes' contexts
  and caches) after both loaded and after the runs, each process's
  ``max_memory_allocated``, against ``specserve.memory.estimate`` of the target
  (``draft=False``) and of the draft (``draft=True``), each with its own CUDA-context
  allowance, as two processes have: ``within_estimate``.

A dry run: the tiny target and a tinier draft in float32 on the CPU, through the same two
processes and pipe; the ``invariant`` kernels make the tokens bit-identical there, and nothing
of memory is measured (null).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from specserve.engine.drafts.base import Proposer
from specserve.engine.runtime.model import default_kernels
from specserve.engine.step.proposal import DraftRequest, Proposal
from specserve.engine.worker import ModelWorker
from specserve.errors import ProposerUnavailable
from specserve.memory import GIB, MemoryEstimate, ModelShape, SharedGpu, Workload, compiled, estimate
from specserve.methods import proposer_class
from specserve.serve.wire import host_only

from load.bench_gpu import SHAPES, random_runtime
from load.gpu.identity import make_prompts
from load.gpu.memory import cuda_now
from load.gpu.output import setup_logging
from load.gpu.step import Bench, figures, run_entries, run_pass, target_only
from load.gpu.step import build as build_target

log = logging.getLogger(__name__)

FILE = "shared.json"
DRAFT_SEED = 1  # the draft's random weights' (the target's: step.SEED)
METHOD = "draft_model"
STOP_S = 10.0   # the draft's process is given this long to exit before it is killed

@dataclass(frozen=True)
class Settings:
    shape: str              # the target's
    draft_shape: str
    dtype: str
    device: str
    kernels: str            # the target's (the draft's: what auto gives a draft)
    backend: str            # torch.compile's, for compiled
    k: int                  # K: drafts per step
    batch: int              # requests at a time, and both models' slots
    num_prompts: int
    max_tokens: int
    draft_timeout_s: float  # a call to the draft's process unanswered this long: the draft is lost


# 8 x 64 tokens on a GPU: a step drafts K tokens through 16 launch-bound layers (about 15 ms a
# forward on library kernels, which decode the 8B's 32 in 30 ms), so with nothing accepted a
# token costs about 60 ms: 30-40 s, which with the target's compile fits the step's 180 s.
GPU = Settings("llama3-8b-4l", "llama3.2-1b", "bfloat16", "cuda", "compiled", "inductor", k=4,
               batch=1, num_prompts=8, max_tokens=64, draft_timeout_s=60)
DRY = Settings("tiny", "tiny-draft", "float32", "cpu", "invariant", "eager", k=4, batch=1,
               num_prompts=4, max_tokens=16, draft_timeout_s=300)


# -- what crosses the pipe ------------------------------------------------------------------
@dataclass
class Propose:
    """Bookkeeping ops (``(name, args)``, as a draft actor's ``apply`` takes them) to apply in
    order, then drafts for ``requests`` (none: the ops alone). Answered by a list of proposals."""

    ops: list[tuple[str, tuple]]
    requests: list[DraftRequest]


@dataclass
class Usage:
    """The draft process's memory now (``memory.cuda_now``). Answered by that dict."""


@dataclass
class Stop:
    """Exit (not answered)."""


@dataclass
class Failed:
    """A call raised in the draft's process: its one line."""

    reason: str


@dataclass
class Ready:
    """The draft's process built and warmed up its proposer (the first message it sends)."""

    report: dict


# -- the draft's process --------------------------------------------------------------------
OPS = frozenset({"start", "fork", "commit", "finish", "reset"})


def serve_draft(conn: Connection, s: Settings, max_len: int, target_vocab_size: int) -> None:
    """The child: build the draft and its proposer and warm it up (as a draft actor does
    before its unit is ready, here while the parent builds the target), say :class:`Ready`,
    then answer each call until :class:`Stop` or the pipe closes (the parent gone)."""
    setup_logging()
    proposer, report = build_draft(s, max_len, target_vocab_size)
    start = time.perf_counter()
    warmed = proposer.warm_up()
    report["warm_up"] = {"seconds": round(time.perf_counter() - start, 2),
                         "cudagraph_skips": warmed.get("cudagraph_skips")}
    log.info("shared draft: warmed up: %s", report["warm_up"])
    try:
        conn.send(Ready(report))
        while not isinstance(call := conn.recv(), Stop):
            try:
                reply = answer(proposer, call, s.device)
            except Exception as exc:  # noqa: BLE001  the parent decides what a failure means
                log.exception("shared draft: %s failed", type(call).__name__)
                reply = Failed(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            conn.send(reply)
    except (EOFError, OSError):  # the parent closed its end: no one is left to answer
        return


def build_draft(s: Settings, max_len: int, target_vocab_size: int) -> tuple[Proposer, dict]:
    """The draft model on ``s.device`` with the kernels ``auto`` gives a draft there, in a
    worker of the target's slots and length, behind a draft-model proposer over the target's
    ids (what ``load_draft_proposer`` builds from a checkpoint)."""
    start = time.perf_counter()
    torch.manual_seed(DRAFT_SEED)
    runtime = random_runtime(s.draft_shape, getattr(torch, s.dtype), s.device, max_len=max_len)
    kernels = default_kernels(torch.device(s.device), draft=True)
    # integer asks for a GGUF's blocks; a model without them runs invariant (loader.load_model)
    runtime.use_kernels("invariant" if kernels == "integer" else kernels, verify_tokens=s.k + 1)
    worker = ModelWorker(runtime, num_slots=s.batch, max_seq_len=max_len)
    proposer = proposer_class(METHOD).from_draft(worker, target_vocab_size=target_vocab_size)
    report = {"shape": s.draft_shape, "kernels": runtime.kernels, "pid": os.getpid(),
              "parameters": sum(p.numel() for p in runtime.parameters()),
              "build_s": round(time.perf_counter() - start, 2)}
    log.info("shared draft: %s", report)
    return proposer, report


def answer(proposer: Proposer, call, device: str):
    """One call's reply (:class:`Propose` or :class:`Usage`)."""
    if isinstance(call, Propose):
        apply(proposer, call.ops)
        # as a draft actor replies: a pipe would pass a CUDA tensor by IPC, where Ray cannot
        return host_only(proposer.propose(call.requests)) if call.requests else []
    if isinstance(call, Usage):
        return cuda_now(device)
    raise TypeError(f"unknown call {call!r}")


def apply(proposer: Proposer, ops: list[tuple[str, tuple]]) -> None:
    """Every op, whatever the one before did (a draft actor's ``apply``): one sequence's
    failed ``commit`` must not keep another's ``finish`` from freeing its slot."""
    for name, args in ops:
        if name not in OPS:
            raise ValueError(f"unknown bookkeeping op {name!r}")
        try:
            getattr(proposer, name)(*args)
        except Exception:  # noqa: BLE001
            log.exception("shared draft: %s%r failed", name, args)


# -- the engine's side ----------------------------------------------------------------------
class RemoteDraft(Proposer):
    """The draft's process as the engine sees it: a proposer whose calls cross the pipe.
    Bookkeeping is buffered and goes with the next proposal (or :meth:`flush`); a call
    unanswered within ``timeout_s``, or a process that died, raises
    :class:`~specserve.errors.ProposerUnavailable` (the engine then decodes target-only, and
    the entry counts a fallback), and every call after it does too."""

    method = METHOD

    def __init__(self, conn: Connection, process, timeout_s: float) -> None:
        self.conn, self.process, self.timeout_s = conn, process, timeout_s
        self.ops: list[tuple[str, tuple]] = []
        self.lost: str | None = None  # why the draft stopped answering
        self.report: dict = {}        # the child's Ready: its build and warm-up

    def start(self, seq_id: int, seed: int) -> None:
        self.ops.append(("start", (seq_id, seed)))

    def fork(self, seq_id: int, parent_id: int, seed: int, num_tokens: int) -> None:
        self.ops.append(("fork", (seq_id, parent_id, seed, num_tokens)))

    def commit(self, seq_id: int, num_valid_tokens: int) -> None:
        self.ops.append(("commit", (seq_id, num_valid_tokens)))

    def finish(self, seq_id: int) -> None:
        self.ops.append(("finish", (seq_id,)))

    def reset(self) -> None:
        self.ops = [("reset", ())]  # what was buffered is moot: the draft drops everything

    def flush(self) -> None:
        if self.ops:
            self.propose([])

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        ops, self.ops = self.ops, []
        return self.call(Propose(ops, requests))

    def warm_up(self) -> dict:
        """The child warmed the draft up before it said ready (:func:`serve_draft`)."""
        return self.report["warm_up"]

    def usage(self) -> dict:
        return self.call(Usage())

    def ready(self, timeout_s: float) -> dict:
        """The child's :class:`Ready` report, once it has built and warmed up the draft."""
        self.report = self.receive(timeout_s).report
        return self.report

    def call(self, message):
        if self.lost:
            raise ProposerUnavailable(self.lost)
        try:
            self.conn.send(message)
        except OSError as exc:  # the child closed its end
            self.lost = f"the draft's process is gone ({exc})"
            raise ProposerUnavailable(self.lost) from exc
        reply = self.receive(self.timeout_s)
        if isinstance(reply, Failed):
            raise RuntimeError(f"the draft's process: {reply.reason}")
        return reply

    def receive(self, timeout_s: float):
        """The next message from the child within ``timeout_s`` (a late reply would answer
        the next call, so a timeout loses the draft for good)."""
        if not self.conn.poll(timeout_s):
            self.lost = f"the draft's process did not answer within {timeout_s:g} s"
            raise ProposerUnavailable(self.lost)
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:  # the child exited (its end closed) or was killed
            self.process.join(1.0)
            self.lost = f"the draft's process exited (code {self.process.exitcode})"
            raise ProposerUnavailable(self.lost) from exc


@contextlib.contextmanager
def draft_process(s: Settings, max_len: int, target_vocab_size: int):
    """The draft's process, started now (it loads while the caller builds the target) and
    always ended after: asked to stop, then killed if it has not within ``STOP_S``."""
    context = multiprocessing.get_context("spawn")
    conn, child_end = context.Pipe()
    process = context.Process(target=serve_draft, name="shared-draft",
                              args=(child_end, s, max_len, target_vocab_size))
    process.start()
    child_end.close()  # ours: the child's exit must close the pipe's last copy of its end
    try:
        yield RemoteDraft(conn, process, s.draft_timeout_s)
    finally:
        with contextlib.suppress(OSError, ValueError):
            conn.send(Stop())
        conn.close()
        process.join(STOP_S)
        if process.is_alive():
            log.info("shared draft: still running %.0f s after stop, killed", STOP_S)
            process.kill()
            process.join()


# -- the entries (module docstring) -----------------------------------------------------------
@dataclass
class Shared(Bench):
    """step.py's bench (the target, the prompts, the reference) with the draft's process and
    the memory sampled once both were loaded."""

    draft: RemoteDraft | None = None
    used_after_load: int | None = None  # the device's bytes in use, both loaded (None: a CPU)


def shared_draft(b: Shared) -> dict:
    engine = b.engine(METHOD, b.draft, f"a random {b.s.draft_shape}-shaped draft in its own process")
    p = run_pass(engine, b.prompts, b.greedy, 1)
    b.draft.flush()  # the last request's finish: the draft frees its slot
    entry = {"batch": 1, "k": b.s.k, **figures(p, b.reference)}
    if entry["status"] == "ok" and not p.drafts.num_draft_tokens:
        entry.update(status="failed", reason="no draft tokens proposed: the comparison proves nothing")
    return entry


def memory(b: Shared) -> dict:
    """Both processes' memory after the runs, and the device's once both were loaded,
    against the estimates."""
    s, max_len = b.s, b.worker.max_seq_len
    est = {"target": estimate_of(s.shape, s, max_len, draft=False, kernels=s.kernels),
           "draft": estimate_of(s.draft_shape, s, max_len, draft=True, kernels=b.draft.report["kernels"])}
    both = SharedGpu(est["target"], est["draft"], None)  # as memory-estimate counts them
    after = {"target": cuda_now(s.device), "draft": b.draft.usage()}
    used = {"after_load": b.used_after_load, "after_run": after["target"]["device_used"]}
    return {"status": "ok",
            "estimate_gib": {**{role: gib(e.total) for role, e in est.items()}, "sum": gib(both.total)},
            "device_used_gib": {when: gib(n) for when, n in used.items()},
            "peak_allocated_gib": {role: gib(now["peak_allocated"]) for role, now in after.items()},
            "reserved_gib": {role: gib(now["reserved"]) for role, now in after.items()},
            "processes_gib": device_processes({os.getpid(): "target", b.draft.report.get("pid"): "draft"}),
            "within_estimate": within(est, after, used.values(), both.total)}


def device_processes(roles: dict) -> dict[str, float] | None:
    """Each process's use of the device as the driver counts it (``nvidia-smi``: context,
    loaded kernels and the allocator's reserve), by role (``roles``: pid -> role; any other
    process by its pid); None without nvidia-smi, or where it fails. What the device's use
    holds beyond the two allocators' reserves is found here (the window of 2026-12-04: 4.9
    GiB beyond them, two contexts' worth expected)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    found = {}
    for line in proc.stdout.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        role = roles.get(int(pid) if pid.isdigit() else None, pid)
        found[role] = round(int(mib) / 1024, 3) if mib.isdigit() else mib  # "[N/A]" in some containers
    return found


def estimate_of(shape: str, s: Settings, max_len: int, *, draft: bool, kernels: str) -> MemoryEstimate:
    """``specserve memory-estimate``'s figure for one of the two models as built here."""
    load = Workload(max_model_len=max_len, max_num_seqs=s.batch, num_speculative_tokens=s.k,
                    dtype=s.dtype, draft=draft, spare_slot=compiled(kernels, s.device, draft))
    return estimate(ModelShape.from_config({"model_type": "llama", **SHAPES[shape]}), load)


def within(est: dict[str, MemoryEstimate], after: dict[str, dict], used, total: int) -> bool | None:
    """Each process's peak within its estimate's tensors (its total less the context
    allowance, which the allocator never sees), and the device's use within ``total``, the
    two estimates together; None where nothing was measured (a CPU)."""
    used = list(used)
    if None in used:
        return None
    peaks = all(after[role]["peak_allocated"] <= e.total - e.overhead for role, e in est.items())
    return peaks and max(used) <= total


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


ENTRIES = (("target_only", target_only), ("shared_draft", shared_draft), ("memory", memory))


# -- the step ---------------------------------------------------------------------------------
def build(s: Settings, draft: RemoteDraft) -> tuple[Shared, dict]:
    """The target, built and warmed up (step.build) while the draft's process loads and warms
    up its draft; the device's memory once both are ready; the report's header."""
    bench, header = build_target(s)
    assert bench.worker.max_seq_len == max_len_of(s), "the draft's length is not the target's"
    header["draft"] = draft.ready(s.draft_timeout_s)
    used = cuda_now(s.device)["device_used"]
    return Shared(s, bench.worker, bench.prompts, draft=draft, used_after_load=used), header


def max_len_of(s: Settings) -> int:
    """The sequence length step.build gives the target (its prompts, the new tokens, a
    verify's K + 1 past the last), which the draft gets too."""
    prompts = make_prompts(s.num_prompts, SHAPES[s.shape]["vocab_size"])
    return max(map(len, prompts)) + s.max_tokens + s.k + 2


def run(out: Path, dry_run: bool) -> None:
    s = DRY if dry_run else GPU
    with draft_process(s, max_len_of(s), SHAPES[s.shape]["vocab_size"]) as draft:
        run_entries(out / FILE, s, partial(build, draft=draft), ENTRIES)
