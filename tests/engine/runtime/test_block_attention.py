"""FlexAttention over the cache's storage (``attention: flex``, the GPU's attention), on a CPU.

Torch's eager FlexAttention runs here (it reads every key and applies the mask_mod alone), so
these tests check the two halves a GPU kernel relies on separately: the block lists read
only each row's own keys and cover every key the rule shows (``key_blocks``), and the rule
gives SDPA's outputs and ``transformers``' logits (chains, sliding windows, token trees).
The GPU kernels themselves are ``tests/gpu``'s.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from specserve.engine.runtime.block_attention import (
    KEY_BLOCK,
    QUERY_BLOCK,
    KeyBlocks,
    attend,
    block_mask,
    key_blocks,
    logical_blocks,
    storage_view,
)
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.errors import ConfigError
from torch.nn.attention.flex_attention import create_mask

from tests.engine.runtime.test_model import ATOL, reference_logits
from tests.engine.runtime.test_tree_forward import random_tree
from tests.models import TINY_CONFIGS, VOCAB, random_sequences, runtime_of, tiny_hf_model

HK, S = 2, 256  # KV heads, and positions per slot (4 key blocks)


def rule(positions: torch.Tensor, last: torch.Tensor, window: int | None = None,
         tree: torch.Tensor | None = None, tree_starts: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, S]``: the keys of its own slot each query sees, written as
    ``ForwardContext.visible`` writes it (a padding query reads up to its row's last key)."""
    keys = torch.arange(S)[None, None, :]
    end = torch.minimum(positions, last[:, None])[:, :, None]            # [B, T, 1]
    seen = keys <= end
    if window is not None:
        seen &= keys > end - window
    if tree is not None:
        rel = keys - tree_starts[:, None, None]
        bit = (tree[:, :, None] >> rel.clamp(0, 63)) & 1
        on_path = (rel < 0) | ((rel < 64) & (bit == 1))
        seen = torch.where((tree_starts >= 0)[:, None, None], seen & on_path, seen)
    return seen


def listed(num_blocks: torch.Tensor, indices: torch.Tensor) -> list[list[list[int]]]:
    """Per row and query tile, the storage blocks a kernel reads, in its order."""
    return [[indices[b, 0, q, :n].tolist() for q, n in enumerate(row)]
            for b, row in enumerate(num_blocks[:, 0].tolist())]


def test_a_decode_and_a_verify_read_their_own_blocks_up_to_their_last_key():
    """Rows in slots 3, 0 and 1 (slot 2 is not in the forward): each reads ceil((last + 1) /
    64) blocks of its own slot, in key order, and a window starts at the window's block."""
    positions = torch.tensor([[70, 71, 72, 73], [5, 6, 7, 8], [200, 201, 202, 203]])
    last = torch.tensor([73, 5, 203])  # row 1: a decode padded to 4 tokens
    slots = torch.tensor([3, 0, 1])
    blocks = key_blocks(positions, last, slots[:, None], num_kv_heads=HK, block_len=S)
    per_slot = HK * S // KEY_BLOCK  # storage blocks between one slot's start and the next's
    assert blocks.num_blocks.flatten().tolist() == [2, 1, 4]
    assert [row[0] for row in listed(blocks.num_blocks, blocks.indices)] == [
        [3 * per_slot, 3 * per_slot + 1], [0], [per_slot + j for j in range(4)]]
    assert blocks.full_num_blocks is None  # decodes and verifies: the decoding kernel
    assert blocks.last[1].tolist() == [5, 5, 5, 5]  # padding queries stop at the row's last key
    windowed = key_blocks(positions, last, slots[:, None], num_kv_heads=HK, block_len=S, window=100)
    assert windowed.num_blocks.flatten().tolist() == [2, 1, 3]  # row 2 sees 101 .. 203
    assert listed(windowed.num_blocks, windowed.indices)[2][0] == [
        per_slot + 1, per_slot + 2, per_slot + 3]


