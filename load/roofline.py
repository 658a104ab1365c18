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
from specserve.engine.runtime.forward_batch import ForwardBatch


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
        if name == "embed.weight":  # one row (formed from blocks where the table is: counted below)
            total += p.shape[-1] * p.element_size() if p.numel() else 0
        else:
            total += p.numel() * p.element_size()
    if runtime.lm_head.weight is runtime.embed.weight:
        total += runtime.lm_head.weight.numel() * runtime.lm_head.weight.element_size()
    # linears on a GGUF's blocks (issue 54): their blocks, not the emptied float32 weight
    blocks = {id(m.quantized): m.quantized for m in runtime.modules()  # a tied head's once
              if getattr(m, "quantized", None) is not None}
    return total + sum(b.nbytes for b in blocks.values())


def forward_costs(runtime, context: list[int], ts=(1, 2, 3, 4, 5, 6, 7, 8),
                  reps: int = 9, rows: int = 1, rounds: int = 3) -> dict[int, float]:
    """Median seconds of one forward of T new tokens after ``context``, in each of ``rows``
    sequences (batch 1 by default): the median of ``rounds`` rounds over every T in turn,
    ``reps`` forwards of each T a round, so a slow moment of the machine falls on all the
    T alike and not on one (T = 1 measured alone, first, once read 1.2-2.8 ms slow on a
    2-core VM, and the verify's cost against it low). The first three calls of each T are
    warm-up: a compiled runtime compiles, then records its CUDA graph."""
    cache, slots = prefilled_cache(runtime, context, rows, max(ts))
    times: dict[int, list[float]] = {t: [] for t in ts}
    for r in range(rounds):
        for t in ts:
            warmup = 3 if r == 0 else 1
            times[t].append(forward_cost(runtime, cache, slots, context, t, reps, warmup)[0])
    return {t: statistics.median(values) for t, values in times.items()}


def prefilled_cache(runtime, context: list[int], rows: int, max_new: int):
    """A cache of ``rows`` slots, each holding ``context``, with room for ``max_new`` more
    tokens; returns ``(cache, slots)``. One cache serves every T: a compiled runtime's CUDA
    graphs keep the cache's addresses, so a new cache per T would record them again."""
    cache = runtime.make_cache(num_slots=rows, max_seq_len=len(context) + max_new + 1)
    slots = [cache.allocate() for _ in range(rows)]
    with torch.inference_mode():
        for slot in slots:
            runtime(cache, ForwardBatch([slot], [context]))
    return cache, slots


def forward_cost(runtime, cache, slots: list[int], context: list[int], t: int, reps: int,
                 warmup: int = 3) -> tuple[float, float]:
    """``(median seconds, first call's seconds)`` of a forward of ``t`` new tokens in every
    slot after ``context`` (``prefilled_cache``'s). The first call is where a compiled
    runtime compiles the shape's bucket; ``warmup`` calls are left out of the median."""
    device = runtime.embed.weight.device
    times = []
    with torch.inference_mode():
        for _ in range(reps + warmup):
            for slot in slots:
                cache.rollback(slot, len(context))
            _sync(device)
            start = time.perf_counter()
            runtime(cache, ForwardBatch(slots, [context[:t]] * len(slots), [t] * len(slots)))
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]), times[0]


def target_runtime():
    """The shipped server's target (the embedded model, its default kernels), target-only."""
    from specserve.config import EngineConfig
    from specserve.engine.builder import build_engine

    _, target = build_engine(EngineConfig.model_validate(
        {"target": {"source": "embedded"}, "speculative": {"method": None}, "max_num_seqs": 1}))
    return target.runtime


def context_ids(n: int) -> list[int]:
    """A context of ``n`` plain token ids (its length is what costs)."""
    return [int(t) for t in torch.arange(n) % 1000 + 1000]


def main(argv: list[str] | None = None) -> None:
    """``python -m load.roofline``: the embedded target's forward at T = 1, 8 and 9 new tokens
    (a decode, and verifies of 7 and 8 drafts) after a context of ``--context`` tokens, the
    bytes a decode reads, and torch's read bandwidth before and after (the best of both), as
    one JSON object on stdout. ``make bench-vs-llama-server`` runs it after the servers, in
    specserve's environment (``--avx2``: the AVX2 build's)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    runtime = target_runtime()
    context = context_ids(args.context)
    costs = forward_costs(runtime, context, ts=(1, 8, 9), reps=args.reps, rounds=args.rounds)
    bandwidth = max(bandwidth, read_bandwidth())
    blocks = [m.quantized for m in runtime.modules() if getattr(m, "quantized", None) is not None]
    kernels = "integer" if blocks and all(b.x8_inputs for b in blocks) else runtime.kernels
    print(json.dumps({"threads": args.threads, "kernels": kernels,
                      "read_bandwidth_gbs": round(bandwidth / 1e9, 2),
                      "decode_bytes": decode_bytes(runtime),
                      "forward_ms": {t: round(s * 1e3, 3) for t, s in costs.items()}}))


if __name__ == "__main__":
    main()
