"""Token trees against chains at equal proposer: the shipped EAGLE head, held-out chat.

Three parts, one run, one machine:

1. **Verify cost per tree size**: the target's forward of a tree of N drafted nodes (plus the
   row's last token) after a chat prompt, at batch 1, 4 and 8, over the same forward of one
   token per row (a decode): what the cost model's node budget trades against.
2. **Batch 1**: target-only, the EAGLE chain (fixed K, and K chosen per step by the cost
   model) and EAGLE-2 trees (fixed node budgets, and the budget chosen by the cost model) on
   the held-out chat prompts (``eval-chat``: none was a training prompt of the draft). Per
   prompt every mode runs once, the order rotating; every output must equal target-only's.
   Mean acceptance length = tokens emitted per verified draft.
3. **Concurrency**: target-only, the adaptive chain and the adaptive tree with c prompts
   decoded together (c = 1, 4, 8; continuous batching in one engine; an untimed round first so
   the cost model is calibrated at that batch size), output tokens per second side by side,
   with the node budgets the cost model chose.

    make bench-tree                        # or: python load/bench_tree.py --help

Prints the tables with the CPU flags and writes ``results/bench-tree.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.builder import build_engine
from specserve.engine.drafts.draft_head import EMBEDDED_DRAFT
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.tokenizer import encode_chat
from specserve.machine import machine_label
from specserve.training.data import read_prompts
from specserve.training.evaluate import end_to_end

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/ is not a package
from common import print_end_to_end, rotated  # noqa: E402


def verify_costs(worker, prompt: list[int], sizes: list[int], batches: list[int],
                 repeats: int) -> dict[int, dict[int, float]]:
    """Median seconds of a forward of each row's last token plus a tree of N nodes (a
    two-level tree: 4 children of the root, the rest spread below them), over a decode's."""
    out: dict[int, dict[int, float]] = {}
    for batch in batches:
        slots = [worker.allocate() for _ in range(batch)]
        for slot in slots:
            worker.forward(ForwardBatch([slot], [prompt[:-1]], [1]))
        base = len(prompt) - 1
        out[batch] = {}
        for n in [0, *sizes]:
            parents = [-1] + [0 if j < 4 else 1 + (j - 4) % 4 for j in range(n)]
            tokens = [prompt[-1]] + [prompt[j % len(prompt)] for j in range(n)]
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                worker.forward(ForwardBatch(slots, [tokens] * batch, [n + 1] * batch,
                                            trees=[parents] * batch if n > 1 else None))
                times.append(time.perf_counter() - t0)
                for slot in slots:
                    worker.rollback(slot, base)
            out[batch][n] = statistics.median(times)
        for slot in slots:
            worker.free(slot)
    return out


