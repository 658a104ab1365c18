"""Two builds of the C kernels' integer linears, side by side in one process: a kernel change's
speed and bits, measured apart from the machine's slow moments. ::

    python load/kernels_ab.py OLD/kernels.c NEW/kernels.c [--kind q4_1] [--threads 2] [--shapes layer]

Each source is compiled with the runtime's flags (``native.FLAGS``) into its own library; both
take the same inputs (random blocks, a scale of 0.01; random normal activations). For M = 1, 4,
8 and 9 input rows (a decode, and verifies of 3, 7 and 8 drafts), each build runs the shapes'
linears 30 times a round, six rounds in turn, and the best round is kept. The outputs of the
two builds are then compared bit for bit. ``--shapes layer``: one decoder layer of the embedded
SmolLM2-135M (qkv, o, gate_up, down: about 1.7 MB, from the caches; until session 60 its qkv
was 1,728 rows, not the model's 960); ``quantize``: one group of 16
weight rows against inputs of 576 and 1,536 (the inputs' quantization, most of the time);
``head``: the LM head (49,152 x 576; with ``--kind q8_0``, the embedded model's, 28 MB read
from memory); ``stack``: the 30 layers' linears, each its own weights (80 MB in Q4_1: from
memory, as a forward reads them).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services"))
from specserve.engine.runtime.native import FLAGS, GROUP_ROWS  # noqa: E402

SHAPES = {"layer": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "head": [(49152, 576)],
          "stack": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30,
          "quantize": [(16, 576), (16, 1536)]}
SCALES = {"q4_0": 1, "q4_1": 2, "q8_0": 1}     # 64-byte rows of scales a group's block opens with
QUANTS = {"q4_0": 256, "q4_1": 256, "q8_0": 512}  # bytes of 16 rows' quants a block
ROWS = (1, 4, 8, 9)


def build(source: Path, out: Path) -> ctypes.CDLL:
    subprocess.run(["cc", *FLAGS, str(source), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--kind", default="q4_1", choices=sorted(SCALES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="layer", choices=sorted(SHAPES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"old": args.old, "new": args.new}
        libs = {name: build(src, Path(tmp) / f"{name}.so") for name, src in sources.items()}
        group = SCALES[args.kind] * 64 + QUANTS[args.kind]
        rng = np.random.default_rng(0)
        weights = []
        for n, k in SHAPES[args.shapes]:
            groups = (n + GROUP_ROWS - 1) // GROUP_ROWS
            w = rng.integers(0, 256, size=(groups * (k // 32), group), dtype=np.uint8)
            w[:, :SCALES[args.kind] * 64] = np.frombuffer(
                np.full(SCALES[args.kind] * GROUP_ROWS, 0.01, np.float32).tobytes(), np.uint8)
            weights.append((n, k, w))
        inputs = {(m, k): rng.standard_normal((m, k)).astype(np.float32) for m in ROWS for _, k, _ in weights}
        outputs = {name: {(m, i): np.zeros((m, n), np.float32)
                          for m in ROWS for i, (n, _, _) in enumerate(weights)} for name in libs}

        def calls(name: str, m: int) -> list[tuple]:
            return [(ctypes.c_void_p(inputs[(m, k)].ctypes.data), ctypes.c_void_p(w.ctypes.data), None,
                     ctypes.c_void_p(outputs[name][(m, i)].ctypes.data), m, n, k, args.threads)
                    for i, (n, k, w) in enumerate(weights)]

        def best_round(name: str, m: int) -> float:
            kernel, argv = getattr(libs[name], f"linear_rows_{args.kind}_x8"), calls(name, m)
            best = float("inf")
            for _ in range(30):
                start = time.perf_counter()
                for a in argv:
                    kernel(*a)
                best = min(best, time.perf_counter() - start)
            return best

        print(f"{args.kind}, {args.threads} threads, shapes {SHAPES[args.shapes]}")
        for m in ROWS:
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(6):
                for name in times:
                    times[name].append(best_round(name, m))
            old, new = min(times["old"]), min(times["new"])
            same = all(np.array_equal(y.view(np.uint32), outputs["new"][key].view(np.uint32))
                       for key, y in outputs["old"].items() if key[0] == m)
            print(f"M={m}: old {old * 1e6:7.1f} us  new {new * 1e6:7.1f} us  new/old {new / old:.3f}  "
                  f"{'bits identical' if same else 'BITS DIFFER'}")


if __name__ == "__main__":
    main()
