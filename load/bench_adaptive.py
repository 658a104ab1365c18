"""The controller's own cost, in process: the same batch decoded with fixed K vs adaptive K.

The embedded default with n-gram drafts, ``--batch`` rewrite prompts (greedy, ``--max-tokens``
each) run to completion, once with K fixed at ``--k`` for every request (what
``speculation.enabled: true`` gets) and once with ``adaptive=True`` (what the router's default
gets: the coordinator picks K per step, at most ``--k``). Modes alternate, their order
swapped every round; the first round is a warm-up for both. Where the controller settles on
the full K (as it does for this workload), the two do the same work, so the ratio is the cost
of the adaptive machinery; the K counts are printed to show it. No HTTP, no Ray.

``--controller-steps N`` times the controller alone instead: N steps of the shipped default's
controller (K up to 8, its ``adaptive`` settings) at batch ``--batch``, each planned and then
told a step's costs and acceptance (a suffix proposer's: drafts on some steps, none on most),
in microseconds a step: what every step of the router pays beside its forward.

    python load/bench_adaptive.py --batch 32
    python load/bench_adaptive.py --controller-steps 2000 --batch 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def controller_step_us(steps: int, batch: int, seed: int = 0):
    """Microseconds a step of the default's controller (module docstring), and the controller."""
    import random

    import yaml
    from specserve.config import SpeculativeConfig
    from specserve.engine.step.adaptive import Row, SpecLengthController

    app = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())["applications"][0]
    spec = SpeculativeConfig.model_validate(app["args"]["unit"]["engine"]["speculative"])
    ctl = SpecLengthController(spec.num_speculative_tokens, spec.adaptive)
    ctl.k_source = spec.method
    rng = random.Random(seed)

    def step(i: int) -> None:
        context = 100 + i % 300
        ks = ctl.plan([Row(context, 8, True, False, 8)] * batch)
        drafts = [min(k, rng.choice((0, 0, 1, 2, 3))) for k in ks]
        tokens = batch + sum(drafts)
        padded = batch * (1 + max(drafts))
        ctl.observe_forward(batch, tokens, tokens * context, 0.0069 + 0.0017 * tokens, padded)
        if max(ks):
            ctl.observe_propose(max(ks), batch, 0.0002)
        for k, d in zip(ks, drafts):
            ctl.observe_draft(max(k, d), d, rng.randint(0, d), spec.method)
        ctl.observe_accept(batch, 0, 0.0003)

    for i in range(min(steps, 300)):  # past the warm-up: calibrated, as a serving unit is
        step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    return 1e6 * (time.perf_counter() - t0) / steps, ctl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="measured rounds after the warm-up")
    p.add_argument("--controller-steps", type=int, default=0,
                   help="time the controller alone for this many steps (module docstring)")
    args = p.parse_args(argv)
    if not (1 <= args.batch <= 256 and 1 <= args.k <= 16 and args.rounds >= 1):
        p.error("--batch in [1, 256], --k in [1, 16], --rounds >= 1")
    if args.controller_steps > 0:
        us, ctl = controller_step_us(args.controller_steps, args.batch)
        print(f"controller: {us:.1f} us a step at batch {args.batch} (K after: {ctl.k})")
        return 0
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
