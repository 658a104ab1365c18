"""Quantized linears (issue 54): the GGUF's own 4- and 8-bit blocks read by the C kernels, each
weight formed in registers with the dequantizer's arithmetic, must give the outputs of the
float32 linear over the dequantized weight **bit for bit** (``torch.equal``), for every row
count (a decode, a verify's K + 1, a batch, a prefill's passes of 24), on every C build
(this CPU's, its AVX2 code where it has AVX512, the portable one). The reference weight is
what the runtime loads today: ``gguf``'s ``dequantize``, the function ``transformers``
dequantizes a GGUF with. Planted changes (the nibble order, one rounding fused) are caught.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from specserve.engine.runtime import native

from tests.engine.runtime.test_kernels import use_build

# The embedded model's weights (q, k and v, the fused qkv the runtime holds, o, gate_up, down,
# the LM head) and odd shapes (row counts off the tiles').
SHAPES = [(576, 576), (192, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576), (7, 64),
          (13, 96)]
ROWS = [*range(1, 17), 24, 50]


@pytest.fixture(params=["native", "avx2", "portable"])
def build(request, monkeypatch, other_builds):
    if request.param not in ("native", *other_builds):
        pytest.skip("this CPU builds the AVX2 code natively")
    use_build(monkeypatch, request.param, other_builds)
    return request.param


def random_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """``[n, k / 32 * file bytes]`` uint8: random quants, scales of a trained model's size."""
    gen = torch.Generator().manual_seed(seed)
    file_bytes, _ = native.QUANT_BLOCKS[kind]
    raw = torch.randint(0, 256, (n, k // 32, file_bytes), dtype=torch.uint8, generator=gen)
    scales = ((torch.rand(n, k // 32, 2, generator=gen) - 0.5) * 0.04).half()
    raw[..., :2] = scales[..., :1].view(torch.uint8)
    if kind == "Q4_1":
        raw[..., 2:4] = scales[..., 1:].view(torch.uint8)
    return raw.reshape(n, -1)


def dequantized(kind: str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    weights = dequantize(raw.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).reshape(n, k)


@pytest.mark.parametrize("kind", list(native.QUANT_BLOCKS))
def test_quantized_linears_are_the_dequantized_float32_linears_bit_for_bit(kind, build):
    for i, (n, k) in enumerate(SHAPES):
        raw = random_blocks(kind, n, k, seed=i)
        weight, packed = dequantized(kind, raw, n, k), native.pack_blocks(kind, raw, n, k)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(100 + i))
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(200 + i))
        for m in ROWS if n * k < 10_000_000 else [1, 8, 24]:  # the LM head: decode, verify, prefill
            want = native.linear(x[:m], weight, bias)
            got = native.linear_quantized(x[:m], packed, bias)
            assert torch.equal(got, want), (kind, n, k, m, float((got - want).abs().max()))
        assert packed.nbytes == n * k // 32 * native.QUANT_BLOCKS[kind][1]
        assert torch.equal(native.dequantize_blocks(packed), weight)  # (the loader's check)


@pytest.mark.parametrize("kind", list(native.QUANT_BLOCKS))
def test_an_embeddings_rows_in_c_are_the_dequantizers_bits(kind):
    """``dequantized_rows`` (an embedding's lookup, C) against the float32 table: every row of a
    table in both layouts (rows in order, and interleaved in groups of 16 with the last padded),
    a repeated row, and an index off the table refused, not read."""
    n, k = 21, 96
    raw = random_blocks(kind, n, k, seed=5)
    table = dequantized(kind, raw, n, k)
    rows = torch.tensor([*range(n), 3, n - 1])
    for x8 in (False, True):
        packed = native.pack_blocks(kind, raw, n, k, x8_inputs=x8)
        got = native.dequantized_rows(packed, rows)
        assert torch.equal(got, table[rows]), (kind, x8)
        assert torch.equal(got, native.dequantize_blocks(packed, rows))
        with pytest.raises(IndexError):
            native.dequantized_rows(packed, torch.tensor([n]))


def test_a_planted_nibble_order_or_rounding_is_caught():
    """The comparison above would see a kernel that read the nibbles the other way round, or
    rounded otherwise: ``d * (q + m / d)``, the same weight in exact arithmetic. (One rounding
    of ``d * q + m`` instead of two is not a change: ``d`` has 11 significant bits and ``q``
    4, so ``d * q`` is exact in float32; only the addition rounds, as in Q4_0's and Q8_0's
    products nothing does.)"""
    n, k = 576, 576
    raw = random_blocks("Q4_1", n, k, seed=0)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    got = native.linear_quantized(x, native.pack_blocks("Q4_1", raw, n, k), None)
    swapped = raw.view(n, -1, 20).clone()
    swapped[..., 4:] = (swapped[..., 4:] >> 4) | (swapped[..., 4:] << 4)
    assert not torch.equal(got, native.linear(x, dequantized("Q4_1", swapped.view(n, -1), n, k), None))
    blocks = raw.view(n, -1, 20)
    d, m = (blocks[..., i:i + 2].contiguous().view(torch.float16).double() for i in (0, 2))
    q = torch.stack([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], dim=2).view(n, -1, 32).double()
    d, m, q = d.float(), m.float(), q.float()
    assert torch.equal((d * q + m).view(n, k), dequantized("Q4_1", raw, n, k))  # the kernel's
    other = (d * (q + m / d)).view(n, k)
    assert not torch.equal(other, dequantized("Q4_1", raw, n, k))
    assert not torch.equal(got, native.linear(x, other.contiguous(), None))


def test_only_the_block_types_the_kernels_read_are_packed():
    with pytest.raises(ValueError, match="no kernel reads Q5_K"):
        native.pack_blocks("Q5_K", torch.zeros(1, 176, dtype=torch.uint8), 1, 256)
    with pytest.raises(ValueError, match="not whole blocks"):
        native.pack_blocks("Q8_0", torch.zeros(1, 34, dtype=torch.uint8), 1, 48)


def huge_page_advised(address: int) -> bool | None:
    """Whether the mapping holding ``address`` was advised into huge pages (``hg`` among its
    VmFlags in /proc/self/smaps); None where the kernel says nothing of it."""
    try:
        smaps = open("/proc/self/smaps").read()
    except OSError:
        return None
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        start, end = (int(x, 16) for x in entry.split()[0].split("-"))
        if start <= address < end:
            flags = re.search(r"^VmFlags:(.*)$", entry, re.M)
            return None if flags is None else "hg" in flags[1].split()
    return None


def test_gathered_blocks_are_the_same_bytes_in_one_buffer_of_huge_pages():
    """A forward's weights in the order it reads them, each at a 64-byte boundary after the
    last, the first on a 2 MiB one, in memory advised into huge pages (Linux)."""
    weights = [native.pack_blocks(kind, random_blocks(kind, n, k, seed=i), n, k, x8_inputs=True)
               for i, (kind, n, k) in enumerate([("Q4_1", 960, 576), ("Q4_1", 13, 96), ("Q8_0", 40, 64)])]
    moved = native.gathered(weights)
    at = moved[0].data.data_ptr()
    assert at % native.HUGE_PAGE == 0
    for before, after in zip(weights, moved):
        assert torch.equal(after.data, before.data) and after.data.data_ptr() == at
        assert (after.kind, after.out_features, after.in_features, after.x8_inputs) == \
            (before.kind, before.out_features, before.in_features, before.x8_inputs)
        at += -(-before.nbytes // 64) * 64
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert huge_page_advised(moved[0].data.data_ptr()) in (True, None)
        assert huge_page_advised(weights[0].data.data_ptr()) in (False, None)


@pytest.mark.slow
def test_the_embedded_model_keeps_its_blocks_with_the_same_logits():
    """Loaded as serving loads it on the float32-identical kernels (``invariant``; the
    default's ``integer`` are tests/engine/runtime/test_integer_kernels.py's), the embedded SmolLM2
    (Q4_1 decoder linears, a Q8_0 embedding tied to its LM head) runs its 120 decoder linears
    and its LM head on the file's blocks and looks its embeddings up in them, each checked
    against the float32 weights at load, and gives the float32 load's logits bit for bit: a
    prefill, a decode, a verify of 5 after a rollback. Its weights drop from 538 MB to under
    150 MB; a draft made on its embedding gets the float32 table."""
    from specserve.config import ModelConfig
    from specserve.engine.gguf_blocks import resident_weights
    from specserve.engine.loader import load_model
    from specserve.engine.runtime.forward_batch import ForwardBatch

    out, weights = {}, {}
    for blocks in (False, True):
        rt = load_model(ModelConfig(kernels="invariant"), max_model_len=256, blocks=blocks).runtime
        weights[blocks] = resident_weights(rt)
        cache = rt.make_cache(num_slots=2, max_seq_len=256)
        slot = cache.allocate()
        prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist()
        first = rt(cache, ForwardBatch([slot], [prompt], [40])).logits
        decode = rt(cache, ForwardBatch([slot], [[int(first[-1].argmax())]])).logits
        cache.rollback(slot, 38)
        verify = rt(cache, ForwardBatch([slot], [[5, 6, 7, 8, 9]], [5])).logits
        out[blocks] = torch.cat([first, decode, verify])
    assert torch.equal(out[True], out[False])
    # one buffer of huge pages, in a forward's order: layer by layer, then the head
    blocks = [lin.quantized.data for layer in rt.layers for lin in
              (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)] + [rt.lm_head.quantized.data]
    assert blocks[0].data_ptr() % native.HUGE_PAGE == 0
    assert all(b.data_ptr() == a.data_ptr() + -(-a.numel() // 64) * 64 for a, b in zip(blocks, blocks[1:]))
    assert rt.embed.quantized is rt.lm_head.quantized
    assert weights[True]["quantized_linears"] == 121 and weights[True]["kinds"] == ["Q4_1", "Q8_0"]
    assert weights[False]["quantized_linears"] == 0 and weights[False]["bytes"] > 500e6
    assert weights[True]["bytes"] < 150e6
    assert torch.equal(rt.embed.float_weight(), load_model(ModelConfig(), max_model_len=256,
                                                         blocks=False).runtime.embed.weight)
