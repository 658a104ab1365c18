"""Two builds of the C kernels' attention, side by side in one process: an attention change's
speed and bits, measured apart from the machine's slow moments. ::

    python load/attention_ab.py OLD/kernels.c NEW/kernels.c [--contexts 64,256,1024] [--tokens 1]

Each source is compiled as ``kernels_ab.py`` compiles it (``native.FLAGS``) into its own
library. The shapes are the embedded SmolLM2-135M's (9 query heads, 3 key/value heads of 64, a
table of 2,048 positions in blocks of ``--block``: 16, a CPU server's paged cache, by default):
30 layers, each its own keys and values, as a forward reads them. Before each layer a 2-thread
sum over 3.6 MB (one layer's weights) evicts what the caches held, as the layer's linears do.
``--tokens``: the new tokens of each row (1: a decode; 8 or 9: a verify of 7 or 8 drafts). For
each context, seven rounds of both builds in turn, the best round of each kept; then their
outputs compared bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]
from specserve.engine.runtime.native import declare  # noqa: E402

from load.kernels_ab import build  # noqa: E402

H, HK, D, LAYERS, TABLE = 9, 3, 64, 30, 2048
SWEEP = r"""
float sweep(const float *x, long n, int threads) {
  float s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(threads)
  for (long i = 0; i < n; i++) s += x[i];
  return s;
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--contexts", default="64,256,1024", help="comma list of positions before the new tokens")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block", type=int, default=16, help="positions a cache block")
    args = p.parse_args()
    T, BS = args.tokens, args.block
    W = TABLE // BS
    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((W, HK, BS, D), dtype=np.float32) for _ in range(LAYERS)]
    values = [rng.standard_normal((W, HK, BS, D), dtype=np.float32) for _ in range(LAYERS)]
    table = np.arange(W, dtype=np.int32)[None, :].copy()
    q = rng.standard_normal((T, (H + 2 * HK) * D), dtype=np.float32)
    weights = [np.ones(3_600_000 // 4, dtype=np.float32) for _ in range(LAYERS)]
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"old": args.old, "new": args.new}
        libs = {name: declare(build(src, Path(tmp) / f"{name}.so")) for name, src in sources.items()}
        (Path(tmp) / "sweep.c").write_text(SWEEP)
        subprocess.run(["cc", "-O3", "-fopenmp", "-shared", "-fPIC", str(Path(tmp) / "sweep.c"),
                        "-o", str(Path(tmp) / "sweep.so")], check=True)
        sweep = ctypes.CDLL(str(Path(tmp) / "sweep.so")).sweep
        sweep.argtypes, sweep.restype = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int], ctypes.c_float
        print(f"attention, {args.threads} threads, {T} new token(s) a row, {LAYERS} layers")
        for context in (int(c) for c in args.contexts.split(",")):
            assert context + T <= TABLE
            lo = np.zeros(T, dtype=np.int32)
            hi = np.arange(context + 1, context + T + 1, dtype=np.int32)
            outs = {name: [np.empty((T, H, D), dtype=np.float32) for _ in range(LAYERS)] for name in libs}
            best = {name: float("inf") for name in libs}
            for _ in range(7):
                for name, lib in libs.items():
                    total = 0
                    for layer in range(LAYERS):
                        call = (q.ctypes.data, q.shape[1], keys[layer].ctypes.data, values[layer].ctypes.data,
                                table.ctypes.data, W, lo.ctypes.data, hi.ctypes.data, None, None,
                                outs[name][layer].ctypes.data, 1, T, H, HK, BS, D, 0.125, args.threads)
                        sweep(weights[layer].ctypes.data, weights[layer].size, args.threads)
                        start = time.perf_counter_ns()
                        lib.attention_rows(*call)
                        total += time.perf_counter_ns() - start
                    best[name] = min(best[name], total / 1e3)
            same = all(np.array_equal(a, b) for a, b in zip(outs["old"], outs["new"]))
            mb = (context + T) * HK * D * 4 * 2 * LAYERS / 1e6
            print(f"context {context:5}: old {best['old']:7.0f} us ({mb / best['old'] * 1e3:4.1f} GB/s)  "
                  f"new {best['new']:7.0f} us ({mb / best['new'] * 1e3:4.1f} GB/s)  "
                  f"new/old {best['new'] / best['old']:.3f}  {'bits identical' if same else 'BITS DIFFER'}")


if __name__ == "__main__":
    main()
