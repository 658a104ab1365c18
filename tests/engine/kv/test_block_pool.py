"""The KV block pool (``engine/kv/block_pool.py``): reference counts, the prefix cache's hashes,
and the order free blocks are handed out in."""

from __future__ import annotations

import subprocess
import sys

import pytest
from specserve.engine.kv.block_pool import BlockPool, hash_blocks
from specserve.errors import CapacityError


def test_a_blocks_hash_covers_every_token_before_it_and_the_salt():
    base = hash_blocks(list(range(12)), 4)
    assert len(base) == 3 and len(set(base)) == 3
    for changed in range(12):  # any earlier token changes this block's hash and every later one
        tokens = list(range(12))
        tokens[changed] = 99
        other = hash_blocks(tokens, 4)
        first = changed // 4
        assert other[:first] == base[:first]
        assert all(a != b for a, b in zip(other[first:], base[first:]))
    assert hash_blocks(list(range(12)), 4, salt="a") != hash_blocks(list(range(12)), 4, salt="b")
    assert hash_blocks(list(range(11)), 4) == base[:2]  # a partly filled block has none


def test_hashes_are_stable_across_processes():
    """BLAKE2b, not Python's ``hash`` (salted per process for strings): two units compare
    hashes when the router looks for a prefix."""
    assert len(hash_blocks([1, 2], 2)[0]) == 16
    code = ("from specserve.engine.kv.block_pool import hash_blocks; "
            "print(hash_blocks([1, 2, 3], 3, salt='s')[0].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == hash_blocks([1, 2, 3], 3, salt="s")[0].hex()


def test_allocation_is_all_or_nothing_and_counts_references():
    pool = BlockPool(4)
    a = pool.allocate(3)
    with pytest.raises(CapacityError, match="2 KV blocks asked, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.cache(a[0], b"h0")
    pool.take([a[0]])
    pool.free([a[0]])
    assert pool.ref_counts[a[0]] == 1 and pool.num_free == 1
    with pytest.raises(ValueError, match="not held"):
        pool.free([pool.allocate(1)[0]] * 2)
    pool.check()


def test_free_blocks_go_out_uncached_first_then_least_recently_freed():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks[:3]):
        pool.cache(block, bytes([i]))
    pool.free([blocks[1]])     # cached, freed first
    pool.free([blocks[3]])     # caches nothing: goes out first of all
    pool.free([blocks[0], blocks[2]])
    assert pool.allocate(1) == [blocks[3]] and pool.evictions == 0
    assert pool.allocate(1) == [blocks[1]] and pool.evictions == 1   # the oldest cached one
    assert pool.lookup([bytes([1])]) == [] and pool.lookup([bytes([0])]) == [blocks[0]]
    pool.check()


def test_a_hit_takes_an_unreferenced_cached_block_back_and_lookup_stops_at_a_miss():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache(block, bytes([i]))
    pool.free(reversed(blocks))
    assert pool.lookup([b"\x00", b"\x01", b"\x07", b"\x02"]) == blocks[:2]
    pool.take(blocks[:2])
    assert pool.num_free == 1 and pool.ref_counts[blocks[0]] == 1
    spare = blocks[2]
    pool.allocate(1)  # takes the last free one (cached: evicted)
    pool.free([spare])  # now free and caching nothing
    with pytest.raises(ValueError, match="caches nothing"):
        pool.take([spare])
    pool.check()


def test_the_same_prefix_computed_twice_is_cached_once_and_reset_forgets_only_free_blocks():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    assert pool.cache(a, b"x") and not pool.cache(b, b"x") and pool.hashes[b] is None
    with pytest.raises(ValueError, match="other tokens"):
        pool.cache(a, b"y")
    pool.cache(c, b"z")
    pool.free([a])
    assert pool.reset_cache() == 1 and pool.lookup([b"x"]) == [] and pool.lookup([b"z"]) == [c]
    pool.check()
