"""GPU memory per rank: what a target rank or a draft holds, estimated from ``config.json``.

The runtime preallocates almost everything it will ever use, so the estimate is mostly exact
arithmetic over the same shapes the code allocates (``tests/test_memory.py`` checks the weight
and KV bytes against a real runtime's tensors, at TP 1 and TP 2):

- **sharded weights**: this rank's ``1 / tp`` of q/k/v, o, gate/up and down (and their
  column-parallel biases): :func:`specserve.engine.runtime.tp.split_of` cuts them;
- **replicated weights**: what every rank holds whole: the embeddings, the LM head (untied;
  a tied head *is* the embedding), every norm, the row-parallel biases (rank 0's copy, zeros
  elsewhere, the same bytes) and the rope tables ``2 x min(max_model_len, max_positions) x
  head_dim``. For Llama-3.1-70B the embeddings and LM head alone are 2 x 128256 x 8192 x 2 B
  = 3.9 GiB on *every* rank;
- **KV cache**: ``2 (k, v) x layers x kv_heads / tp x head_dim x dtype bytes`` per position,
  times the positions the cache allocates. The slot layout
  (:class:`~specserve.engine.kv.kv_cache.SlotKVCache`) keeps every slot at full length:
  ``slots x max_model_len``, rounded up to whole blocks of :data:`KV_BLOCK`, and one spare slot
  with ``kernels: compiled``. The paged layout (:class:`~specserve.engine.kv.kv_cache.PagedKVCache`)
  allocates its pool: ``kv_cache.num_blocks x block_size`` (by default the slots' positions);
  sequences share it by the tokens they hold, so a pool below ``max_num_seqs x max_model_len``
  serves as many sequences as their actual lengths fit (the scheduler preempts beyond);
- **workspace**: the transient tensors of the largest forward as a GPU runs it (FlexAttention:
  no scores), computed from its shapes (see :func:`forward_workspace`), the larger of a
  prefill of ``prefill_rows`` prompts of full length and a verify of every slot at full
  context;
- **overhead**: an allowance, not computed: the CUDA context with cuBLAS workspaces and
  loaded kernels (:data:`CUDA_CONTEXT_BYTES`) and, under TP, NCCL's buffers (:data:`NCCL_BYTES`).

An estimate *fits* a GPU when its total is at most :data:`MAX_UTILIZATION` of the GPU's memory:
the rest is for what no formula here sees (the caching allocator's fragmentation, a library's
lazily made buffers). ``docs/MEMORY.md`` has the flagship's numbers and the reasoning;
``specserve memory-estimate`` prints an estimate.

Nothing here imports torch (but :func:`check_cuda_memory`, when called) or the engine: it
runs where a Helm chart is rendered.

Worked example (Llama-3.2-1B-shaped numbers, one GPU):

>>> cfg = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
...        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
...        "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 131072}
>>> est = estimate_memory(cfg, max_model_len=8192, max_num_seqs=32, num_speculative_tokens=4)
>>> round(est.weights / GIB, 2), round(est.kv_cache / GIB, 2)
(2.3, 8.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from specserve.config import KVCacheConfig
from specserve.errors import ConfigError

GIB = 1 << 30
KV_BLOCK = 64  # positions per KV block: specserve.engine.runtime.kernels.KV_BLOCK (a test keeps them equal)
FP32 = 4
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}  # auto: bfloat16 on CUDA

# The allowance for what is not a tensor of ours. A CUDA 12 context with torch's kernels
# loaded lazily, cuBLAS / cuBLASLt workspaces and the caching allocator's first blocks take
# 0.5 - 0.8 GiB on an H100; 1 GiB leaves room for more kernels than one forward loads.
CUDA_CONTEXT_BYTES = 1 * GIB
# NCCL's per-peer buffers (NCCL_BUFFSIZE, 4 MiB, x channels x protocols) and, on NVSwitch
# machines, NVLink SHARP buffers, which take the most (NCCL_NVLS_ENABLE=0 turns them off).
NCCL_BYTES = 3 * GIB // 2
# The share of a GPU an estimate may take (vLLM's default gpu_memory_utilization is 0.9 too).
MAX_UTILIZATION = 0.9
# Logits are float32 [rows, vocab]; sampling them (temperature, one sort with int64 indices
# for top-k / top-p, masks, softmax, cumsum, the exponential-race noise and its int64
# intermediates) keeps about fourteen float32 copies alive at its peak, plus the LM head's own
# output in the model dtype: an H100's verify of 16 x 5 rows peaked at 13.9 copies.
SAMPLER_FP32_COPIES = 14
# FlexAttention's decoding kernel: under this many queries per row; its split-KV buffers are
# sized by the GPU's streaming multiprocessors (132 on an H100 or H200, 148 on a B200).
FLEX_QUERY_TILE = 128
MAX_SMS = 148


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-family ``config.json`` the estimate reads (the same rules as
    :class:`specserve.engine.runtime.arch.ModelArch`: head_dim defaults to hidden / heads, kv heads
    to heads, Qwen2 has q/k/v biases and no o bias, Qwen3 a norm over each q and k head)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        def need(key: str) -> int:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config.json: {key} must be a positive integer (got {value!r})")
            return value

        heads = need("num_attention_heads")
        model_type = config.get("model_type", "llama")
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            hidden_size=need("hidden_size"), num_layers=need("num_hidden_layers"), num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or need("hidden_size") // heads,
            intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings") or 1 << 30,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)), qk_norm=model_type == "qwen3")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU (one tensor-parallel rank, or the draft's GPU); the module docstring
    defines each part."""

    sharded_weights: int
    replicated_weights: int
    kv_cache: int
    workspace: int
    overhead: int

    @property
    def weights(self) -> int:
        return self.sharded_weights + self.replicated_weights

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def fits(self, gpu_memory_bytes: float) -> bool:
        return self.total <= MAX_UTILIZATION * gpu_memory_bytes


