"""Milliseconds a token of a target-only greedy decode at batch 1, in-process, on the embedded
model (128 tokens past EOS, 2 threads): ``python load/decode_ms.py [RUNS [KERNELS]]``. A
generate of one token (the prefill and the first) is taken off and the rest divided by 127,
as the gap between tokens over HTTP leaves the prefill out (spread over 128 tokens it added
0.3 ms a token to the step outside the forward on a Zen 3). Two checkouts compared in turn:
``PYTHONPATH=<checkout>/services:<checkout> python load/decode_ms.py 3`` (docs/BENCHMARKS.md,
"The one-call stack's refs gathered once"). Beside it, the same steps' forward calls
(``forward_in_step_ms``: the decode less them is the engine's step outside the forward), and
the same model's bare forward of one token after the prompt (``load.roofline.forward_costs``)."""

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


def decode_engine(kernels: str = "auto"):
    """``(engine, target)``: the embedded model, target-only, on 2 threads, no prefix cache
    (every run prefills): the engine this script, ``step_python`` and ``kernel_times`` decode on."""
    torch.set_num_threads(2)
    cfg = EngineConfig.model_validate({"speculative": {"method": None}, "max_num_seqs": 2,
                                       "kv_cache": {"prefix_caching": False},
                                       "target": {"kernels": kernels}})
    return build_engine(cfg)


def main(runs: int, kernels: str = "auto") -> dict:
    engine, target = decode_engine(kernels)
    ids = encode_chat(target.tokenizer, PROMPT)
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    spent = timed_forwards(target.runtime)
    ms, in_step = [], []
    for _ in range(runs):  # the steps after the first: the prefill is not a decode's (nor the gap's)
        start, spent[0] = time.perf_counter(), 0.0
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        first, first_forwards, spent[0] = time.perf_counter(), spent[0], 0.0
        [done] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        whole, steps = time.perf_counter() - first, len(done.output_token_ids) - 1
        ms.append(round((whole - (first - start)) / steps * 1000, 2))
        in_step.append(round((spent[0] - first_forwards) / steps * 1000, 2))
    del target.runtime.forward  # the class's again
    forward = forward_costs(target.runtime, ids, ts=(1,), reps=15, rounds=max(runs, 1))[1]
    return {"ms_per_token": ms, "forward_in_step_ms": in_step, "tokens": len(done.output_token_ids),
            "forward_ms": round(forward * 1000, 2)}


def timed_forwards(runtime) -> list[float]:
    """``runtime``'s forward timed where the engine calls it: a list whose one item adds up the
    seconds its calls take (the forward of those very steps, at their context lengths; a bare
    forward measured apart drifted by 1-2 ms against the decode on a shared 2-core VM)."""
    spent, inner = [0.0], runtime.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    runtime.forward = forward  # nn.Module.__call__ finds the instance's first
    return spent


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, *sys.argv[2:3])))
