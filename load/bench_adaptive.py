"""The controller's own cost, in process: the same batch decoded with fixed K vs adaptive K.

The embedded default with n-gram drafts, ``--batch`` rewrite prompts (greedy, ``--max-tokens``
each) run to completion, once with K fixed at ``--k`` for every request (what
``speculation.enabled: true`` gets) and once with ``adaptive=True`` (what the router's default
gets: the coordinator picks K per step, at most ``--k``). Modes alternate, their order
swapped every round; the first round is a warm-up for both. Where the controller settles on
the full K (as it does for this workload), the two do the same work, so the ratio is the cost
of the adaptive machinery; the K counts are printed to show it. No HTTP, no Ray.

    python load/bench_adaptive.py --batch 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="measured rounds after the warm-up")
    args = p.parse_args(argv)
    if not (1 <= args.batch <= 256 and 1 <= args.k <= 16 and args.rounds >= 1):
        p.error("--batch in [1, 256], --k in [1, 16], --rounds >= 1")
    from specserve.config import EngineConfig, SamplingParams
    from specserve.engine.builder import build_engine
    from specserve.engine.tokenizer import encode_chat

    from load.prompts import load_prompts

    cfg = EngineConfig.model_validate({
        "target": {"source": "embedded"}, "max_model_len": 2048, "max_num_seqs": args.batch,
        "speculative": {"method": "ngram", "num_speculative_tokens": args.k},
        "kv_cache": {"prefix_caching": False}})  # repeated prompts: every run prefills
    engine, target = build_engine(cfg)
    prompts = load_prompts("rewrite")
    ids = [encode_chat(target.tokenizer, prompts[i % len(prompts)]["messages"])
           for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rates: dict[str, list[float]] = {"fixed": [], "adaptive": []}
    for r in range(args.rounds + 1):
        for mode in (("fixed", "adaptive") if r % 2 == 0 else ("adaptive", "fixed")):
            engine.counters.k_counts.clear()
            t0 = time.perf_counter()
            outs = engine.generate(ids, params, num_speculative_tokens=args.k, adaptive=mode == "adaptive")
            rate = sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)
            print(f"round {r}{' (warm-up)' if r == 0 else ''}  {mode:>8}  {rate:7.1f} tok/s  "
                  f"K counts {dict(sorted(engine.counters.k_counts.items()))}", flush=True)
            if r > 0:
                rates[mode].append(rate)
    mean = {m: sum(v) / len(v) for m, v in rates.items()}
    print(f"\nbatch {args.batch}: fixed {mean['fixed']:.1f} tok/s, adaptive {mean['adaptive']:.1f} "
          f"tok/s, adaptive / fixed = {mean['adaptive'] / mean['fixed']:.3f} "
          f"(per round: {', '.join(f'{a / f:.3f}' for a, f in zip(rates['adaptive'], rates['fixed']))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