@dataclass(frozen=True)
class Workload:
    """What the engine is configured for: the inputs of an estimate besides the model."""

    max_model_len: int
    max_num_seqs: int
    num_speculative_tokens: int = 0  # K: a verify forward feeds K + 1 tokens per row
    tp: int = 1
    dtype: str = "auto"
    draft: bool = False       # a draft: one logit row per sequence (a target: K + 1)
    prefill_rows: int = 1     # prompts of full length prefilled in one forward
    spare_slot: bool = False  # kernels: compiled (a static-shape forward's padding slot)
    paged: bool = False       # kv_cache.layout paged: a pool of blocks
    kv_blocks: int | None = None  # paged: the pool's blocks (None: the slots' positions)
    block_size: int = 16          # paged: positions per block

    @property
    def pool_blocks(self) -> int:
        """A paged pool's blocks (:meth:`KVCacheConfig.pool_blocks
        <specserve.config.KVCacheConfig.pool_blocks>`, the engine's own count)."""
        kv = KVCacheConfig(layout="paged", block_size=self.block_size, num_blocks=self.kv_blocks)
        return kv.pool_blocks(self.max_num_seqs, self.max_model_len)

    @classmethod
    def of(cls, engine, *, tp: int = 1, draft: bool = False) -> Workload:
        """The workload of an :class:`~specserve.config.EngineConfig`'s target (or draft)."""
        model = engine.speculative.draft if draft else engine.target
        kv = engine.draft_kv_cache if draft else engine.kv_cache
        paged = {} if kv is None or kv.layout != "paged" else {
            "paged": True, "kv_blocks": kv.num_blocks, "block_size": kv.block_size}
        return cls(max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
                   num_speculative_tokens=engine.speculative.num_speculative_tokens, tp=tp,
                   dtype=model.dtype, draft=draft,
                   spare_slot=compiled(model.kernels, model.device, draft), **paged)


