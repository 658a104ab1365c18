"""The KV block pool: fixed-size blocks of KV memory, who holds them, and the prefix cache.

Vocabulary (vLLM v1's ``block_pool.py`` has the same shape):

- A **block** is ``block_size`` consecutive token positions of one sequence's keys and values,
  in every layer (the storage lives with the model: :mod:`specserve.engine.kv.kv_cache`). Blocks
  are named by an id ``0 .. num_blocks - 1``; a sequence's **block table** lists its blocks
  in position order (:mod:`specserve.engine.kv.kv_manager`).
- A block's **reference count** is the number of sequences whose table holds it: ``n > 1``
  samples of one prompt share the prompt's full blocks, and a prefix-cache hit shares a
  finished sequence's.
- A block is **cached** when it is full of committed tokens (never drafts: drafted tokens are
  cached only once accepted) and has a **block hash**: :func:`hash_blocks` chains each full
  block's tokens onto the hash of everything before it, so equal hashes mean the same tokens
  from position 0, hence the same keys and values (on row-invariant kernels bit for bit:
  a token's K/V depend only on the tokens up to it, not on the forward that computed them).
  The first block's parent is the **salt**: requests with different salts never share.
- An **unreferenced** block (count 0) is free: it can be handed out. A cached one keeps its
  hash until then, so a later request with the same prefix takes it back (a hit). Free blocks
  are handed out in order: first those holding nothing worth keeping (never used, or not
  cached), then cached ones least recently freed first (LRU eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from specserve.errors import CapacityError

BlockHash = bytes  # 16 bytes of BLAKE2b: stable across processes (two units compare them)

ROOT = b"specserve-kv-v1"  # the parent of every first block, before the salt


def hash_blocks(tokens: Sequence[int], block_size: int, *, salt: str | None = None,
                parent: BlockHash | None = None, start: int = 0) -> list[BlockHash]:
    """The chained hashes of the full blocks of ``tokens`` from block index ``start``
    (``parent``: the hash of block ``start - 1``; ``None`` with ``start`` 0, or the salt's
    root). A partly filled last block has none.

    >>> a, b = hash_blocks([1, 2, 3, 4, 5], 2), hash_blocks([9, 9, 3, 4], 2)
    >>> len(a), a[0] != b[0], a[1] != b[1]  # block 1 holds 3, 4 in both: its prefix differs
    (2, True, True)
    >>> hash_blocks([1, 2, 3, 4], 2, start=1, parent=a[0]) == a[1:]
    True
    >>> hash_blocks([1, 2], 2, salt="tenant-a") != hash_blocks([1, 2], 2)
    True
    """
    assert block_size >= 1 and start >= 0 and (parent is None) == (start == 0)
    if parent is None:
        parent = _digest(ROOT, b"" if salt is None else b"salt:" + salt.encode())
    out = []
    for i in range(start, len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = _digest(parent, b",".join(str(int(t)).encode() for t in block))
        out.append(parent)
    return out


def _digest(parent: bytes, data: bytes) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"|")
    h.update(data)
    return h.digest()


class BlockPool:
    """``num_blocks`` block ids with their reference counts, hashes and the free order.

    Every method is O(blocks it touches). Nothing here knows sequences or tensors:
    :class:`~specserve.engine.kv.kv_manager.KVManager` keeps the tables and decides what to
    share, cache or free; the model's storage holds the bytes.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}   # hash -> the block holding it
        # Unreferenced blocks in hand-out order: the front goes first. Blocks holding nothing
        # worth keeping are put at the front, cached ones at the back (most recently freed last).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0  # cached blocks handed out for other content (a metric)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached unreferenced ones included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for new content, each referenced once; a cached one loses its hash
        (evicted). All or nothing: :class:`CapacityError` when fewer than ``n`` are free."""
        if n > len(self._free):
            raise CapacityError(f"{n} KV blocks asked, {len(self._free)} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks caching the longest run of ``hashes`` from the first (not referenced
        here: :meth:`take` them to use them)."""
        out = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def take(self, blocks: Iterable[int]) -> None:
        """One more reference to each of ``blocks`` (held or cached ones: a prefix hit, a fork)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                if self.hashes[block] is None:
                    raise ValueError(f"block {block} is free and caches nothing: allocate it")
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """One reference fewer to each of ``blocks``, in the order given: pass a table's
        blocks last first, so that of one sequence's cached blocks its first (the prefix
        others are likeliest to share) are evicted last."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.hashes[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing to keep: hand out first

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Record that held ``block`` is full of committed tokens whose chained hash is
        ``block_hash``. False (nothing recorded) when another block caches that hash already
        (two sequences computed the same prefix at once): this one stays uncached."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not held")
        if self.hashes[block] is not None:
            if self.hashes[block] != block_hash:
                raise ValueError(f"block {block} already caches other tokens")
            return True
        if block_hash in self._cached:
            return False
        self.hashes[block] = block_hash
        self._cached[block_hash] = block
        return True

    def _uncache(self, block: int) -> None:
        h = self.hashes[block]
        if h is not None:
            del self._cached[h]
            self.hashes[block] = None
            self.evictions += 1

    def reset_cache(self) -> int:
        """Forget every cached hash of an unreferenced block (the cache turned off, or a
        weight change); returns how many. Held blocks keep theirs."""
        dropped = [b for b in self._free if self.hashes[b] is not None]
        for block in dropped:
            del self._cached[self.hashes[block]]
            self.hashes[block] = None
            self._free.move_to_end(block, last=False)
        return len(dropped)

    def check(self) -> None:
        """Assert the pool's invariants (tests, and a leak check after a unit drains)."""
        assert all(c >= 0 for c in self.ref_counts)
        assert set(self._free) == {b for b, c in enumerate(self.ref_counts) if c == 0}
        assert self._cached == {h: b for b, h in enumerate(self.hashes) if h is not None}
