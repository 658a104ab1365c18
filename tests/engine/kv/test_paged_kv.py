"""The paged KV cache under the model (``PagedKVCache``, issue 34): the same logits bit for bit
as the slot cache, whether a prompt was prefilled whole, in chunks, or partly from the prefix
cache, and through forks, rollbacks and token-tree compaction. On the row-invariant kernels a
token's keys and values depend only on the tokens up to it, and the C attention reads keys
through the block table with the same arithmetic wherever they lie: so these are equalities,
not tolerances. The torch paths (``library``, the kernels' torch fallback) read through
``gather``: equal to the slot cache's too."""

from __future__ import annotations

import pytest
import torch
from specserve.engine.kv.kv_cache import PagedKVCache
from specserve.engine.runtime.forward_batch import ForwardBatch

from tests.models import random_sequences, runtime_of, tiny_hf_model

BS = 16


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama-gqa", seed=3, logit_scale=3.0)


def paged(rt, num_blocks: int = 64, num_slots: int = 4, **kwargs) -> PagedKVCache:
    attn = rt.layers[0].attn
    return PagedKVCache(num_layers=len(rt.layers), num_blocks=num_blocks, block_size=BS,
                        num_slots=num_slots, num_kv_heads=attn.num_kv_heads, max_seq_len=256,
                        head_dim=attn.head_dim, **kwargs)


def steps(rt, cache, prompts, chunks=None):
    """Prefill ``prompts`` (in ``chunks`` of those sizes, else whole; from what the cache
    already holds), then 3 greedy decodes, a verify of 4 drafts rolled back to 2, and 2
    decodes; every forward's logits, concatenated."""
    slots = [cache.allocate() for _ in prompts]
    out = []
    for slot, prompt in zip(slots, prompts):
        done = cache.match(slot, prompt) if hasattr(cache, "match") else 0
        cache_len = done
        for size in chunks or [len(prompt)]:
            piece = prompt[cache_len:cache_len + size]
            if piece:
                out.append(rt(cache, ForwardBatch([slot], [piece])).logits)
                cache_len += len(piece)
        assert cache_len == len(prompt)
    last = [int(o.argmax()) for o in out[-len(prompts):]] if not chunks else \
        [int(out[-1].argmax())] * len(prompts)
    for i in range(7):
        if i == 3:  # a verify: drafts 1..4, two kept
            logits = rt(cache, ForwardBatch(slots, [[t, 1, 2, 3, 4] for t in last],
                                            [5] * len(slots))).logits
            for slot in slots:
                cache.rollback(slot, cache.lengths[slot] - 2)
            last = [int(x) for x in logits.view(len(slots), 5, -1)[:, 2].argmax(-1)]
        else:
            logits = rt(cache, ForwardBatch(slots, [[t] for t in last])).logits
            last = [int(x) for x in logits.argmax(-1)]
        out.append(logits)
    return torch.cat(out), slots


@pytest.mark.parametrize("kernels", ["invariant", "torch", "library"])
def test_paged_logits_are_the_slot_caches_bit_for_bit(hf, kernels, monkeypatch):
    """Three rows of 21, 40 and 5 tokens (blocks part-filled, and a row past two blocks)."""
    rt = runtime_of(hf).use_kernels("library" if kernels == "library" else "invariant")
    if kernels == "torch":  # the invariant kernels' torch fallback: reads through gather
        monkeypatch.setattr("specserve.engine.runtime.layers.native_ready", lambda x: False)
    prompts = random_sequences((21, 40, 5), seed=1)
    slot_out, _ = steps(rt, rt.make_cache(num_slots=4, max_seq_len=256), prompts)
    paged_out, _ = steps(rt, paged(rt), prompts)
    assert torch.equal(paged_out, slot_out)


def test_a_prefix_hit_and_any_chunking_give_a_fresh_prefills_bits(hf):
    """Turn 1 (40 tokens) is served and freed; turn 2 (its 40 and 29 more) finds 32 of them
    cached (two full blocks) and prefills the rest, whole or in chunks of 7 and 13: every
    logit equals a fresh cache's whole prefill."""
    rt = runtime_of(hf)
    turn1, more = random_sequences((40, 29), seed=2)
    turn2 = turn1 + more
    fresh, _ = steps(rt, paged(rt), [turn2])
    for chunks in (None, [7, 13, 7, 13, 7, 13, 9]):
        cache = paged(rt)
        _, (slot,) = steps(rt, cache, [turn1])
        cache.commit(slot, turn1)
        cache.free(slot)
        hit, (slot,) = steps(rt, cache, [turn2], chunks=chunks)
        assert cache.manager.stats.hits == 32
        want = fresh if chunks is None else _chunked_reference(rt, turn2, chunks)
        assert torch.equal(hit, want)


def _chunked_reference(rt, prompt, chunks):
    """The same chunks on a fresh slot cache, after a first one of the 32 cached positions
    (whose logits the hit never computed)."""
    out, _ = steps(rt, rt.make_cache(num_slots=4, max_seq_len=256), [prompt],
                   chunks=[32, *chunks])
    return out[1:]


def test_a_fork_shares_the_prompt_and_copies_its_last_block(hf):
    """``n > 1``: two samples forked after a 37-token prompt decode on as two fresh
    sequences would; the prompt's two full blocks are shared, its third copied."""
    rt = runtime_of(hf)
    prompt = random_sequences((37,), seed=4)[0]
    cache = paged(rt)
    a = cache.allocate()
    rt(cache, ForwardBatch([a], [prompt]))
    b = cache.allocate()
    cache.fork(a, b, len(prompt))
    assert cache.manager.tables[b][:2] == cache.manager.tables[a][:2]
    forked = rt(cache, ForwardBatch([a, b], [[7, 8], [9, 10]], [2, 2])).logits
    ref = rt.make_cache(num_slots=4, max_seq_len=256)
    x, y = ref.allocate(), ref.allocate()
    rt(ref, ForwardBatch([x, y], [prompt, prompt]))
    assert torch.equal(forked, rt(ref, ForwardBatch([x, y], [[7, 8], [9, 10]], [2, 2])).logits)
    cache.free(a)
    cache.free(b)
    cache.manager.check()


def test_a_tree_verify_keeps_its_path_through_the_block_table(hf):
    """A token tree verified across a block boundary, its kept path compacted (``keep``):
    the next decode's logits are the slot cache's."""
    rt = runtime_of(hf)
    prompt = random_sequences((14,), seed=5)[0]
    parents = [-1, 0, 0, 1, 2, 4]  # tokens 1 and 2 both follow 0, 3 follows 1, 4 follows 2
    out = []
    for cache in (rt.make_cache(num_slots=4, max_seq_len=256), paged(rt)):
        slot = cache.allocate()
        rt(cache, ForwardBatch([slot], [prompt]))
        tree = rt(cache, ForwardBatch([slot], [[5, 6, 7, 8, 9, 10]], [6], trees=[parents])).logits
        cache.keep(slot, [14, 16, 18, 19], at=14)  # the path 0 -> 2 -> 4 -> 5
        out.append(torch.cat([tree, rt(cache, ForwardBatch([slot], [[11]])).logits]))
    assert torch.equal(out[0], out[1])


def test_padding_queries_read_nothing_past_a_rows_blocks(hf):
    """A one-token row beside a five-token one is padded to five queries; at a block's end
    its padding would sit past the blocks it holds. Padding queries read up to the row's
    last real token (found by the TP ranks, which hold no spare blocks)."""
    rt = runtime_of(hf)
    outs = []
    for cache in (rt.make_cache(num_slots=4, max_seq_len=256), paged(rt)):
        a, b = cache.allocate(), cache.allocate()
        first, second = random_sequences((63, 10), seed=6)
        rt(cache, ForwardBatch([a], [first]))
        rt(cache, ForwardBatch([b], [second]))
        # a: positions 63..67
        outs.append(rt(cache, ForwardBatch([a, b], [[5], [1, 2, 3, 4, 5]], [1, 5])).logits)
    assert len(cache.manager.tables[a]) == 4 and torch.equal(outs[0], outs[1])


def test_a_forwards_new_tokens_are_located_from_lists_as_from_tensors(hf):
    """``locate_new`` (the host's lists, what a forward uses) places each new token where
    ``locate`` (tensors through the block table) does, on both caches: rows part-filled, one
    crossing a block, one padded."""
    rt = runtime_of(hf)
    for cache in (rt.make_cache(num_slots=4, max_seq_len=256), paged(rt)):
        slots = [cache.allocate() for _ in range(3)]
        for slot, prompt in zip(slots, random_sequences((13, 30, 2), seed=7)):
            rt(cache, ForwardBatch([slot], [prompt]))
        starts, lens = [cache.lengths[s] for s in slots], [5, 1, 3]
        cache.reserve(slots, [s + n for s, n in zip(starts, lens)])
        positions = torch.tensor(starts)[:, None] + torch.arange(5)[None]
        valid = torch.arange(5)[None] < torch.tensor(lens)[:, None]
        expected = cache.locate(cache.block_table(slots), positions, valid)
        got = cache.locate_new(slots, starts, lens)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), type(cache).__name__
