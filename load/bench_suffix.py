"""Suffix decoding on traffic that looks like real traffic, side by side with every other
proposer: batch 1, greedy, one process, one target per mode.

Workloads (``load/prompts/``): ``code_edit``, ``extract``, ``agent``, ``doc_qa``, ``revise``
(a later turn revises an earlier answer) and ``chat``, the held-out open-chat control
(``eval-chat``: no prompt of it trained the shipped draft). Modes:

- ``target-only``: the baseline; every other mode's output must equal it;
- ``ngram``: prompt lookup, K up to ``--ngram-k``, adaptive;
- ``suffix-cold``: suffix decoding over the request alone (no global cache);
- ``suffix-warm``: ... and over the unit's earlier responses: the cache starts from the
  target's answers to ``--warm-prompts`` training prompts of the draft (none of them held out;
  written to ``results/suffix-warm.jsonl`` and loaded with ``cache_file``, the opt-in seeding)
  and learns every response of the run, as a serving unit would;
- ``eagle``: the shipped EAGLE head, adaptive;
- ``eagle+ngram``: prompt lookup first, then the head (the shipped default before this issue);
- ``suffix+eagle``: suffix decoding first (warm), the EAGLE head for the other rows.

Per prompt every mode runs once, the order rotating. Speedup = target-only seconds / mode
seconds, summed over the workload's prompts (prefill included, as a client sees it).

    make bench-suffix                      # or: python load/bench_suffix.py --help

Prints a table and writes ``results/bench-suffix.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.builder import build_engine
from specserve.engine.drafts.draft_head import EMBEDDED_DRAFT
from specserve.engine.tokenizer import encode_chat
from specserve.machine import cpu_flags, machine_label
from specserve.training.data import read_prompts
from specserve.training.evaluate import end_to_end

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/ is not a package
from common import print_end_to_end  # noqa: E402
from prompts import load_prompts  # noqa: E402

WORKLOADS = ("code_edit", "extract", "agent", "doc_qa", "revise", "chat")


def warm_responses(path: Path, n: int, max_tokens: int, engine, tokenizer) -> None:
    """The target's greedy answers to the first ``n`` training chat prompts of the draft, as
    the cache file ``suffix-warm`` starts from (made once, reused while ``n`` is the same)."""
    if path.is_file() and sum(1 for _ in path.open()) == n:
        return
    prompts = [encode_chat(tokenizer, m) for m in read_prompts("chat")[:n]]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"token_ids": c.output_token_ids}) + "\n" for c in done))


def proposer_cost(tokenizer, repeats: int = 200) -> list[dict]:
    """The suffix proposer alone: microseconds per proposal (one row, K = 8) at contexts of
    512 and 2048 tokens against caches of 0 to 4096 responses, and the cache's bytes per cached
    token. The text is the project's own docs and code, tokenized (real token statistics)."""
    import random
    import statistics

    from specserve.engine.drafts.suffix import SuffixOptions, SuffixProposer
    from specserve.engine.step.proposal import DraftRequest

    root = Path(__file__).resolve().parent.parent
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(root.glob("docs/*.md"))
                     + sorted(root.glob("services/specserve/**/*.py")))
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    rows = []
    for responses in (0, 256, 4096):
        proposer = SuffixProposer(SuffixOptions(max_cached_responses=max(responses, 1),
                                                max_cached_tokens=10_000_000))
        for _ in range(responses):
            start = rng.randrange(len(ids) - 400)
            proposer.learn(ids[start:start + rng.randrange(100, 400)], prompt_len=0)
        cache = proposer.cache
        for context in (512, 2048):
            times, drafted = [], 0
            for i in range(repeats):
                start = rng.randrange(len(ids) - context)
                proposer.start(i, seed=0)
                t0 = time.perf_counter()
                [p] = proposer.propose([DraftRequest(i, ids[start:start + context], 8)])
                times.append(time.perf_counter() - t0)
                proposer.finish(i)
                drafted += bool(p.token_ids)
            rows.append({"responses": cache.num_responses, "cached_tokens": cache.num_tokens,
                         "bytes_per_cached_token": cache.nbytes / max(cache.num_tokens, 1),
                         "context": context, "median_us": statistics.median(times) * 1e6,
                         "p99_us": sorted(times)[int(0.99 * len(times))] * 1e6,
                         "share_drafted": drafted / repeats})
    print(f"\nsuffix proposer alone (one row, K = 8; the first proposal of a sequence, which "
          f"also copies its context in), {machine_label()}")
    print(f"{'responses':>9} {'tokens':>8} {'B/token':>8} {'context':>8} {'median us':>10} "
          f"{'p99 us':>8} {'drafted':>8}")
    for r in rows:
        print(f"{r['responses']:9d} {r['cached_tokens']:8d} {r['bytes_per_cached_token']:8.1f} "
              f"{r['context']:8d} {r['median_us']:10.0f} {r['p99_us']:8.0f} {r['share_drafted']:8.2f}")
    return rows