@pytest.mark.parametrize("shape", ["chain", "window", "tree"])
def test_block_lists_cover_the_rule_and_full_blocks_are_whole(shape):
    """A prefill of 200 tokens (two query tiles) beside a short row: every key the mask_mod
    shows a real query lies in a listed block of the query's tile, nothing outside its own
    slot is listed, and every key of a full block is visible to every query of the tile."""
    rng = random.Random(0)
    starts, lens, t = torch.tensor([40, 3]), torch.tensor([200, 7]), 200
    positions = starts[:, None] + torch.arange(t)
    last = starts + lens - 1
    slots = torch.tensor([1, 2])
    window = 90 if shape == "window" else None
    tree = tree_starts = None
    if shape == "tree":  # row 0's last 40 tokens: a token tree after base 199
        tree = torch.zeros(2, t, dtype=torch.int64)
        parents = random_tree(rng, 40)
        masks = [1]
        for j in range(1, 40):
            masks.append(masks[parents[j]] | (1 << j))
        tree[0, 160:] = torch.tensor(masks)
        tree_starts = torch.tensor([199, -1])
    blocks = key_blocks(positions, last, slots[:, None], num_kv_heads=HK, block_len=S, window=window,
                        tree=tree, tree_starts=tree_starts)
    base = (slots * HK * S).tolist()
    length = storage_view(torch.zeros(3, HK, S, 1)).shape[2]
    dense = create_mask(block_mask(blocks, t, (3, HK, S, 1)).mask_mod, 2, 1, t, length)[:, 0]  # [B, T, L]
    expected = rule(positions, last, window, tree, tree_starts)                        # [B, T, S]
    for b in range(2):  # the mask_mod is the rule, inside the row's slot and nowhere else
        segment = dense[b, :, base[b]:base[b] + S]
        assert torch.equal(segment, expected[b]) and dense[b].sum() == segment.sum()
    partial = [[set(tile) for tile in row] for row in listed(blocks.num_blocks, blocks.indices)]
    full = ([[set(tile) for tile in row] for row in listed(blocks.full_num_blocks, blocks.full_indices)]
            if blocks.full_indices is not None else [[set() for _ in row] for row in partial])
    for b in range(2):
        for q in range(-(-t // QUERY_BLOCK)):
            rows = range(q * QUERY_BLOCK, min((q + 1) * QUERY_BLOCK, int(lens[b])))
            seen = {int(k) // KEY_BLOCK for r in rows for k in dense[b, r].nonzero().flatten()}
            assert seen <= partial[b][q] | full[b][q] and not partial[b][q] & full[b][q]
            own_blocks = set(range(base[b] // KEY_BLOCK, (base[b] + S) // KEY_BLOCK))
            assert partial[b][q] | full[b][q] <= own_blocks
            for block in full[b][q]:
                keys = slice(block * KEY_BLOCK, (block + 1) * KEY_BLOCK)
                assert all(dense[b, r, keys].all() for r in rows), (b, q, block)
    assert any(full[0]) or shape == "window"  # a long chain has whole blocks to skip masking


@pytest.mark.parametrize("window", [None, 70])
def test_a_paged_rows_rule_shows_its_own_positions_where_its_table_puts_them(window):
    """Issue 53: a pool of 7 blocks of 64 (the last the spare), rows whose tables hold blocks
    out of order (2 then 0 then 5; 4 alone) and a padding row of the spare block alone. The
    mask_mod shows each query exactly the storage keys of its row's positions up to its last
    (in the window), through the physical-to-logical map; the block lists hold the row's own
    blocks in its logical order (what a GPU kernel sums in) and cover every key shown."""
    pool, block, t = 7, 64, 5
    spare = pool - 1
    table = torch.tensor([[2, 0, 5, spare], [4, spare, spare, spare], [spare] * 4])
    positions = torch.tensor([[150], [10], [0]]) + torch.arange(t)       # row 2: padding
    last = torch.tensor([152, 12, t - 1])
    blocks = key_blocks(positions, last, table, num_kv_heads=HK, block_len=block, paged=True,
                        window=window)
    length = ((pool - 1) * HK + 1) * block
    dense = create_mask(block_mask(blocks, t, (pool, HK, block, 1)).mask_mod, 3, 1, t, length)[:, 0]
    span = HK * block
    for b in range(3):
        for q in range(t):
            end = min(int(positions[b, q]), int(last[b]))
            shown = range(max(0, end - window + 1) if window else 0, end + 1)
            want = {int(table[b, p // block]) * span + p % block for p in shown}
            assert set(dense[b, q].nonzero().flatten().tolist()) == want, (b, q)
    lists = listed(blocks.num_blocks, blocks.indices)
    assert lists[0][0] == ([2 * HK, 0, 5 * HK] if window is None else [0, 5 * HK])
    assert lists[1][0] == [4 * HK] and lists[2][0] == [spare * HK]


def test_the_paged_map_reaches_the_gpu_kernels_template_as_one_laid_out_buffer():
    """The mask_mod reads the physical-to-logical map, and inductor inlines the ops that make
    it into FlexAttention's Triton template, whose codegen failed on them on an H200 twice: a
    cat's masked loads (2026-11-28), then a scatter's buffer not yet laid out (2026-12-04,
    docs/BENCHMARKS.md). The map is one custom op, whose output the template only loads, made
    once a forward; the old maps, their ops inlined, fail here."""
    from torch.fx.experimental.proxy_tensor import make_fx

    table = torch.tensor([[2, 0, 5, 6], [6, 6, 6, 6]])
    graph = make_fx(lambda table: logical_blocks(table, 7))(table)
    ops = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert ops == ["specserve.logical_blocks.default"], ops
    blocks = KeyBlocks(base=None, last=torch.zeros(2, 1, dtype=torch.long), num_blocks=None,
                       indices=None, table=table).with_map(7)
    assert blocks.logical.tolist() == [[1, -1, 0, -1, -1, 2, -1], [-1] * 6 + [0]]
    assert blocks.with_map(7).logical is blocks.logical  # once: the layers share it


@pytest.mark.parametrize("shape", ["chain", "window", "tree"])
def test_flex_attention_gives_sdpas_outputs(shape):
    """Grouped-query heads, rows in scattered slots, padding queries: each real query's output
    equals SDPA's over its own slot with the rule as a mask (float32)."""
    gen = torch.Generator().manual_seed(1)
    h, d, t = 4, 16, 9
    keys, values = (torch.randn(4, HK, S, d, generator=gen) for _ in range(2))
    q = torch.randn(3, t, h, d, generator=gen)
    positions = torch.tensor([[60], [0], [130]]) + torch.arange(t)
    last = torch.tensor([68, 4, 131])
    slots = torch.tensor([2, 0, 3])
    window = 50 if shape == "window" else None
    tree = tree_starts = None
    if shape == "tree":  # row 0: root at 60, then 1 and 2 children of it, 3 a child of 1...
        masks, parents = [1], [-1, 0, 0, 1, 1, 2, 3, 6, 4]
        for j in range(1, t):
            masks.append(masks[parents[j]] | (1 << j))
        tree = torch.zeros(3, t, dtype=torch.int64)
        tree[0] = torch.tensor(masks)
        tree_starts = torch.tensor([60, -1, -1])
    blocks = key_blocks(positions, last, slots[:, None], num_kv_heads=HK, block_len=S, window=window,
                        tree=tree, tree_starts=tree_starts)
    out = attend(q, keys, values, blocks, d ** -0.5).view(3, t, h, d)
    mask = rule(positions, last, window, tree, tree_starts)                 # [B, T, S]
    for b in range(3):
        want = F.scaled_dot_product_attention(
            q[b:b + 1].transpose(1, 2), keys[slots[b]][None], values[slots[b]][None],
            attn_mask=mask[b][None, None], enable_gqa=True)[0].transpose(0, 1)  # [T, H, D]
        real = int(last[b] - positions[b, 0]) + 1
        torch.testing.assert_close(out[b, :real], want[:real], atol=2e-6, rtol=1e-5)


def library_flex(hf, max_len: int = 256):
    return runtime_of(hf, max_len).use_kernels("library", attention="flex")


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_library_on_flex_matches_transformers(kind):
    """Ragged prefills, then ragged continuations with one row decoding alone (its batch
    padded to 2 rows), crossing a key block: transformers' logits, windows included."""
    hf = tiny_hf_model(kind)
    rt = library_flex(hf)
    cache = rt.make_cache(num_slots=4, max_seq_len=128)
    seqs = random_sequences((70, 17, 9))
    slots = [cache.allocate() for _ in seqs][::-1]  # slots 2, 1, 0: not the rows' order
    cut = [60, 11, 8]
    first = rt(cache, ForwardBatch(slots, [s[:c] for s, c in zip(seqs, cut)], cut)).logits
    second = rt(cache, ForwardBatch(slots[:2], [s[c:] for s, c in zip(seqs[:2], cut[:2])],
                                    [10, 6])).logits
    third = rt(cache, ForwardBatch(slots[2:], [[seqs[2][-1]]])).logits
    got = [*first.split(cut), *second.split([10, 6]), third]
    want = [reference_logits(hf, s) for s in seqs]
    for ours, ref in zip(got, [want[0][:60], want[1][:11], want[2][:8], want[0][60:],
                               want[1][11:], want[2][8:9]]):
        assert (ours - ref).abs().max() <= ATOL


def test_library_on_flex_takes_trees_as_the_c_kernels_do():
    """A batch of token trees (one grown over two forwards, one across a key block) beside a
    chain row: the logits of the default runtime, whose trees are exact chains' (issue 20)."""
    hf = tiny_hf_model("llama-gqa", logit_scale=4.0)
    rng = random.Random(3)
    prefixes = random_sequences((58, 20, 33), seed=4)
    trees = [random_tree(rng, 12), None, random_tree(rng, 9)]
    tokens = [[rng.randrange(3, VOCAB) for _ in range(len(p) if p else 3)] for p in trees]
    outs = []
    for rt in (runtime_of(hf), library_flex(hf)):
        cache = rt.make_cache(num_slots=3, max_seq_len=128)
        slots = [cache.allocate() for _ in prefixes]
        rt(cache, ForwardBatch(slots, prefixes))
        first = [ids[:5] for ids in tokens]  # row 2's tree continues in a second forward
        rt(cache, ForwardBatch(slots[2:], [first[2]], [5], trees=[trees[2][:5]]))
        logits = rt(cache, ForwardBatch(slots, [tokens[0], tokens[1], tokens[2][5:]], [12, 3, 4],
                                        trees=[trees[0], None, trees[2]])).logits
        outs.append(logits)
    assert torch.allclose(outs[0], outs[1], atol=ATOL)


def test_library_pads_decodes_to_the_verify_width(monkeypatch):
    """On CUDA the library path runs decodes at the verify's width (``decode_width``, set by
    use_kernels there): padding tokens change no logit, prefills stay their own width."""
    hf = tiny_hf_model("llama-gqa")
    rt = library_flex(hf)
    rt.decode_width = 5  # what use_kernels(..., verify_tokens=5) sets on CUDA
    widths = []
    prepare = rt._prepare
    monkeypatch.setattr(rt, "_prepare", lambda *a, **k: (out := prepare(*a, **k),
                                                           widths.append(out[1].shape[1]))[0])
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    seq = random_sequences((16,))[0]
    slot = cache.allocate()
    logits = [rt(cache, ForwardBatch([slot], [seq[:9]], [9])).logits,
              rt(cache, ForwardBatch([slot], [seq[9:10]])).logits,
              rt(cache, ForwardBatch([slot], [seq[10:13]], [3])).logits,
              rt(cache, ForwardBatch([slot], [seq[13:]], [3])).logits]
    assert widths == [9, 5, 5, 5] and cache.lengths[slot] == 16
    assert (torch.cat(logits) - reference_logits(hf, seq)).abs().max() <= ATOL


def test_attention_is_flex_on_cuda_and_sdpa_on_a_cpu_by_default():
    rt = runtime_of(tiny_hf_model("llama-gqa")).use_kernels("library", verify_tokens=5)
    assert rt.attention == "sdpa" and rt.decode_width is None  # a CPU: the benchmarks' SDPA
    assert {layer.attn.attention for layer in rt.layers} == {"sdpa"}
    rt.use_kernels("compiled", attention="flex", backend="eager")
    assert {layer.attn.attention for layer in rt.layers} == {"flex"}
    with pytest.raises(ConfigError, match="attention"):
        rt.use_kernels("library", attention="paged")
