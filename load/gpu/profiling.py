"""``profile.txt``: where a compiled decode and verify spend their time, one profiler table.

The Llama-3-8B-shaped model of ``bench.json`` (bfloat16, 512 tokens of context, batch 1),
``kernels: compiled``: a few decode steps (T = 1) and verifies of K + 1 = 5 tokens, after
warm-up, under ``torch.profiler``; the table is ``key_averages`` sorted by CUDA time, top
rows. The cache has the bench's shape, so inductor's on-disk cache, filled by the bench step
before it, spares most of the compile. A dry run: the tiny shape on the CPU, sorted by CPU time.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from specserve.engine.runtime.forward_batch import ForwardBatch
from torch.profiler import ProfilerActivity, profile

from load.bench_gpu import random_runtime
from load.gpu.output import write_text
from load.gpu.runtime import cudagraph_skips, sync, use_kernels
from load.roofline import prefilled_cache

log = logging.getLogger(__name__)

FILE = "profile.txt"
K = 4
STEPS = 5        # profiled calls of each T
ROW_LIMIT = 30


def step_calls(runtime, cache, slots: list[int], context: list[int], t: int, calls: int) -> None:
    """``calls`` forwards of ``t`` new tokens after ``context`` in every slot."""
    for _ in range(calls):
        for slot in slots:
            cache.rollback(slot, len(context))
        runtime(cache, ForwardBatch(slots, [context[:t]] * len(slots), [t] * len(slots)))


def table(prof, cuda: bool) -> str:
    """The top rows by device time (CPU time on a CPU); newer torch names it device_time."""
    keys = ("cuda_time_total", "device_time_total") if cuda else ("cpu_time_total",)
    for key in keys:
        try:
            return prof.key_averages().table(sort_by=key, row_limit=ROW_LIMIT)
        except (AttributeError, KeyError, ValueError):
            continue
    return prof.key_averages().table(row_limit=ROW_LIMIT)


def run(out: Path, dry_run: bool) -> None:
    shape, dtype, device, backend, context_len = (
        ("tiny", torch.float32, "cpu", "eager", 40) if dry_run
        else ("llama3-8b", torch.bfloat16, "cuda", "inductor", 512))
    runtime = random_runtime(shape, dtype, device, max_len=context_len + 8 + 64)
    use_kernels(runtime, "compiled", backend=backend)
    context = [(7 * i) % runtime.arch.vocab_size for i in range(context_len)]
    cache, slots = prefilled_cache(runtime, context, 1, 8)  # bench_gpu's cache at batch 1
    with torch.inference_mode():
        for t in (1, K + 1):  # compile, warm up, capture
            step_calls(runtime, cache, slots, context, t, 3)
            log.info("T = %d ready", t)
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for t in (1, K + 1):
                step_calls(runtime, cache, slots, context, t, STEPS)
            sync(device)
    header = (f"{shape}, {dtype}, kernels: compiled ({backend}), batch 1, context {context_len}: "
              f"{STEPS} decodes (T = 1) then {STEPS} verifies (T = {K + 1}); "
              f"cudagraph_skips {cudagraph_skips()}\n\n")
    write_text(out / FILE, header + table(prof, device == "cuda") + "\n")
    log.info("wrote %s", FILE)
