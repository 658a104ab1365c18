"""``identity.json``: does a token's logits depend on what else is in the forward, and is
greedy speculation's output exactly the target's own? Per kernels setting.

1. **Row invariance.** ``rows`` sequences hold a context each; the logits after each one's
   last token are computed four ways: decoded alone (T = 1, the reference), as the first
   position of a verify of K + 1 alone, decoded among all ``rows`` rows, and verified among
   them. Against the reference: the largest absolute difference and the number of rows whose
   argmax flips. The first position of a verify cannot see the drafts after it, so any
   difference is the kernels' rounding, not the model.
2. **Greedy speculation on vs off.** ``num_prompts`` prompts, ``max_tokens`` new tokens each,
   batched through :class:`~specserve.engine.spec_decode.SpecDecodeEngine` built as serving
   builds it (``assemble_engine``), target-only twice and with n-gram drafts (the tiny
   model's greedy output loops, so there n-gram drafts get accepted; the 8B shape's random
   output does not: drafts are made and rejected). Identical or not, how many sequences
   differ, the earliest divergence (by token index, then prompt), the drafts made and
   accepted, and whether target-only repeats itself exactly (``off_repeats``: false would
   mean the kernels are not deterministic, and no comparison could be exact).

The weights are random from a fixed seed (:data:`SEED`), so two windows compare the same
model.

The model (docs/GPU.md): on a GPU, Llama-3-8B's layers but 4 of them (``llama3-8b-4l``) in
bfloat16: every GEMM and attention shape of the real model, so the same kernel choices and
the same rounding per layer, at an eighth of the compile time per shape (``compiled``
compiles each batch shape it meets, a minute each at 32 layers). Random weights make the
top two logits closer than a trained model's, so argmax flips are an upper bound; the max
differences are the figures that carry over. A dry run: the tiny shape in float32 on the
CPU, ``invariant`` too, dynamo's eager backend for ``compiled``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from specserve.config import SamplingParams, SpeculativeConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.worker import ModelWorker

from load.bench_gpu import SHAPES, random_runtime
from load.gpu.output import write_json
from load.gpu.runtime import cudagraph_skips, free_cuda, use_kernels, warm_up

log = logging.getLogger(__name__)

FILE = "identity.json"
SEED = 0  # the random weights'


@dataclass(frozen=True)
class Settings:
    shape: str
    dtype: str
    device: str
    kernels: tuple[str, ...]
    backend: str           # torch.compile's, for compiled
    k: int                 # K: drafts per step (a verify feeds K + 1 tokens)
    rows: int              # rows of the row-invariance batch
    num_prompts: int
    max_tokens: int


GPU = Settings("llama3-8b-4l", "bfloat16", "cuda", ("library", "compiled"), "inductor",
               k=4, rows=8, num_prompts=16, max_tokens=128)
DRY = Settings("tiny", "float32", "cpu", ("invariant", "library", "compiled"), "eager",
               k=4, rows=4, num_prompts=4, max_tokens=16)


class IdText:
    """A tokenizer for random-weight models: token i is the text `` i``. The engine only
    decodes (stop strings, streaming); identity compares token ids."""

    def decode(self, ids, **_) -> str:
        return "".join(f" {i}" for i in ids)


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 19 tokens and more (longer than the compiled path's largest bucket,
    so prefill stays a prefill), each a random piece, the piece again, and its first 3 tokens:
    stretches that n-gram lookup finds."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        piece = torch.randint(3, vocab, (8 + i,), generator=gen).tolist()
        out.append(piece + piece + piece[:3])
    return out


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Max |diff| and argmax flips of ``other`` ``[rows, vocab]`` against ``reference``."""
    assert reference.shape == other.shape and reference.ndim == 2
    flips = reference.argmax(-1) != other.argmax(-1)  # [rows]
    return {"max_abs_diff": float((reference - other).abs().max()), "argmax_flips": int(flips.sum()),
            "rows": reference.shape[0], "bit_identical": bool(torch.equal(reference, other))}


