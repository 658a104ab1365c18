"""Kernels whose result for one token does not depend on what else is in the call.

Speculative decoding promises the target's own output. A verify runs K + 1 tokens through
the target in one forward where plain decoding runs one; a batch puts other sequences'
tokens beside them. Floating-point sums round differently when a library picks a different
kernel or blocking for a different number of rows, and greedy decoding turns one flipped
near-tie into a different answer. Measured on this project's CPUs (float32, torch 2.13):
``F.linear`` (MKL) gives other bits for 1, 2-3 and >= 4 rows (AVX2 and AVX512 alike) and
``scaled_dot_product_attention`` gives other bits for a query inside a masked call than for
the same query alone. So the runtime uses these instead:

- :class:`Linear`, and the layer's attention, norms, RoPE and SiLU in ``layers.py``: the C
  kernels of ``kernels.c`` (:mod:`specserve.engine.runtime.native`), built for the machine at first
  use. Each output is one fixed sequence of operations over its own inputs, so invariance
  holds by construction; a decode streams the weights at close to memory bandwidth (about
  MKL's speed at one row, much faster at 4-8) and attention reads a query's visible keys
  straight from the cache.
- Where no C compiler is found, the fallbacks, row-invariant too and slower: linears through
  oneDNN with the weight reordered once into its blocked layout (what inductor's CPU
  freezing emits: ``_reorder_linear_weight``, ``_linear_pointwise``; every row goes through
  the same microkernel whatever the row count), and :func:`attention`: every query's
  arithmetic has the same shapes however many queries and rows share the call. Keys are
  read in blocks of ``KV_BLOCK`` positions; the score product reduces over the head
  dimension only; softmax's maximum is exact in any order; each block's sums have a fixed
  length (masked positions are exact zeros), and blocks are added in position order by a
  prefix sum, so the blocks past a query's own (padding, or keys of later queries) add exact
  zeros at the end.

In the fallback's torch ops, elementwise ops are exact per element, with one caveat: torch
computes the tail of a contiguous run that does not fill two vector registers with the scalar
function, and for some ops (``silu``) scalar and vector results differ in the last bit
(measured). The runs here are whole tokens' rows (hidden, intermediate, heads x head size,
key blocks), multiples of 32 floats in every supported model, so no token's elements fall in
a tail.
``tests/engine/runtime/test_kernels.py`` checks each kernel directly, on whatever CPU runs the suite.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specserve.engine.runtime import native

KV_BLOCK = 64  # positions per key/value block; the cache is allocated in whole blocks
# Row counts below which a library switches kernels (measured, torch 2.13): oneDNN's packed
# linear gives other bits at 1 row for long inputs (K >= 1536 on AVX512); MKL's matmul at
# 1 and 2 rows on AVX512 and 1 and 2-3 on AVX2. Fewer rows are padded up to these.
LINEAR_MIN_ROWS = 2
MATMUL_MIN_ROWS = 4


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the same indices (a row's first maximum; a NaN counts as the
    maximum, its first), on the host through numpy, whose reduction is vectorized: torch's CPU
    argmax over a vocabulary's width costs more than the rest of a decode's verdict
    (docs/BENCHMARKS.md). Elsewhere (a GPU, a dtype numpy lacks) torch's own."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x.argmax(dim=-1)
    return torch.as_tensor(np.argmax(x.numpy(), axis=-1))


def cpu_float32(weight: torch.Tensor) -> bool:
    """Where the row-invariant linears apply: float32 on a CPU (bfloat16 and GPUs are left
    to ``F.linear``; see README, "Precision")."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def native_ready(t: torch.Tensor) -> bool:
    """The C kernels take ``t``: float32 on a CPU, and they were built here."""
    return cpu_float32(t) and native.library() is not None


class RefsWatched(nn.Module):
    """A module whose tensors the C kernels may hold by address (:class:`native.LayerRef`):
    ``epoch`` moves on whatever may move them, so that a holder of refs made at one epoch
    reuses them, unchecked, until the next. What moves them: assigning a public attribute (a
    weight, a flag, a quantized weight, a submodule) and ``Module._apply`` (``.to``,
    ``.float``...), which assigns ``param.data``. ``load_state_dict`` copies in place and
    moves nothing; an underscore name is a cache of the module's own and moves nothing."""

    epoch = 0  # one count for every RefsWatched module: a change anywhere invalidates all refs

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_"):
            RefsWatched.epoch += 1

    def _apply(self, fn, recurse: bool = True):
        try:
            return super()._apply(fn, recurse)
        finally:
            RefsWatched.epoch += 1


class HeldAsBlocks:
    """A module whose ``weight`` may be held as a GGUF's blocks: ``weight`` is then empty,
    and the C kernels read the blocks, a fifth of the bytes for the same outputs."""

    quantized: native.QuantizedWeight | None = None
    weight: nn.Parameter

    def quantize(self, blocks: native.QuantizedWeight) -> None:
        """Hold the weight as ``blocks`` and drop its float32 copy, after checking that they
        are that weight bit for bit (:func:`native.dequantize_blocks`). Raises ValueError
        where they are not (a wrong row order, another file)."""
        if not torch.equal(native.dequantize_blocks(blocks), self.weight):
            raise ValueError(f"the {blocks.kind} blocks are not this {type(self).__name__}'s weight")
        self.quantized = blocks
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # shapes fail loudly

    def float_weight(self) -> torch.Tensor:
        """The weight in float32 whether or not it is held as blocks (a copy if it is): for
        readers of its values (a draft head made on this model's LM head or embedding)."""
        return self.weight if self.quantized is None else native.dequantize_blocks(self.quantized)


