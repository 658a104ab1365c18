"""Model runtime for Llama-family decoders (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

Our own forward over a :class:`~specserve.engine.kv_cache.SlotKVCache`: one call takes a
*ragged* batch — every row its own slot, its own start position (the slot's current length)
and its own number of new tokens — and returns logits only for the positions the caller asks
for (the last ``num_logits`` new tokens of each row: 1 for plain decoding and prefill, K + 1
for a verify). Weights come from a ``transformers`` model of the same architecture, and the
logits match its forward (fp32, max abs diff ≤ 1e-4; ``tests/engine/test_model.py``).

Row invariance: the logits after a token are bit-identical whether it was decoded alone,
verified among other drafted tokens, or decoded in a batch beside other sequences, so greedy
speculative decoding gives exactly the target's own output. The linears and attention come
from :mod:`specserve.engine.kernels`, which is built for that (``tests/engine/test_kernels.py``
checks it kernel by kernel and for the whole forward). Training (``forward_full``) does not
need it and uses torch's own attention.

Layout choices, for speed on the hot path:
- q/k/v are one fused linear (``qkv``) and gate/up another (``gate_up``): two matmuls fewer
  per layer. Tensor parallelism (``specserve.engine.tp``) shards them by head / by column.
- cos/sin for every position up to the cache length are computed once, with the
  architecture's own ``transformers`` rotary embedding so every RoPE variant it knows
  (default, linear, llama3, yarn, ...) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine import block_attention, native
from specserve.engine.block_attention import KeyBlocks
from specserve.engine.compiled import StaticForward, StaticInputs, bucket, warm_up
from specserve.engine.kernels import KV_BLOCK, Linear, attention, hidden_keys, native_ready
from specserve.engine.kv_cache import PagedKVCache, SlotKVCache
from specserve.engine.tree_acceptance import validate_tree
from specserve.errors import ConfigError, InvalidRequestError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArch:
    """The numbers of a Llama-family architecture, read from a ``transformers`` config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before RoPE

    @classmethod
    def from_hf_config(cls, config) -> ModelArch:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
            raise ConfigError("dynamic NTK RoPE depends on the sequence length and is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias covers all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_windows=_sliding_windows(config),
            qk_norm=model_type == "qwen3",
        )