def compiled(kernels: str, device: str, draft: bool) -> bool:
    """Whether a model of ``kernels`` on ``device`` (a ModelConfig's; ``memory-estimate``:
    ``auto`` on a GPU) runs ``compiled``: named, or ``auto`` for a target on a GPU
    (:func:`~specserve.engine.runtime.model.default_kernels`; an estimate is a GPU's), which
    counts its padding slot (``Workload.spare_slot``)."""
    return kernels == "compiled" or (kernels == "auto" and not draft and device != "cpu")


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def weight_bytes(shape: ModelShape, tp: int, nbytes: int, max_len: int) -> tuple[int, int]:
    """``(sharded, replicated)`` parameter and rope-table bytes on one rank."""
    h, d, layers = shape.hidden_size, shape.head_dim, shape.num_layers
    q, kv, inter = shape.num_heads // tp * d, shape.num_kv_heads // tp * d, shape.intermediate_size // tp
    per_layer = (q + 2 * kv) * h + h * q + 2 * inter * h + inter * h  # qkv, o, gate_up, down
    per_layer += (q + 2 * kv) * shape.qkv_bias + 2 * inter * shape.mlp_bias  # column-parallel biases
    # norms, and the row-parallel biases (o, down) every rank holds (zeros off rank 0)
    per_layer_whole = 2 * h + h * shape.o_bias + h * shape.mlp_bias + 2 * d * shape.qk_norm
    embeddings = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    rope = 2 * max_len * d  # cos and sin tables, in the model dtype
    return (layers * per_layer * nbytes,
            (layers * per_layer_whole + h + embeddings + rope) * nbytes)


