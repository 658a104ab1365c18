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

The split itself is described once, by :func:`split_of` (which parameter is cut along which
dimension) and :func:`shard_index` (which rows or columns this rank keeps), and the layer
sizes and all-reduce hooks that go with it are set by :func:`localize`. Two paths use them:
``apply_tp`` on a model already loaded whole (tests, small models), and
:mod:`specserve.engine.shard_loader`, where each rank reads only its shard from the
checkpoint, so both give the same weights bit for bit.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from specserve.engine.runtime.arch import ModelArch
from specserve.engine.runtime.model import LlamaRuntime
from specserve.errors import ConfigError

_COLUMN_PARALLEL = ("attn.qkv", "mlp.gate_up")
_ROW_PARALLEL = ("attn.o", "mlp.down")


class Split(enum.Enum):
    """How one parameter is divided among the ranks."""

    REPLICATE = "replicate"  # every rank holds all of it (embeddings, norms, LM head)
    COLUMN = "column"        # dim 0 (output features) of each fused part: this rank's heads
    ROW = "row"              # dim 1 (input features): this rank's heads / intermediate slice
    RANK0 = "rank0"          # a row-parallel bias: whole on rank 0, zeros elsewhere


_SPLIT_DIM = {Split.COLUMN: 0, Split.ROW: 1}  # the dimension each split cuts


def split_of(name: str) -> Split:
    """How parameter ``name`` of a :class:`LlamaRuntime` is divided.

    >>> split_of("layers.3.attn.qkv.bias"), split_of("layers.3.mlp.down.weight")
    (<Split.COLUMN: 'column'>, <Split.ROW: 'row'>)
    >>> split_of("layers.3.attn.o.bias"), split_of("layers.3.input_norm")
    (<Split.RANK0: 'rank0'>, <Split.REPLICATE: 'replicate'>)
    """
    module, _, leaf = name.rpartition(".")
    if module.endswith(_COLUMN_PARALLEL):
        return Split.COLUMN
    if module.endswith(_ROW_PARALLEL):
        return Split.ROW if leaf == "weight" else Split.RANK0
    return Split.REPLICATE


def shard_index(split: Split, shape: Sequence[int], rank: int, world: int) -> tuple[slice, ...]:
    """This rank's part of one *unfused* tensor of ``shape`` (q, k, v, gate or up separately),
    as an index that works on a tensor and on a safetensors slice alike: the ``rank``-th of
    ``world`` equal consecutive pieces along the split's dimension, which is what
    ``tensor.chunk(world, dim)[rank]`` gives when the size divides.

    >>> shard_index(Split.ROW, (8, 6), rank=1, world=2)
    (slice(None, None, None), slice(3, 6, None))
    """
    index = [slice(None)] * len(shape)
    dim = _SPLIT_DIM.get(split)
    if dim is not None:
        step, rest = divmod(shape[dim], world)
        assert rest == 0, f"dim {dim} of {tuple(shape)} does not divide by {world}"
        index[dim] = slice(rank * step, (rank + 1) * step)
    return tuple(index)


def local_shape(split: Split, shape: Sequence[int], world: int) -> tuple[int, ...]:
    """The shape of this rank's shard of a whole (fused) parameter of ``shape``: fused parts
    are cut separately, but each loses the same fraction along the split's dimension."""
    dim = _SPLIT_DIM.get(split)
    return tuple(n // world if d == dim else n for d, n in enumerate(shape))


def fused_sizes(arch: ModelArch, name: str) -> list[int]:
    """Dim-0 sizes of the parts fused in parameter ``name`` (each is cut separately, so every
    rank keeps its own q, k and v heads): ``[H * D, Hk * D, Hk * D]`` for ``qkv``,
    ``[I, I]`` for ``gate_up``, none for the rest."""
    if ".attn.qkv." in name:
        d = arch.head_dim
        return [arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]
    if ".mlp.gate_up." in name:
        return [arch.intermediate_size] * 2
    return []


def shard_tensor(tensor: torch.Tensor, split: Split, parts: list[int], rank: int,
                 world: int) -> torch.Tensor:
    """This rank's shard of a whole (fused) parameter, contiguous. ``parts``: see
    :func:`fused_sizes` (empty: one part)."""
    if split is Split.RANK0:
        return tensor if rank == 0 else torch.zeros_like(tensor)
    pieces = tensor.split(parts or [tensor.shape[0]], dim=0)
    return torch.cat([p[shard_index(split, p.shape, rank, world)] for p in pieces]).contiguous()


def tp_rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (default: the world); ``(0, 1)`` without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_divisible(arch: ModelArch, world: int) -> None:
    for name, value in (("num_attention_heads", arch.num_heads),
                        ("num_key_value_heads", arch.num_kv_heads),
                        ("intermediate_size", arch.intermediate_size)):
        if value % world:
            raise ConfigError(f"{name} = {value} is not divisible by the tensor parallel "
                              f"size {world}")


def set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter ``name`` (dotted) by ``tensor``, whatever its old shape or device."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))


def apply_tp(model: LlamaRuntime, group: dist.ProcessGroup | None = None) -> LlamaRuntime:
    """Shard ``model`` in place for this rank of ``group`` (default: the world)."""
    rank, world = tp_rank_world(group)
    if world == 1:
        return model
    check_divisible(model.arch, world)
    for name, param in list(model.named_parameters()):
        split = split_of(name)
        if split is not Split.REPLICATE:
            parts = fused_sizes(model.arch, name)
            set_param(model, name, shard_tensor(param.data, split, parts, rank, world))
    return localize(model, world, group)


def localize(model: LlamaRuntime, world: int,
             group: dist.ProcessGroup | None = None) -> LlamaRuntime:
    """Make the layers match weights already cut by :func:`split_of`: local head counts and
    intermediate size, linears' feature counts, and the all-reduce after each row-parallel
    linear. ``model.arch`` keeps the whole model's numbers."""
    if world == 1:
        return model
    reduce = all_reducer(group)
    for layer in model.layers:
        layer.attn.num_heads //= world
        layer.attn.num_kv_heads //= world
        layer.mlp.intermediate_size //= world
        layer.attn.all_reduce = reduce
        layer.mlp.all_reduce = reduce
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    return model


def all_reducer(group: dist.ProcessGroup | None):
    """The hook a row-parallel linear's output goes through: summed over ``group``'s ranks,
    in place."""
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return all_reduce
