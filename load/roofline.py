"""How close a runtime's step is to the memory roofline, and what a verify costs.

A decode step at batch 1 reads every weight once; on a CPU it cannot be faster than the
bytes it reads over the memory bandwidth (the roofline). A verify of T tokens reads the same
weights, so with kernels that are memory-bound it should cost about one decode: the premise
of speculative decoding. ``forward_costs`` measures a forward of T = 1..8 new tokens after a
context; ``read_bandwidth`` the machine's read bandwidth with torch itself (a sum over a
buffer far larger than the caches, all threads).
"""

from __future__ import annotations

import statistics
import time

import torch


def read_bandwidth(gib: float = 1.0, reps: int = 7, device: str | torch.device = "cpu") -> float:
    """Bytes per second torch reads with a sum over ``gib`` GiB (best of ``reps``)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        _sync(x.device)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def _sync(device: torch.device) -> None:
    """Wait for a GPU's queued kernels (a CPU runs them before returning)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_bytes(runtime) -> int:
    """Bytes of weights a one-token decode reads: every linear weight (a tied LM head reads
    the embedding again, as its own packed copy) and norms; the embedding table itself only
    for one row. The KV cache a short context adds is left out (a few hundred KB here)."""
    total = 0
    for name, p in runtime.named_parameters():
        if name == "embed.weight":
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    if runtime.lm_head.weight is runtime.embed.weight:
        total += runtime.lm_head.weight.numel() * runtime.lm_head.weight.element_size()
    return total


def forward_costs(runtime, context: list[int], ts=(1, 2, 3, 4, 5, 6, 7, 8),
                  reps: int = 9, rows: int = 1) -> dict[int, float]:
    """Median seconds of one forward of T new tokens after ``context``, in each of ``rows``
    sequences (batch 1 by default). The first three calls of each T are warm-up: a
    compiled runtime compiles, then records its CUDA graph."""
    cache = runtime.make_cache(num_slots=rows, max_seq_len=len(context) + max(ts) + 1)
    slots = [cache.allocate() for _ in range(rows)]
    device = runtime.embed.weight.device
    out = {}
    with torch.inference_mode():
        for slot in slots:
            runtime(cache, [slot], [context])
        for t in ts:
            times = []
            for _ in range(reps + 3):
                for slot in slots:
                    cache.rollback(slot, len(context))
                _sync(device)
                start = time.perf_counter()
                runtime(cache, slots, [context[:t]] * rows, [t] * rows)
                _sync(device)
                times.append(time.perf_counter() - start)
            out[t] = statistics.median(times[3:])
    return out
