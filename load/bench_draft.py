"""The shipped EAGLE drafts vs suffix decoding vs n-gram vs target-only, batch 1.

Modes: target-only; the shipped EAGLE-1-style head (``embedded-eagle``), alone and behind
prompt lookup; an EAGLE-3 head (``--eagle3``: a ``train-draft --kind eagle3`` export or any
published head; the shipped one by default where there is one), alone and behind suffix
decoding; suffix decoding alone; n-gram.

Workloads: ``chat`` is the held-out chat set (``eval-chat``: no prompt of it is a training
prompt of the draft); ``rewrite`` (``load/prompts/rewrite.jsonl``) is where n-gram lookup is at
its best, for contrast. Per prompt every mode runs once, the order rotating, and the outputs
must be identical to target-only's (they are the same greedy decode). Speedup = target-only
seconds / mode seconds, summed over the prompts (prefill included, as a client sees it).

    make bench-draft                       # or: python load/bench_draft.py --help

Prints a table (and the acceptance at each draft position) and writes
``results/bench-draft.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from specserve.config import EngineConfig
from specserve.engine.builder import build_engine
from specserve.engine.drafts.draft_head import EMBEDDED_DRAFT, EMBEDDED_EAGLE3, draft_path, is_draft_dir
from specserve.engine.tokenizer import encode_chat
from specserve.machine import machine_label
from specserve.training.data import read_prompts
from specserve.training.evaluate import end_to_end

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/ is not a package
from common import print_end_to_end  # noqa: E402
from prompts import load_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=EMBEDDED_DRAFT, help="an eagle draft directory")
    p.add_argument("--k", type=int, help="K for the draft (default: the K its eval.json measured)")
    p.add_argument("--eagle3", default=EMBEDDED_EAGLE3,
                   help="an EAGLE-3 head (directory or hub id; '' for none)")
    p.add_argument("--eagle3-k", type=int, help="K for it (default: its eval.json's, else 3)")
    p.add_argument("--suffix-k", type=int, default=8, help="K for suffix decoding")
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=12, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workloads", default="chat,rewrite")
    p.add_argument("--modes", help="comma-separated mode names to run (target-only, ngram, eagle, "
                                   "eagle+ngram, eagle3, suffix, suffix+eagle3); default all")
    p.add_argument("--out", default="results/bench-draft.json")
    args = p.parse_args()
    args.modes = set(args.modes.split(",")) if args.modes else None
    k = args.k or json.loads((draft_path(args.draft) / "eval.json").read_text())["end_to_end"]["k"]

    def engine(spec: dict):
        cfg = EngineConfig.model_validate({"speculative": spec, "max_num_seqs": 1, "max_model_len": 2048,
                                           "kv_cache": {"prefix_caching": False}})  # fair repeats
        return build_engine(cfg)

    target_only, target = engine({"method": None})
    ngram, _ = engine({"method": "ngram", "num_speculative_tokens": args.ngram_k})
    ngram_tuned, _ = engine({"method": "ngram", "num_speculative_tokens": args.ngram_k})
    eagle, _ = engine({"method": "eagle", "num_speculative_tokens": k, "draft": {"source": args.draft}})
    both, _ = engine({"method": "eagle", "num_speculative_tokens": k, "draft": {"source": args.draft},
                      "ngram_first": True})
    tuned, _ = engine({"method": "eagle", "num_speculative_tokens": k, "draft": {"source": args.draft},
                       "ngram_first": True})
    suffix, _ = engine({"method": "suffix", "num_speculative_tokens": args.suffix_k})
    modes = {"target-only": (target_only, 0), f"ngram K={args.ngram_k}": (ngram, args.ngram_k),
             f"eagle K={k}": (eagle, k), f"eagle+ngram K={k}": (both, k),
             f"eagle+ngram K<={k} adaptive": (tuned, k, True),  # what `make serve` runs
             f"ngram K<={args.ngram_k} adaptive": (ngram_tuned, args.ngram_k, True),  # before issue 9
             f"suffix K={args.suffix_k}": (suffix, args.suffix_k)}
    if args.eagle3 and is_draft_dir(args.eagle3):
        made = draft_path(args.eagle3) / "eval.json"
        k3 = args.eagle3_k or (json.loads(made.read_text()).get("end_to_end", {}).get("k", 3)
                               if made.is_file() else 3)
        head = {"source": args.eagle3}
        modes[f"eagle3 K={k3}"] = (engine({"method": "eagle", "num_speculative_tokens": k3,
                                           "draft": head})[0], k3)
        modes[f"suffix+eagle3 K={k3}"] = (engine({"method": "eagle", "num_speculative_tokens": k3,
                                                  "draft": head, "first": "suffix"})[0], k3)
    elif args.eagle3:
        print(f"no EAGLE-3 head at {args.eagle3!r}: its modes are left out")
    modes = {name: mode for name, mode in modes.items() if not args.modes or name.split()[0] in args.modes}
    results = {}
    for workload in args.workloads.split(","):
        rows = (read_prompts("eval-chat") if workload == "chat"
                else [r["messages"] for r in load_prompts(workload)])
        prompts = [encode_chat(target.tokenizer, m) for m in rows[:args.prompts]]
        end_to_end(modes, prompts[:1], max_tokens=16, progress=False)  # warm-up
        results[workload] = end_to_end(modes, prompts, max_tokens=args.max_tokens)
    print(f"\nbatch 1, greedy, max {args.max_tokens} tokens, {machine_label()}")
    print_end_to_end(results, 28)
    print("\nacceptance at each draft position (of the drafts that reached it)")
    for workload, runs in results.items():
        for name, r in runs.items():
            if r["acceptance_per_position"]:
                cells = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"][:8])
                print(f"{workload:10} {name:28} {cells}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "draft": args.draft,
                               "eagle3": args.eagle3,
                               "max_tokens": args.max_tokens, "results": results}, indent=2) + "\n")
    return 0 if all(r["outputs_identical"] for runs in results.values() for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