class Linear(HeldAsBlocks, RefsWatched, nn.Linear):
    """An ``nn.Linear`` whose inference forward is row-invariant on a CPU in float32: the C
    kernel where it is built, else oneDNN with a copy of the weight in its blocked layout
    (made on first use, made again if the weight changes; the model then holds those
    weights twice). What autograd must see through (a weight or an input that wants a
    gradient) uses ``F.linear``, and so do other devices and dtypes."""

    invariant = True  # False: plain ``F.linear`` (the "library" kernels, see LlamaRuntime)

    def dequantize(self) -> None:
        """The float32 weight back from the blocks (what every path but the C kernels reads)."""
        if self.quantized is not None:
            self.weight = nn.Parameter(native.dequantize_blocks(self.quantized), requires_grad=False)
            self.quantized = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            if self.invariant and native_ready(x):
                return native.linear_quantized(x, self.quantized, self.bias)
            self.dequantize()  # another path (no C build, library kernels): the float weight
        wants_grad = torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)
        if (wants_grad or not self.invariant or not cpu_float32(self.weight)
                or x.dtype != torch.float32):
            return super().forward(x)
        if native.library() is not None and self.weight.is_contiguous():
            return native.linear(x, self.weight, self.bias)
        if not torch.backends.mkldnn.is_available():
            return super().forward(x)
        flat = _at_least(x.reshape(-1, self.in_features), LINEAR_MIN_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed(), self.bias, "none", [], "")
        return out[:x.numel() // self.in_features].view(*x.shape[:-1], self.out_features)

    def _packed(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.shape, weight.dtype)
        if getattr(self, "_packed_key", None) != key:
            # No batch-size hint: packed for a hint of 1, oneDNN picks kernels by row count
            # and the rows stop being identical (measured).
            self._packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._packed_key = key
        return self._packed_weight


class Embedding(HeldAsBlocks, nn.Embedding):
    """An ``nn.Embedding`` that may hold its table as a GGUF's blocks (a tied LM head's,
    shared with it): a lookup forms its rows from them, the float32 table's bits."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return super().forward(tokens)
        rows = tokens.reshape(-1)  # the blocks are read by the C kernels, so they are built
        return native.dequantized_rows(self.quantized, rows).view(*tokens.shape, -1)


def hidden_keys(visible: torch.Tensor, group: int) -> torch.Tensor:
    """The mask :func:`attention` takes, from ``visible`` ``[B, T, S]`` (which keys each query
    may read): ``[B, 1, M, S]``, True where query row ``m`` (query ``m // group``; rows past
    ``T * group`` repeat the last query, see :func:`_at_least`) must not look. Computed once
    per forward, shared by the layers."""
    b, t, s = visible.shape
    rows = max(t * group, MATMUL_MIN_ROWS)
    query = (torch.arange(rows, device=visible.device) // group).clamp(max=t - 1)
    return ~visible[:, query].unsqueeze(1)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention that computes each query the same way whatever else is in the call.

    ``q``: ``[B, T, H, D]``; ``keys`` / ``values``: ``[B, Hk, S, D]`` with ``S`` a multiple of
    :data:`KV_BLOCK` (query head ``h`` reads key/value head ``h // (H // Hk)``); ``hidden``:
    :func:`hidden_keys` of the queries' visible keys (at least one per query). Returns
    ``[B, T, H * D]``.

    The query heads that share a key/value head are its rows (``M = T * G`` of them, padded to
    ``MATMUL_MIN_ROWS``); every elementwise op runs on contiguous ``[B, Hk, M, S]`` tensors, so
    each row is whole vector registers (a strided or ragged run would take torch's scalar
    path, slower and, for some ops, other bits).
    """
    b, t, h, d = q.shape
    hk, s = keys.shape[1], keys.shape[2]
    g, nb = h // hk, s // KV_BLOCK
    assert s % KV_BLOCK == 0, "keys come in whole blocks"
    m = t * g
    rows = _at_least(q.view(b, t, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b, hk, m, d),
                     MATMUL_MIN_ROWS, dim=2)                                  # [B, Hk, M', D]
    scores = torch.matmul(rows, keys.transpose(-1, -2)).mul_(scale)          # [B, Hk, M', S]
    scores.masked_fill_(hidden, float("-inf"))
    weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()             # hidden: exactly 0
    blocked = weights.view(b, hk, -1, nb, KV_BLOCK)
    total = blocked.sum(-1).cumsum(-1)[..., -1:]                              # [B, Hk, M', 1]
    blocks = torch.matmul(blocked.transpose(2, 3),                            # [B, Hk, nb, M', D]
                          values.view(b, hk, nb, KV_BLOCK, d))
    out = blocks.cumsum(2)[:, :, -1].div_(total)[:, :, :m]                    # [B, Hk, M, D]
    return out.reshape(b, hk, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, h * d)


def _at_least(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """``x`` with at least ``rows`` entries along ``dim`` (repeats of the last one): the
    library picks another kernel for fewer rows, which rounds differently."""
    n = x.shape[dim]
    if n >= rows:
        return x
    last = x.narrow(dim, n - 1, 1)
    return torch.cat([x, *[last] * (rows - n)], dim=dim)
