"""The paged KV cache's bookkeeping (``engine/kv/kv_manager.py``): block tables, the prefix cache,
forks and rollback, with the planted bugs the identity tests must catch named where they are
guarded: a wrong hash chain, a reused block whose tokens differ, a write into a shared block."""

from __future__ import annotations

import doctest
import random

import pytest
from specserve.engine.kv import block_pool
from specserve.engine.kv.kv_manager import KVManager
from specserve.engine.step import scheduler
from specserve.errors import CapacityError

BS = 4


def manager(num_blocks: int = 16, **kwargs) -> KVManager:
    return KVManager(num_blocks=num_blocks, block_size=BS, num_slots=4, max_seq_len=64, **kwargs)


def run(m: KVManager, tokens: list[int], *, salt: str | None = None, cache: bool = True) -> tuple[int, int]:
    """A sequence that prefills ``tokens`` (what the cache lacks) and commits them; returns
    (slot, positions found cached)."""
    slot = m.allocate(salt=salt, cache=cache)
    cached = m.match(slot, tokens)
    m.reserve(slot, len(tokens))
    m.advance(slot, len(tokens) - cached)
    m.commit(slot, tokens)
    return slot, cached


def test_the_doctests_hold():
    assert doctest.testmod(block_pool).failed == 0
    assert doctest.testmod(scheduler).failed == 0


def test_a_later_turn_reuses_the_full_blocks_of_the_earlier_one():
    m = manager()
    turn1 = list(range(10, 21))                 # 11 tokens: 2 full blocks
    slot, cached = run(m, turn1)
    assert cached == 0 and m.pool.num_cached == 2
    m.free(slot)
    turn2 = turn1 + [5, 6, 7, 8, 9]              # 16 tokens
    slot2, cached = run(m, turn2)
    assert cached == 8 and m.tables[slot2][:2] == m.pool.lookup(block_pool.hash_blocks(turn1, BS))
    assert m.stats.queries == 27 and m.stats.hits == 8
    m.check()


def test_at_least_the_last_token_is_computed():
    m = manager()
    tokens = list(range(8))
    m.free(run(m, tokens)[0])
    slot, cached = run(m, tokens)  # both blocks cached: the last token is computed again
    assert cached == 4 and m.lengths[slot] == 8
    m.check()


def test_a_block_with_the_same_tokens_after_another_prefix_is_not_a_hit():
    """The hash chains over the prefix: with per-block hashes (the planted bug) block 1 of
    the second prompt would be the first's, keys computed after other tokens."""
    m = manager()
    m.free(run(m, [1, 2, 3, 4, 9, 9, 9, 9, 0])[0])
    slot, cached = run(m, [5, 6, 7, 8, 9, 9, 9, 9, 0])
    assert cached == 0
    m.check()


def test_salts_and_opting_out_keep_prefixes_apart():
    m = manager()
    tokens = list(range(13))
    m.free(run(m, tokens, salt="tenant-a")[0])
    assert run(m, tokens, salt="tenant-b")[1] == 0
    assert run(m, tokens)[1] == 0
    assert run(m, tokens, salt="tenant-a")[1] == 12
    m2 = manager()
    m2.free(run(m2, tokens, cache=False)[0])
    assert m2.pool.num_cached == 0 and run(m2, tokens)[1] == 0
    assert manager(prefix_caching=False).match(0, tokens) == 0


def test_drafts_are_never_cached_and_shared_blocks_are_never_rolled_into():
    m = manager()
    slot = m.allocate()
    prompt = list(range(6))
    m.reserve(slot, 6 + 4)
    m.advance(slot, 6 + 4)            # the prompt and 4 drafts
    m.rollback(slot, 7)               # one draft accepted: 7 committed
    assert m.commit(slot, prompt + [100, 101]) == 1  # block 0 only: block 1 (4..7) is not full
    assert m.pool.num_cached == 1
    with pytest.raises(ValueError, match="first 4 positions are shared"):
        m.rollback(slot, 3)
    m.reserve(slot, 9)
    m.advance(slot, 2)
    assert m.commit(slot, prompt + [100, 101, 102, 103]) == 1  # block 1 full of committed tokens
    assert m.writable_from(slot) == 8
    m.check()


def test_a_fork_shares_full_blocks_and_copies_the_partly_filled_one():
    m = manager(num_blocks=8)
    src, _ = run(m, list(range(10)))            # blocks: 0..3 full, 4..7 full, 8..9 partial
    dst = m.allocate()
    copy = m.fork(src, dst, 10)
    assert copy == (m.tables[src][2], m.tables[dst][2]) and copy[0] != copy[1]
    assert m.tables[dst][:2] == m.tables[src][:2]
    assert [m.pool.ref_counts[b] for b in m.tables[src]] == [2, 2, 1]
    assert m.writable_from(dst) == m.writable_from(src) == 8
    assert m.fork(src, m.allocate(), 8) is None
    m.free(src)
    m.free(dst)
    m.check()


