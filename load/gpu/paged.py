"""``paged.json``: the paged KV cache against slots where the GPU's kernels run (issue 53).

One random-weight target (step.py's model: on a GPU Llama-3-8B's layers, 4 of them, bf16,
``compiled`` over FlexAttention) and two workers over it, one per layout: slots, and paged in
blocks of 64 (FlexAttention's key block) with prefix caching, its pool handing blocks out in
a shuffled order so a row's blocks lie apart and out of order. The entries, each written the
moment it is measured:

- ``logits``: the same forwards on both caches (prompts prefilled; a decode of every row, a
  bucket of the compiled graph; a verify of K + 1 on one row; a ``chunk``-token chunk after
  a long context, the library's FlexAttention): per kind ``max_abs_diff``, ``argmax_flips``,
  ``bit_identical``. The GPU kernel reads a row's listed blocks in its logical order, as the
  slot cache's are read, so the aim is bit for bit.
- ``greedy``: ``num_prompts`` x ``max_tokens`` greedy tokens target-only through the engine on
  each cache (``num_same`` prompts, ``first_divergence``), at batch 1 and ``batch``:
  tokens/s each and ``paged_over_slots`` (the aim: at least 0.95).
- ``prefix``: a prompt of ``prefix`` tokens served on the paged cache (a miss), then the same
  prompt with ``more`` tokens after it (a hit of the prompt's full blocks): the new tokens'
  logits and 8 greedy decodes against the slot cache doing the same forwards (the prompt,
  then the rest), and the seconds to the first token of the hit and of a whole prefill.
- ``chunk_gap``: ``batch`` requests decoding, then a prompt of ``long_prompt`` tokens
  arrives and is prefilled in chunks of ``chunk`` beside them (``chunked_prefill_size``): the
  decoding rows' largest gap between tokens while it runs, their median step before it, one
  chunk's forward alone, and ``within_bound``: largest gap <= 2 x median + chunk forward.

A dry run: the tiny shape in float32 on the CPU, ``compiled`` under dynamo's eager backend
with FlexAttention (its eager CPU form reduces over keys in storage order, so there the
FlexAttention logits differ in the last bits: ``tests/engine/runtime/test_paged_compiled.py``).
docs/GPU.md says what passes.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from specserve.config import KVCacheConfig, SamplingParams, SpeculativeConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.worker import ModelWorker

from load.bench_gpu import SHAPES, random_runtime
from load.gpu.identity import IdText, compare, first_divergence, make_prompts
from load.gpu.runtime import sync
from load.gpu.step import SEED, run_entries, run_pass

log = logging.getLogger(__name__)

FILE = "paged.json"
BLOCK = 64  # FlexAttention's key block: the paged layout's block on a GPU


@dataclass(frozen=True)
class Settings:
    shape: str
    dtype: str
    device: str
    backend: str
    k: int            # the verify's drafts (K + 1 tokens)
    batch: int        # rows decoding together
    num_prompts: int
    max_tokens: int
    chunk: int        # a chunk's tokens (chunked_prefill_size)
    prefix: int       # prefix's cached prompt
    more: int         # ... and the tokens after it
    long_prompt: int  # chunk_gap's arriving prompt


GPU = Settings("llama3-8b-4l", "bfloat16", "cuda", "inductor", k=4, batch=8, num_prompts=16,
               max_tokens=128, chunk=256, prefix=512, more=64, long_prompt=2048)
DRY = Settings("tiny", "float32", "cpu", "eager", k=4, batch=2, num_prompts=2, max_tokens=8,
               chunk=32, prefix=128, more=24, long_prompt=96)


@dataclass
class Caches:
    s: Settings
    slots: ModelWorker
    paged: ModelWorker
    prompts: list[list[int]]

    @property
    def worker(self) -> ModelWorker:  # step.attempt skips an entry where an earlier one leaked slots
        return self.paged

    def workers(self) -> tuple[tuple[str, ModelWorker], ...]:
        return ("slots", self.slots), ("paged", self.paged)

    def engine(self, worker: ModelWorker, chunked_prefill_size: int | None = None):
        return assemble_engine(worker, IdText(), frozenset(), SpeculativeConfig(method=None),
                               chunked_prefill_size=chunked_prefill_size)

    @property
    def vocab(self) -> int:
        return self.slots.vocab_size


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


# -- the entries (module docstring) ------------------------------------------------------------
def logits(c: Caches) -> dict:
    rows = c.prompts[:c.s.batch]
    context = tokens(c.s.prefix, c.vocab, seed=7)
    chunk = tokens(c.s.chunk, c.vocab, seed=8)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, worker in c.workers():
        slots = [worker.allocate() for _ in rows]
        long = worker.allocate()
        got = {"prefill": torch.cat([worker.forward(ForwardBatch([s], [p])).logits
                                     for s, p in zip(slots, rows)])}
        got["decode"] = worker.forward(ForwardBatch(slots, [p[-1:] for p in rows])).logits
        got["verify"] = worker.forward(ForwardBatch(slots[:1], [list(range(5, 6 + c.s.k))],
                                                    [c.s.k + 1])).logits
        worker.forward(ForwardBatch([long], [context]))
        got["chunk"] = worker.forward(ForwardBatch([long], [chunk], [len(chunk)])).logits
        out[name] = {kind: x.float().cpu() for kind, x in got.items()}
        for slot in (*slots, long):
            worker.free(slot)
    kinds = {kind: compare(out["slots"][kind], out["paged"][kind]) for kind in out["slots"]}
    return {"status": "ok", "bit_identical": all(k["bit_identical"] for k in kinds.values()),
            "max_abs_diff": max(k["max_abs_diff"] for k in kinds.values()), "kinds": kinds}


def greedy(c: Caches) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=c.s.max_tokens, ignore_eos=True)
    passes = {}
    for batch in (1, c.s.batch):  # interleaved: the machine's drift hits both layouts alike
        for name, worker in c.workers():
            passes[name, batch] = run_pass(c.engine(worker), c.prompts, params, batch)
    entry = {"status": "ok"}
    for batch in (1, c.s.batch):
        slots, paged = passes["slots", batch], passes["paged", batch]
        same = [a == b for a, b in zip(slots.outputs, paged.outputs)]
        entry[f"batch_{batch}"] = {
            "slots_tokens_per_s": round(slots.tokens_per_s, 2),
            "paged_tokens_per_s": round(paged.tokens_per_s, 2),
            "paged_over_slots": round(paged.tokens_per_s / slots.tokens_per_s, 3),
            "num_same": sum(same), "first_divergence": first_divergence(slots.outputs, paged.outputs)}
        if slots.errors or paged.errors:
            entry.update(status="failed", reason=f"requests ended in error at batch {batch}")
    entry["num_same"] = min(entry[f"batch_{b}"]["num_same"] for b in (1, c.s.batch))
    return entry


def prefix(c: Caches) -> dict:
    prompt = tokens(c.s.prefix, c.vocab, seed=9)
    more = tokens(c.s.more, c.vocab, seed=10)
    cache = c.paged.cache
    first = c.paged.allocate()
    c.paged.forward(ForwardBatch([first], [prompt]))
    c.paged.commit(first, prompt)
    c.paged.free(first)
    out, seconds = {}, {}
    for name, worker in c.workers():
        slot = worker.allocate()
        hit = worker.match(slot, prompt + more) if name == "paged" else 0
        if name == "slots":  # the miss: the prompt's forward, which the hit skips
            worker.forward(ForwardBatch([slot], [prompt[:c.s.prefix // BLOCK * BLOCK]]))
        sync(c.s.device)
        start = time.perf_counter()
        rest = (prompt + more)[worker.length(slot):]
        got = [worker.forward(ForwardBatch([slot], [rest], [len(rest)])).logits]
        sync(c.s.device)
        seconds[name] = time.perf_counter() - start
        for _ in range(8):
            got.append(worker.forward(ForwardBatch([slot], [[int(got[-1][-1].argmax())]])).logits)
        out[name] = torch.cat(got).float().cpu()
        if name == "paged":
            out["hit_tokens"] = hit
        worker.free(slot)
    miss = whole_prefill_seconds(c.slots, prompt + more, c.s.device)
    return {"status": "ok", "hit_tokens": out.pop("hit_tokens"), **compare(out["slots"], out["paged"]),
            "hit_rest_s": round(seconds["paged"], 5), "whole_prefill_s": round(miss, 5),
            "pool_cached_blocks": cache.manager.pool.num_cached}


def whole_prefill_seconds(worker: ModelWorker, prompt: list[int], device: str) -> float:
    slot = worker.allocate()
    sync(device)
    start = time.perf_counter()
    worker.forward(ForwardBatch([slot], [prompt]))
    sync(device)
    worker.free(slot)
    return time.perf_counter() - start


def chunk_gap(c: Caches) -> dict:
    worker = c.paged
    chunk_s = chunk_forward_seconds(worker, c.s.chunk, c.vocab, c.s.device)
    engine = c.engine(worker, chunked_prefill_size=c.s.chunk)
    params = SamplingParams(temperature=0.0, max_tokens=4 * c.s.max_tokens, ignore_eos=True)
    rows = [engine.add_request(p, params) for p in c.prompts[:c.s.batch]]
    seen: dict[int, list[float]] = {r: [] for r in rows}
    steps_before: list[float] = []
    arrived = long_id = None
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.seq_id in seen and out.new_token_ids:
                seen[out.seq_id].append(now)
            if out.seq_id == long_id and out.finish_reason:  # prefilled: the rows stop here
                for r in rows:
                    engine.abort(r)
        if arrived is None and all(seen[r] for r in rows):
            steps_before.append(now - start)
            if len(steps_before) >= 16:  # the rows' steady steps, then the prompt arrives
                long_id = engine.add_request(tokens(c.s.long_prompt, c.vocab, seed=11),
                                             SamplingParams(temperature=0.0, max_tokens=1))
                arrived = time.perf_counter()
    gaps = [b - a for r in rows for a, b in zip(seen[r], seen[r][1:]) if arrived and b >= arrived]
    median = statistics.median(steps_before)
    largest = max(gaps) if gaps else None
    bound = 2 * median + chunk_s
    return {"status": "ok" if largest is not None else "failed",
            "median_step_s": round(median, 5), "chunk_forward_s": round(chunk_s, 5),
            "largest_gap_s": None if largest is None else round(largest, 5),
            "bound_s": round(bound, 5),
            "within_bound": largest is not None and largest <= bound,
            "chunks": -(-c.s.long_prompt // c.s.chunk), "free_slots": worker.num_free_slots}


def chunk_forward_seconds(worker: ModelWorker, n: int, vocab: int, device: str) -> float:
    """One chunk's forward alone (after one untimed, which compiles its shape), in a free slot."""
    times = []
    for _ in range(2):
        slot = worker.allocate()
        sync(device)
        start = time.perf_counter()
        worker.forward(ForwardBatch([slot], [tokens(n, vocab, seed=12)], [0]))
        sync(device)
        times.append(time.perf_counter() - start)
        worker.free(slot)
    return times[-1]


