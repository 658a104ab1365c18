"""Evaluate a draft on held-out prompts: acceptance per K, the cost model, the real speedup.

Three measurements, all greedy (the acceptance a user sees at temperature 0):

1. **Acceptance per K** (K = 1..8) from one pass over each held-out answer: at every answer
   position the proposer (the serving code path, fed exactly as the engine feeds it) drafts 8
   tokens, and we count how many match the target's own continuation. For a given K a step
   accepts ``min(K, matched)``: acceptance rate = that / K, mean acceptance length = 1 + that.
2. **Costs** on this machine, batch 1: a target forward of 1 and of K + 1 tokens, a draft step.
   With (1) they predict the speedup per K; the best K is the one measured next.
3. **End-to-end**: the engine at batch 1 on each held-out prompt, target-only and with the
   draft at that K, alternating which runs first; the outputs must be identical (the engine's
   promise), and the speedup is the ratio of the summed wall times.
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from specserve.config import SamplingParams
from specserve.engine.drafts.base import Proposer
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step.proposal import DraftRequest
from specserve.engine.worker import ModelWorker
from specserve.training.data import Sample
from specserve.training.options import MAX_K


def matched_lengths(proposer: Proposer, samples: list[Sample], *, max_k: int = MAX_K,
                    progress: bool = True) -> list[int]:
    """For every answer position of every sample: how many of ``max_k`` greedy drafts match
    the target's own next tokens (fewer near the end of the answer: capped by what is left)."""
    out: list[int] = []
    for n_seq, s in enumerate(tqdm(samples, desc="acceptance", unit="seq", disable=not progress)):
        seq_id = 1_000_000 + n_seq
        proposer.start(seq_id, 0)
        sent = 0
        try:
            for n in range(s.prompt_len, s.num_tokens - 1):
                # As after a step that emitted token n: the target holds (and has features of) 0..n-1.
                hidden = None
                if proposer.needs_hidden:
                    hidden = s.features[sent:n].float()
                    sent = n
                truth = s.token_ids[n + 1:n + 1 + max_k]
                (prop,) = proposer.propose([DraftRequest(seq_id, s.token_ids[:n + 1], len(truth),
                                                         hidden=hidden)])
                matched = 0
                for a, b in zip(prop.token_ids, truth):
                    if a != b:
                        break
                    matched += 1
                out.append(matched if len(truth) == max_k else -1 - matched)
                proposer.commit(seq_id, n + 1)
        finally:
            proposer.finish(seq_id)
    return out


def acceptance_table(matched: list[int], max_k: int = MAX_K) -> dict[int, dict]:
    """Per K: acceptance rate and mean acceptance length (positions with K tokens left)."""
    table = {}
    for k in range(1, max_k + 1):
        # A position with fewer than K tokens left (stored as -1 - matched) still tells us
        # about K when it matched fewer than it had left (the miss is inside its window).
        usable = [m for m in matched if m >= 0] + [-1 - m for m in matched if m < 0 and -1 - m < k]
        accepted = [min(k, m) for m in usable]
        mean = statistics.fmean(accepted) if accepted else 0.0
        table[k] = {"acceptance_rate": mean / k, "mean_acceptance_length": 1.0 + mean,
                    "positions": len(accepted)}
    return table


