"""``memory.json``: the per-rank memory estimate (``specserve.memory``, what ``specserve
memory-estimate`` prints) against what CUDA measures, on a Llama-3-8B-shaped model.

The workload is one that fits an 80 GB GPU with room to spare: ``max_model_len`` 8192 (the
model's own limit), ``max_num_seqs`` 16, K = 4, bfloat16 (the estimate: about 59 GiB with the
``library`` kernels, most of it the 8192-token prefill's attention scores). Two forwards, the
two the estimate's workspace is the larger of: a prefill of a full-length prompt, and a
verify of every slot at full context (the rejection sampler included, sampled with top-k and
top-p: its sort and copies are in the estimate). Measured per forward:

- ``peak_allocated``: ``torch.cuda.max_memory_allocated`` over the forward, which must be at
  most the estimate's tensors (``total - overhead``: the overhead is the CUDA context, which
  the allocator never sees);
- ``reserved``: ``torch.cuda.memory_reserved`` after it, the caching allocator's hold,
  CUDA-graph pools included (``compiled``: the forward runs three times, compile, warm-up and
  capture, then once more replayed);
- ``device_used``: total minus free memory of the device (``mem_get_info``), context included,
  which must be at most the estimate's total.

A dry run runs the same forwards at the tiny shape on the CPU; nothing is measured there.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from specserve.config import SamplingParams
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.step.proposal import Proposal
from specserve.engine.step.verify_batch import VerifyBatch, VerifyRow
from specserve.engine.worker import ModelWorker
from specserve.memory import MemoryEstimate, ModelShape, Workload, estimate, format_estimate

from load.bench_gpu import SHAPES, random_runtime
from load.gpu.output import write_json
from load.gpu.runtime import cudagraph_skips, free_cuda, sync, use_kernels

log = logging.getLogger(__name__)

FILE = "memory.json"
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)


@dataclass(frozen=True)
class Settings:
    shape: str
    dtype: str
    device: str
    max_model_len: int
    max_num_seqs: int
    k: int
    kernels: tuple[str, ...]
    backend: str


GPU = Settings("llama3-8b", "bfloat16", "cuda", 8192, 16, 4, ("library", "compiled"), "inductor")
DRY = Settings("tiny", "float32", "cpu", 256, 4, 4, ("library", "compiled"), "eager")


def estimate_of(s: Settings, kernels: str) -> MemoryEstimate:
    """What ``specserve memory-estimate`` says for this workload (compiled: a spare slot)."""
    shape = ModelShape.from_config({"model_type": "llama", **SHAPES[s.shape]})
    load = Workload(max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                    num_speculative_tokens=s.k, dtype=s.dtype, spare_slot=kernels == "compiled")
    return estimate(shape, load)


def cuda_now(device: str) -> dict:
    """The three numbers (module docstring) and what is allocated now; None on a CPU."""
    if device == "cpu":
        return {"peak_allocated": None, "reserved": None, "device_used": None, "allocated": None}
    sync(device)
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used": total - free, "allocated": torch.cuda.memory_allocated()}


def prefill(worker: ModelWorker, s: Settings) -> None:
    """A prompt of ``max_model_len`` tokens in slot 0 (K + 1 logits, as a target's prefill)."""
    prompt = [3 + (7 * i) % (worker.vocab_size - 3) for i in range(s.max_model_len)]
    worker.forward(ForwardBatch([0], [prompt], [s.k + 1]))
    worker.rollback(0, 0)


def verify(worker: ModelWorker, s: Settings) -> None:
    """Every slot at full context verifies K drafts, sampled. The cache's contents do not
    matter to memory, so its lengths are set rather than prefilled."""
    slots = list(range(s.max_num_seqs))
    for slot in slots:
        worker.cache.lengths[slot] = s.max_model_len - s.k - 1  # (the rows' start)
    start = s.max_model_len - s.k - 1
    worker.verify(VerifyBatch([VerifyRow(slot, start, [5] * (s.k + 1), Proposal([5] * s.k), (SAMPLED, slot))
                               for slot in slots]))


def measure(worker: ModelWorker, s: Settings, phase, calls: int) -> dict:
    """``phase`` run ``calls`` times from a reset peak: the three numbers after."""
    if s.device != "cpu":
        sync(s.device)
        torch.cuda.reset_peak_memory_stats()
    for _ in range(calls):
        phase(worker, s)
    return cuda_now(s.device)


def check_kernels(runtime, kernels: str, s: Settings, save) -> None:
    """The estimate and both forwards on one kernels setting, ``save(entry)`` after each."""
    use_kernels(runtime, kernels, backend=s.backend, verify_tokens=s.k + 1)
    est = estimate_of(s, kernels)
    worker = ModelWorker(runtime, num_slots=s.max_num_seqs, max_seq_len=s.max_model_len)
    for _ in range(s.max_num_seqs):
        worker.allocate()
    static = cuda_now(s.device)["allocated"]  # weights, rope tables, KV cache
    entry = {"estimate": {**asdict(est), "total": est.total},
             "estimate_line": format_estimate(est, oneline=True), "static_allocated": static,
             "static_estimate": est.weights + est.kv_cache, "phases": {}}
    save(entry)
    calls = 4 if kernels == "compiled" else 1  # compile, warm up, capture; replay
    for name, phase in (("prefill", prefill), ("verify", verify)):
        entry["phases"][name] = measure(worker, s, phase, calls if name == "verify" else 1)
        entry["within_estimate"] = within(entry, est)
        entry["workspace_ratio"] = workspace_ratio(entry, est)
        entry["cudagraph_skips"] = cudagraph_skips()
        log.info("%s %s: %s (estimate %s)", kernels, name, _gib(entry["phases"][name]),
                 format_estimate(est, oneline=True))
        save(entry)
    del worker
    gc.collect()
    free_cuda()


def workspace_ratio(entry: dict, est: MemoryEstimate) -> float | None:
    """The estimate's workspace over the largest forward's peak above the static allocation
    (issue 52: at least 1, at most 1.25); None where nothing was measured (a CPU)."""
    peaks = [p["peak_allocated"] for p in entry["phases"].values()]
    if None in peaks:
        return None
    return round(est.workspace / max(max(peaks) - entry["static_allocated"], 1), 3)


def within(entry: dict, est: MemoryEstimate) -> bool | None:
    """Every forward's peak within the estimate's tensors and the device's use within its
    total; None where nothing was measured (a CPU)."""
    phases = entry["phases"].values()
    if any(p["peak_allocated"] is None for p in phases):
        return None
    return all(p["peak_allocated"] <= est.total - est.overhead and p["device_used"] <= est.total
               for p in phases)


def run(out: Path, dry_run: bool) -> None:
    s = DRY if dry_run else GPU
    report = {"settings": asdict(s), "kernels": {}}
    runtime = random_runtime(s.shape, getattr(torch, s.dtype), s.device, max_len=s.max_model_len)
    for kernels in s.kernels:
        def save(entry: dict, kernels: str = kernels) -> None:
            report["kernels"][kernels] = entry
            write_json(out / FILE, report)
        check_kernels(runtime, kernels, s, save)


def _gib(numbers: dict) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f} GiB" if v is not None else f"{k} -" for k, v in numbers.items())