def test_reserve_is_all_or_nothing_and_evicts_least_recently_used_prefixes():
    m = manager(num_blocks=4)
    a, _ = run(m, list(range(100, 109)))        # 3 blocks, 2 cached
    with pytest.raises(CapacityError, match="2 KV blocks asked, 1 of 4 free"):
        m.reserve(m.allocate(), 8)
    with pytest.raises(CapacityError, match="exceeds the context length of 64"):
        m.reserve(a, 65)
    m.free(a)                                    # its cached blocks stay, reusable
    assert run(m, list(range(100, 104)) + [7])[1] == 4  # a hit on the first block
    run(m, list(range(200, 208)))                # needs 2: the uncached block, then the LRU cached
    assert m.pool.evictions == 1                 # a's second block went; its first is b's
    assert m.match(m.allocate(), list(range(100, 109))) == 4
    m.check()


def test_trim_gives_back_blocks_past_the_length():
    m = manager()
    slot = m.allocate()
    m.reserve(slot, 13)
    m.advance(slot, 13)
    m.rollback(slot, 5)
    assert m.trim(slot) == 2 and len(m.tables[slot]) == 2
    assert m.table_rows([slot, m.allocate()], width=3) == [[*m.tables[slot], m.tables[slot][-1]], [0, 0, 0]]
    m.check()


def test_random_workloads_keep_every_count_true():
    """Sequences that match, grow by drafts, roll back, commit, fork and free at random: the
    pool's counts, free list and cache stay consistent, and every block two tables share is
    a full block of committed tokens (never written again)."""
    rng = random.Random(0)
    m = KVManager(num_blocks=40, block_size=BS, num_slots=8, max_seq_len=64)
    live: dict[int, list[int]] = {}
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    for _ in range(400):
        op = rng.random()
        try:
            if op < 0.3 and m.num_free_slots:
                tokens = list(rng.choice(prompts))
                slot = m.allocate()
                cached = m.match(slot, tokens)
                m.reserve(slot, len(tokens))
                m.advance(slot, len(tokens) - cached)
                m.commit(slot, tokens)
                live[slot] = tokens
            elif op < 0.7 and live:
                slot = rng.choice(list(live))
                k = rng.randrange(0, 4)
                m.reserve(slot, m.lengths[slot] + k + 1)
                m.advance(slot, k + 1)
                kept = rng.randrange(0, k + 1)
                m.rollback(slot, m.lengths[slot] - k - 1 + kept + 1)
                live[slot] += [rng.randrange(5) for _ in range(kept + 1)]
                m.commit(slot, live[slot])
            elif op < 0.8 and live and m.num_free_slots:
                src = rng.choice(list(live))
                dst = m.allocate()
                m.fork(src, dst, m.lengths[src])
                live[dst] = list(live[src])
            elif live:
                slot = rng.choice(list(live))
                m.free(slot)
                del live[slot]
        except CapacityError:
            for slot in [s for s in range(m.num_slots) if s not in live and s not in m._free_slots]:
                m.free(slot)
        m.check()
        for slot, tokens in live.items():
            assert m.lengths[slot] == len(tokens)
            assert m.writable_from(slot) <= m.lengths[slot]
            for i, block in enumerate(m.tables[slot]):  # shared or cached: never written again
                if m.pool.ref_counts[block] > 1 or m.pool.hashes[block] is not None:
                    assert (i + 1) * BS <= m.writable_from(slot), (slot, i)
    assert m.stats.hits > 100 and m.stats.forks > 10 and m.pool.evictions > 10, m.stats


def test_the_shortfall_counts_new_blocks_against_free_ones_cached_included():
    """What the scheduler asks before a step (``Scheduler.schedule``): the blocks that
    rows growing to given lengths need beyond those they hold, against the free ones; a
    cached block no sequence holds is free (taking it evicts it)."""
    m = KVManager(num_blocks=6, block_size=4, num_slots=3, max_seq_len=16)
    old, _ = run(m, list(range(9)))        # 3 blocks, 2 of them full and cached
    m.free(old)                            # all 6 free again, 2 of them cached
    a, _ = run(m, [50] * 5)                # 2 blocks: 4 free
    assert m.kv_shortfall([(a, 8)]) == 0                 # its 2 blocks hold 8 positions
    assert m.kv_shortfall([(a, 12), (-1, 9)]) == 0       # 1 + 3 of the 4 free
    assert m.kv_shortfall([(a, 12), (-1, 9)], extra_blocks=2) == 2
    assert m.kv_shortfall([(-1, 100)]) == 0              # capped at max_seq_len: 4 blocks
