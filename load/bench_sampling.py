"""What the sampling settings cost with speculation, on the embedded model at batch 1.

Each setting (``SETTINGS``: greedy as it is, with a ``logit_bias``, with ``min_tokens``, with
the presence / frequency / repetition penalties, with ``bad_words``, with
``allowed_token_ids``; all greedy, so every run can be checked
against its target-only twin) runs the same prompts target-only and with the speculation of
``--method`` (n-gram by default: its drafts are the repeats a penalty pushes down) at a
fixed K (no K controller: ``engine.generate``), one request at a time, in rounds whose order
rotates. Per setting: tokens/s of each, the
speedup, the acceptance rate, and whether the tokens are target-only's (they must be).
The cost of a setting is its speedup against plain greedy's: a row with any of them asks its
verify for logits rather than the argmax, its bias, masks or tokens so far go to the device
in a copy of their own, and a penalty rejects the drafts that repeat (a bad word, the drafts
that spell it).

    python load/bench_sampling.py           # --help

Prints the table with the CPU flags and writes ``results/bench-sampling.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from specserve.config import EngineConfig, SamplingParams
from specserve.engine.builder import build_engine
from specserve.engine.tokenizer import encode_chat
from specserve.machine import cpu_flags, machine_label

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/ is not a package
from common import rotated  # noqa: E402
from prompts import load_prompts  # noqa: E402

SETTINGS = {
    "greedy": {},
    "logit_bias": {"logit_bias": ((198, -2.0), (30, 1.0), (28, 1.0))},  # newline down, "." and "," up
    "min_tokens": {"min_tokens": 48},
    "penalties": {"presence_penalty": 0.2, "frequency_penalty": 0.2, "repetition_penalty": 1.1},
    "bad_words": {"bad_words": ("the", "and", "is", "However")},  # banned where they would come
    "allowed_token_ids": {"allowed_token_ids": tuple(t for t in range(49152) if t != 198)},  # no newline
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ngram", help="speculation to measure (ngram, suffix...)")
    p.add_argument("--k", type=int, default=4, help="drafts per step")
    p.add_argument("--workload", default="rewrite", help="a prompt set of load/prompts")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/bench-sampling.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = {}
    for name, method in (("target-only", None), ("speculative", args.method)):
        cfg = EngineConfig.model_validate({"speculative": {"method": method,
                                                           "num_speculative_tokens": args.k},
                                           "max_num_seqs": 1, "max_model_len": 4096})
        engines[name], loaded = build_engine(cfg)
    prompts = [encode_chat(loaded.tokenizer, r["messages"])
               for r in load_prompts(args.workload)[:args.prompts]]
    for engine in engines.values():  # warm: the first calls of a process are slower
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=args.max_tokens))
    runs = [(s, e) for s in SETTINGS for e in engines]
    seconds: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    accepted: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        for setting, name in rotated(runs, r):
            engine = engines[name]
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, **SETTINGS[setting])
            before = engine.counters.snapshot().spec
            start = time.perf_counter()
            outputs = [engine.generate([p], params)[0].output_token_ids for p in prompts]
            seconds[setting, name].append(time.perf_counter() - start)
            assert tokens.setdefault((setting, name), outputs) == outputs, "greedy runs differ"
            after = engine.counters.spec
            if name == "speculative":
                drafted, kept = accepted.get(setting, (0, 0))
                accepted[setting] = (drafted + after.num_draft_tokens - before.num_draft_tokens,
                                     kept + after.num_accepted_tokens - before.num_accepted_tokens)
    rows = []
    for setting in SETTINGS:
        rate = {name: sum(map(len, tokens[setting, name])) / statistics.median(seconds[setting, name])
                for name in engines}
        drafted, kept = accepted[setting]
        rows.append({"setting": setting, "target_only_tok_s": rate["target-only"],
                     "speculative_tok_s": rate["speculative"],
                     "speedup": rate["speculative"] / rate["target-only"],
                     "acceptance": kept / drafted if drafted else 0.0,
                     "same_tokens": tokens[setting, "target-only"] == tokens[setting, "speculative"]})
    plain = rows[0]["speculative_tok_s"]
    print(f"\nbench-sampling: {machine_label()}; torch threads {torch.get_num_threads()}; "
          f"{' '.join(cpu_flags())}; {datetime.date.today()}")
    print(f"embedded model, {args.method} K = {args.k}, {args.prompts} {args.workload} prompts x "
          f"{args.max_tokens} tokens, batch 1, greedy, {args.rounds} rounds (medians)")
    print(f"{'setting':<18}{'target tok/s':>13}{'spec tok/s':>11}{'speedup':>9}{'accept':>8}"
          f"{'vs greedy':>10}{'same':>6}")
    for row in rows:
        print(f"{row['setting']:<18}{row['target_only_tok_s']:>13.1f}{row['speculative_tok_s']:>11.1f}"
              f"{row['speedup']:>9.2f}{row['acceptance']:>8.2f}{row['speculative_tok_s'] / plain:>10.2f}"
              f"{'yes' if row['same_tokens'] else 'NO':>6}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_label(), "cpu_flags": cpu_flags(), "date": str(datetime.date.today()),
        "method": args.method, "k": args.k, "workload": args.workload, "prompts": args.prompts,
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "settings": {k: {f: _shown(v) for f, v in s.items()} for k, s in SETTINGS.items()},
        "rows": rows}, indent=2) + "\n")
    return 0 if all(row["same_tokens"] for row in rows) else 1


def _shown(value):
    """A setting's value as the JSON shows it (a long list: its length)."""
    if isinstance(value, tuple):
        return list(value) if len(value) <= 16 else f"{len(value)} values"
    return value


if __name__ == "__main__":
    sys.exit(main())
