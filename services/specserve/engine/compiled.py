"""Static shapes for ``torch.compile`` and CUDA graphs: the runtime's GPU path (``kernels: compiled``).

On a GPU, a decode step of a model that fits is short enough that launching its kernels
costs as much as running them: ~15 kernels per layer at a few microseconds each is a few
milliseconds a step over 32 layers, the time an H100 takes to read 8B bfloat16 weights.
gpt-fast's recipe removes that: compile the layer stack with static shapes and replay it as
one CUDA graph. A graph needs every shape and address fixed, so this module

- pads a ragged decode or verify batch up to a *bucket*: rows to the next power of two, new
  tokens per row to 1, 2, 4, 8 or 16 (a verify of K + 1 <= 16), and compiles the layer stack
  once per bucket (``dynamic=False``; :data:`BUCKET_TOKENS`). A unit with ``S`` slots sees at
  most ``(log2(S) + 1) * 5`` shapes, each compiled at its first use;
- attends over a slot's *whole* cache with a mask (keys after a query's position hidden), as
  gpt-fast does over its static cache, so no shape depends on a sequence's length. The cost
  is reading up to ``max_seq_len`` keys per row per layer instead of the row's own, the price
  gpt-fast pays too; a paged kernel (FlashInfer, flex attention with a block mask) is where
  this goes next;
- writes the new keys and values with one ``index_put`` per layer, in place on the cache
  tensors (marked static so the graph keeps their addresses). Padding tokens write to the
  cache's spare slot (:class:`~specserve.engine.kv_cache.SlotKVCache` ``spare``), which no
  sequence owns;
- leaves prefill (more than :data:`BUCKET_TOKENS`\\ [-1] new tokens in a row) to the library
  path: its shapes vary anyway, and its cost is compute, not launches.

What this path does not promise: row invariance. Compiled GEMMs pick tilings by shape, so a
token's logits in a verify of 5 may round differently from the same token decoded alone,
and greedy speculation is then as identical to target-only as the GPU's kernels make it
(README, "Precision"). On a CPU the same code runs under inductor, which is how the tests
check it; the C kernels are faster there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BUCKET_TOKENS = (1, 2, 4, 8, 16)  # new tokens per row a compiled forward takes


def bucket(n: int, limit: int | None = None) -> int:
    """The static size ``n`` rows or tokens are padded to: the next power of two (at most
    ``limit``, itself allowed where it is not a power of two).

    >>> [bucket(n) for n in (1, 2, 3, 5, 9)]
    [1, 2, 4, 8, 16]
    >>> bucket(5, limit=6)
    6
    """
    size = 1 << max(n - 1, 0).bit_length()
    return min(size, limit) if limit is not None else size


@dataclass
class StaticInputs:
    """What the layers of one padded forward share; every shape fixed by the bucket
    ``(B, T)`` and the cache's storage length ``S``. Padding rows and padding tokens carry
    the cache's spare slot."""

    cos: torch.Tensor              # [B, T, 1, D]
    sin: torch.Tensor              # [B, T, 1, D]
    slots: torch.Tensor            # [B] int64: each row's slot
    write_slots: torch.Tensor      # [B, T] int64: where each token's key goes (spare: padding)
    write_positions: torch.Tensor  # [B, T] int64
    visible: torch.Tensor          # [B, 1, T, S] bool: the keys each query attends to
    window_visible: torch.Tensor | None  # the same inside the sliding window


class StaticForward:
    """The layer stack of a :class:`~specserve.engine.model.LlamaRuntime` run at bucketed
    static shapes, compiled (``backend``; ``None`` runs the same code eagerly)."""

    def __init__(self, runtime, *, backend: str | None = "inductor") -> None:
        self.runtime = runtime
        self.buckets: set[tuple[int, int]] = set()  # (rows, tokens) compiled so far
        self._step = self._layers
        if backend is not None:
            cuda = runtime.embed.weight.device.type == "cuda"
            # one graph per bucket: raise dynamo's recompile limit (8) to the bucket count
            limit = len(BUCKET_TOKENS) * 16
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            self._step = torch.compile(self._layers, backend=backend, fullgraph=True, dynamic=False,
                                       mode="reduce-overhead" if cuda and backend == "inductor"
                                       else None)

    def takes(self, num_new: int) -> bool:
        """Whether a forward whose longest row has ``num_new`` tokens runs here."""
        return num_new <= BUCKET_TOKENS[-1]

    def __call__(self, x: torch.Tensor, ctx, cache) -> torch.Tensor:
        """``x`` ``[B, T, hidden]`` (a ragged :class:`~specserve.engine.model.ForwardContext`
        batch) through every layer; returns ``[B, T, hidden]``."""
        b, t, hidden = x.shape
        rows, tokens = bucket(b, limit=cache.num_slots), bucket(t)
        if (rows, tokens) not in self.buckets:
            log.info("compiling the layer stack for %d rows x %d tokens", rows, tokens)
            self.buckets.add((rows, tokens))
        padded = x.new_zeros(rows, tokens, hidden)
        padded[:b, :t] = x
        out = self._step(padded, static_inputs(self.runtime, ctx, cache, rows, tokens), cache)
        return out[:b, :t].clone()  # a CUDA graph's output is overwritten by its next replay

    def _layers(self, x: torch.Tensor, inputs: StaticInputs, cache) -> torch.Tensor:
        for layer in self.runtime.layers:
            x = layer(x, inputs, cache)
        return x


def static_inputs(runtime, ctx, cache, rows: int, tokens: int) -> StaticInputs:
    """The padded positions, cache writes and masks of a ragged batch (``ctx``)."""
    device = runtime.embed.weight.device
    b, t = ctx.positions.shape
    spare = cache.spare_slot
    steps = torch.arange(tokens)
    positions = steps.repeat(rows, 1)                                     # [B', T']
    positions[:b, :t] = ctx.positions
    positions[:b, t:] = ctx.positions[:, -1:] + steps[1:tokens - t + 1]
    slots = torch.full((rows,), spare, dtype=torch.int64)
    slots[:b] = torch.tensor(ctx.slots)
    valid = torch.zeros(rows, tokens, dtype=torch.bool)
    valid[:b, :t] = ctx.valid.cpu()
    write_slots = torch.where(valid, slots[:, None], spare)
    write_positions = torch.where(valid, positions, steps)
    table = positions.clamp(max=runtime.max_positions - 1).to(device)
    keys = torch.arange(cache.k[0].shape[2], device=device)               # [S]
    query = positions.to(device)[:, None, :, None]                        # [B', 1, T', 1]
    visible = keys <= query                                               # [B', 1, T', S]
    window = ctx.window
    return StaticInputs(
        cos=runtime.rope_cos[table].unsqueeze(2), sin=runtime.rope_sin[table].unsqueeze(2),
        slots=slots.to(device), write_slots=write_slots.to(device),
        write_positions=write_positions.to(device), visible=visible,
        window_visible=None if window is None else visible & (keys > query - window))