def concurrency(modes: dict[str, tuple], prompts: list[list[int]], levels: list[int],
                max_tokens: int) -> dict[int, dict[str, dict]]:
    """Output tokens per second of each mode with ``c`` prompts decoded together: per level,
    one untimed round first (the cost model calibrates at that batch size, as a serving unit's
    has), then two timed rounds of other prompts, the modes' order rotating."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out: dict[int, dict[str, dict]] = {}
    names = list(modes)
    for c in levels:
        rounds = [[prompts[(r * c + i) % len(prompts)] for i in range(c)] for r in range(3)]
        seconds, tokens, outputs = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {}
        for engine, k in modes.values():
            engine.generate(rounds[0], params, num_speculative_tokens=k, adaptive=True)
            engine.counters.k_counts.clear()
        for r, batch in enumerate(rounds[1:]):
            for name in rotated(names, r):
                engine, k = modes[name]
                t0 = time.perf_counter()
                done = engine.generate(batch, params, num_speculative_tokens=k, adaptive=True)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += sum(len(d.output_token_ids) for d in done)
                outputs.setdefault(name, []).extend(d.output_token_ids for d in done)
        out[c] = {name: {"tokens_per_s": tokens[name] / seconds[name],
                         "k_counts": dict(sorted(modes[name][0].k_counts.items())),
                         "outputs_identical": outputs[name] == outputs[names[0]]} for name in names}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=EMBEDDED_DRAFT, help="an eagle draft directory")
    p.add_argument("--k", type=int, default=4, help="the chain's K")
    p.add_argument("--budgets", default="4,8,12", help="fixed tree node budgets")
    p.add_argument("--max-budget", type=int, default=12, help="the adaptive tree's largest budget")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--repeats", type=int, default=5, help="forwards per verify-cost cell")
    p.add_argument("--out", default="results/bench-tree.json")
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    draft = {"source": args.draft}
    tree = {"tree": True, "tree_topk": args.topk, "tree_depth": args.depth}

    def engine(spec: dict, seqs: int = 1):
        cfg = EngineConfig.model_validate({"speculative": spec, "max_num_seqs": seqs,
                                           "max_model_len": 2048})
        return build_engine(cfg)[0]

    target_only, target = build_engine(EngineConfig.model_validate(
        {"speculative": {"method": None}, "max_num_seqs": 8, "max_model_len": 2048}))
    prompts = [encode_chat(target.tokenizer, m) for m in read_prompts("eval-chat")[:args.prompts]]
    costs = verify_costs(target_only.target, prompts[0], sorted({1, 2, 4, 8, 12, 16, *budgets}),
                         [int(c) for c in args.concurrency.split(",")], args.repeats)

    chain = {"method": "eagle", "draft": draft, "num_speculative_tokens": args.k}
    trees = {"method": "eagle", "draft": draft, "eagle": tree}
    modes = {"target-only": (target_only, 0),
             f"chain K={args.k}": (engine(chain), args.k),
             f"chain K={2 * args.k}": (engine({**chain, "num_speculative_tokens": 2 * args.k}), 2 * args.k),
             f"chain K<={args.k} adaptive": (engine(chain), args.k, True)}
    for n in budgets:
        modes[f"tree N={n}"] = (engine({**trees, "num_speculative_tokens": n}), n)
    modes[f"tree N<={args.max_budget} adaptive"] = (
        engine({**trees, "num_speculative_tokens": args.max_budget}), args.max_budget, True)
    end_to_end(modes, prompts[:1], max_tokens=16, progress=False)  # warm-up
    for _, (e, *_) in modes.items():
        e.counters.k_counts.clear()
    batch1 = end_to_end(modes, prompts, max_tokens=args.max_tokens)
    for name, (e, *_) in modes.items():
        batch1[name]["k_counts"] = dict(sorted(e.counters.k_counts.items()))

    levels = [int(c) for c in args.concurrency.split(",")]
    many = max(levels)
    swept = concurrency({"target-only": (target_only, 0),
                         f"chain K<={args.k} adaptive": (engine(chain, many), args.k),
                         f"tree N<={args.max_budget} adaptive": (
                             engine({**trees, "num_speculative_tokens": args.max_budget}, many),
                             args.max_budget)},
                        prompts, levels, args.max_tokens)

    print(f"\n{machine_label()}")
    print("verify cost: a forward of the last token + N tree nodes / a decode (batch rows)")
    print("rows " + "".join(f"{n:>7}" for n in costs[levels[0]]))
    for batch, row in costs.items():
        print(f"{batch:4} " + "".join(f"{t / row[0]:7.2f}" for t in row.values()))
    print(f"\nbatch 1, greedy, max {args.max_tokens} tokens, held-out chat, tree topk {args.topk} "
          f"depth {args.depth}")
    print_end_to_end({"chat": batch1}, 28)
    print("budgets / K chosen per step (adaptive):",
          {n: r["k_counts"] for n, r in batch1.items() if "adaptive" in n})
    print("\nconcurrency (c prompts together, adaptive): output tokens/s")
    for c, runs in swept.items():
        cells = "  ".join(f"{n}: {r['tokens_per_s']:.1f}{'' if r['outputs_identical'] else ' (DIFFERS)'}"
                          for n, r in runs.items())
        print(f"c={c}: {cells}")
        print(f"      budgets chosen: {runs[f'tree N<={args.max_budget} adaptive']['k_counts']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine_label(),
                               "args": vars(args), "verify_cost_s": costs, "batch1": batch1,
                               "concurrency": swept}, indent=2) + "\n")
    identical = all(r["outputs_identical"] for r in batch1.values()) and all(
        r["outputs_identical"] for runs in swept.values() for r in runs.values())
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
