"""Tensor parallelism as an opt-in transform of a :class:`LlamaRuntime` (Megatron-style).

``apply_tp(model, group)`` keeps this rank's shard of every layer:

- attention: q/k/v are *column-parallel* by head (each rank owns ``H / world`` query heads
  and ``Hk / world`` key/value heads, so its KV cache holds only those heads); ``o`` is
  *row-parallel* (it takes this rank's heads as input) followed by an all-reduce;
- MLP: gate/up column-parallel, down row-parallel followed by an all-reduce;
- embeddings, norms and the LM head are replicated (every rank computes full logits, so rank 0
  can return them without a gather).

A row-parallel layer's bias is added once, after the all-reduce, by keeping it on rank 0
only. At world size 1 this is a no-op, so the single-process path is the same code. Two
all-reduces per layer is the minimum for this split (Shoeybi et al. 2019, "Megatron-LM").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from specserve.engine.model import MLP, Attention, LlamaRuntime
from specserve.errors import ConfigError


def apply_tp(model: LlamaRuntime, group: dist.ProcessGroup | None = None) -> LlamaRuntime:
    """Shard ``model`` in place for this rank of ``group`` (default: the world)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return model
    rank = dist.get_rank(group)
    _check_divisible(model, world)
    for layer in model.layers:
        _shard_attention(layer.attn, rank, world)
        _shard_mlp(layer.mlp, rank, world)
        reduce = _all_reducer(group)
        layer.attn.all_reduce = reduce
        layer.mlp.all_reduce = reduce
    return model


def _check_divisible(model: LlamaRuntime, world: int) -> None:
    arch = model.arch
    for name, value in (("num_attention_heads", arch.num_heads),
                        ("num_key_value_heads", arch.num_kv_heads),
                        ("intermediate_size", arch.intermediate_size)):
        if value % world:
            raise ConfigError(f"{name} = {value} is not divisible by the tensor parallel "
                              f"size {world}")


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Split dim 0 into the consecutive parts ``sizes`` (e.g. q, k, v) and keep this
    rank's slice of each part."""
    parts = weight.split(sizes, dim=0)
    return torch.cat([p.chunk(world, dim=0)[rank] for p in parts]).contiguous()


def _column_parallel(linear: nn.Linear, sizes: list[int], rank: int, world: int) -> None:
    linear.weight = nn.Parameter(_rows(linear.weight.data, sizes, rank, world), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias.data, sizes, rank, world), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, rank: int, world: int) -> None:
    shard = linear.weight.data.chunk(world, dim=1)[rank].contiguous()  # [out, in / world]
    linear.weight = nn.Parameter(shard, requires_grad=False)
    linear.in_features = shard.shape[1]
    if linear.bias is not None and rank != 0:  # added once, by rank 0, before the all-reduce
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)


def _shard_attention(attn: Attention, rank: int, world: int) -> None:
    d = attn.head_dim
    _column_parallel(attn.qkv, [attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d],
                     rank, world)
    _row_parallel(attn.o, rank, world)
    attn.num_heads //= world
    attn.num_kv_heads //= world


def _shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    _column_parallel(mlp.gate_up, [mlp.intermediate_size, mlp.intermediate_size], rank, world)
    _row_parallel(mlp.down, rank, world)
    mlp.intermediate_size //= world


def _all_reducer(group):
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return all_reduce
