"""The runtime on a GPU: ``kernels: library`` vs ``compiled`` (CUDA graphs), side by side.

A Llama-3-8B-shaped model with random weights (speed does not depend on the values), in
bfloat16 on the first CUDA device: the forward cost of T = 1..8 new tokens after a context,
at batch 1 and at ``--rows``; the bytes a decode reads against the device's measured read
bandwidth; the verify / decode ratio per T; on the compiled path, the seconds of the first
call of each shape (its bucket's compile and CUDA-graph capture). Prints a table and writes
JSON.

    make bench-gpu                      # on a machine with a GPU
    python load/bench_gpu.py --shape tiny --device cpu --backend eager   # the script's smoke run

The JSON is rewritten after every measurement and each step is logged, so a run killed at a
lent machine's time limit keeps what it measured. Measurements go in order of importance:
every row count at T = 1 (decode), then T = 8 (issue 52's verify of 8) and, right after it,
T = 8 against T = 1 in alternating calls (``r8_paired``: the ratio without the drift between
two runs measured apart), then 5 (a verify of K = 4), 2, 4, 3, 6, 7; on the compiled path
that is also the order its buckets compile (1, 8, 2, 4 new tokens).

On a CPU it runs too (``--shape tiny``; the CI test does that), but measures nothing of
interest there: the C kernels (``kernels: invariant``) are the CPU path.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import TableSpec, format_table  # noqa: E402
from roofline import decode_bytes, forward_cost, prefilled_cache, read_bandwidth  # noqa: E402
from specserve.engine.runtime.arch import ModelArch  # noqa: E402
from specserve.engine.runtime.compiled import bucket  # noqa: E402
from specserve.engine.runtime.model import LlamaRuntime, rope_tables  # noqa: E402

from load.gpu.output import setup_logging, write_json  # noqa: E402
from load.gpu.runtime import cudagraph_skips, use_kernels, warm_up  # noqa: E402

log = logging.getLogger("bench-gpu")

DEFAULT_OUT = Path("results/bench-gpu.json")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 rope_theta=500000.0, max_position_embeddings=8192)
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    # Llama-3-8B's layers, 4 of them: every GEMM and attention shape of the real model (what
    # decides kernels' tilings and so their rounding) at an eighth of the compile time.
    "llama3-8b-4l": {**LLAMA3_8B, "num_hidden_layers": 4},
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=1024),
}
# Drafts beside those targets (gpu/shared.py): Llama-3.2-1B's shape (16 layers of hidden 2048,
# tied embeddings, Llama-3's vocabulary) and one under the tiny target, with its vocabulary.
SHAPES["llama3.2-1b"] = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192,
                         "num_hidden_layers": 16, "tie_word_embeddings": True}
SHAPES["tiny-draft"] = {**SHAPES["tiny"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}
PRIORITY = (1, 8, 5, 2, 4, 3, 6, 7)  # T in the order measured (module docstring)
PAIRED = 8  # the verify measured against T = 1 in alternating calls as well (``paired``)
TABLE: TableSpec = (("kernels", "kernels", 9, 0), ("rows", "rows", 4, 0),
                    ("T=1 ms", "t1_ms", 8, 2), ("tok/s", "tokens_per_s", 8, 1),
                    ("GB/s", "gbps", 7, 0), ("roofline", "roofline_share", 8, 2),
                    ("T2/T1", "r2", 6, 2), ("T4/T1", "r4", 6, 2), ("T5/T1", "r5", 6, 2),
                    ("T8/T1", "r8", 6, 2), ("paired", "r8_paired", 6, 2),
                    ("1st s", "first_calls_s", 6, 1))


def random_runtime(shape: str, dtype: torch.dtype, device: str, max_len: int) -> LlamaRuntime:
    """A runtime of ``shape`` with random weights made on ``device`` in ``dtype`` (an 8B
    model never passes through host memory or float32)."""
    config = LlamaConfig(**SHAPES[shape])
    cos, sin = rope_tables(config, max_len)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            runtime = LlamaRuntime(ModelArch.from_hf_config(config), cos.to(device, dtype),
                                   sin.to(device, dtype))
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in runtime.parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0.0, 0.02)
    return runtime.eval().requires_grad_(False)


def measure_order(ts: list[int]) -> list[int]:
    """``ts`` in :data:`PRIORITY` order (any T outside it last, ascending)."""
    return [t for t in PRIORITY if t in ts] + sorted(set(ts) - set(PRIORITY))


def measure(runtime: LlamaRuntime, kernels: str, rows: list[int], context: list[int], ts: list[int],
            args, save) -> list[dict]:
    """One result per row count, filled T by T (:func:`measure_order`); ``save()`` after each."""
    use_kernels(runtime, kernels, backend=args.backend)
    results, caches = [], {}
    for n in rows:
        caches[n] = prefilled_cache(runtime, context, n, max(ts))
        results.append({"kernels": kernels, "rows": n, "costs_s": {}, "first_call_s": {},
                        "buckets_s": {}, "warm_up": None})
        if kernels == "compiled" and args.warm_up:
            results[-1]["warm_up"] = warm_up(runtime, caches[n][0])
    save(results)
    for t in measure_order(ts):
        for r in results:
            cache, slots = caches[r["rows"]]
            median, first = forward_cost(runtime, cache, slots, context, t, args.reps)
            r["costs_s"][t], r["first_call_s"][t] = median, first
            if kernels == "compiled":  # the first T to reach a bucket paid its compile
                key = f"{bucket(len(slots), limit=cache.num_slots)}x{bucket(t)}"
                r["buckets_s"].setdefault(key, first)
            log.info("%s rows %d T %d: %.2f ms (first call %.2f s)", kernels, r["rows"], t,
                     1e3 * median, first)
            if t == PAIRED and 1 in r["costs_s"]:
                r["paired"] = paired(runtime, cache, slots, context, t, 2 * args.reps + 1)
                log.info("%s rows %d T %d / T 1, alternating: %.3f", kernels, r["rows"], t,
                         r["paired"]["ratio"])
            save(results)
    return results


def paired(runtime: LlamaRuntime, cache, slots: list[int], context: list[int], t: int,
           reps: int) -> dict:
    """T = 1 and ``t`` called in turn, ``reps`` times each (both measured, so compiled,
    already): the ratio of their medians, free of the drift between two runs measured apart
    (the fourth window: T = 5, which runs T = 8's graph, measured 10% off T = 8)."""
    ones, many = [], []
    for _ in range(reps):
        ones.append(forward_cost(runtime, cache, slots, context, 1, 1, warmup=0)[0])
        many.append(forward_cost(runtime, cache, slots, context, t, 1, warmup=0)[0])
    one, other = statistics.median(ones), statistics.median(many)
    return {"t": t, "reps": reps, "t1_s": one, "t_s": other, "ratio": other / one}


def summarize(results: list[dict], nbytes: int, bandwidth: float) -> list[dict]:
    """One table row per run measured at T = 1: the decode step and what a verify of T
    costs relative to it (None: T not measured yet)."""
    out = []
    for r in results:
        t1 = r["costs_s"].get(1)
        if t1 is None:
            continue
        ratio = {f"r{t}": r["costs_s"][t] / t1 if t in r["costs_s"] else None for t in (2, 4, 5, 8)}
        out.append({"kernels": r["kernels"], "rows": r["rows"], "t1_ms": 1e3 * t1,
                    "tokens_per_s": r["rows"] / t1, "gbps": nbytes / t1 / 1e9,
                    "roofline_share": nbytes / t1 / bandwidth, **ratio,
                    "r8_paired": r["paired"]["ratio"] if "paired" in r else None,
                    "first_calls_s": sum(r["first_call_s"].values())})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kernels", default="library,compiled")
    p.add_argument("--rows", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--ts", default="1,2,3,4,5,6,7,8", help="new tokens per row, comma-separated")
    p.add_argument("--reps", type=int, default=7, help="timed calls per T (after 3 warm-up calls)")
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence")
    p.add_argument("--backend", default="inductor", help="torch.compile backend for 'compiled'")
    p.add_argument("--warm-up", action="store_true",
                   help="call the runtime's warm_up (every shape serving uses; ~1 min each at 8B) "
                        "before measuring compiled, where the runtime has one")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="buffer of the read-bandwidth sum")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    started = time.time()
    bandwidth = read_bandwidth(gib=args.bandwidth_gib, device=args.device)
    log.info("%s: read bandwidth %.0f GB/s", device, bandwidth / 1e9)
    ts = [int(t) for t in args.ts.split(",")]
    runtime = random_runtime(args.shape, getattr(torch, args.dtype), args.device,
                             max_len=args.context + max(ts) + 64)
    nbytes = decode_bytes(runtime)
    log.info("%s: %.2f GB of weights in %s", args.shape, nbytes / 1e9, args.dtype)
    context = [(7 * i) % runtime.arch.vocab_size for i in range(args.context)]
    done: list[dict] = []

    def save(current: list[dict], complete: bool = False) -> None:
        results = done + current
        write_json(out, {"device": device, "shape": args.shape, "dtype": args.dtype,
                         "context": args.context, "bandwidth": bandwidth, "decode_bytes": nbytes,
                         "rows": summarize(results, nbytes, bandwidth), "raw": results,
                         "cudagraph_skips": cudagraph_skips(), "complete": complete,
                         "seconds": time.time() - started})

    for kernels in args.kernels.split(","):
        done += measure(runtime, kernels, [int(n) for n in args.rows.split(",")], context, ts, args, save)
    save([], complete=True)
    print(f"{device}, {args.shape} ({nbytes / 1e9:.2f} GB of weights, {args.dtype}), context "
          f"{args.context}; read bandwidth {bandwidth / 1e9:.0f} GB/s; {time.time() - started:.0f} s")
    rows = summarize(done, nbytes, bandwidth)
    print(format_table([{k: float("nan") if v is None else v for k, v in r.items()} for r in rows], TABLE))


if __name__ == "__main__":
    main()
