"""Bytes between a unit's groups per step, before and after issue 21, on the embedded model.

A unit's target group (rank 0 in a Ray actor; TP = 1, as SmolLM2-135M's 9 heads divide by
no TP size the config takes: what rank 0 sends does not depend on TP, and
tests/serve/test_wire.py measures TP = 2) and its draft group (the embedded model as its own
draft, a Ray actor) under the engine a unit runs, batch 8, every row sampled and unseeded
(the rows whose q crosses), K = 4:

- **after** (measured): what the coordinator received per row and step from target rank 0
  (the tokens each row keeps) and from the draft (token ids and each drafted token's top-k q,
  ``speculative.draft_model.q_top_k``), counted by ``serve/wire.py`` as Ray ships it;
- **before** (measured on the same groups): rank 0's reply to a forward of the same shape
  that returns logits, as every sampled step did before (rows x (K + 1) x V float32), and the
  draft's full q per drafted token (K x V float32), the size of what it sent.

    make bench-wire                        # or: python load/bench_wire.py --help

Prints the table with the CPU flags and writes ``results/bench-wire.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from specserve.config import SamplingParams, UnitConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.tokenizer import encode_chat
from specserve.machine import cpu_flags, machine_label
from specserve.serve.wire import wire_bytes

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France, and why?",
           "Explain recursion to a child.", "List three uses of a paperclip.",
           "How do vaccines work?", "Summarise the plot of Hamlet in two sentences.",
           "Give me a recipe for pancakes.", "Why is the sky blue?"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="the embedded model takes 1 only")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--q-top-k", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path("results/bench-wire.json"))
    args = ap.parse_args(argv)

    cfg = UnitConfig.model_validate({
        "engine": {"target": {"source": "embedded"}, "max_model_len": 512, "max_num_seqs": args.batch,
                   "speculative": {"method": "draft_model", "num_speculative_tokens": args.k,
                                   "draft": {"source": "embedded"}, "adaptive": {"enabled": False},
                                   "draft_model": {"q_top_k": args.q_top_k}},
                   "kv_cache": {"prefix_caching": False}},  # repeated prompts prefill in full
        "tensor_parallel_size": args.tp, "draft_timeout_s": 600, "target_step_timeout_s": 600})
    from specserve.serve.local import start_local_ray  # before ray is imported (loopback only)

    start_local_ray(num_cpus=2 + args.tp, metrics_export_port=None)
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from specserve.serve.draft_group import DraftGroup
    from specserve.serve.placement import unit_bundles
    from specserve.serve.target_group import TargetGroup

    pg = placement_group(unit_bundles(cfg), strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=300)
    target = TargetGroup(cfg, pg, 2)
    draft = DraftGroup.launch(cfg, pg, 1, target_vocab_size=target.vocab_size)
    try:
        tokenizer = load_tokenizer(resolve("embedded"))
        engine = assemble_engine(target, tokenizer, frozenset(target.info["eos_token_ids"]),
                                 cfg.engine.speculative, draft=draft)
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}])
                   for p in (PROMPTS * args.batch)[:args.batch]]
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0.8, max_tokens=args.max_tokens))
        engine.step()  # the prefill
        start = (target.received.bytes, draft.received.bytes)
        row_steps = 0
        while engine.has_unfinished():
            row_steps += len(engine.scheduler.running)
            engine.step()
        after_target = (target.received.bytes - start[0]) / row_steps
        after_draft = (draft.received.bytes - start[1]) / row_steps
        # Before: rank 0 returned the logits of every verified position (float32).
        slots = [target.allocate() for _ in prompts]
        target.forward(ForwardBatch(slots, [p[:-1] for p in prompts], [1] * len(prompts)))
        logits = target.forward(ForwardBatch(slots, [[p[-1]] * (args.k + 1) for p in prompts],
                                             [args.k + 1] * len(prompts))).logits
        before_target = wire_bytes(logits) / len(prompts)
        # Before: the draft sent its full q, [K, V] float32, with each row's K drafts.
        before_draft = wire_bytes(torch.zeros(args.k, target.vocab_size))
        for slot in slots:
            target.free(slot)
        stats = engine.counters.spec
    finally:
        draft.shutdown()
        target.shutdown()
        remove_placement_group(pg)
        ray.shutdown()

    vocab = target.vocab_size
    table = [("target -> coordinator", before_target, after_target),
             ("draft -> coordinator", before_draft, after_draft)]
    print(f"\nbench-wire: {machine_label()}; {' '.join(cpu_flags())}; {datetime.date.today()}")
    print(f"embedded model (V = {vocab}), TP = {args.tp}, batch {args.batch}, K = {args.k}, "
          f"q_top_k = {args.q_top_k}, T = 0.8 unseeded; {row_steps} row-steps, acceptance "
          f"{stats.acceptance_rate:.2f}")
    print(f"{'bytes per row and step':<24}{'before':>12}{'after':>10}{'ratio':>9}")
    for name, before, after in table:
        print(f"{name:<24}{before:>12.0f}{after:>10.0f}{before / after:>8.0f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_label(), "cpu_flags": cpu_flags(), "date": str(datetime.date.today()),
        "vocab": vocab, "tp": args.tp, "batch": args.batch, "k": args.k, "q_top_k": args.q_top_k,
        "row_steps": row_steps, "acceptance_rate": stats.acceptance_rate,
        "bytes_per_row_step": {name: {"before": before, "after": after}
                               for name, before, after in table}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
