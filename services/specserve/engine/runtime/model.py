"""Model runtime for Llama-family decoders (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

Our own forward over a :class:`~specserve.engine.kv.kv_cache.SlotKVCache`: one call takes a
*ragged* batch — every row its own slot, its own start position (the slot's current length)
and its own number of new tokens — and returns logits only for the positions the caller asks
for (the last ``num_logits`` new tokens of each row: 1 for plain decoding and prefill, K + 1
for a verify). Weights come from a ``transformers`` model of the same architecture, and the
logits match its forward (fp32, max abs diff ≤ 1e-4; ``tests/engine/runtime/test_model.py``).

Row invariance: the logits after a token are bit-identical whether it was decoded alone,
verified among other drafted tokens, or decoded in a batch beside other sequences, so greedy
speculative decoding gives exactly the target's own output. The linears and attention come
from :mod:`specserve.engine.runtime.kernels`, which is built for that
(``tests/engine/runtime/test_kernels.py`` checks it kernel by kernel and for the whole
forward). Training (``forward_full``) does not need it and uses torch's own attention.

Layout choices, for speed on the hot path:
- q/k/v are one fused linear (``qkv``) and gate/up another (``gate_up``): two matmuls fewer
  per layer. Tensor parallelism (``specserve.engine.runtime.tp``) shards them by head / by column.
- cos/sin for every position up to the cache length are computed once, with the
  architecture's own ``transformers`` rotary embedding so every RoPE variant it knows
  (default, linear, llama3, yarn, ...) is exact.

Here: :class:`LlamaRuntime` (the forward, its caches and kernels) and building it from a
checkpoint. Its parts: the architecture's numbers (:mod:`specserve.engine.runtime.arch`), the
layers (:mod:`specserve.engine.runtime.layers`), a forward's shared context
(:mod:`specserve.engine.runtime.forward_context`) and row groups in one pass
(:mod:`specserve.engine.runtime.grouped_forward`).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.engine.kv.kv_cache import PagedKVCache, SlotKVCache
from specserve.engine.runtime.arch import ModelArch
from specserve.engine.runtime.compiled import StaticForward, warm_up
from specserve.engine.runtime.forward_batch import (
    ForwardBatch,
    Forwarded,
    Upload,
    fed_positions,
    logit_positions,
)
from specserve.engine.runtime.forward_context import ForwardContext, chains, prepare
from specserve.engine.runtime.grouped_forward import forward_groups
from specserve.engine.runtime.kernels import KV_BLOCK, Embedding, Linear, argmax
from specserve.engine.runtime.layers import MLP, Attention, DecoderLayer, NativeStack, rms_norm
from specserve.errors import ConfigError


class LlamaRuntime(nn.Module):
    """A Llama-family decoder whose forward runs on a :class:`SlotKVCache`."""

    def __init__(self, arch: ModelArch, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> None:
        super().__init__()
        self.arch = arch
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        tied = arch.tie_word_embeddings  # a tied head is the embedding: never allocated apart
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False, device="meta" if tied else None)
        self.native_stack = NativeStack()  # the layers in one C call where each runs in one
        if tied:
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
    # The hidden states a forward returns (``ForwardBatch.hidden``: the features an EAGLE head
    # reads): by default the final hidden state after the last norm; with ``feature_layers``
    # (a target serving an EAGLE-3 head) the residual stream entering each of those layers,
    # concatenated in their order; with ``hidden_prenorm`` (an EAGLE-3 head itself) the final
    # hidden state before the norm.
    feature_layers: tuple[int, ...] | None = None
    hidden_prenorm = False

    def use_kernels(self, kernels: str, *, backend: str | None = "inductor",
                    attention: str | None = None, verify_tokens: int | None = None) -> LlamaRuntime:
        """``invariant``: :mod:`specserve.engine.runtime.kernels` (a token's logits do not depend on
        the rest of the forward; the C kernels on CPU). ``library``: ``F.linear`` and torch's
        attention, the runtime before those kernels (kept for GPUs and for side-by-side
        benchmarks). ``compiled``: the library's ops at bucketed static shapes under
        ``torch.compile`` (``backend``), with CUDA graphs on a GPU
        (:mod:`specserve.engine.runtime.compiled`); prefill stays on ``library``. Call it after the
        model is on its device; caches made afterwards have the spare slot it needs.

        ``attention`` (``library`` and ``compiled``): ``flex``, FlexAttention reading each
        row's own key blocks (:mod:`specserve.engine.runtime.block_attention`), or ``sdpa``, torch's
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
        compiled (:func:`specserve.engine.runtime.compiled.warm_up`)."""
        return warm_up(self, cache)

    @property
    def max_positions(self) -> int:
        return self.rope_cos.shape[0]

    def _check_length(self, max_seq_len: int) -> None:
        if max_seq_len > self.max_positions:
            raise ConfigError(f"max_seq_len {max_seq_len} exceeds the {self.max_positions} "
                              "positions this runtime was built for")

    def make_paged_cache(self, num_slots: int, max_seq_len: int, *, block_size: int,
                         num_blocks: int, prefix_caching: bool = True) -> PagedKVCache:
        """A paged cache shaped for this model (:class:`PagedKVCache`), read by every kernel
        (the compiled path and FlexAttention too). FlexAttention reads whole 64-key
        blocks, so there ``block_size`` is a multiple of 64; a forward at static shapes (the
        compiled path) and FlexAttention's padded tables get the pool's spare block."""
        flex = self.kernels != "invariant" and self.attention == "flex"
        if flex and block_size % KV_BLOCK:
            raise ConfigError(f"kv_cache block_size {block_size}: FlexAttention reads blocks of "
                              f"{KV_BLOCK} keys, so a paged cache on it needs a multiple of "
                              f"{KV_BLOCK} (64 is the default on CUDA)")
        self._check_length(max_seq_len)
        attn = self.layers[0].attn
        cache = PagedKVCache(num_layers=len(self.layers), num_blocks=num_blocks,
                             block_size=block_size, num_slots=num_slots,
                             num_kv_heads=attn.num_kv_heads, max_seq_len=max_seq_len,
                             head_dim=attn.head_dim, dtype=self.embed.weight.dtype,
                             device=self.embed.weight.device, prefix_caching=prefix_caching,
                             spare=self.static is not None or flex)
        self._static_addresses(cache)
        return cache

    def make_cache(self, num_slots: int, max_seq_len: int) -> SlotKVCache:
        """A cache shaped for this model (local KV heads under tensor parallelism)."""
        self._check_length(max_seq_len)
        attn = self.layers[0].attn
        cache = SlotKVCache(num_layers=len(self.layers), num_slots=num_slots,
                            num_kv_heads=attn.num_kv_heads, max_seq_len=max_seq_len,
                            head_dim=attn.head_dim, dtype=self.embed.weight.dtype,
                            device=self.embed.weight.device, block=KV_BLOCK,
                            spare=self.static is not None)
        self._static_addresses(cache)
        return cache

    def _static_addresses(self, cache: SlotKVCache | PagedKVCache) -> None:
        """A CUDA graph keeps the addresses it captured: the cache's tensors stay put."""
        if self.static is not None and cache.k[0].is_cuda:
            for tensor in cache.k + cache.v:
                torch._dynamo.mark_static_address(tensor)

    @torch.inference_mode()
    def forward(self, cache: SlotKVCache, batch: ForwardBatch) -> Forwarded:
        """Append ``batch.token_ids[i]`` to slot ``batch.slots[i]``; return what the batch
        asks for (:class:`~specserve.engine.runtime.forward_batch.ForwardBatch`, its fields' meanings).

        :attr:`Forwarded.logits` is ``[sum(num_logits), vocab]``: for each row, in order, the
        logits after each of its last ``num_logits[i]`` new tokens (default 1; 0 for a row
        whose logits nobody reads, a prompt's chunk), or with ``batch.argmax`` their argmax in
        :attr:`Forwarded.token_ids`. Each slot's length advances by its number of new tokens;
        callers roll back what the rejection sampler did not keep.

        ``groups``: a forward pads its rows to the longest, so a prompt's chunk of 256 tokens
        beside decode rows of 5 would make each of them 256 wide; in groups, each is padded to
        its own group's longest row. On the ``invariant`` kernels the groups share one pass
        through the layers (every linear over all groups' tokens at once, attention group by
        group: :class:`PackedContext`), and a token's bits are those of its group run alone
        (the kernels are row-invariant). The other kernels run each group as a forward of its
        own, at the shapes it has alone: their bits depend on the shape.

        ``hidden``: :attr:`Forwarded.hidden` holds the final hidden state (after the last
        norm, what the LM head reads) of *every* new token, ``[sum(len(ids)), hidden]`` in row
        order: the features an EAGLE draft head reads (other features with
        :attr:`feature_layers` and :attr:`hidden_prenorm`). ``features``: per-token inputs of
        that shape for a model that takes them (:class:`~specserve.engine.drafts.draft_head.DraftHead`).

        ``trees``: a tree node sits at the position of its depth and attends to the cache and
        its ancestors only, so its logits are those of its root-to-node path as a chain (bit
        for bit on the C kernels). The new tokens are stored in the slot in their order; the
        caller keeps the accepted path (:meth:`SlotKVCache.keep`). At most 64 tokens in a tree
        after its base (``forward_context._trees``); not with sliding-window layers.
        """
        logits, hidden, verdict = self._outputs(cache, batch)
        if batch.argmax:
            return Forwarded(None, argmax(logits), hidden, verdict)
        return Forwarded(logits, None, hidden, verdict)

    def _outputs(self, cache: SlotKVCache, batch: ForwardBatch
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`forward`'s logits ``[sum(num_logits), vocab]``, hidden states (None
        unless ``batch.hidden``) and the compiled graph's verdict (None but there:
        :attr:`StaticForward.verdict <specserve.engine.runtime.compiled.StaticForward.verdict>`)."""
        slots, token_ids = batch.slots, batch.token_ids
        num_logits = batch.num_logits or [1] * len(slots)
        assert len(slots) == len(token_ids) == len(num_logits) and slots
        groups = batch.groups
        if groups is not None and len(groups) > 1:
            assert batch.fed is None, "fed tokens go in one group"
            if sum(groups) != len(slots) or min(groups) < 1:
                raise ValueError(f"groups {groups} do not split {len(slots)} rows")
            return *forward_groups(self, cache, batch, num_logits), None
        upload = batch.upload or Upload()
        static = self.static is not None and self.static.takes(max(map(len, token_ids)))
        if static and chains(batch.trees):  # from token ids to logits in one graph
            outputs = self.static.forward(cache, batch, num_logits, upload)
            for slot, ids in zip(slots, token_ids):
                cache.lengths[slot] += len(ids)
            return outputs
        asked = upload.add(logit_positions(token_ids, num_logits))  # with the inputs' copy
        last = None if batch.fed is None else upload.add(fed_positions(batch))
        ctx, tokens = self._prepare(cache, slots, token_ids, batch.trees, upload)
        if last is not None:
            assert chains(batch.trees), "a fed token follows a chain"
            tokens[tuple(upload[last])] = batch.fed
        x = self._inputs(tokens, ctx, batch.features)  # [B, T, hidden]
        x, captured = self._layers(x, ctx, cache, batch.hidden and self.feature_layers is not None)
        for slot, ids in zip(slots, token_ids):
            cache.lengths[slot] += len(ids)
        head = self._head_shape(ctx, *x.shape[:2])
        own = self._own_features(batch.hidden)
        if head is not None:
            logits, hidden = self._padded_head(x, head, *upload[asked], ctx.real, batch.hidden and not own)
            return logits, (self._features(x, captured).flatten(0, 1)[ctx.real] if own else hidden), None
        if not batch.hidden or own:
            states = asked_states(x, token_ids, num_logits, upload[asked])
            return (self.logits(self.final_norm(states)),
                    self._features(x, captured).flatten(0, 1)[ctx.real] if own else None, None)
        rows, cols = upload[asked]
        hidden = self.final_norm(x.flatten(0, 1)[ctx.real])  # [sum(len), hidden]
        index = torch.zeros_like(ctx.valid, dtype=torch.long)
        index.view(-1)[ctx.real] = torch.arange(hidden.shape[0], device=x.device)
        return self.logits(hidden[index[rows, cols]]), hidden, None

    def _layers(self, x: torch.Tensor, ctx, cache: SlotKVCache,
                capture: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer over ``x``; with ``capture``, also the inputs of ``feature_layers``."""
        out = None if capture else self.native_stack(self.layers, x, ctx, cache)
        if out is not None:
            return out, []
        captured = []
        for i, layer in enumerate(self.layers):
            if capture and i in self.feature_layers:
                captured.append(x)
            x = layer(x, ctx, cache)
        return x, captured

    def _own_features(self, hidden: bool) -> bool:
        """Hidden states are asked for (``hidden``) and are not the final normed ones
        (``feature_layers``, ``hidden_prenorm``)."""
        return hidden and (self.feature_layers is not None or self.hidden_prenorm)

    def _features(self, x: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """Per position, the hidden states a forward returns when :meth:`_own_features`. A layer
        index equal to the number of layers in ``feature_layers`` stands for the final hidden
        state after the norm (what the LM head reads: ``train-draft``'s soft labels)."""
        if self.feature_layers is None:
            return x
        if len(self.layers) in self.feature_layers:
            captured = [*captured, self.final_norm(x)]
        return torch.cat(captured, dim=-1)

    def _inputs(self, tokens: torch.Tensor, ctx: ForwardContext,
                features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input ``[B, T, width]`` of ``tokens`` ``[B, T]`` and, for a
        model that takes them, per-token ``features`` in row order (:meth:`_embedded`)."""
        if features is not None:
            padded = features.new_zeros(*tokens.shape, features.shape[-1])  # [B, T, width]
            padded.view(-1, features.shape[-1])[ctx.real] = features
            features = padded
        return self._embedded(tokens, features)

    def _embedded(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input from ``tokens`` ``[B, T]`` and ``features`` ``[B, T, width]``
        at their tokens' places (or None): token embeddings (a draft head adds its features)."""
        assert features is None, "this model takes no features"
        return self.embed(tokens)

    def warm_up_features(self, num_tokens: int) -> torch.Tensor | None:
        """What a warm-up forward of ``num_tokens`` new tokens passes as ``features``: none
        (a draft head takes zeros of its feature width)."""
        return None

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm between the last layer and the LM head (a published EAGLE-1 head has none)."""
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits of final hidden states ``[N, hidden]``."""
        return self.lm_head(hidden).float()

    def _head_shape(self, ctx: ForwardContext, b: int, t: int) -> tuple[int, int] | None:
        """The ``(rows, tokens)`` a decode's or verify's final norm and LM head run at where
        the kernels are not row-invariant (``library`` on CUDA; the compiled path runs its
        head in its graph at the bucket): the shape its layers ran at, so a token's logits
        do not depend on how many others asked for theirs. A decode asks one per row and a
        verify K + 1, and cuBLAS picks the LM head's kernel by that count (the last shape a
        decode and a verify did not share; docs/BENCHMARKS.md, "Second window").
        None (the asked positions only): the ``invariant`` kernels, prefills, trees, and a
        draft head (:attr:`fixed_head`)."""
        if not self.fixed_head or ctx.tree is not None:
            return None
        if self.decode_width is not None and t == self.decode_width:
            return b, t
        return None

    def _padded_head(self, x: torch.Tensor, shape: tuple[int, int], rows: torch.Tensor,
                     cols: torch.Tensor, real: torch.Tensor, hidden: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`'s logits, and with ``hidden`` the final normed hidden states, with
        the final norm and LM head run over every position of ``shape`` (:meth:`_head_shape`;
        padding is zeros, whose rows nothing reads)."""
        b, t, size = x.shape
        padded = x.new_zeros(*shape, size)                                    # [R, W, hidden]
        padded[:b, :t] = x
        normed = self.final_norm(padded)
        logits = self.lm_head(normed.flatten(0, 1))[rows * shape[1] + cols].float()
        return logits, normed[:b, :t].flatten(0, 1)[real] if hidden else None

    def _prepare(self, cache: SlotKVCache, slots: list[int], token_ids: list[list[int]],
                 trees: list[list[int] | None] | None = None, upload: Upload | None = None
                 ) -> tuple[ForwardContext, torch.Tensor]:
        """The forward's context and tokens (:func:`~specserve.engine.runtime.forward_context.prepare`)."""
        return prepare(cache, slots, token_ids, trees, rope_cos=self.rope_cos, rope_sin=self.rope_sin,
                       sliding_windows=self.arch.sliding_windows, decode_width=self.decode_width,
                       device=self.embed.weight.device, upload=upload)


def asked_states(x: torch.Tensor, token_ids: list[list[int]], num_logits: list[int],
                 positions: torch.Tensor) -> torch.Tensor:
    """``x[rows, cols]`` at ``positions`` (``[2, N]``, :func:`logit_positions`'), or ``x``
    itself, flattened, where every row asks for all its tokens and none is padded (decodes; a
    verify of one row): those are x's own positions in order, read as they are, not copied
    (at batch 1 the copy was a decode's one indexing operation)."""
    t = x.shape[1]
    if all(n == len(ids) == t for ids, n in zip(token_ids, num_logits)):
        return x.flatten(0, 1)
    rows, cols = positions
    return x[rows, cols]


def default_kernels(device: torch.device, draft: bool = False) -> str:
    """``kernels: auto``: on a CPU the C kernels' ``integer`` arithmetic (a GGUF's blocks met by
    8-bit inputs, 16 bits for an outlier's block; where a model has no such blocks the loader
    runs their float32 arithmetic, ``invariant``). On CUDA, where they cannot run, a target's
    are ``compiled`` (CUDA graphs: 4-5x ``library``, which is launch-bound there; the engine
    end to end on them on an H200, docs/BENCHMARKS.md), a draft's the library's (``library``,
    attention on FlexAttention) until a GPU window has run drafts compiled."""
    if torch.device(device).type != "cuda":
        return "integer"
    return "library" if draft else "compiled"


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
