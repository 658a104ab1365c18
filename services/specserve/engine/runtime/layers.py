"""The decoder's building blocks: :func:`rms_norm`, :func:`apply_rope`, :class:`Attention`
(over the KV cache: the C kernels, torch's ops, or the compiled path's static shapes),
:class:`MLP` and :class:`DecoderLayer`. Head counts and sizes are *local* (per TP rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.kv.kv_cache import SlotKVCache
from specserve.engine.runtime import block_attention, native
from specserve.engine.runtime.arch import ModelArch
from specserve.engine.runtime.compiled import StaticInputs
from specserve.engine.runtime.forward_context import ForwardContext, PackedContext
from specserve.engine.runtime.kernels import Linear, RefsWatched, attention, native_ready


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as ``transformers`` does, then cast back. On float32 CPU
    tensors, torch's own ``rms_norm``: the same six operations in the same order (torch
    composes it from them there), dispatched once from Python, not six times."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x``: ``[B, T, H, D]``; ``cos``/``sin``: ``[B, T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(RefsWatched):
    """Self-attention over the KV cache (slots or blocks). Head counts are *local* (per TP rank)."""

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
        cache.write(self.layer_idx, ctx.write_slots, ctx.write_positions,
                    k.flatten(0, 1)[ctx.real], v.flatten(0, 1)[ctx.real])
        if self.invariant:
            keys, values = cache.gather(self.layer_idx, ctx.slots, ctx.kv_len)  # [B, Hk, S, D]
            hidden = ctx.hidden_keys(self.num_heads // self.num_kv_heads, window)
            return attention(q, keys, values, hidden, self.head_dim ** -0.5)
        if self.attention == "flex":  # each row's own keys, read in place
            return block_attention.attend(q, cache.k[self.layer_idx], cache.v[self.layer_idx],
                                          ctx.key_blocks(cache, window), self.head_dim ** -0.5)
        # library: torch's own attention, as the runtime had it before the row-invariant
        # kernels (keys up to the longest row, no mask where every key is visible, as for a
        # lone decode row)
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
        """The same at static shapes (:mod:`specserve.engine.runtime.compiled`): every token's key
        and value written in place (padding to the spare slot), then attention reading each
        row's own key blocks (``flex``), or each row's whole slot with a mask (``sdpa``)."""
        q, k, v = self._qkv(x, ctx.cos, ctx.sin)  # [B, T, H, D], [B, T, Hk, D] twice
        keys, values = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [slots, Hk, S, D]
        keys[ctx.write_slots, :, ctx.write_positions] = k
        values[ctx.write_slots, :, ctx.write_positions] = v
        if ctx.keys is not None:
            blocks = ctx.window_keys if window else ctx.keys
            return block_attention.attend(q, keys, values, blocks, self.head_dim ** -0.5)
        if ctx.blocks is not None:  # paged: each row's blocks in table order, as one slot
            b, w = ctx.blocks.shape
            keys, values = (x[ctx.blocks].transpose(1, 2).reshape(b, x.shape[1], -1, x.shape[3])
                            for x in (keys, values))
        else:
            keys, values = keys[ctx.slots], values[ctx.slots]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values,
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


class MLP(RefsWatched):
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


class DecoderLayer(RefsWatched):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(arch.hidden_size))  # None: none (EAGLE-1's first layer)
        self.attn = Attention(arch, layer_idx)
        self.post_attn_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.mlp = MLP(arch)
        self.invariant = True  # the C kernels where they apply (see LlamaRuntime.use_kernels)
        self.one_call = True   # on the C kernels, the layer in one call (False: module by module)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | StaticInputs,
                cache: SlotKVCache) -> torch.Tensor:
        if self.one_call and self.invariant and native_ready(x) and type(ctx) is ForwardContext:
            layer = self._native_layer(cache)
            if layer is not None:  # the same calls as below, from C
                return native.decoder_layer(x.contiguous(), layer, ctx.native_forward(cache, layer))
        norm = native.rms_norm if self.invariant and native_ready(x) else rms_norm
        attn_in = x if self.input_norm is None else norm(x, self.input_norm, self.eps)
        x = x + self.attn(attn_in, ctx, cache)
        return x + self.mlp(norm(x, self.post_attn_norm, self.eps))

    def _native_layer(self, cache: SlotKVCache) -> native.LayerRef | None:
        """What :func:`native.decoder_layer` reads of this layer, where it runs the layer as
        :meth:`forward` would (made again when a weight or the cache storage moves); None
        where it does not: another module's kernels, tensor parallelism, q/k norms, a weight
        autograd must see, or one the C kernels cannot read."""
        attn, mlp = self.attn, self.mlp
        linears = (attn.qkv, attn.o, mlp.gate_up, mlp.down)
        tensors = (cache.k[attn.layer_idx], cache.v[attn.layer_idx], self.input_norm,
                   self.post_attn_norm, *(lin.weight if lin.quantized is None else lin.quantized.data
                                          for lin in linears), *(lin.bias for lin in linears))
        key = tuple(None if x is None else x.data_ptr() for x in tensors)
        if getattr(self, "_native_key", None) != key:
            self._native_key, self._native_ref = key, self._make_native_layer(cache, linears)
        return self._native_ref

    def _make_native_layer(self, cache: SlotKVCache, linears: tuple[Linear, ...]) -> native.LayerRef | None:
        attn, mlp = self.attn, self.mlp
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        if (grad or self.input_norm is None or attn.q_norm is not None or not attn.invariant
                or not mlp.invariant or attn.all_reduce is not None or mlp.all_reduce is not None
                or not all(lin.invariant and (lin.quantized is not None
                                              or native.cpu_float32_contiguous(lin.weight))
                           for lin in linears)):
            return None
        refs = [native.weight_ref(lin.weight if lin.quantized is None else lin.quantized, lin.bias)
                for lin in linears]
        window = attn.sliding_window is not None
        return native.LayerRef(*refs, self.input_norm.data_ptr(), self.post_attn_norm.data_ptr(),
                               cache.k[attn.layer_idx].data_ptr(), cache.v[attn.layer_idx].data_ptr(),
                               attn.num_heads, attn.num_kv_heads, attn.head_dim, self.input_norm.shape[0],
                               mlp.intermediate_size, window, self.eps, attn.head_dim ** -0.5)

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training: see :meth:`Attention.forward_full`."""
        attn_in = x if self.input_norm is None else rms_norm(x, self.input_norm, self.eps)
        x = x + self.attn.forward_full(attn_in, cos, sin)
        return x + self.mlp(rms_norm(x, self.post_attn_norm, self.eps))