def _sliding_windows(config) -> tuple[int | None, ...]:
    """Per-layer sliding window, following how each ``transformers`` model decides it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return (window,) * n
    if config.model_type in ("qwen2", "qwen3"):
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as ``transformers`` does, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x``: ``[B, T, H, D]``; ``cos``/``sin``: ``[B, T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Self-attention over the slot cache. Head counts are *local* (per TP rank)."""

    def __init__(self, arch: ModelArch, layer_idx: int, in_features: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        # in_features: an EAGLE-3 head's first layer projects [token embedding, feature] (2H)
        self.qkv = Linear(in_features or arch.hidden_size, qkv_out, bias=arch.qkv_bias)
        self.o = Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.o_bias)
        self.sliding_window = arch.sliding_windows[layer_idx]
        self.all_reduce = None  # set by tensor parallelism: the row-parallel ``o`` needs it
        self.invariant = True   # row-invariant attention (kernels.attention); False: library
        self.attention = "sdpa"  # the library's attention: "sdpa" or "flex" (block_attention)
        # Qwen3: each q and k head RMS-normalised (weights over D, shared by the heads) before
        # RoPE; replicated, not sharded, under tensor parallelism.
        self.eps = arch.rms_norm_eps
        if arch.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(arch.head_dim))
            self.k_norm = nn.Parameter(torch.ones(arch.head_dim))
        else:
            self.q_norm = self.k_norm = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, T, H, D]``, k and v ``[B, T, Hk, D]``, RoPE applied. RoPE runs in the layout
        the projection produced (broadcasting over a transposed view is several times slower
        on CPU)."""
        bsz, t, _ = x.shape
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([h * d, hk * d, hk * d], dim=-1)
        q, k = q.view(bsz, t, h, d), k.view(bsz, t, hk, d)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(bsz, t, hk, d)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | StaticInputs,
                cache: SlotKVCache) -> torch.Tensor:
        window = self.sliding_window is not None
        if isinstance(ctx, StaticInputs):
            attend = self._attend_static
        elif isinstance(ctx, PackedContext):
            attend = self._attend_packed
        else:
            attend = self._attend_native if self.invariant and native_ready(x) else self._attend
        out = self.o(attend(x, ctx, cache, window))
        return self.all_reduce(out) if self.all_reduce is not None else out

    def _attend_packed(self, x: torch.Tensor, ctx: PackedContext, cache: SlotKVCache,
                       window: bool) -> torch.Tensor:
        """``[1, N, H * D]``: each group's attention in its own ``[B, T]`` layout over its span
        of the packed tokens ``x`` (``[1, N, hidden]``); on the C kernels one projection for
        every group's tokens (:meth:`LlamaRuntime.forward`, ``groups``)."""
        native_path = self.invariant and native_ready(x)
        qkv = self.qkv(x)[0] if native_path else None  # [N, (H + 2 Hk) D]
        outs = []
        for group, (a, b) in zip(ctx.groups, ctx.spans):
            shape = group.valid.shape  # (B, T) of the group
            if native_path:
                outs.append(self._native(qkv[a:b].view(*shape, -1), group, cache, window))
            else:
                outs.append(self._attend(x[0, a:b].view(*shape, -1), group, cache, window))
        return torch.cat([out.reshape(-1, out.shape[-1]) for out in outs])[None]

    def _attend(self, x: torch.Tensor, ctx: ForwardContext, cache: SlotKVCache,
                window: bool) -> torch.Tensor:
        """``[B, T, H * D]`` attention outputs, in torch ops (the fallback and ``library``)."""
        q, k, v = self._qkv(x, ctx.cos, ctx.sin)
        # Only real (non-padding) tokens are written: [N, Hk, D] at (slot, position).
        cache.write(self.layer_idx, ctx.write_slots, ctx.write_positions, k[ctx.valid], v[ctx.valid])
        if self.invariant:
            keys, values = cache.gather(self.layer_idx, ctx.slots, ctx.kv_len)  # [B, Hk, S, D]
            hidden = ctx.hidden_keys(self.num_heads // self.num_kv_heads, window)
            return attention(q, keys, values, hidden, self.head_dim ** -0.5)
        if self.attention == "flex":  # each row's own keys, read in place
            return block_attention.attend(q, cache.k[self.layer_idx], cache.v[self.layer_idx],
                                          ctx.key_blocks(cache, window), self.head_dim ** -0.5)
        # library: the runtime before issue 17, exactly (keys up to the longest row, no mask
        # where every key is visible, as for a lone decode row)
        keys, values = cache.gather(self.layer_idx, ctx.slots, ctx.kv_used)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=ctx.library_mask(window),
            enable_gqa=self.num_kv_heads != self.num_heads)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(*q.shape[:2], -1)

    def _attend_native(self, x: torch.Tensor, ctx: ForwardContext, cache: SlotKVCache,
                       window: bool) -> torch.Tensor:
        """The same on the C kernels: RoPE and the cache write in one call on the fused
        projection, attention reading the q heads in place and the cache storage directly."""
        return self._native(self.qkv(x), ctx, cache, window)

    def _native(self, qkv: torch.Tensor, ctx: ForwardContext, cache: SlotKVCache,
                window: bool) -> torch.Tensor:
        """:meth:`_attend_native` after the projection: ``qkv`` ``[B, T, (H + 2 Hk) D]``."""
        bsz, t, _ = qkv.shape
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        keys, values = cache.k[self.layer_idx], cache.v[self.layer_idx]
        if self.q_norm is not None:  # in place, head by head (each a row of D)
            heads = qkv.view(-1, h + 2 * hk, d)
            heads[:, :h] = native.rms_norm(heads[:, :h], self.q_norm, self.eps)
            heads[:, h:h + hk] = native.rms_norm(heads[:, h:h + hk], self.k_norm, self.eps)
        native.rope_and_store(qkv, ctx.cos, ctx.sin, h, hk, keys, values, ctx.table,
                              ctx.row_starts, ctx.row_lens)
        q = qkv.view(bsz, t, h + 2 * hk, d)[:, :, :h]
        return native.attention(q, keys, values, ctx.table, ctx.key_start(window),
                                ctx.key_end, d ** -0.5, ctx.tree, ctx.tree_starts)

    def _attend_static(self, x: torch.Tensor, ctx: StaticInputs, cache: SlotKVCache,
                       window: bool) -> torch.Tensor:
        """The same at static shapes (:mod:`specserve.engine.compiled`): every token's key
        and value written in place (padding to the spare slot), then attention reading each
        row's own key blocks (``flex``), or each row's whole slot with a mask (``sdpa``)."""
        q, k, v = self._qkv(x, ctx.cos, ctx.sin)  # [B, T, H, D], [B, T, Hk, D] twice
        keys, values = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [slots, Hk, S, D]
        keys[ctx.write_slots, :, ctx.write_positions] = k
        values[ctx.write_slots, :, ctx.write_positions] = v
        if ctx.keys is not None:
            blocks = ctx.window_keys if window else ctx.keys
            return block_attention.attend(q, keys, values, blocks, self.head_dim ** -0.5)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys[ctx.slots], values[ctx.slots],
            attn_mask=ctx.window_visible if window else ctx.visible,
            enable_gqa=self.num_kv_heads != self.num_heads)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(*q.shape[:2], -1)

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training: whole sequences ``[B, T, hidden]`` from position 0, causal, no cache
        (``cos``/``sin``: ``[1, T, 1, D]``). Right padding is harmless: nothing attends to it."""
        bsz, t, _ = x.shape
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = (y.transpose(1, 2) for y in self._qkv(x, cos, sin))  # [B, heads, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != h)
        return self.o(out.transpose(1, 2).reshape(bsz, t, h * d))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size  # local (per TP rank)
        self.gate_up = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down = Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.all_reduce = None
        self.invariant = True  # the C kernels where they apply (see LlamaRuntime.use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.invariant and native_ready(gate_up):
            out = self.down(native.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out = self.down(F.silu(gate) * up)
        return self.all_reduce(out) if self.all_reduce is not None else out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(arch.hidden_size))  # None: none (EAGLE-1's first layer)
        self.attn = Attention(arch, layer_idx)
        self.post_attn_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.mlp = MLP(arch)
        self.invariant = True  # the C kernels where they apply (see LlamaRuntime.use_kernels)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | StaticInputs,
                cache: SlotKVCache) -> torch.Tensor:
        norm = native.rms_norm if self.invariant and native_ready(x) else rms_norm
        attn_in = x if self.input_norm is None else norm(x, self.input_norm, self.eps)
        x = x + self.attn(attn_in, ctx, cache)
        return x + self.mlp(norm(x, self.post_attn_norm, self.eps))

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training: see :meth:`Attention.forward_full`."""
        attn_in = x if self.input_norm is None else rms_norm(x, self.input_norm, self.eps)
        x = x + self.attn.forward_full(attn_in, cos, sin)
        return x + self.mlp(rms_norm(x, self.post_attn_norm, self.eps))


