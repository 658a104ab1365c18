"""The runtime on a GPU: ``kernels: library`` vs ``compiled`` (CUDA graphs), side by side.

A Llama-3-8B-shaped model with random weights (speed does not depend on the values), in
bfloat16 on the first CUDA device: the forward cost of T = 1..8 new tokens after a context,
at batch 1 and at ``--rows``; the bytes a decode reads against the device's measured read
bandwidth; the verify / decode ratio per T. Prints a table and writes JSON.

    make bench-gpu                      # on a machine with a GPU
    python load/bench_gpu.py --shape tiny --device cpu --backend eager   # the script's smoke run

On a CPU it runs too (``--shape tiny``; the CI test does that), but measures nothing of
interest there: the C kernels (``kernels: invariant``) are the CPU path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TableSpec, format_table  # noqa: E402
from roofline import decode_bytes, forward_costs, read_bandwidth  # noqa: E402
from specserve.engine.model import LlamaRuntime, ModelArch, rope_tables  # noqa: E402

DEFAULT_OUT = Path("results/bench-gpu.json")
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=1024),
}
TABLE: TableSpec = (("kernels", "kernels", 9, 0), ("rows", "rows", 4, 0),
                    ("T=1 ms", "t1_ms", 8, 2), ("tok/s", "tokens_per_s", 8, 1),
                    ("GB/s", "gbps", 7, 0), ("roofline", "roofline_share", 8, 2),
                    ("T2/T1", "r2", 6, 2), ("T4/T1", "r4", 6, 2), ("T5/T1", "r5", 6, 2),
                    ("T8/T1", "r8", 6, 2))


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


def measure(runtime: LlamaRuntime, kernels: str, rows: int, context: list[int],
            backend: str) -> dict:
    runtime.use_kernels(kernels, backend=backend)
    costs = forward_costs(runtime, context, reps=7, rows=rows)
    return {"kernels": kernels, "rows": rows, "costs_s": costs}


def summarize(results: list[dict], nbytes: int, bandwidth: float) -> list[dict]:
    """One table row per run: the decode step and what a verify of T costs relative to it."""
    out = []
    for r in results:
        t1 = r["costs_s"][1]
        out.append({"kernels": r["kernels"], "rows": r["rows"], "t1_ms": 1e3 * t1,
                    "tokens_per_s": r["rows"] / t1, "gbps": nbytes / t1 / 1e9,
                    "roofline_share": nbytes / t1 / bandwidth,
                    **{f"r{t}": r["costs_s"][t] / t1 for t in (2, 4, 5, 8)}})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kernels", default="library,compiled")
    p.add_argument("--rows", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence")
    p.add_argument("--backend", default="inductor", help="torch.compile backend for 'compiled'")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    runtime = random_runtime(args.shape, getattr(torch, args.dtype), args.device,
                             max_len=args.context + 64)
    context = [(7 * i) % runtime.arch.vocab_size for i in range(args.context)]
    started = time.time()
    results = [measure(runtime, kernels, int(rows), context, args.backend)
               for kernels in args.kernels.split(",") for rows in args.rows.split(",")]
    bandwidth = read_bandwidth(gib=1.0, device=args.device)
    nbytes = decode_bytes(runtime)
    rows = summarize(results, nbytes, bandwidth)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"{device}, {args.shape} ({nbytes / 1e9:.2f} GB of weights, {args.dtype}), context "
          f"{args.context}; read bandwidth {bandwidth / 1e9:.0f} GB/s; {time.time() - started:.0f} s")
    print(format_table(rows, TABLE))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "shape": args.shape, "dtype": args.dtype,
                                          "bandwidth": bandwidth, "decode_bytes": nbytes,
                                          "rows": rows, "raw": results}, indent=1))


if __name__ == "__main__":
    main()
