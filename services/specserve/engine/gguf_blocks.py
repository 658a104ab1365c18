"""A GGUF's quantized blocks in the target's linears, read directly by the C kernels.

The runtime loads a GGUF through its dequantized float32 copy (``loader._dequantized``), so
every model has one load path. Then, on the C kernels, each decoder linear whose tensors are
of a block type the kernels read (``native.QUANT_BLOCKS``: Q4_0, Q4_1, Q8_0) takes those
blocks from the file and drops its float32 weight (``Linear.quantize``, which first checks
that the blocks are that weight bit for bit): the same logits, and a decode streams a fifth
of the bytes. The fused linears take their parts' rows in the runtime's order (q, k, v;
gate, up), and q's and k's rows the order ``transformers`` gives them (a GGUF of a Llama
stores them permuted for its RoPE; the loader puts them back, and so does this).

The LM head takes its blocks too, and a tied one's are the embedding's (``token_embd``):
the embedding then forms the rows it looks up from them (``kernels.Embedding``), and a draft
head made on it in the same process gets a float32 copy (``Embedding.float_weight``). An
untied model's embedding stays float32. Left in float32, said in one log line: tensors of
other block types, other architectures than Llama's, a tensor-parallel shard, and any linear
whose blocks fail the check.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.runtime import native

log = logging.getLogger(__name__)

# The runtime's fused decoder linears and their GGUF tensors, in row order.
LAYER_LINEARS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",),
                 "mlp.gate_up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}


def quantize_linears(runtime, path: Path, x8_inputs: bool = False) -> dict:
    """Give ``runtime``'s decoder linears the blocks of the GGUF at ``path`` where the kernels
    read them (module docstring); ``x8_inputs``: met by 8-bit inputs (16-bit in an outlier's
    block) in integer dot products (``kernels: integer``), not in float32. Returns what was
    done: ``linears`` quantized, their ``bytes`` and the float32 ``bytes_dropped``, and per
    reason the linears ``kept_float32``."""
    arch, tensors = read_tensors(path)
    kept: Counter[str] = Counter()
    done, size, dropped = 0, 0, 0
    for i, layer in enumerate(runtime.layers):
        for attr, parts in LAYER_LINEARS.items():
            linear = layer.get_submodule(attr)
            found = [tensors.get(f"blk.{i}.{part}.weight") for part in parts]
            kinds = {t.kind for t in found if t is not None}
            reason = _unfit(arch, found, kinds)
            if reason:
                kept[reason] += 1
                continue
            kind = kinds.pop()
            rows = [_rows(part, torch.from_numpy(np.array(t.rows)), runtime.arch)
                    for part, t in zip(parts, found)]
            blocks = native.pack_blocks(kind, torch.cat(rows), linear.out_features, linear.in_features,
                                        x8_inputs)
            weight_bytes = linear.weight.numel() * linear.weight.element_size()
            try:
                linear.quantize(blocks)
            except ValueError:
                kept["blocks that are not the loaded weight"] += 1
                continue
            done, size, dropped = done + 1, size + blocks.nbytes, dropped + weight_bytes
    head = _lm_head(runtime, tensors, arch, x8_inputs)
    if isinstance(head, str):
        kept[head] += 1
    else:
        tied = runtime.lm_head.weight is runtime.embed.weight
        weight_bytes = runtime.lm_head.weight.numel() * runtime.lm_head.weight.element_size()
        try:
            runtime.lm_head.quantize(head)
            if tied:  # the embedding is the same table: its rows are formed from these blocks
                runtime.embed.quantize(head)
            done, size, dropped = done + 1, size + head.nbytes, dropped + weight_bytes
        except ValueError:
            kept["blocks that are not the loaded weight"] += 1
    _gather(runtime)
    report = {"linears": done, "bytes": size, "bytes_dropped": dropped, "kept_float32": dict(kept)}
    kinds = "/".join(sorted({lin.quantized.kind for lin in _linears(runtime) if lin.quantized})) or "-"
    log.info("%s: %d linears on their %s blocks%s (%.0f MB, were %.0f MB in float32)%s", path.name, done,
             kinds, ", integer inputs" if x8_inputs else "", size / 1e6, dropped / 1e6,
             "; kept in float32: " + ", ".join(f"{n} ({reason})" for reason, n in kept.items())
             if kept else "")
    return report


def _gather(runtime) -> None:
    """The linears' blocks moved into one buffer of huge pages (``native.gathered``) in the
    order a forward reads them; a tied head's blocks stay the embedding's."""
    linears = [lin for lin in (*_linears(runtime)[1:], runtime.lm_head) if lin.quantized is not None]
    unique = list({id(lin.quantized): lin.quantized for lin in linears}.values())
    moved = dict(zip(map(id, unique), native.gathered(unique)))
    for module in (*linears, runtime.embed):
        if getattr(module, "quantized", None) is not None and id(module.quantized) in moved:
            module.quantized = moved[id(module.quantized)]


class Tensor(NamedTuple):
    kind: str            # its GGML type's name: Q4_1, F32, ...
    shape: tuple[int, ...]  # as GGUF lists it: innermost first
    rows: np.ndarray     # [rows, bytes a row] uint8, mapped from the file


# GGUF metadata value types: the bytes of the fixed-size ones (8: a string, 9: an array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensors(path: Path) -> tuple[str, dict[str, Tensor]]:
    """A GGUF file's architecture and its tensors, mapped (not read). Its metadata is
    skipped but for ``general.architecture``: ``gguf``'s reader builds every field, the
    tokenizer's 49,152 strings of the embedded model included (5 s of a 7 s load)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    magic, _version, num_tensors, num_fields = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    at, fields = 24, {}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(kind: int, at: int) -> int:
        if kind == 8:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if kind == 9:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SIZES:
                return at + count * _SIZES[item]
            for _ in range(count):
                at = skip(item, at)
            return at
        return at + _SIZES[kind]

    for _ in range(num_fields):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        if kind == 8 and key in ("general.architecture",):
            fields[key], at = string(at)
        elif kind in (4, 5) and key == "general.alignment":
            fields[key] = struct.unpack_from("<I", buf, at)[0]
            at += 4
        else:
            at = skip(kind, at)
    infos = []
    for _ in range(num_tensors):
        name, at = string(at)
        (dims,) = struct.unpack_from("<I", buf, at)
        shape = struct.unpack_from(f"<{dims}Q", buf, at + 4)
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, shape, GGMLQuantizationType(kind), offset))
    align = fields.get("general.alignment", 32)
    start = -(-at // align) * align
    tensors = {}
    for name, shape, kind, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * block_bytes
        rows = int(np.prod(shape[1:], dtype=np.int64))
        view = data[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = Tensor(kind.name, tuple(shape), view)
    return fields.get("general.architecture", ""), tensors


def _lm_head(runtime, tensors: dict[str, Tensor], arch: str, x8_inputs: bool) -> native.QuantizedWeight | str:
    """The LM head's blocks (a tied head's are the embedding's, ``token_embd``), or why not.
    Its rows are the vocabulary's, as stored."""
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    reason = _unfit(arch, [tensor], {tensor.kind} if tensor is not None else set())
    if reason:
        return f"LM head: {reason}"
    head = runtime.lm_head
    return native.pack_blocks(tensor.kind, torch.from_numpy(np.array(tensor.rows)), head.out_features,
                              head.in_features, x8_inputs)


def _unfit(arch: str, found: list, kinds: set[str]) -> str | None:
    """Why a linear keeps its float32 weight, or None."""
    if arch != "llama":
        return f"{arch} GGUFs: only Llama's tensor layout is mapped"
    if any(t is None for t in found):
        return "tensors not found by name"
    if len(kinds) != 1:
        return "parts of one fused linear in different types"
    kind = next(iter(kinds))
    return None if kind in native.QUANT_BLOCKS else f"{kind} blocks"


def _rows(part: str, raw: torch.Tensor, arch) -> torch.Tensor:
    """A tensor's rows of blocks in the order ``transformers`` loads its rows: q's and k's
    un-permuted per head (``reverse_permute`` of its GGUF converter), others as stored."""
    heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(part)
    if heads is None:
        return raw
    n = raw.shape[0]
    return raw.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)


def _linears(runtime):
    return [runtime.lm_head, *(layer.get_submodule(attr) for layer in runtime.layers
                               for attr in LAYER_LINEARS)]


def resident_weights(runtime) -> dict:
    """What ``runtime``'s weights hold in memory: ``bytes`` (its parameters, a tied one once,
    and its linears' quantized blocks), of which ``quantized_bytes`` in
    ``quantized_linears`` linears (``/v1/units/stats``' ``weights``)."""
    blocks = list({id(m.quantized): m.quantized for m in runtime.modules()  # a tied head's once
                   if getattr(m, "quantized", None) is not None}.values())
    params = sum(p.numel() * p.element_size() for p in runtime.parameters())
    quantized = sum(b.nbytes for b in blocks)
    return {"bytes": params + quantized, "quantized_bytes": quantized,
            "quantized_linears": len(blocks), "kinds": sorted({b.kind for b in blocks})}