class NativeStack:
    """A model's decoder layers in one C call (:func:`native.decoder_layers`) where each would
    run in one (:meth:`DecoderLayer.forward`'s first branch): the same calls in the same order,
    so the same bits, without the Python between them (module calls, each layer's checks and
    output: at batch 1 about 0.5 ms of a 10 ms 4-bit decode).

    The refs are each layer's own (:meth:`DecoderLayer._native_layer`), gathered and checked
    once and reused while nothing they point at can have moved: the same layers, the same
    cache (whose storage never moves), no gradient, and the same :attr:`RefsWatched.epoch`.
    A forward then costs a few comparisons, however many layers there are (gathering them
    took about 60 us a layer, 1.9 ms a token at 30)."""

    def __init__(self) -> None:
        self.enabled = True  # False: layer by layer (tests compare the two)
        # (key, the cache, the refs, their stack or None, the widest ref): the cache and the
        # refs held here, so that neither is freed, nor its address reused, while the stack
        # points at them (a layer run alone with another cache makes itself new refs)
        self._held: tuple | None = None

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, ctx: ForwardContext | StaticInputs,
                 cache: SlotKVCache) -> torch.Tensor | None:
        """The stack's output over ``x``, or None where a layer would not run in one call."""
        if not self.enabled or type(ctx) is not ForwardContext or not native_ready(x):
            return None
        key = (RefsWatched.epoch, id(layers), len(layers), id(cache))
        if torch.is_grad_enabled() or self._held is None or self._held[0] != key:
            self._held = (key, cache, *self._gather(layers, cache))
        _, _, _, stack, widest = self._held
        if stack is None:
            return None
        return native.decoder_layers(x.contiguous(), stack, ctx.native_forward(cache, widest))

    def _gather(self, layers: nn.ModuleList, cache: SlotKVCache) -> tuple:
        """(the refs, their stack, the widest ref), or Nones where a layer would not run in
        one call."""
        refs = []
        for layer in layers:
            if type(layer) is not DecoderLayer or not (layer.one_call and layer.invariant):
                return None, None, None
            ref = layer._native_layer(cache)
            if ref is None:
                return None, None, None
            refs.append(ref)
        if not refs:
            return None, None, None
        widest = max(refs, key=lambda ref: native.layer_scratch(ref, 1))
        return refs, native.layer_stack(refs), widest