ENTRIES = (("logits", logits), ("greedy", greedy), ("prefix", prefix), ("chunk_gap", chunk_gap))


# -- the step ---------------------------------------------------------------------------------
def build(s: Settings) -> tuple[Caches, dict]:
    """The target compiled over FlexAttention, a slot worker and a paged one (its pool's
    order shuffled), both warmed up; the report's header."""
    prompts = make_prompts(s.num_prompts, SHAPES[s.shape]["vocab_size"])
    max_len = max(s.long_prompt, s.prefix + s.more) + 4 * s.max_tokens + s.k + 2
    torch.manual_seed(SEED)
    runtime = random_runtime(s.shape, getattr(torch, s.dtype), s.device, max_len=max_len)
    runtime.use_kernels("compiled", backend=s.backend, attention="flex", verify_tokens=s.k + 1)
    num_slots = s.batch + 2  # the rows, an arriving prompt, one free for measuring
    slots = ModelWorker(runtime, num_slots=num_slots, max_seq_len=max_len)
    paged = ModelWorker(runtime, num_slots=num_slots, max_seq_len=max_len,
                        kv=KVCacheConfig(layout="paged", block_size=BLOCK))
    pool = paged.cache.manager.pool
    order = list(range(pool.num_blocks))
    random.Random(SEED).shuffle(order)
    pool._free = OrderedDict((b, None) for b in order)  # a row's blocks apart and out of order
    warm = {}
    for name, worker in (("slots", slots), ("paged", paged)):
        start = time.perf_counter()
        report = worker.warm_up()
        warm[name] = {"seconds": round(time.perf_counter() - start, 2),
                      "cudagraph_skips": report.get("cudagraph_skips")}
    header = {"max_len": max_len, "block_size": BLOCK, "pool_blocks": pool.num_blocks, "warm_up": warm}
    return Caches(s, slots, paged, prompts), header


def run(out: Path, dry_run: bool) -> None:
    run_entries(out / FILE, DRY if dry_run else GPU, build, ENTRIES)