def _broadcast(proposers: list):
    """A ``learn`` that hands each finished response to every proposer's cache."""
    from specserve.engine.drafts.suffix import SuffixProposer

    def learn(token_ids: list[int], prompt_len: int) -> None:
        for proposer in proposers:
            SuffixProposer.learn(proposer, token_ids, prompt_len)
    return learn


def sharing(engine, target_only, workloads: list[str], n: int, max_tokens: int, k: int) -> dict:
    """Does sharing the global cache between the units of a deployment pay, at 2 units?
    Two suffix engines stand for two units behind a router that alternates requests; each
    workload's prompts go to unit A and B in turn. Separate: each unit's cache learns its own
    responses; shared: every response reaches both caches (what a broadcast would do, its
    transfer not counted). Speedup over target-only on the same prompts, outputs identical."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokenizer = target_only.tokenizer
    report = {}
    for shared in (False, True):
        units = [engine({"method": "suffix", "num_speculative_tokens": k}) for _ in range(2)]
        if shared:  # every response reaches both caches
            broadcast = _broadcast([u.proposer for u in units])
            for unit in units:
                unit.proposer.learn = broadcast
        seconds = base = 0.0
        identical = True
        drafted = accepted = 0
        for workload in workloads:
            rows = (read_prompts("eval-chat") if workload == "chat"
                    else [r["messages"] for r in load_prompts(workload)])
            for i, messages in enumerate(rows[:n]):
                prompt = encode_chat(tokenizer, messages)
                t0 = time.perf_counter()
                (ref,) = target_only.generate([prompt], params)
                base += time.perf_counter() - t0
                unit = units[i % 2]
                before = (unit.stats.num_draft_tokens, unit.stats.num_accepted_tokens)
                t0 = time.perf_counter()
                (got,) = unit.generate([prompt], params, adaptive=True)
                seconds += time.perf_counter() - t0
                drafted += unit.stats.num_draft_tokens - before[0]
                accepted += unit.stats.num_accepted_tokens - before[1]
                identical &= got.output_token_ids == ref.output_token_ids
        name = "shared" if shared else "separate"
        report[name] = {"speedup": base / seconds, "acceptance_rate": accepted / max(drafted, 1),
                        "drafted": drafted, "accepted": accepted, "outputs_identical": identical,
                        "cached_responses": [u.proposer.cache.num_responses for u in units]}
        print(f"2 units, cache {name}: {report[name]['speedup']:.2f}x over target-only, "
              f"{accepted} of {drafted} drafted tokens accepted, identical {identical}", flush=True)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", help="comma-separated modes (default all): target-only, ngram, "
                                   "suffix-cold, suffix-warm, eagle, eagle+ngram, suffix+eagle")
    p.add_argument("--k", type=int, default=8, help="K at most for suffix and the hybrid")
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--eagle-k", type=int, default=4)
    p.add_argument("--warm-prompts", type=int, default=64)
    p.add_argument("--warm-file", default="results/suffix-warm.jsonl")
    p.add_argument("--reuse-warm", action="store_true",
                   help="keep an existing --warm-file (made by an earlier run with the same settings)")
    p.add_argument("--out", default="results/bench-suffix.json")
    p.add_argument("--cost-only", action="store_true", help="only the proposer's own cost")
    p.add_argument("--sharing", action="store_true",
                   help="only: does sharing the cache between 2 units pay (prompts per workload: --prompts)")
    args = p.parse_args()

    def engine(spec: dict):
        cfg = EngineConfig.model_validate({"speculative": spec, "max_num_seqs": 1, "max_model_len": 2048})
        return build_engine(cfg)[0]

    target_only = engine({"method": None})
    tokenizer = target_only.tokenizer
    if args.sharing:
        report = sharing(engine, target_only, args.workloads.split(","), args.prompts,
                         args.max_tokens, args.k)
        out = Path(args.out).with_name("bench-suffix-sharing.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine_label(),
                                   "workloads": args.workloads, "prompts": args.prompts,
                                   "report": report}, indent=2) + "\n")
        return 0 if all(r["outputs_identical"] for r in report.values()) else 1
    cost = proposer_cost(tokenizer)
    if args.cost_only:
        return 0
    wanted = set(args.modes.split(",")) if args.modes else None
    reuse = args.reuse_warm and Path(args.warm_file).exists()
    if (wanted is None or wanted & {"suffix-warm", "suffix+eagle"}) and not reuse:
        started = time.perf_counter()
        warm_responses(Path(args.warm_file), args.warm_prompts, args.max_tokens, target_only, tokenizer)
        print(f"warm cache: {args.warm_prompts} responses ({time.perf_counter() - started:.0f} s)")
    eagle = {"draft": {"source": EMBEDDED_DRAFT}}
    warm = {"cache_file": args.warm_file}
    specs = {
        "ngram": ({"method": "ngram", "num_speculative_tokens": args.ngram_k}, args.ngram_k),
        "suffix-cold": ({"method": "suffix", "num_speculative_tokens": args.k,
                         "suffix": {"max_cached_responses": 0}}, args.k),
        "suffix-warm": ({"method": "suffix", "num_speculative_tokens": args.k, "suffix": warm}, args.k),
        "eagle": ({"method": "eagle", "num_speculative_tokens": args.eagle_k, **eagle}, args.eagle_k),
        "eagle+ngram": ({"method": "eagle", "num_speculative_tokens": args.eagle_k, "first": "ngram",
                         **eagle}, args.eagle_k),
        "suffix+eagle": ({"method": "eagle", "num_speculative_tokens": args.k, "first": "suffix",
                          "suffix": warm, **eagle}, args.k),
    }
    modes = {"target-only": (target_only, None)}
    modes |= {name: (engine(spec), k, True) for name, (spec, k) in specs.items()
              if wanted is None or name in wanted}
    results = {}
    for workload in args.workloads.split(","):
        rows = (read_prompts("eval-chat") if workload == "chat"
                else [r["messages"] for r in load_prompts(workload)])
        prompts = [encode_chat(tokenizer, m) for m in rows[:args.prompts]]
        results[workload] = end_to_end(modes, prompts, max_tokens=args.max_tokens, progress=False)
        line = ", ".join(f"{n} {r['speedup']:.2f}x" for n, r in results[workload].items())
        print(f"{workload}: {line}", flush=True)
    cache = {}
    for name, (e, *_) in modes.items():
        suffix = getattr(e.draft.proposer, "first", e.draft.proposer)
        if getattr(suffix, "method", None) == "suffix":
            cache[name] = {"responses": suffix.cache.num_responses, "tokens": suffix.cache.num_tokens,
                           "bytes": suffix.cache.nbytes}
    print(f"\nbatch 1, greedy, max {args.max_tokens} tokens, {args.prompts} prompts per workload, "
          f"{machine_label()}")
    print_end_to_end(results, 14)
    print(f"cpu flags: {' '.join(cpu_flags())}")
    for name, c in cache.items():
        print(f"{name} cache at the end: {c['responses']} responses, {c['tokens']} tokens, "
              f"{c['bytes'] / 1024:.0f} KiB ({c['bytes'] / max(c['tokens'], 1):.1f} bytes per token)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine_label(),
                               "cpu_flags": cpu_flags(), "max_tokens": args.max_tokens, "k": args.k,
                               "results": results, "cache": cache, "proposer_cost": cost}, indent=2) + "\n")
    return 0 if all(r["outputs_identical"] for runs in results.values() for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