@dataclass
class ForwardContext:
    """Everything one ragged forward shares across layers (computed once per call)."""

    slots: list[int]
    kv_len: int                    # S: longest (start + num_new) in the batch, in whole KV blocks
    cos: torch.Tensor              # [B, T, 1, D]
    sin: torch.Tensor              # [B, T, 1, D]
    valid: torch.Tensor            # [B, T] bool: real tokens, not padding
    write_slots: torch.Tensor      # [N] slot of each real token
    write_positions: torch.Tensor  # [N] position of each real token
    kv_used: int                   # the longest (start + num_new) in the batch
    positions: torch.Tensor        # [B, T] int64 position of each query (padding included)
    window: int | None             # the sliding window of the layers that have one
    # Token trees (``LlamaRuntime.forward(trees=...)``): [B, T] int64, bit i of query (b, t) set
    # where it sees the i-th token from its row's base (its ancestors and itself), and [B]
    # int32, each tree row's base position (-1: a chain row; ``LlamaRuntime._trees``).
    # None: every row is a chain.
    tree: torch.Tensor | None = None
    tree_starts: torch.Tensor | None = None
    lens: torch.Tensor | None = None  # [B] int64 on the CPU: each row's real new tokens
    table: torch.Tensor | None = None  # [B, W] int32: each row's block table (the C kernels)
    _hidden: dict = field(default_factory=dict)
    _ranges: dict = field(default_factory=dict)

    @property
    def query_last(self) -> torch.Tensor:
        """``[B, T]``: each query's position, a padding query's capped at its row's last real
        token (its output is never read, and a paged row holds blocks for its real tokens
        only: nothing past them may be read)."""
        if "last" not in self._ranges:
            last = self.positions[:, :1] + self.lens[:, None].to(self.positions.device) - 1
            self._ranges["last"] = torch.minimum(self.positions, last)
        return self._ranges["last"]

    @property
    def key_end(self) -> torch.Tensor:
        """``[B, T]`` int32: each query reads keys before ``position + 1``."""
        if "end" not in self._ranges:
            self._ranges["end"] = (self.query_last + 1).to(torch.int32)
        return self._ranges["end"]

    @property
    def row_starts(self) -> torch.Tensor:
        """``[B]`` int32: each row's first new position."""
        if "starts" not in self._ranges:
            self._ranges["starts"] = self.positions[:, 0].to(torch.int32)
        return self._ranges["starts"]

    @property
    def row_lens(self) -> torch.Tensor:
        """``[B]`` int32: each row's number of new (real) tokens."""
        if "lens" not in self._ranges:
            self._ranges["lens"] = self.valid.sum(1, dtype=torch.int32)
        return self._ranges["lens"]

    def library_mask(self, window: bool) -> torch.Tensor | None:
        """``[B, 1, T, kv_used]`` for torch's attention, None where every key is visible."""
        key = ("library", window)
        if key not in self._ranges:
            visible = self.visible(window)[..., :self.kv_used]
            self._ranges[key] = None if visible.all() else visible[:, None]
        return self._ranges[key]

    def visible(self, window: bool) -> torch.Tensor:
        """``[B, T, S]`` bool, True where a query may attend (made on first use: the C kernels
        take key ranges instead, so the default CPU path never builds it).

        A query at position ``p`` sees keys ``0..p`` of its own slot, and with ``window`` the
        last ``self.window`` of them. Padding queries keep the same rule; they always see key
        0, so no softmax row is empty, and their outputs are never read.
        """
        key = ("visible", window)
        if key not in self._ranges:
            keys = torch.arange(self.kv_len)[None, None, :]                  # [1, 1, S]
            visible = keys <= self.positions[:, :, None]                     # [B, T, S]
            if window:
                visible &= keys > self.positions[:, :, None] - self.window
            if self.tree is not None:  # a tree row's query: its prefix, ancestors and itself
                rel = keys - self.tree_starts.long()[:, None, None]          # [B, 1, S]
                bit = (self.tree[:, :, None] >> rel.clamp(0, 63)) & 1        # [B, T, S]
                seen = (rel < 0) | ((rel < 64) & (bit == 1))
                visible = torch.where((self.tree_starts >= 0)[:, None, None], visible & seen, visible)
            self._ranges[key] = visible.to(self.valid.device)
        return self._ranges[key]

    def key_start(self, window: bool) -> torch.Tensor:
        """``[B, T]`` int32: the first key each query reads (0, or the window's start)."""
        key = ("start", window)
        if key not in self._ranges:
            start = torch.zeros_like(self.positions)
            if window:
                start = (self.query_last - self.window + 1).clamp(min=0)
            self._ranges[key] = start.to(torch.int32)
        return self._ranges[key]

    def key_blocks(self, cache: SlotKVCache, window: bool) -> KeyBlocks:
        """The key blocks each row reads in :mod:`~specserve.engine.block_attention` (made
        once per forward and window kind). Rows are padded to a power of two with copies of
        row 0 (their outputs are dropped): a compiled kernel then sees a handful of batch
        sizes, not every one."""
        key = ("blocks", window)
        if key not in self._ranges:
            b = len(self.slots)
            rows = torch.cat([torch.arange(b), torch.zeros(bucket(b) - b, dtype=torch.long)])
            last = self.positions[:, 0] + self.lens - 1                       # [B]
            tree = None if self.tree is None else self.tree[rows]
            starts = None if self.tree_starts is None else self.tree_starts[rows]
            blocks = block_attention.key_blocks(
                self.positions[rows], last[rows], torch.tensor(self.slots)[rows],
                num_kv_heads=cache.k[0].shape[1], slot_len=cache.k[0].shape[2],
                window=self.window if window else None, tree=tree, tree_starts=starts)
            self._ranges[key] = blocks.to(self.valid.device)
        return self._ranges[key]

    def hidden_keys(self, group: int, window: bool) -> torch.Tensor:
        """The attention mask for ``group`` query heads per key/value head (made once)."""
        key = (group, window)
        if key not in self._hidden:
            self._hidden[key] = hidden_keys(self.visible(window), group)
        return self._hidden[key]