def kv_cache_bytes(shape: ModelShape, load: Workload) -> int:
    """One rank's KV tensors: a :class:`~specserve.engine.kv.kv_cache.SlotKVCache`'s, or a
    paged pool's (:class:`~specserve.engine.kv.kv_cache.PagedKVCache`)."""
    per_position = (2 * shape.num_layers * (shape.num_kv_heads // load.tp) * shape.head_dim
                    * dtype_bytes(load.dtype))
    if load.paged:  # the compiled path's pool has a spare block, for its padding
        return per_position * (load.pool_blocks + load.spare_slot) * load.block_size
    positions = -(-load.max_model_len // KV_BLOCK) * KV_BLOCK
    return per_position * (load.max_num_seqs + load.spare_slot) * positions


def forward_workspace(shape: ModelShape, tp: int, nbytes: int, *, rows: int, new_tokens: int,
                      logit_rows: int) -> int:
    """Peak transient bytes of one forward of ``rows`` rows of ``new_tokens`` tokens on one
    rank, however many keys they attend to, as a GPU runs it: attention on FlexAttention (what
    ``kernels: auto`` and ``compiled`` use on CUDA; ``engine/runtime/block_attention.py``).

    FlexAttention keeps no scores and reads the keys where the cache holds them, so its
    transient tensors grow with the queries, not the keys: the queries padded to a
    power-of-two batch and made contiguous, the output and its reshaped copy
    (``[rows', heads / tp, new_tokens, head_dim]`` each) and the float32 log-sum-exp; under a
    tile of queries torch's decoding kernel adds float32 split-KV buffers, at most about
    ``2 x SMs x (heads / kv_heads) x 16 x head_dim`` (it splits a row's keys over
    ``2 x SMs / (rows x kv_heads)`` thread blocks). Beside
    attention, the hidden states (residual, normed input, sublayer output and rms_norm's
    float32 copy), the fused q/k/v output, the MLP's (gate/up, silu(gate), their product; not
    alive with attention's) and the logits with the sampler's copies
    (:data:`SAMPLER_FP32_COPIES`). Measured on an H100 (Llama-3-8B shape, bfloat16, 8192 x
    16, K = 4; docs/MEMORY.md): a prefill of 8192 tokens peaked 1.10 GiB above the static
    allocation (this: 1.31), a verify of every slot with its sampler 0.53 GiB (this: 0.57).
    """
    h, d = shape.hidden_size, shape.head_dim
    heads, kv_heads = shape.num_heads // tp, shape.num_kv_heads // tp
    tokens = rows * new_tokens
    hidden = tokens * h * (3 * nbytes + FP32)
    qkv = tokens * (heads + 2 * kv_heads) * d * nbytes
    queries = (1 << (rows - 1).bit_length()) * new_tokens * heads  # rows padded to a power of 2
    attention = queries * (4 * d * nbytes + FP32)
    if new_tokens < FLEX_QUERY_TILE:
        attention += 2 * MAX_SMS * (heads // kv_heads) * 16 * d * FP32
    mlp = tokens * shape.intermediate_size // tp * 4 * nbytes
    logits = logit_rows * shape.vocab_size * (nbytes + SAMPLER_FP32_COPIES * FP32)
    return hidden + qkv + max(attention, mlp) + logits


def workspace_bytes(shape: ModelShape, load: Workload) -> int:
    """The larger of the two largest forwards the engine makes: a prefill of
    ``prefill_rows`` prompts of ``max_model_len`` tokens (prefill rows share a forward only
    when their prompts have the same length), and a verify of every slot at full context
    (K + 1 tokens per row; a draft's catch-up feeds as many)."""
    nbytes, per_row = dtype_bytes(load.dtype), load.num_speculative_tokens + 1
    logits_per_row = 1 if load.draft else per_row
    prefill = forward_workspace(shape, load.tp, nbytes, rows=load.prefill_rows,
                                new_tokens=load.max_model_len,
                                logit_rows=load.prefill_rows * logits_per_row)
    verify = forward_workspace(shape, load.tp, nbytes, rows=load.max_num_seqs, new_tokens=per_row,
                               logit_rows=load.max_num_seqs * logits_per_row)
    return max(prefill, verify)


def check_workload(shape: ModelShape, load: Workload) -> None:
    """The refusals the engine would make (``tp.check_divisible``, ``make_cache``)."""
    if load.tp < 1 or (load.draft and load.tp != 1):
        raise ConfigError(f"tensor parallel size {load.tp}: a draft runs on 1 GPU, a target on 1 or more")
    for name, value in (("num_attention_heads", shape.num_heads),
                        ("num_key_value_heads", shape.num_kv_heads),
                        ("intermediate_size", shape.intermediate_size)):
        if value % load.tp:
            raise ConfigError(f"{name} = {value} is not divisible by the tensor parallel size {load.tp}")
    if load.max_model_len > shape.max_position_embeddings:
        raise ConfigError(f"max_model_len {load.max_model_len} exceeds the model's "
                          f"max_position_embeddings {shape.max_position_embeddings}")
    if min(load.max_model_len, load.max_num_seqs, load.prefill_rows) < 1 or load.num_speculative_tokens < 0:
        raise ConfigError("max_model_len, max_num_seqs and prefill_rows must be positive, K not negative")


def estimate(shape: ModelShape, load: Workload) -> MemoryEstimate:
    """Bytes on one GPU of a rank (or the draft) serving ``load``."""
    check_workload(shape, load)
    sharded, replicated = weight_bytes(shape, load.tp, dtype_bytes(load.dtype),
                                       min(load.max_model_len, shape.max_position_embeddings))
    return MemoryEstimate(
        sharded_weights=sharded, replicated_weights=replicated,
        kv_cache=kv_cache_bytes(shape, load), workspace=workspace_bytes(shape, load),
        overhead=CUDA_CONTEXT_BYTES + (NCCL_BYTES if load.tp > 1 else 0))


def estimate_memory(config: dict, **workload) -> MemoryEstimate:
    """:func:`estimate` from a ``config.json`` dict and :class:`Workload`'s fields."""
    return estimate(ModelShape.from_config(config), Workload(**workload))


def largest_num_seqs(shape: ModelShape, load: Workload, gpu_memory_bytes: float) -> int:
    """The most ``max_num_seqs`` at which ``load`` still fits (0: not even one)."""
    return _largest(lambda n: estimate(shape, replace(load, max_num_seqs=n)).fits(gpu_memory_bytes),
                    load.max_num_seqs)


def largest_kv_blocks(shape: ModelShape, load: Workload, gpu_memory_bytes: float) -> int:
    """A paged pool's most blocks at which ``load`` still fits (0: none)."""
    one = kv_cache_bytes(shape, replace(load, paged=True, kv_blocks=1))
    return _largest(lambda n: estimate(shape, replace(load, paged=True, kv_blocks=n)).fits(gpu_memory_bytes),
                    max(1, int(gpu_memory_bytes // max(1, one))))


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """The largest ``n`` in ``0..high`` with ``fits(n)`` (0 where none does). The total grows
    with ``n``, so a bisection finds it."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def check_fits(shape: ModelShape, load: Workload, *, free_bytes: int, total_bytes: int) -> MemoryEstimate:
    """Refuse, with the fix named, a ``load`` that will not fit this GPU: its estimate must
    be within :data:`MAX_UTILIZATION` of ``total_bytes``, and what it has yet to allocate
    (all but the CUDA context, which exists by now) within ``free_bytes``. The arguments
    are ``torch.cuda.mem_get_info()``'s, the check runs before the weights load."""
    est = estimate(shape, load)
    if est.fits(total_bytes) and est.total - CUDA_CONTEXT_BYTES <= free_bytes:
        return est
    budget = min(total_bytes, (free_bytes + CUDA_CONTEXT_BYTES) / MAX_UTILIZATION)
    seqs = largest_num_seqs(shape, load, budget)
    fix = (f"lower max_num_seqs to {seqs} or less, or max_model_len" if seqs
           else "use a larger tensor_parallel_size, a shorter max_model_len or a larger GPU")
    if load.paged and load.kv_blocks is not None:
        blocks = largest_kv_blocks(shape, load, budget)
        fix = (f"lower kv_cache.num_blocks to {blocks} or less" if blocks * load.block_size
               >= load.max_model_len else fix)
    raise ConfigError(
        f"this GPU cannot hold the {'draft' if load.draft else 'target'} as configured: about "
        f"{est.total / GIB:.1f} GiB per GPU ({format_estimate(est, oneline=True)}), "
        f"{free_bytes / GIB:.1f} of {total_bytes / GIB:.1f} GiB free, {MAX_UTILIZATION:.0%} usable: "
        f"{fix} (docs/MEMORY.md)")


def check_cuda_memory(config, load: Workload, device=None) -> MemoryEstimate:
    """:func:`check_fits` on a CUDA device (default: the current one), with torch's numbers.
    ``config``: a ``config.json`` dict or a ``transformers`` config. Meant for a rank or a
    draft at start, before its weights load."""
    import torch

    config = config if isinstance(config, dict) else config.to_dict()
    free, total = torch.cuda.mem_get_info(device)
    return check_fits(ModelShape.from_config(config), load, free_bytes=free, total_bytes=total)


@dataclass(frozen=True)
class SharedGpu:
    """Target rank 0 and the draft on one GPU (``draft_placement: shared``): two processes,
    each with its own CUDA context, so both estimates count in full, overheads included."""

    target: MemoryEstimate
    draft: MemoryEstimate
    gpu_memory_bytes: float | None

    @property
    def total(self) -> int:
        return self.target.total + self.draft.total

    @property
    def fits(self) -> bool:
        """Within :data:`MAX_UTILIZATION` of the GPU (True without a GPU to compare)."""
        return self.gpu_memory_bytes is None or self.total <= MAX_UTILIZATION * self.gpu_memory_bytes

    @property
    def draft_share(self) -> float:
        """The draft's share of the GPU in steps of 0.05: the ``draft_gpu_fraction`` it implies."""
        return math.ceil(self.draft.total / self.gpu_memory_bytes * 20) / 20

    def line(self) -> str:
        """One line: both totals, their sum, and against the GPU whether it fits."""
        line = (f"target rank 0 + draft on one GPU: {self.target.total / GIB:.2f} + "
                f"{self.draft.total / GIB:.2f} = {self.total / GIB:.2f} GiB")
        if self.gpu_memory_bytes is None:
            return line
        return (f"{line}, {self.total / self.gpu_memory_bytes:.0%} of {self.gpu_memory_bytes / GIB:.1f} "
                f"GiB: {'fits' if self.fits else 'does NOT fit'} (at most {MAX_UTILIZATION:.0%}); "
                f"draft_gpu_fraction {self.draft_share:.2f}")


def shared_gpu(target: tuple[ModelShape, Workload], draft: tuple[ModelShape, Workload],
               gpu_memory_bytes: float | None) -> SharedGpu:
    """Target rank 0's and the draft's estimates on one GPU, each ``(shape, workload)``."""
    return SharedGpu(estimate(*target), estimate(*draft), gpu_memory_bytes)


def largest_shared_num_seqs(target: tuple[ModelShape, Workload], draft: tuple[ModelShape, Workload],
                            gpu_memory_bytes: float) -> int:
    """The most ``max_num_seqs``, up to the target workload's (both models hold as many), at
    which target rank 0 and the draft still fit one GPU together (0: not even one)."""
    def fits(n: int) -> bool:
        return shared_gpu((target[0], replace(target[1], max_num_seqs=n)),
                          (draft[0], replace(draft[1], max_num_seqs=n)), gpu_memory_bytes).fits
    return _largest(fits, target[1].max_num_seqs)


PARTS = (  # (field, label, what it is) in the order a table prints them
    ("sharded_weights", "sharded weights", "this rank's 1/tp of attention and MLP"),
    ("replicated_weights", "replicated weights", "embeddings, LM head, norms, rope tables"),
    ("kv_cache", "KV cache", "every slot at max_model_len"),
    ("workspace", "workspace", "largest forward: activations, logits, sampler"),
    ("overhead", "overhead", "allowance: CUDA context, cuBLAS, NCCL"),
)


def format_estimate(est: MemoryEstimate, *, gpu_memory_bytes: float | None = None,
                    oneline: bool = False, load: Workload | None = None) -> str:
    """A table, one line per part, or with ``oneline`` the parts on one line (GiB).

    >>> print(format_estimate(MemoryEstimate(GIB, 0, 2 * GIB, 0, GIB), oneline=True))
    sharded weights 1.0 + replicated weights 0.0 + KV cache 2.0 + workspace 0.0 + overhead 1.0 = 4.0 GiB
    """
    if oneline:
        parts = " + ".join(f"{label} {getattr(est, name) / GIB:.1f}" for name, label, _ in PARTS)
        return f"{parts} = {est.total / GIB:.1f} GiB"
    whys = {name: why for name, _, why in PARTS}
    if load is not None and load.paged:
        whys["kv_cache"] = (f"{load.pool_blocks} blocks of {load.block_size}: "
                            f"{load.pool_blocks * load.block_size / load.max_model_len:.1f} x max_model_len")
    lines = [f"  {label:<19}{getattr(est, name) / GIB:7.2f} GiB  {whys[name]}" for name, label, _ in PARTS]
    lines.append(f"  {'total':<19}{est.total / GIB:7.2f} GiB" + _verdict(est, gpu_memory_bytes))
    return "\n".join(lines)


def _verdict(est: MemoryEstimate, gpu_memory_bytes: float | None) -> str:
    if gpu_memory_bytes is None:
        return ""
    share = est.total / gpu_memory_bytes
    return (f"  {share:.0%} of {gpu_memory_bytes / GIB:.1f} GiB: "
            f"{'fits' if est.fits(gpu_memory_bytes) else 'does NOT fit'} "
            f"(at most {MAX_UTILIZATION:.0%})")
