"""Milliseconds a token of a target-only greedy decode at batch 1, in-process, on the embedded
model (128 tokens past EOS, 2 threads): ``python load/decode_ms.py [RUNS [KERNELS]]``. A
generate of one token (the prefill and the first) is taken off and the rest divided by 127,
as the gap between tokens over HTTP leaves the prefill out (spread over 128 tokens it added
0.3 ms a token to the step outside the forward on a Zen 3). Two checkouts compared in turn:
``PYTHONPATH=<checkout>/services:<checkout> python load/decode_ms.py 3`` (docs/BENCHMARKS.md,
"The one-call stack's refs gathered once"). Beside it, the same model's bare forward of one
token after the prompt (``load.roofline.forward_costs``): the decode less the forward is the
engine's step outside it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from specserve.config import EngineConfig, SamplingParams
from specserve.engine.builder import build_engine
from specserve.engine.tokenizer import encode_chat

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `load` as a namespace package, run as a script or imported

from load.roofline import forward_costs  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def main(runs: int, kernels: str = "auto") -> dict:
    torch.set_num_threads(2)
    cfg = EngineConfig.model_validate({"speculative": {"method": None}, "max_num_seqs": 2,
                                       "kv_cache": {"prefix_caching": False},
                                       "target": {"kernels": kernels}})
    engine, target = build_engine(cfg)
    ids = encode_chat(target.tokenizer, PROMPT)
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    ms = []
    for _ in range(runs):  # the steps after the first: the prefill is not a decode's (nor the gap's)
        start = time.perf_counter()
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        first = time.perf_counter()
        [done] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        whole = time.perf_counter() - first
        ms.append(round((whole - (first - start)) / (len(done.output_token_ids) - 1) * 1000, 2))
    forward = forward_costs(target.runtime, ids, ts=(1,), reps=15, rounds=max(runs, 1))[1]
    return {"ms_per_token": ms, "tokens": len(done.output_token_ids),
            "forward_ms": round(forward * 1000, 2)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, *sys.argv[2:3])))
