"""``step.json``: whole requests through the engine, in this process, on a random-weight
model (issue 52): target-only speed, what each proposer makes of it, and whether speculation
leaves the tokens as they were.

Every engine is built as serving builds it (``assemble_engine`` with a
:class:`~specserve.config.SpeculativeConfig`) over one target ``ModelWorker``: one cache,
because CUDA graphs keep the addresses of the cache they were captured on. The entries, in
this order (the most wanted first, so a timeout cuts the least), each written to
``step.json`` the moment it is measured:

- ``target_only``: ``num_prompts`` prompts x ``max_tokens`` new tokens, greedy, one request
  at a time (batch 1): tokens/s and the mean step time. Its tokens are the reference the
  other entries are compared with (``same_as_target_only``, ``num_same`` prompts,
  ``first_divergence``), its tokens/s the one their ``speedup`` divides by.
- ``host_gap``: ``target_only`` again on its first ``HOST_GAP_PROMPTS`` prompts under
  ``torch.profiler``: the time per step the device was idle while the host worked
  (``host_gap_ms_per_step``: the wall time less the union of the device's kernel and copy
  intervals, over the steps; issue 52's aim is 0.3 ms). On a CPU the same sum over torch's
  own operators (the time outside them: Python, the C kernels called through ctypes), a dry
  run's figure only.
- ``target_only_batch``: the same, ``batch`` requests at a time (its ``same_as_target_only``:
  batching left the tokens alone).
- ``host_profile``: ``target_only`` on the same prompts under cProfile: per step, the
  functions of the most own time (``top_own``) and this package's of the most cumulative time
  (``top_cumulative``), each with its calls, own and cumulative milliseconds: where the host's
  part goes (cProfile's own cost on every call inflates it; the ranks are what carry over).
- ``launch_ahead_off``: ``target_only`` with each step read before the next is launched
  (``TargetCalls.launch_ahead`` off; on by default for a CUDA worker, as in the entries
  above): its ``speedup`` below 1 is what launching ahead buys (``target_only``'s
  ``launch_ahead`` says whether it ran).
- ``suffix``: suffix decoding, two passes over the prompts in one engine. The proposer keeps
  the responses of finished requests, so the second pass drafts the first pass's own
  outputs: acceptance near 1, the most speculation can give at K.
- ``ngram``: prompt lookup.
- ``seeded``: temperature 0.8 with a fixed seed, target-only and with n-gram drafts. A draw
  depends on the seed and the token's position only (``engine/step/sampling.py``), so each
  prompt's tokens should be the same with speculation on and off.
- ``engine_loop``: the n-gram engine driven by a unit's :class:`EngineLoop` (its engine
  thread, asyncio streams; no Ray), one request at a time: the streamed tokens against
  ``engine.generate``'s (``same_as_generate``) and target-only's.
- ``self_draft``: ``draft_model`` with the target's first ``draft_layers`` layers, made as
  ``specserve train-draft`` starts a decoder draft (``new_draft_head``), untrained.
- ``eagle``: an untrained EAGLE head made likewise (the target's last layer behind a fuser
  that passes the target's features through): the features path end to end.
- ``tp_world_1``: target-only with tensor parallelism's all-reduces in every layer over a
  process group of one (NCCL on the GPU): the collectives inside the captured graph, as a
  TP unit runs them, compiled before the timed pass; its tokens against target-only's, and
  n-gram drafts with the collectives against the pass without them (``speculation``).
- ``self_draft_compiled`` and ``eagle_compiled``: the two drafts again on the target's
  kernels (``compiled``: CUDA graphs on a GPU), which ``kernels: auto`` does not give a
  draft yet; last, as the least wanted.

Every speculative entry also says what the cost model (``engine/step/cost_model.py``)
predicts of it (``cost_model``): from its measured acceptance rate, mean K and the share of
its steps that drafted, the independent-acceptance tokens per step, over its step's cost
(propose, verify and accept, measured) relative to a target-only step;
``measured_over_predicted`` is its speedup over that prediction (issue 52's aim for the
truncated draft: within 20%).

The speculative entries run at batch 1 with K drafts per step. An entry whose requests ended
in error or whose proposer fell back to target-only is ``failed``; so is one that raised,
with its one-line reason, and the next entry runs.

The model is identity.py's: on a GPU Llama-3-8B's layers, 4 of them, in bfloat16 on the
``compiled`` kernels, random weights from a fixed seed. Its greedy output does not repeat
itself, so n-gram drafts are rarely accepted there (suffix's second pass is the speed
figure), and the untrained drafts measure their paths, not an acceptance that carries over.
A dry run: the tiny shape in float32 on the CPU with the row-invariant ``invariant``
kernels, where every greedy entry must be bit-identical to target-only. docs/GPU.md says
what passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import logging
import pstats
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from specserve.config import ModelConfig, SamplingParams, SpeculativeConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.drafts.base import Proposer
from specserve.engine.drafts.draft_head import DraftHead, head_kernels, new_draft_head
from specserve.engine.request import check_request
from specserve.engine.runtime.model import LlamaRuntime
from specserve.engine.runtime.tp import all_reducer
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step.cost_model import expected_speedup
from specserve.engine.step.stats import EngineCounters, SpecStats, StepTimes
from specserve.engine.worker import ModelWorker
from specserve.methods import proposer_class
from specserve.serve.engine_loop import EngineLoop
from torch.profiler import ProfilerActivity, profile

from load.bench_gpu import SHAPES, random_runtime
from load.gpu.identity import IdText, first_divergence, make_prompts
from load.gpu.output import write_json
from load.gpu.runtime import cudagraph_skips, use_kernels, warm_up

log = logging.getLogger(__name__)

FILE = "step.json"
SEED = 0              # the random weights' (identity.py's: the same model)
SAMPLING_SEED = 1234  # the seeded entry's requests'
TEMPERATURE = 0.8     # ... and their temperature
HOST_GAP_PROMPTS = 4  # host_gap's requests (the profiler's trace grows with every kernel)
HOST_PROFILE_ROWS = 25  # host_profile's functions, of each kind
HOST_GAP_AIM_MS = 0.3  # issue 52: wall time less device-busy time a step


@dataclass(frozen=True)
class Settings:
    shape: str
    dtype: str
    device: str
    kernels: str       # the target's
    backend: str       # torch.compile's, for compiled
    k: int             # K: drafts per step
    batch: int         # target_only_batch's requests at a time (the target's slots)
    num_prompts: int
    max_tokens: int
    draft_layers: int  # self_draft: the target's first this many layers


GPU = Settings("llama3-8b-4l", "bfloat16", "cuda", "compiled", "inductor", k=4, batch=8,
               num_prompts=16, max_tokens=128, draft_layers=2)
DRY = Settings("tiny", "float32", "cpu", "invariant", "eager", k=4, batch=2, num_prompts=4,
               max_tokens=32, draft_layers=1)


@dataclass
class Pass:
    """One pass of the prompts through an engine: the tokens and what the engine counted."""

    outputs: list[list[int]]
    seconds: float
    steps: int
    drafts: SpecStats  # this pass's verified drafts
    errors: int        # requests that ended in error
    fallbacks: int     # times the proposer stopped answering
    times: StepTimes   # this pass's steps, phase by phase

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Bench:
    """What the entries share: the settings, the target, the prompts, and what earlier
    entries found (the target-only reference; n-gram's tokens, the engine loop's reference)."""

    s: Settings
    worker: ModelWorker
    prompts: list[list[int]]
    reference: Pass | None = None
    ngram: list[list[int]] | None = None

    @property
    def greedy(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.s.max_tokens, ignore_eos=True)

    def engine(self, method: str | None, draft: Proposer | None = None,
               draft_source: str | None = None) -> SpecDecodeEngine:
        """An engine over the target as serving assembles one (``draft_source``: a model
        method's ``speculative.draft``, which names the draft; ``draft`` is its proposer)."""
        spec = SpeculativeConfig(method=method, num_speculative_tokens=self.s.k,
                                 draft=ModelConfig(source=draft_source) if draft_source else None)
        return assemble_engine(self.worker, IdText(), frozenset(), spec, draft)


def run_pass(engine: SpecDecodeEngine, prompts: list[list[int]], params: SamplingParams,
             batch: int) -> Pass:
    """``prompts`` through ``engine.generate``, ``batch`` requests at a time, each group run
    to its end."""
    before, start = engine.counters.snapshot(), time.perf_counter()
    completions = []
    for i in range(0, len(prompts), batch):
        completions += engine.generate(prompts[i:i + batch], params)
    return counted(engine.counters, before, [c.output_token_ids for c in completions],
                   time.perf_counter() - start, sum(c.finish_reason == "error" for c in completions))


def counted(after: EngineCounters, before: EngineCounters, outputs: list[list[int]],
            seconds: float, errors: int) -> Pass:
    """A :class:`Pass` of what the counters gained between ``before`` and ``after``."""
    drafts = SpecStats(num_drafts=after.spec.num_drafts - before.spec.num_drafts,
                       num_draft_tokens=after.spec.num_draft_tokens - before.spec.num_draft_tokens,
                       num_accepted_tokens=after.spec.num_accepted_tokens - before.spec.num_accepted_tokens)
    a, b = after.times, before.times
    times = StepTimes(a.steps - b.steps, a.propose_s - b.propose_s, a.verify_s - b.verify_s,
                      a.accept_s - b.accept_s)
    return Pass(outputs, seconds, times.steps, drafts, errors,
                after.num_draft_fallbacks - before.num_draft_fallbacks, times)


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Per prompt, are the tokens ``reference``'s; the earliest divergence if not."""
    same = [a == b for a, b in zip(reference, outputs)]
    return {"same_as_target_only": len(reference) == len(outputs) and all(same),
            "num_same": sum(same), "first_divergence": first_divergence(reference, outputs)}


def figures(p: Pass, reference: Pass | None) -> dict:
    """An entry's numbers: speed, drafts, and the tokens and speed against ``reference``."""
    bad = p.errors or p.fallbacks
    entry = {"status": "failed" if bad else "ok",
             "tokens": p.tokens, "num_prompts": len(p.outputs), "seconds": round(p.seconds, 4),
             "tokens_per_s": round(p.tokens_per_s, 2), "steps": p.steps,
             "step_s": round(p.seconds / p.steps, 6) if p.steps else None,
             "draft_tokens": p.drafts.num_draft_tokens, "accepted_tokens": p.drafts.num_accepted_tokens,
             "acceptance_rate": round(p.drafts.acceptance_rate, 4),
             "mean_acceptance_length": round(p.drafts.mean_acceptance_length, 4),
             "errors": p.errors, "draft_fallbacks": p.fallbacks}
    if bad:
        entry["reason"] = f"{p.errors} requests ended in error, {p.fallbacks} draft fallbacks"
    if reference is not None:
        entry.update(compare(reference.outputs, p.outputs),
                     speedup=round(p.tokens_per_s / reference.tokens_per_s, 3))
        if p.drafts.num_drafts and reference.steps:
            entry["cost_model"] = predicted(p, reference, entry["speedup"])
    return entry


def step_seconds(t: StepTimes) -> float:
    """A step's mean wall time over its phases."""
    return (t.propose_s + t.verify_s + t.accept_s) / t.steps


def predicted(p: Pass, reference: Pass, speedup: float) -> dict:
    """What the cost model says of a speculative pass: ``expected_speedup(alpha, K, c, v,
    share)`` with its measured acceptance rate ``alpha``, its mean K (draft tokens per draft),
    the draft's cost per drafted token ``c`` and the verify's (with the acceptance) ``v``, both
    relative to a step of ``reference`` (target-only), and the share of its steps that drafted
    (one row a step: n-gram drafts only where it finds a match); against the measured speedup."""
    decode = step_seconds(reference.times)
    k = p.drafts.num_draft_tokens / p.drafts.num_drafts
    c = p.times.propose_s / max(p.drafts.num_draft_tokens, 1) / decode
    v = (p.times.verify_s + p.times.accept_s) / p.times.steps / decode
    alpha = min(p.drafts.acceptance_rate, 1.0)
    share = min(p.drafts.num_drafts / p.times.steps, 1.0)
    expected = expected_speedup(alpha, round(k), c, v, share) if v > 0 else None
    return {"alpha": round(alpha, 4), "mean_k": round(k, 3), "c": round(c, 4), "v": round(v, 4),
            "share": round(share, 4), "predicted_speedup": round(expected, 3) if expected else None,
            "measured_over_predicted": round(speedup / expected, 3) if expected else None}


def worst(*parts: dict) -> dict:
    """The status of an entry made of ``parts``: failed where one of them is."""
    bad = [p for p in parts if p["status"] != "ok"]
    return {"status": "failed", "reason": bad[0]["reason"]} if bad else {"status": "ok"}


# -- the entries (module docstring), each a function of the bench returning its dict ---------
def target_only(b: Bench) -> dict:
    engine = b.engine(None)
    b.reference = run_pass(engine, b.prompts, b.greedy, 1)
    return {"batch": 1, "launch_ahead": engine.calls.launch_ahead, **figures(b.reference, None)}


def host_gap(b: Bench) -> dict:
    """``target_only`` on a few prompts under the profiler: per step, the wall time the
    device was not busy (module docstring)."""
    cuda = b.worker.runtime.embed.weight.device.type == "cuda"
    engine = b.engine(None)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        p = run_pass(engine, b.prompts[:HOST_GAP_PROMPTS], b.greedy, 1)
    kind = "CUDA" if cuda else "CPU"
    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type.name == kind]
    busy = union_us(intervals) / 1e6
    gap_ms = 1e3 * (p.seconds - busy) / p.steps if p.steps else None
    entry = {"batch": 1, "num_prompts": len(p.outputs), "steps": p.steps,
             "seconds": round(p.seconds, 4), "busy_s": round(busy, 4), "busy_of": kind,
             "intervals": len(intervals),
             "host_gap_ms_per_step": None if gap_ms is None else round(gap_ms, 4),
             "aim_ms": HOST_GAP_AIM_MS, **compare(b.reference.outputs[:len(p.outputs)], p.outputs)}
    if not intervals or gap_ms is None:
        entry.update(status="failed", reason=f"the profiler recorded no {kind} activity")
    else:
        entry.update(status="ok", within_aim=gap_ms <= HOST_GAP_AIM_MS)
    return entry


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (nested and overlapping ones
    counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def host_profile(b: Bench) -> dict:
    """``target_only`` on a few prompts under cProfile: where the host's part of a step goes
    (module docstring), per step: the functions of the most own time, and this package's
    functions of the most cumulative time."""
    engine = b.engine(None)
    prof = cProfile.Profile()
    prof.enable()
    p = run_pass(engine, b.prompts[:HOST_GAP_PROMPTS], b.greedy, 1)
    prof.disable()
    rows = pstats.Stats(prof).stats.items()  # (file, line, name): (calls, calls, own, cumulative, callers)

    def row(key, value) -> dict:
        (path, line, name), (_, calls, own, cumulative, _) = key, value
        per_step = 1e3 / p.steps
        return {"function": f"{Path(path).name}:{line}({name})", "calls": round(calls / p.steps, 2),
                "own_ms": round(own * per_step, 4), "cumulative_ms": round(cumulative * per_step, 4)}

    own = sorted(rows, key=lambda kv: kv[1][2], reverse=True)[:HOST_PROFILE_ROWS]
    ours = sorted((kv for kv in rows if "specserve" in kv[0][0]), key=lambda kv: kv[1][3],
                  reverse=True)[:HOST_PROFILE_ROWS]
    return {"batch": 1, "num_prompts": len(p.outputs), "steps": p.steps, "status": "ok",
            "step_ms": round(1e3 * p.seconds / p.steps, 4),
            "top_own": [row(*kv) for kv in own], "top_cumulative": [row(*kv) for kv in ours],
            **compare(b.reference.outputs[:len(p.outputs)], p.outputs)}


def launch_ahead_off(b: Bench) -> dict:
    engine = b.engine(None)
    engine.calls.launch_ahead = False
    return {"batch": 1, **figures(run_pass(engine, b.prompts, b.greedy, 1), b.reference)}


def target_only_batch(b: Bench) -> dict:
    return {"batch": b.s.batch, **figures(run_pass(b.engine(None), b.prompts, b.greedy, b.s.batch),
                                          b.reference)}


def suffix(b: Bench) -> dict:
    engine = b.engine("suffix")
    first = figures(run_pass(engine, b.prompts, b.greedy, 1), b.reference)
    second = figures(run_pass(engine, b.prompts, b.greedy, 1), b.reference)  # drafts the first's
    same = first.get("same_as_target_only") and second.get("same_as_target_only")
    return {"batch": 1, "k": b.s.k, **worst(first, second), "same_as_target_only": same,
            "speedup_second_pass": second.get("speedup"), "first_pass": first, "second_pass": second}


def ngram(b: Bench) -> dict:
    p = run_pass(b.engine("ngram"), b.prompts, b.greedy, 1)
    b.ngram = p.outputs
    return {"batch": 1, "k": b.s.k, **figures(p, b.reference)}


def seeded(b: Bench) -> dict:
    params = SamplingParams(temperature=TEMPERATURE, seed=SAMPLING_SEED, max_tokens=b.s.max_tokens,
                            ignore_eos=True)
    off_pass = run_pass(b.engine(None), b.prompts, params, 1)
    off = figures(off_pass, None)
    on = figures(run_pass(b.engine("ngram"), b.prompts, params, 1), off_pass)  # against off's tokens
    return {"batch": 1, "k": b.s.k, "temperature": TEMPERATURE, "seed": SAMPLING_SEED,
            **worst(off, on), "same_as_target_only": on["same_as_target_only"],
            "num_same": on["num_same"], "off": off, "on": on}


def engine_loop(b: Bench) -> dict:
    engine = b.engine("ngram")
    before, start = engine.counters.snapshot(), time.perf_counter()
    loop = EngineLoop(engine, max_queue_len=len(b.prompts))
    try:
        outputs, items = asyncio.run(stream(loop, b.prompts, b.greedy, b.s.k))
    finally:
        loop.shutdown()
    entry = {"batch": 1, "k": b.s.k, "stream_items": items,
             **figures(counted(engine.counters, before, outputs, time.perf_counter() - start, 0),
                       b.reference)}
    if b.ngram is not None:
        entry["same_as_generate"] = outputs == b.ngram
    return entry


async def stream(loop: EngineLoop, prompts: list[list[int]], params: SamplingParams,
                 k: int) -> tuple[list[list[int]], int]:
    """Each prompt as a unit streams it (``EngineLoop.generate`` of a checked request), one
    after the other: the tokens per prompt and the stream items received."""
    outputs, items = [], 0
    for prompt in prompts:
        request = check_request(prompt, params, loop.engine.limits, n=1)
        tokens: list[int] = []
        async for out in loop.generate(request, None, num_speculative_tokens=k, adaptive=False):
            tokens += out.new_token_ids
            items += 1
        outputs.append(tokens)
    return outputs, items


def self_draft(b: Bench) -> dict:
    return with_draft(b, "draft_model", "decoder", b.s.draft_layers)


def eagle(b: Bench) -> dict:
    return with_draft(b, "eagle", "eagle", 1)


def self_draft_compiled(b: Bench) -> dict:
    return with_draft(b, "draft_model", "decoder", b.s.draft_layers, compiled=True)


def eagle_compiled(b: Bench) -> dict:
    return with_draft(b, "eagle", "eagle", 1, compiled=True)


def with_draft(b: Bench, method: str, kind: str, num_layers: int, compiled: bool = False) -> dict:
    """A model method's entry: its untrained draft built (``build_s``) and warmed up
    (``warm_up_s``, as a unit's draft actor warms it before the unit is ready), then the
    prompts. ``compiled``: the draft on the target's kernels (``compiled``, CUDA graphs)
    instead of what ``auto`` gives a draft (``library`` on CUDA): issue 52's compiled drafts,
    measured before they become the default."""
    start = time.perf_counter()
    head = untrained_draft(b.worker.runtime, kind, num_layers)
    if compiled:
        use_kernels(head, "compiled", backend=b.s.backend, verify_tokens=b.s.k + 1)
    worker = ModelWorker(head, num_slots=b.worker.num_slots, max_seq_len=b.worker.max_seq_len)
    proposer = proposer_class(method).from_draft(worker, target_vocab_size=b.worker.vocab_size)
    built = time.perf_counter()
    report = proposer.warm_up()  # as the draft actor does before the unit is ready
    draft = {"kind": kind, "num_layers": num_layers, "kernels": head.kernels,
             "build_s": round(built - start, 2),
             "warm_up_s": round(time.perf_counter() - built, 2),
             "cudagraph_skips": report.get("cudagraph_skips")}
    engine = b.engine(method, proposer, f"untrained {kind} draft, {num_layers} layers of the target")
    return {"batch": 1, "k": b.s.k, "draft": draft,
            **figures(run_pass(engine, b.prompts, b.greedy, 1), b.reference)}


def tp_world_1(b: Bench) -> dict:
    """Target-only at batch 1 with the tensor-parallel all-reduces in the layers, over a
    world of one (NCCL on a GPU, gloo on a CPU): inside the compiled graph on a GPU, as a
    unit of TP > 1 runs them. A first pass, two tokens of every prompt and untimed, compiles
    the graphs with the collectives in them (the fourth GPU window timed that compile: 0.46x).
    Against target-only (``num_same``): an all-reduce of one rank adds nothing, but the
    compiler fuses the row-parallel output differently around it, so the bits may move (the
    fourth window: 5 of 16 the same). What a TP unit promises is ``speculation``: n-gram
    drafts with the collectives, against the pass without drafts, identical. The hooks are
    taken out after, and the graphs compiled without them serve again."""
    device = b.worker.runtime.embed.weight.device
    skips = cudagraph_skips()
    with world_of_one("nccl" if device.type == "cuda" else "gloo"), all_reduces(b.worker.runtime):
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        run_pass(b.engine(None), b.prompts, warm, 1)
        off = run_pass(b.engine(None), b.prompts, b.greedy, 1)
        on = run_pass(b.engine("ngram"), b.prompts, b.greedy, 1)
    entry = {"batch": 1, **figures(off, b.reference)}
    speculation = figures(on, off)
    return {**entry, **worst(entry, speculation), "speculation": speculation,
            "cudagraph_skips": cudagraph_skips() - skips}


@contextlib.contextmanager
def world_of_one(backend: str):
    """A process group of this process alone, destroyed after."""
    with socket.socket() as sock:  # a free port on loopback for the store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def all_reduces(runtime: LlamaRuntime):
    """The row-parallel linears' all-reduces set on every layer (``tp.localize``'s hooks,
    kept at world size 1, where ``apply_tp`` leaves them out), unset after."""
    reduce = all_reducer(None)
    for layer in runtime.layers:
        layer.attn.all_reduce = layer.mlp.all_reduce = reduce
    try:
        yield
    finally:
        for layer in runtime.layers:
            layer.attn.all_reduce = layer.mlp.all_reduce = None


def untrained_draft(target: LlamaRuntime, kind: str, num_layers: int) -> DraftHead:
    """A draft as ``specserve train-draft`` starts one (``new_draft_head``) over every token
    id, on the target's device in its dtype, on the kernels a loaded draft gets
    (``kernels: auto``). Made on the CPU, then moved: ``new_draft_head`` seeds an EAGLE
    fuser's noise with a CPU generator."""
    weight = target.embed.weight
    with default_dtype(weight.dtype):
        head = new_draft_head(target, kind=kind, num_layers=num_layers,
                              draft_vocab=torch.arange(target.arch.vocab_size))
    head = head.to(weight.device).requires_grad_(False).eval()
    return head.use_kernels(head_kernels(head))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


LOGGED = ("status", "reason", "tokens_per_s", "speedup", "speedup_second_pass", "acceptance_rate",
          "same_as_target_only", "num_same", "same_as_generate", "host_gap_ms_per_step",
          "wall_s")  # an entry's log line
ENTRIES = (("target_only", target_only), ("host_gap", host_gap), ("target_only_batch", target_only_batch),
           ("host_profile", host_profile), ("launch_ahead_off", launch_ahead_off), ("suffix", suffix),
           ("ngram", ngram), ("seeded", seeded),
           ("engine_loop", engine_loop), ("self_draft", self_draft), ("eagle", eagle),
           ("tp_world_1", tp_world_1), ("self_draft_compiled", self_draft_compiled),
           ("eagle_compiled", eagle_compiled))


# -- the step ---------------------------------------------------------------------------------
def build(s: Settings) -> tuple[Bench, dict]:
    """The target on its kernels, warmed up, with ``batch`` slots; the report's header."""
    prompts = make_prompts(s.num_prompts, SHAPES[s.shape]["vocab_size"])
    max_len = max(map(len, prompts)) + s.max_tokens + s.k + 2
    torch.manual_seed(SEED)
    runtime = random_runtime(s.shape, getattr(torch, s.dtype), s.device, max_len=max_len)
    kernels = use_kernels(runtime, s.kernels, backend=s.backend, verify_tokens=s.k + 1)
    worker = ModelWorker(runtime, num_slots=s.batch, max_seq_len=max_len)
    header = {"max_len": max_len, "use_kernels": kernels, "warm_up": warm_up(runtime, worker.cache)}
    return Bench(s, worker, prompts), header


def attempt(name: str, measure, bench: Bench) -> dict:
    """One entry, its failure its own: a raise becomes ``failed`` with one line."""
    if bench.worker.num_free_slots < bench.worker.num_slots:  # every engine frees its own
        return {"status": "skipped", "reason": "an earlier entry failed holding target slots"}
    start = time.perf_counter()
    try:
        entry = measure(bench)
    except Exception as exc:  # noqa: BLE001  the next entry still runs
        log.exception("%s failed", name)
        entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    entry["wall_s"] = round(time.perf_counter() - start, 2)
    log.info("%s: %s", name, {k: entry[k] for k in LOGGED if k in entry})
    return entry


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def run(out: Path, dry_run: bool) -> None:
    run_entries(out / FILE, DRY if dry_run else GPU, build, ENTRIES)


def run_entries(path: Path, s, build_with, entries) -> None:
    """A step of entries (``entries``: ``(name, measure)`` in order, each measuring what
    ``build_with(s)`` returned): the report at ``path`` rewritten as each entry ends, the
    pending ones named; exits 1 where one failed (the step's status in summary.json, with
    this line as its reason)."""
    started = time.perf_counter()
    device = device_name(s.device)
    report = {"settings": asdict(s), "device": device,
              "entries": {name: {"status": "pending"} for name, _ in entries}}
    write_json(path, report)
    bench, header = build_with(s)
    report.update(header)
    for name, measure in entries:
        report["entries"][name] = {"device": device, **attempt(name, measure, bench)}
        report.update(cudagraph_skips=cudagraph_skips(), seconds=round(time.perf_counter() - started, 1))
        write_json(path, report)
    bad = {n: e["status"] for n, e in report["entries"].items() if e["status"] != "ok"}
    log.info("%s: %s in %.0f s", path.stem, f"not ok: {bad}" if bad else "every entry ok",
             report["seconds"])
    if "failed" in bad.values():
        raise SystemExit(f"error: {path.name} entries not ok: {bad}")