def row_invariance(worker: ModelWorker, contexts: list[list[int]], k: int) -> dict:
    """Part 1 (module docstring) over one row per context; the slots are freed after."""
    slots = [worker.allocate() for _ in contexts]
    for slot, ids in zip(slots, contexts):
        worker.forward(ForwardBatch([slot], [ids[:-1]], [1]))  # the cache holds all but the last token
    last = [[ids[-1]] for ids in contexts]
    chains = [[ids[-1], *ids[:k]] for ids in contexts]  # any drafts: position 0 cannot see them

    def logits(rows: list[int], ids: list[list[int]], n: int) -> torch.Tensor:
        out = worker.forward(ForwardBatch([slots[r] for r in rows], ids, [n] * len(rows))).logits.float()
        for r in rows:
            worker.rollback(slots[r], len(contexts[r]) - 1)
        return out  # [len(rows) * n, vocab]

    every = list(range(len(slots)))
    alone = torch.cat([logits([r], [last[r]], 1) for r in every])                  # [rows, vocab]
    verify_alone = torch.cat([logits([r], [chains[r]], k + 1)[:1] for r in every])  # [rows, vocab]
    batch_decode = logits(every, last, 1)                                          # [rows, vocab]
    batch_verify = logits(every, chains, k + 1)[::k + 1]                           # [rows, vocab]
    for slot in slots:
        worker.free(slot)
    return {"verify_alone": compare(alone, verify_alone), "batch_decode": compare(alone, batch_decode),
            "batch_verify": compare(alone, batch_verify),
            "max_abs_logit": float(alone.abs().max())}


def first_divergence(off: list[list[int]], on: list[list[int]]) -> dict | None:
    """The earliest token (then the lowest prompt) where the two runs differ; None: equal.
    ``-1`` stands for "no token" where one run is shorter."""
    found = None
    for p, (a, b) in enumerate(zip(off, on)):
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b and (found is None or t < found["token"]):
            found = {"prompt": p, "token": t, "off": a[t] if t < len(a) else -1,
                     "on": b[t] if t < len(b) else -1}
    return found


def speculation_identity(worker: ModelWorker, prompts: list[list[int]], s: Settings) -> dict:
    """Part 2 (module docstring): the same prompts target-only, then with n-gram drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
    runs = {}
    for name, spec in (("off", SpeculativeConfig(method=None)),
                       ("on", SpeculativeConfig(method="ngram", num_speculative_tokens=s.k)),
                       ("off again", SpeculativeConfig(method=None))):
        engine = assemble_engine(worker, IdText(), frozenset(), spec)
        start = time.perf_counter()
        outputs = [c.output_token_ids for c in engine.generate(prompts, params)]
        runs[name] = (outputs, time.perf_counter() - start, engine.counters.spec)
        log.info("speculation %s: %d x %d tokens in %.1f s", name, len(prompts), s.max_tokens,
                 runs[name][1])
    (off, off_s, _), (on, on_s, stats) = runs["off"], runs["on"]
    return {"identical": off == on, "num_differ": sum(a != b for a, b in zip(off, on)),
            "first_divergence": first_divergence(off, on), "num_prompts": len(prompts),
            "max_tokens": s.max_tokens, "k": s.k, "seconds_off": off_s, "seconds_on": on_s,
            "off_repeats": runs["off again"][0] == off,
            "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length}


def check_kernels(runtime, kernels: str, s: Settings, prompts: list[list[int]], max_len: int,
                  save) -> dict:
    """Both parts on one kernels setting, ``save(entry)`` after each. One worker (one cache)
    for both: CUDA graphs keep the addresses of the cache they were captured on."""
    entry: dict = {"use_kernels": use_kernels(runtime, kernels, backend=s.backend,
                                              verify_tokens=s.k + 1)}
    worker = ModelWorker(runtime, num_slots=len(prompts), max_seq_len=max_len)
    entry["warm_up"] = warm_up(runtime, worker.cache)
    save(entry)
    entry["row_invariance"] = row_invariance(worker, prompts[:s.rows], s.k)
    log.info("%s row invariance: %s", kernels, entry["row_invariance"])
    save(entry)
    entry["speculation"] = speculation_identity(worker, prompts[:s.num_prompts], s)
    entry["cudagraph_skips"] = cudagraph_skips()
    save(entry)
    return entry


def run(out: Path, dry_run: bool) -> None:
    s = DRY if dry_run else GPU
    prompts = make_prompts(max(s.num_prompts, s.rows), SHAPES[s.shape]["vocab_size"])
    max_len = max(map(len, prompts)) + s.max_tokens + s.k + 2
    torch.manual_seed(SEED)
    runtime = random_runtime(s.shape, getattr(torch, s.dtype), s.device, max_len=max_len)
    report = {"settings": asdict(s), "max_len": max_len, "kernels": {}}
    for kernels in s.kernels:
        def save(entry: dict, kernels: str = kernels) -> None:
            report["kernels"][kernels] = entry
            write_json(out / FILE, report)
        check_kernels(runtime, kernels, s, prompts, max_len, save)
        free_cuda()
    identical = {k: v["speculation"]["identical"] for k, v in report["kernels"].items()}
    log.info("greedy speculation identical to target-only, per kernels: %s", identical)
