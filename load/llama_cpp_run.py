"""llama.cpp on given prompts (token ids): tokens and seconds per workload, as JSON on stdout.

Run by ``load/bench_engine.py --llama-cpp PYTHON`` under an interpreter that has
``llama-cpp-python`` (it compiles llama.cpp for minutes, so it lives in its own virtualenv,
not in the project's). Only the standard library and ``llama_cpp`` are imported here.

Input (``--prompts``, a JSON file): ``{"workload": [[token ids], ...], ...}``; with
``--prefill-reps``, ``{"name": [token ids], ...}`` and only the prompts' evaluation is timed. Each prompt
runs once greedily (temperature 0), stopping at EOS or ``--max-tokens``; seconds include the
prompt evaluation, as bench_engine's own modes do. One warm-up run comes first.
``--n-batch 1`` by default: batched prompt evaluation crashed (SIGSEGV) in the 0.3.36 build on
the AVX512 machine (docs/BENCHMARKS.md); pass a larger value where it works.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: workload -> list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-batch", type=int, default=1)
    p.add_argument("--prefill-reps", type=int, default=0,
                   help="prefill mode: time each prompt's evaluation (its logits after the last "
                        "token), the median of this many; --prompts maps a name to one prompt")
    args = p.parse_args()

    from llama_cpp import Llama, __version__

    with open(args.prompts) as f:
        workloads = json.load(f)
    if args.prefill_reps:
        return prefill(args, workloads, Llama, __version__)
    longest = max(len(ids) for prompts in workloads.values() for ids in prompts)
    llm = Llama(model_path=args.gguf, n_ctx=longest + args.max_tokens + 8, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=args.n_batch, verbose=False)

    def run(ids: list[int]) -> tuple[list[int], float]:
        llm.reset()
        out = []
        start = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if llm.token_eos() == token:
                break
            out.append(token)
            if len(out) >= args.max_tokens:
                break
        return out, time.perf_counter() - start

    run(next(iter(workloads.values()))[0][:32])  # warm-up
    result = {"version": __version__, "n_batch": args.n_batch, "workloads": {}}
    for name, prompts in workloads.items():
        outs, seconds = [], 0.0
        for ids in prompts:
            out, s = run(ids)
            outs.append(out)
            seconds += s
        result["workloads"][name] = {"tokens": sum(map(len, outs)), "seconds": seconds,
                                     "outputs": outs}
    json.dump(result, sys.stdout)
    return 0


def prefill(args, prompts: dict, Llama, version: str) -> int:
    """Seconds to evaluate each prompt (``{name: ids}``), the median of ``--prefill-reps``
    (llama.cpp evaluates ``--n-batch`` tokens a call), as JSON on stdout."""
    longest = max(map(len, prompts.values()))
    llm = Llama(model_path=args.gguf, n_ctx=longest + 8, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=args.n_batch, verbose=False)
    llm.eval(next(iter(prompts.values()))[:32])  # warm-up
    seconds = {}
    for name, ids in prompts.items():
        runs = []
        for _ in range(args.prefill_reps):
            llm.reset()
            start = time.perf_counter()
            llm.eval(ids)
            runs.append(time.perf_counter() - start)
        seconds[name] = sorted(runs)[len(runs) // 2]
    json.dump({"version": version, "n_batch": args.n_batch, "prefill_s": seconds}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