@dataclass
class PackedContext:
    """Several row groups in one pass (:meth:`LlamaRuntime.forward`, ``groups``): each
    group's context in its own ``[B, T]`` layout, and its span of the packed tokens."""

    groups: list[ForwardContext]
    spans: list[tuple[int, int]]  # [start, end) of each group's B x T tokens in the pack


class LlamaRuntime(nn.Module):
    """A Llama-family decoder whose forward runs on a :class:`SlotKVCache`."""

    def __init__(self, arch: ModelArch, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # [max_len, D] tables; buffers so .to(device/dtype) carries them.
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    KERNELS = ("invariant", "library", "compiled")
    ATTENTIONS = ("flex", "sdpa")
    kernels = "invariant"                # set by use_kernels
    attention = "sdpa"                   # the library's and compiled path's attention
    verify_tokens: int | None = None     # new tokens per row of a verify (K + 1)
    decode_width: int | None = None      # library on CUDA: decodes and verifies padded to it
    static: StaticForward | None = None  # set by use_kernels("compiled")
    fixed_head = True                    # decodes' and verifies' LM head at one shape (_head_shape)
    # What ``return_hidden`` returns (the features an EAGLE head reads): by default the final
    # hidden state after the last norm; with ``feature_layers`` (a target serving an EAGLE-3
    # head) the residual stream entering each of those layers, concatenated in their order;
    # with ``hidden_prenorm`` (an EAGLE-3 head itself) the final hidden state before the norm.
    feature_layers: tuple[int, ...] | None = None
    hidden_prenorm = False

    def use_kernels(self, kernels: str, *, backend: str | None = "inductor",
                    attention: str | None = None, verify_tokens: int | None = None) -> LlamaRuntime:
        """``invariant``: :mod:`specserve.engine.kernels` (a token's logits do not depend on
        the rest of the forward; the C kernels on CPU). ``library``: ``F.linear`` and torch's
        attention, the runtime before those kernels (kept for GPUs and for side-by-side
        benchmarks). ``compiled``: the library's ops at bucketed static shapes under
        ``torch.compile`` (``backend``), with CUDA graphs on a GPU
        (:mod:`specserve.engine.compiled`); prefill stays on ``library``. Call it after the
        model is on its device; caches made afterwards have the spare slot it needs.

        ``attention`` (``library`` and ``compiled``): ``flex``, FlexAttention reading each
        row's own key blocks (:mod:`specserve.engine.block_attention`), or ``sdpa``, torch's
        ``scaled_dot_product_attention`` with a mask; default ``flex`` where the weights are
        on CUDA, ``sdpa`` elsewhere (on a CPU the C kernels are the fast path, and the
        library's benchmarks keep what they measured). ``verify_tokens``: new tokens per row
        of a verify (the unit's K + 1), the one token shape decodes share on a GPU: the
        compiled path's token bucket, and on CUDA the library's padded width for forwards of
        at most that many tokens per row (``compiled.py``, "One token shape")."""
        if kernels not in self.KERNELS:
            raise ConfigError(f"kernels {kernels!r}: expected one of {', '.join(self.KERNELS)}")
        cuda = self.embed.weight.device.type == "cuda"
        attention = attention or ("flex" if cuda else "sdpa")
        if attention not in self.ATTENTIONS:
            raise ConfigError(f"attention {attention!r}: expected one of {', '.join(self.ATTENTIONS)}")
        if verify_tokens is not None and verify_tokens < 1:
            raise ConfigError(f"verify_tokens must be at least 1, got {verify_tokens}")
        for module in self.modules():
            if isinstance(module, (Linear, Attention, MLP, DecoderLayer)):
                module.invariant = kernels == "invariant"
            if isinstance(module, Attention):
                module.attention = attention
        self.kernels, self.attention, self.verify_tokens = kernels, attention, verify_tokens
        self.decode_width = verify_tokens if kernels == "library" and cuda else None
        self.static = (StaticForward(self, backend=backend, verify_tokens=verify_tokens)
                       if kernels == "compiled" else None)
        return self

    def warm_up(self, cache: SlotKVCache) -> dict:
        """A forward in every shape serving will use, on the cache's free slots (left free,
        at their lengths), so compiles happen now and not inside a step; returns what was
        compiled (:func:`specserve.engine.compiled.warm_up`)."""
        return warm_up(self, cache)

    @property
    def max_positions(self) -> int:
        return self.rope_cos.shape[0]

    def make_paged_cache(self, num_slots: int, max_seq_len: int, *, block_size: int,
                         num_blocks: int, prefix_caching: bool = True) -> PagedKVCache:
        """A paged cache shaped for this model (:class:`PagedKVCache`). The C kernels and the
        library's torch attention read it; the compiled path and FlexAttention do not yet."""
        if self.static is not None or (self.kernels == "library" and self.attention == "flex"):
            raise ConfigError("kv_cache layout 'paged' runs on the invariant and library (sdpa) "
                              "kernels so far, not on 'compiled' or FlexAttention")
        if max_seq_len > self.max_positions:
            raise ConfigError(f"max_seq_len {max_seq_len} exceeds the {self.max_positions} "
                              "positions this runtime was built for")
        attn = self.layers[0].attn
        return PagedKVCache(num_layers=len(self.layers), num_blocks=num_blocks,
                            block_size=block_size, num_slots=num_slots,
                            num_kv_heads=attn.num_kv_heads, max_seq_len=max_seq_len,
                            head_dim=attn.head_dim, dtype=self.embed.weight.dtype,
                            device=self.embed.weight.device, prefix_caching=prefix_caching)

    def make_cache(self, num_slots: int, max_seq_len: int) -> SlotKVCache:
        """A cache shaped for this model (local KV heads under tensor parallelism)."""
        if max_seq_len > self.max_positions:
            raise ConfigError(f"max_seq_len {max_seq_len} exceeds the {self.max_positions} "
                              "positions this runtime was built for")
        attn = self.layers[0].attn
        cache = SlotKVCache(num_layers=len(self.layers), num_slots=num_slots,
                            num_kv_heads=attn.num_kv_heads, max_seq_len=max_seq_len,
                            head_dim=attn.head_dim, dtype=self.embed.weight.dtype,
                            device=self.embed.weight.device, block=KV_BLOCK,
                            spare=self.static is not None)
        if self.static is not None and cache.k[0].is_cuda:
            for tensor in cache.k + cache.v:  # a CUDA graph keeps the addresses it captured
                torch._dynamo.mark_static_address(tensor)
        return cache

    @torch.inference_mode()
    def forward(self, cache: SlotKVCache, slots: list[int], token_ids: list[list[int]],
                num_logits: list[int] | None = None, *,
                features: torch.Tensor | None = None, return_hidden: bool = False,
                trees: list[list[int] | None] | None = None, groups: list[int] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``token_ids[i]`` to slot ``slots[i]`` and return logits.

        Returns ``[sum(num_logits), vocab]``: for each row, in order, the logits after each of
        its last ``num_logits[i]`` new tokens (default 1; 0 for a row whose logits nobody
        reads, a prompt's chunk). Each slot's length advances by its number of new tokens;
        callers roll back what the rejection sampler did not keep.

        ``groups``: the rows as consecutive groups of these sizes (default: one group). A
        forward pads its rows to the longest, so a prompt's chunk of 256 tokens beside decode
        rows of 5 would make each of them 256 wide; in groups, each is padded to its own
        group's longest row. On the ``invariant`` kernels the groups share one pass through
        the layers (every linear over all groups' tokens at once, attention group by group:
        :class:`PackedContext`), and a token's bits are those of its group run alone (the
        kernels are row-invariant). The other kernels run each group as a forward of its own,
        at the shapes it has alone: their bits depend on the shape.

        ``return_hidden``: also return the final hidden state (after the last norm, what the
        LM head reads) of *every* new token, ``[sum(len(ids)), hidden]`` in row order: the
        features an EAGLE draft head reads. ``features``: per-token inputs of that shape for
        a model that takes them (:class:`~specserve.engine.draft_head.DraftHead`).

        ``trees``: per row, None (a chain: each new token follows the one before) or a token
        tree over its new tokens: ``trees[i][j]`` is the index of new token j's parent among
        them (``[-1, 0, 0, 1]``: token 0 follows the cache, 1 and 2 both follow 0, 3 follows
        1). A node sits at the position of its depth and attends to the cache and its
        ancestors only, so its logits are those of its root-to-node path as a chain (bit for
        bit on the C kernels). The new tokens are stored in the slot in their order; the
        caller keeps the accepted path (:meth:`SlotKVCache.keep`). At most 64 tokens in a
        tree after its base (``_trees``); not with sliding-window layers.

        A tree may grow over several forwards (a draft expanding it a level at a time,
        ``proposers/eagle.py``): ``trees[i]`` longer than ``token_ids[i]`` covers the row's
        last ``len(trees[i])`` tokens *after* this forward, the first of them stored by earlier
        forwards of the same tree (their parents as they were given then), so a new token's
        parent may be a token already in the cache.
        """
        num_logits = num_logits or [1] * len(slots)
        assert len(slots) == len(token_ids) == len(num_logits) and slots
        if groups is not None and len(groups) > 1:
            if sum(groups) != len(slots) or min(groups) < 1:
                raise ValueError(f"groups {groups} do not split {len(slots)} rows")
            return self._forward_groups(cache, slots, token_ids, num_logits, features,
                                        return_hidden, trees, groups)
        ctx, tokens = self._prepare(cache, slots, token_ids, trees)
        x = self._inputs(tokens, ctx, features)  # [B, T, hidden]
        captured: list[torch.Tensor] = []  # feature_layers' inputs
        capture = return_hidden and self.feature_layers is not None
        if (self.static is not None and ctx.tree is None and self.static.takes(x.shape[1])
                and not capture):
            x = self.static(x, ctx, cache)
        else:
            x, captured = self._layers(x, ctx, cache, capture)
        for slot, ids in zip(slots, token_ids):
            cache.lengths[slot] += len(ids)
        rows, cols = _logit_positions(token_ids, num_logits, x.device)
        head = self._head_shape(ctx, cache.num_slots, *x.shape[:2])
        if head is not None:
            out = self._padded_head(x, head, rows, cols, ctx.valid, return_hidden)
            return (out[0], self._features(x, captured)[ctx.valid]) if self._own_features(
                return_hidden) else out
        if not return_hidden:
            return self.logits(self.final_norm(x[rows, cols]))
        if self._own_features(return_hidden):
            return (self.logits(self.final_norm(x[rows, cols])),
                    self._features(x, captured)[ctx.valid])
        hidden = self.final_norm(x[ctx.valid])  # [sum(len), hidden]
        index = torch.zeros_like(ctx.valid, dtype=torch.long)
        index[ctx.valid] = torch.arange(hidden.shape[0], device=x.device)
        return self.logits(hidden[index[rows, cols]]), hidden

    def _forward_groups(self, cache: SlotKVCache, slots: list[int], token_ids: list[list[int]],
                        num_logits: list[int], features: torch.Tensor | None, return_hidden: bool,
                        trees: list[list[int] | None] | None, groups: list[int]
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` of rows in ``groups`` (its docstring): outputs in row order."""
        spans = list(pairwise(accumulate(groups, initial=0)))  # each group's rows
        feats: list[torch.Tensor | None] = [None] * len(spans)
        if features is not None:
            feats = list(features.split([sum(map(len, token_ids[a:b])) for a, b in spans]))
        part = (lambda a, b: None) if trees is None else (lambda a, b: trees[a:b])
        if self.kernels != "invariant":
            outs = [self.forward(cache, slots[a:b], token_ids[a:b], num_logits[a:b], features=f,
                                 return_hidden=return_hidden, trees=part(a, b))
                    for (a, b), f in zip(spans, feats)]
            if not return_hidden:
                return torch.cat(outs)
            return torch.cat([out[0] for out in outs]), torch.cat([out[1] for out in outs])
        prepared = [self._prepare(cache, slots[a:b], token_ids[a:b], part(a, b)) for a, b in spans]
        x = torch.cat([self._inputs(tokens, ctx, f).flatten(0, 1)
                       for (ctx, tokens), f in zip(prepared, feats)])[None]  # [1, N, hidden]
        packed = PackedContext([ctx for ctx, _ in prepared],
                               list(pairwise(accumulate((ctx.valid.numel() for ctx, _ in prepared),
                                                        initial=0))))
        x, captured = self._layers(x, packed, cache, return_hidden and self.feature_layers is not None)
        for slot, ids in zip(slots, token_ids):
            cache.lengths[slot] += len(ids)
        where = []  # each row's new tokens in the pack, rows in order
        for (a, b), ctx, (first, _) in zip(spans, packed.groups, packed.spans):
            t = ctx.valid.shape[1]
            where += [range(first + j * t, first + j * t + len(ids))
                      for j, ids in enumerate(token_ids[a:b])]
        asked = [i for r, n in zip(where, num_logits) for i in r[len(r) - n:]]
        if not return_hidden:
            return self.logits(self.final_norm(x[0, asked]))
        if self._own_features(return_hidden):
            return (self.logits(self.final_norm(x[0, asked])),
                    self._features(x, captured)[0, [i for r in where for i in r]])
        hidden = self.final_norm(x[0, [i for r in where for i in r]])
        ends = list(accumulate(map(len, where)))
        rows = [i for end, n in zip(ends, num_logits) for i in range(end - n, end)]
        return self.logits(hidden[rows]), hidden

    def _layers(self, x: torch.Tensor, ctx, cache: SlotKVCache,
                capture: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer over ``x``; with ``capture``, also the inputs of ``feature_layers``."""
        captured = []
        for i, layer in enumerate(self.layers):
            if capture and i in self.feature_layers:
                captured.append(x)
            x = layer(x, ctx, cache)
        return x, captured

    def _own_features(self, return_hidden: bool) -> bool:
        """The hidden states asked for are not the final normed ones (``feature_layers``,
        ``hidden_prenorm``)."""
        return return_hidden and (self.feature_layers is not None or self.hidden_prenorm)

    def _features(self, x: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """Per position, what ``return_hidden`` returns when :meth:`_own_features`. A layer
        index equal to the number of layers in ``feature_layers`` stands for the final hidden
        state after the norm (what the LM head reads: ``train-draft``'s soft labels)."""
        if self.feature_layers is None:
            return x
        if len(self.layers) in self.feature_layers:
            captured = [*captured, self.final_norm(x)]
        return torch.cat(captured, dim=-1)

    def _inputs(self, tokens: torch.Tensor, ctx: ForwardContext,
                features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input: token embeddings (a draft head adds its features)."""
        assert features is None, "this model takes no features"
        return self.embed(tokens)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm between the last layer and the LM head (a published EAGLE-1 head has none)."""
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits of final hidden states ``[N, hidden]``."""
        return self.lm_head(hidden).float()

    def _head_shape(self, ctx: ForwardContext, num_slots: int, b: int, t: int) -> tuple[int, int] | None:
        """The ``(rows, tokens)`` a decode's or verify's final norm and LM head run at where
        the kernels are not row-invariant (``library`` on CUDA, ``compiled``): the shape its
        layers ran at (the compiled bucket; the library's padded width), so a token's logits
        do not depend on how many others asked for theirs. A decode asks one per row and a
        verify K + 1, and cuBLAS picks the LM head's kernel by that count (the last shape a
        decode and a verify did not share; docs/BENCHMARKS.md, "Second window").
        None (the asked positions only): the ``invariant`` kernels, prefills, trees, and a
        draft head (:attr:`fixed_head`)."""
        if not self.fixed_head or ctx.tree is not None:
            return None
        if self.static is not None and self.static.takes(t):
            return self.static.bucket_of(b, t, num_slots)
        if self.decode_width is not None and t == self.decode_width:
            return b, t
        return None

    def _padded_head(self, x: torch.Tensor, shape: tuple[int, int], rows: torch.Tensor,
                     cols: torch.Tensor, valid: torch.Tensor, return_hidden: bool):
        """:meth:`forward`'s outputs with the final norm and LM head run over every position of
        ``shape`` (:meth:`_head_shape`; padding is zeros, whose rows nothing reads)."""
        b, t, size = x.shape
        padded = x.new_zeros(*shape, size)                                    # [R, W, hidden]
        padded[:b, :t] = x
        normed = self.final_norm(padded)
        logits = self.lm_head(normed.flatten(0, 1))[rows * shape[1] + cols].float()
        if not return_hidden:
            return logits
        return logits, normed[:b, :t][valid]

    def _prepare(self, cache: SlotKVCache, slots: list[int], token_ids: list[list[int]],
                 trees: list[list[int] | None] | None = None) -> tuple[ForwardContext, torch.Tensor]:
        device = self.embed.weight.device
        starts = [cache.lengths[s] for s in slots]
        lens = [len(ids) for ids in token_ids]
        if min(lens) < 1:
            raise InvalidRequestError("every row of a forward needs at least one new token")
        kv_len = max(s + n for s, n in zip(starts, lens))
        if kv_len > cache.max_seq_len:
            raise InvalidRequestError(f"sequence of {kv_len} tokens exceeds the context length "
                                      f"of {cache.max_seq_len}")
        cache.reserve(slots, [s + n for s, n in zip(starts, lens)])  # a paged cache's blocks
        kv_used, kv_len = kv_len, -(-kv_len // KV_BLOCK) * KV_BLOCK  # kernels read whole blocks
        t = max(lens)
        if self.decode_width is not None and t <= self.decode_width:
            t = self.decode_width  # a decode's GEMMs take a verify's shape (use_kernels)
        tokens = torch.zeros(len(slots), t, dtype=torch.long)
        for i, ids in enumerate(token_ids):
            tokens[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        start_t = torch.tensor(starts)
        steps = torch.arange(t)
        positions = start_t[:, None] + steps[None, :]                   # [B, T]
        valid = steps[None, :] < torch.tensor(lens)[:, None]              # [B, T]
        rope_positions, tree, tree_starts = positions, None, None
        if trees is not None and any(parents is not None for parents in trees):
            rope_positions, tree, tree_starts = self._trees(trees, starts, lens, t)
        table_pos = rope_positions.clamp(max=self.max_positions - 1).to(device)
        cos = self.rope_cos[table_pos].unsqueeze(2)                      # [B, T, 1, D]
        sin = self.rope_sin[table_pos].unsqueeze(2)
        slot_t = torch.tensor(slots)[:, None].expand(-1, t)
        ctx = ForwardContext(
            slots=slots, kv_len=kv_len, cos=cos, sin=sin, valid=valid.to(device),
            write_slots=slot_t[valid].to(device), write_positions=positions[valid].to(device),
            kv_used=kv_used, positions=positions, window=self._window(), tree=tree,
            tree_starts=tree_starts, lens=torch.tensor(lens), table=cache.block_table(slots))
        return ctx, tokens.to(device)

    def _trees(self, trees: list[list[int] | None], starts: list[int], lens: list[int],
               t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE positions ``[B, T]`` (a node's: its row start + its depth), the visibility
        bitmasks ``[B, T]`` and the tree rows' bases ``[B]`` (-1: chain) of a forward.

        A row's tokens up to its *base* form a chain that every later token descends from
        (the base: the lowest parent of a token that does not follow the token before it;
        a verify's base is the row's last token, a prompt's tail before it): the kernels
        read keys before the base as a chain's, and bit i of a query's mask stands for the
        base's i-th token after it, so a tree of up to 63 drafts fits whatever came before."""
        if self._window() is not None:
            raise InvalidRequestError("token trees are not supported with sliding-window attention")
        depth = torch.arange(t).repeat(len(starts), 1)          # [B, T]: chains (and padding)
        masks = torch.zeros(len(starts), t, dtype=torch.int64)
        bases = torch.full((len(starts),), -1, dtype=torch.int32)
        for b, parents in enumerate(trees):
            if parents is None:
                continue
            past = len(parents) - lens[b]  # the tree's tokens stored by earlier forwards
            if not 0 <= past <= starts[b]:
                raise InvalidRequestError(f"a tree needs one parent per new token and at most one "
                                          f"per cached token (row {b}: {len(parents)} parents, "
                                          f"{lens[b]} new tokens, {starts[b]} cached)")
            try:  # the drafts after token 0, numbered as tree_acceptance numbers them
                if not parents or parents[0] != -1:
                    raise ValueError("token 0's parent must be -1 (it follows the cache)")
                validate_tree([p - 1 for p in parents[1:]])
            except ValueError as exc:
                raise InvalidRequestError(f"row {b}: malformed token tree ({exc})") from None
            branching = [p for j, p in enumerate(parents) if j and p != j - 1]
            if not branching:
                continue  # a chain after all
            base = min(branching)
            if len(parents) - base > 64:
                raise InvalidRequestError(f"row {b}: a tree of {len(parents) - base} tokens after "
                                          "its base; at most 64")
            # Depth and mask of every token of the tree, cached ones included (index j is
            # stored at starts[b] - past + j); the new tokens take theirs.
            tree_depth, tree_mask = list(range(base + 1)), [0] * base + [1]
            for j in range(base + 1, len(parents)):
                tree_depth.append(tree_depth[parents[j]] + 1)
                tree_mask.append(tree_mask[parents[j]] | _bit(j - base))
            for j in range(lens[b]):
                depth[b, j] = tree_depth[past + j] - past
                masks[b, j] = tree_mask[past + j]
            for j in range(lens[b], t):  # padding: sees the row's tokens; never read
                depth[b, j] = j
                bit = past + j - base
                masks[b, j] = masks[b, j - 1] | _bit(bit) if bit < 64 else masks[b, j - 1]
            bases[b] = starts[b] - past + base
        return torch.tensor(starts)[:, None] + depth, masks, bases

    def _window(self) -> int | None:
        """The sliding window of the layers that have one (one size per model), or None."""
        windows = {w for w in self.arch.sliding_windows if w is not None}
        assert len(windows) <= 1, "one sliding window size per model"
        return next(iter(windows), None)


def _bit(j: int) -> int:
    """Bit j of an int64 (bit 63 is the sign)."""
    return 1 << j if j < 63 else -(1 << 63)


def _logit_positions(token_ids: list[list[int]], num_logits: list[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) indices of the last ``num_logits[i]`` new tokens of each row."""
    rows, cols = [], []
    for i, (ids, n) in enumerate(zip(token_ids, num_logits)):
        if not 0 <= n <= len(ids):
            raise ValueError(f"row {i}: asked for {n} logits of {len(ids)} new tokens")
        rows += [i] * n
        cols += range(len(ids) - n, len(ids))
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(cols, dtype=torch.long, device=device))


def default_kernels(device: torch.device) -> str:
    """``kernels: auto``: the C kernels (``invariant``) on a CPU; on CUDA, where they cannot
    run, the library's (``library``, attention on FlexAttention)."""
    return "library" if torch.device(device).type == "cuda" else "invariant"


def rope_tables(hf_config, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_len, head_dim]`` from the architecture's own rotary embedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(max_len)[None]  # [1, max_len]
    dummy = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(dummy, positions)  # [1, max_len, D] each
    return cos[0], sin[0]


def build_runtime(hf_config, state_dict: dict[str, torch.Tensor], *, max_len: int | None = None,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaRuntime:
    """Our runtime holding the weights of a ``transformers`` ``*ForCausalLM`` state dict."""
    arch = ModelArch.from_hf_config(hf_config)
    max_len = min(max_len or arch.max_position_embeddings, arch.max_position_embeddings)
    cos, sin = rope_tables(hf_config, max_len)
    with torch.device("meta"):
        model = LlamaRuntime(arch, torch.empty_like(cos), torch.empty_like(sin))
    model.load_state_dict(_convert_state_dict(state_dict, arch), assign=True, strict=True)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.rope_cos, model.rope_sin = cos, sin
    return model.to(device=device, dtype=dtype).eval()


def _convert_state_dict(sd: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Map ``transformers`` parameter names onto ours, fusing q/k/v and gate/up."""
    out = {ours: torch.cat([sd[name] for name in names]) if len(names) > 1 else sd[names[0]]
           for ours, names in checkpoint_names(arch).items()}
    if arch.tie_word_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return {k: v.detach() for k, v in out.items()}


def checkpoint_names(arch: ModelArch) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the ``transformers`` tensors it is made of, concatenated on dim 0
    in this order: the one mapping that :func:`_convert_state_dict` and the sharded loader
    (``shard_loader.py``) both read. A tied LM head is absent: it is the embedding."""
    names = {"embed.weight": ("model.embed_tokens.weight",), "norm": ("model.norm.weight",)}
    if not arch.tie_word_embeddings:
        names["lm_head.weight"] = ("lm_head.weight",)
    for i in range(arch.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        att, mlp = hf + "self_attn.", hf + "mlp."
        names[ours + "input_norm"] = (hf + "input_layernorm.weight",)
        names[ours + "post_attn_norm"] = (hf + "post_attention_layernorm.weight",)
        for kind in _kinds(arch.qkv_bias):
            names[ours + f"attn.qkv.{kind}"] = tuple(att + f"{p}_proj.{kind}" for p in "qkv")
        if arch.qk_norm:
            names[ours + "attn.q_norm"] = (att + "q_norm.weight",)
            names[ours + "attn.k_norm"] = (att + "k_norm.weight",)
        for kind in _kinds(arch.o_bias):
            names[ours + f"attn.o.{kind}"] = (att + f"o_proj.{kind}",)
        for kind in _kinds(arch.mlp_bias):
            names[ours + f"mlp.gate_up.{kind}"] = (mlp + f"gate_proj.{kind}", mlp + f"up_proj.{kind}")
            names[ours + f"mlp.down.{kind}"] = (mlp + f"down_proj.{kind}",)
    return names


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)