@torch.inference_mode()
def measure_costs(target: ModelWorker, proposer: Proposer, context: list[int], *,
                  max_k: int = MAX_K, repeats: int = 7) -> dict:
    """Median seconds, batch 1, at ``context``: target forwards of 1..max_k + 1 tokens and one
    draft step per drafted token (from a K = max_k proposal)."""
    slot = target.allocate()
    try:  # the prefill also gives the features an EAGLE proposer catches up on below
        hidden = target.forward(ForwardBatch([slot], [context[:-1]], [1], hidden=True)).hidden
        base = target.length(slot)
        verify = {}
        for n in range(1, max_k + 2):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                target.forward(ForwardBatch([slot], [context[-1:] * n], [n], argmax=True))
                times.append(time.perf_counter() - t0)
                target.rollback(slot, base)
            verify[n] = statistics.median(times)
    finally:
        target.free(slot)
    if not proposer.needs_hidden:
        hidden = None
    times = []
    for r in range(repeats):  # a step after a catch-up: one new token, then max_k - 1 drafts
        seq = -1 - r
        proposer.start(seq, 0)
        first = hidden[:-1] if hidden is not None else None
        proposer.propose([DraftRequest(seq, context[:-1], max_k, hidden=first)])
        proposer.commit(seq, len(context) - 1)
        last = hidden[-1:] if hidden is not None else None
        t0 = time.perf_counter()
        (prop,) = proposer.propose([DraftRequest(seq, context, max_k, hidden=last)])
        times.append((time.perf_counter() - t0) / max_k)
        assert len(prop.token_ids) == max_k
        proposer.finish(seq)
    return {"target_forward_s": verify, "draft_token_s": statistics.median(times)}


def predicted_speedup(table: dict[int, dict], costs: dict) -> dict[int, float]:
    """Tokens per second with K drafts over target-only, from acceptance and costs (the cost
    model's formula with measured terms: a step costs K draft tokens plus a K + 1 verify)."""
    one = costs["target_forward_s"][1]
    return {k: row["mean_acceptance_length"] * one
            / (k * costs["draft_token_s"] + costs["target_forward_s"][k + 1])
            for k, row in table.items()}


def end_to_end(engines: dict[str, tuple], prompts: list[list[int]], *,
               max_tokens: int, progress: bool = True) -> dict[str, dict]:
    """Batch-1 greedy wall time of every prompt on every engine (``name: (engine, K)`` or
    ``(engine, K, adaptive)``; K None for target-only; adaptive: the engine's controller picks
    K per step, at most K), the order rotating per prompt so drift hits all alike. The first
    engine is the baseline: every output must equal its output, and speedups are over it."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    names = list(engines)
    times = dict.fromkeys(names, 0.0)
    mismatches = dict.fromkeys(names, 0)
    before = {n: _counts(e) for n, (e, *_) in engines.items()}
    before_positions = {n: _positions(e) for n, (e, *_) in engines.items()}
    tokens = 0
    for i, prompt in enumerate(tqdm(prompts, desc="end-to-end", unit="prompt", disable=not progress)):
        outputs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine, k, *adaptive = engines[name]
            t0 = time.perf_counter()
            (done,) = engine.generate([prompt], params, num_speculative_tokens=k,
                                      adaptive=bool(adaptive and adaptive[0]))
            times[name] += time.perf_counter() - t0
            outputs[name] = done.output_token_ids
        for name in names:
            mismatches[name] += outputs[name] != outputs[names[0]]
        tokens += len(outputs[names[0]])
    report = {}
    for name, (engine, k, *_) in engines.items():
        drafts, drafted, accepted = (a - b for a, b in zip(_counts(engine), before[name]))
        (acc_now, drafted_now), (acc_then, drafted_then) = _positions(engine), before_positions[name]
        per_position = [(a - (acc_then[i] if i < len(acc_then) else 0))
                        / max(1, d - (drafted_then[i] if i < len(drafted_then) else 0))
                        for i, (a, d) in enumerate(zip(acc_now, drafted_now))]
        report[name] = {"k": k, "seconds": times[name], "speedup": times[names[0]] / times[name],
                        "acceptance_rate": accepted / drafted if drafted else 0.0,
                        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
                        # of the drafts that reached position i, the share accepted there
                        "acceptance_per_position": [round(x, 4) for x in per_position],
                        "outputs_identical": mismatches[name] == 0, "prompts": len(prompts),
                        "output_tokens": tokens}
    return report


def _positions(engine: SpecDecodeEngine) -> tuple[list[int], list[int]]:
    s = engine.counters.spec
    return list(s.accepted_per_position), list(s.drafted_per_position)


def _counts(engine: SpecDecodeEngine) -> tuple[int, int, int]:
    s = engine.counters.spec
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens
