"""Paged KV where the GPU's kernels run (issue 53), on a CPU: the compiled path (bucketed static
shapes; dynamo's eager backend, as ``test_compiled.py`` runs it) with SDPA and with
FlexAttention, and the library's FlexAttention, over a pool of 64-position blocks whose
tables are scrambled (blocks out of order, a row's blocks apart): a decode, a verify of
K + 1, prefills whole and in chunks (a 16-token chunk runs in the compiled graph), a
prefix-cache hit against a miss, and greedy speculation through the engine.

With SDPA (the compiled path gathers each row's blocks in table order) the logits are the
slot cache's bit for bit. With FlexAttention they are within 1e-4 with the same argmax,
and why not bit for bit is this CPU's: torch's eager FlexAttention (never the GPU's path)
computes every query against the whole storage view and reduces over keys in storage
order, so where a row's blocks lie changes the order of its sums (rows of one block come
out exact; measured differences 7-9e-6). A GPU kernel reads the listed blocks, which
``key_blocks`` lists in the row's logical order (``test_block_attention.py`` checks the
lists and the physical-to-logical rule exactly); bit equality there is ``make gpu-check``'s
``paged`` entry to show.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch
from specserve.config import KVCacheConfig, SamplingParams
from specserve.engine.drafts.ngram import NgramProposer
from specserve.engine.runtime import block_attention
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError

from tests.engine.kv.test_paged_kv import steps
from tests.engine.test_spec_decode import EOS, prompts
from tests.models import random_sequences, runtime_of, tiny_hf_model
from tests.tiny import make_tiny_tokenizer

KERNELS = [("compiled", "sdpa"), ("compiled", "flex"), ("library", "flex")]
BLOCK = 64
FLEX_ATOL = 1e-4  # eager FlexAttention's reduction order on a CPU (module docstring)


def assert_same(got: torch.Tensor, want: torch.Tensor, attention: str) -> None:
    """Bit for bit with SDPA; with FlexAttention within FLEX_ATOL and the same argmax."""
    if attention == "sdpa":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= FLEX_ATOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama-gqa", seed=3, logit_scale=3.0)


def runtime(hf, kernels: str, attention: str):
    return runtime_of(hf).use_kernels(kernels, backend="eager", attention=attention, verify_tokens=5)


def scrambled(rt, seed: int = 0, **options):
    """A paged cache of 16 blocks of 64 whose pool hands blocks out in a shuffled order."""
    cache = rt.make_paged_cache(4, 256, block_size=BLOCK, num_blocks=16, **options)
    order = list(range(16))
    random.Random(seed).shuffle(order)
    cache.manager.pool._free = OrderedDict((b, None) for b in order)
    return cache


@pytest.mark.parametrize(("kernels", "attention"), KERNELS)
def test_paged_logits_equal_the_slot_caches_on_the_gpus_kernels(hf, kernels, attention):
    """Rows of 21, 70 (past a block) and 5 tokens: prefills, 3 decodes, a verify of 5 rolled
    back to 2, 2 decodes (``test_paged_kv.steps``), each row's blocks scattered in the pool."""
    rt = runtime(hf, kernels, attention)
    rows = random_sequences((21, 70, 5), seed=1)
    want, _ = steps(rt, rt.make_cache(num_slots=4, max_seq_len=256), rows)
    cache = scrambled(rt)
    got, slots = steps(rt, cache, rows)
    tables = [cache.manager.tables[s] for s in slots]
    assert any(t != sorted(t) or t[0] > min(u[0] for u in tables) for t in tables), tables
    assert_same(got, want, attention)


@pytest.mark.parametrize(("kernels", "attention"), KERNELS)
def test_a_prefix_hit_and_chunks_give_a_fresh_prefills_bits(hf, kernels, attention):
    """Turn 1 (150 tokens) is served and freed; turn 2 (its 150 and 60 more) finds 128 cached
    (two full blocks) and prefills the rest, whole or in chunks of 16, 16, 30 and 20: every
    logit equals the slot cache's with the same forwards (a fresh prefill of the cached 128
    first, whose logits the hit never computes)."""
    rt = runtime(hf, kernels, attention)
    turn1, more = random_sequences((150, 60), seed=2)
    turn2 = turn1 + more
    for chunks in (None, [16, 16, 30, 20]):
        cache = scrambled(rt, seed=3)
        _, (slot,) = steps(rt, cache, [turn1])
        cache.commit(slot, turn1)
        cache.free(slot)
        hit, _ = steps(rt, cache, [turn2], chunks=chunks)
        assert cache.manager.stats.hits == 2 * BLOCK
        want, _ = steps(rt, rt.make_cache(num_slots=4, max_seq_len=256), [turn2],
                        chunks=[2 * BLOCK, *(chunks or [len(turn2) - 2 * BLOCK])])
        assert_same(hit, want[1:], attention)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_padding_writes_only_the_spare_block(hf, attention):
    """A bucket of 2 rows x 8 tokens (a decode beside a verify of 3): padding tokens and rows
    land in the pool's spare block, which no table holds; no other block changes but at the
    rows' new positions."""
    rt = runtime(hf, "compiled", attention)
    cache = scrambled(rt, seed=4)
    a, b, idle = (cache.allocate() for _ in range(3))
    for slot, n in ((a, 64), (b, 7), (idle, 11)):
        rt(cache, ForwardBatch([slot], [list(range(3, 3 + n))]))
    before = [t.clone() for t in cache.k + cache.v]
    rt(cache, ForwardBatch([a, b, idle], [[4], [5, 6, 7], [8]], [1, 3, 1]))  # rows 3 -> bucket 4
    tables = cache.manager.tables
    expected = {(tables[a][1], 0), (tables[b][0], 7), (tables[b][0], 8), (tables[b][0], 9),
                (tables[idle][0], 11)}
    for old, new in zip(before, cache.k + cache.v):
        changed = (old != new).any(-1).any(1)  # [blocks + 1, 64]
        written = {(int(blk), int(off)) for blk, off in changed.nonzero()}
        assert {w for w in written if w[0] != cache.spare_block} == expected
    assert cache.spare_block == 16 and all(16 not in t for t in tables)


def test_a_planted_wrong_map_is_caught(hf, monkeypatch):
    """The physical-to-logical map with two of a row's blocks swapped gives other logits."""
    rt = runtime(hf, "compiled", "flex")
    rows = random_sequences((21, 70, 5), seed=1)
    want, _ = steps(rt, rt.make_cache(num_slots=4, max_seq_len=256), rows)
    real = block_attention.logical_blocks

    def swapped(table, num_blocks):
        logical = real(table, num_blocks)
        first, second = table[:, 0], table[:, 1]
        return logical.scatter(1, torch.stack([first, second], 1),
                               logical.gather(1, torch.stack([second, first], 1)))

    monkeypatch.setattr(block_attention, "logical_blocks", swapped)
    got, _ = steps(rt, scrambled(rt), rows)
    assert (got - want).abs().max() > 100 * FLEX_ATOL


def test_greedy_speculation_on_paged_compiled_flex_is_target_only_on_slots(hf):
    """Through the engine (a worker with ``kv_cache: paged``, block size 64): greedy n-gram
    speculation on the compiled path over FlexAttention emits what target-only emits on a
    slot cache, and the second pass of the same prompts hits the prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=24)
    first = [(p * 16)[:80] for p in prompts(4, seed=9)]  # a full block each, to cache
    reference = SpecDecodeEngine(ModelWorker(runtime(hf, "compiled", "flex"), num_slots=4, max_seq_len=256),
                                 make_tiny_tokenizer(), eos_token_ids=EOS)
    want = [c.output_token_ids for c in reference.generate(first, params)]
    worker = ModelWorker(runtime(hf, "compiled", "flex"), num_slots=4, max_seq_len=256,
                         kv=KVCacheConfig(layout="paged", block_size=BLOCK))
    engine = SpecDecodeEngine(worker, make_tiny_tokenizer(), eos_token_ids=EOS,
                              proposer=NgramProposer(), num_speculative_tokens=4)
    for _ in range(2):
        assert [c.output_token_ids for c in engine.generate(first, params)] == want
    assert worker.cache.paged and worker.cache.manager.stats.hits > 0
    assert worker.num_free_slots == 4


def test_flex_attention_needs_blocks_of_its_key_block(hf):
    with pytest.raises(ConfigError, match="multiple of 64"):
        runtime(hf, "library", "flex").make_paged_cache(4, 256, block_size=16, num_blocks=64)
