"""Sequences' block tables over a :class:`~specserve.engine.kv.block_pool.BlockPool`: the paged
KV cache's bookkeeping, in place of :class:`~specserve.engine.kv.kv_cache.SlotTable`'s.

A sequence is still named by a *slot* (``0 .. num_slots - 1``): the handle every caller
already passes, now the row of a block-table tensor instead of a row of preallocated storage.
Position ``p`` of slot ``s`` lives in block ``tables[s][p // block_size]`` at offset
``p % block_size``. A sequence holds the blocks its longest write reached (drafts included),
not ``max_seq_len`` of them: the pool, not the slot count, bounds how many tokens a unit
holds.

What the manager guarantees the storage:

- **Shared and cached blocks are never written.** A prefix hit and a fork share whole blocks
  only (a fork's partly filled last block is a fresh block, copied by the caller:
  :meth:`fork`), drafts land past every shared block, and :meth:`rollback` refuses to go back
  into one. So writes stay in blocks only their own sequence holds.
- **A cached block holds committed tokens only**: :meth:`commit` is told the tokens the
  sequence keeps (its prompt and its accepted outputs), never drafts.
- **At least one token is computed**: a prompt whose every full block is cached still prefills
  its last token (:meth:`match`), whose logits the request needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.kv.block_pool import BlockHash, BlockPool, hash_blocks
from specserve.errors import CapacityError


@dataclass
class _Chain:
    """How far a slot's prefix is hashed: ``blocks`` full blocks, the last with ``last``."""
    salt: str | None = None
    blocks: int = 0
    last: BlockHash | None = None
    caching: bool = True  # False: this sequence's blocks are never cached (opted out)


@dataclass
class KVStats:
    """Counters for ``/metrics`` (vLLM's names: prefix cache queries and hits, in tokens)."""
    queries: int = 0        # prompt tokens looked up
    hits: int = 0           # of those, found cached
    forks: int = 0
    copied_blocks: int = 0  # partly filled blocks a fork copied


class KVManager:
    """``num_slots`` sequences' block tables over ``num_blocks`` blocks of ``block_size``
    positions; sequences of at most ``max_seq_len`` tokens."""

    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int, max_seq_len: int,
                 prefix_caching: bool = True) -> None:
        assert block_size >= 1 and num_slots >= 1 and max_seq_len >= 1
        self.pool = BlockPool(num_blocks)
        self.block_size, self.num_slots, self.max_seq_len = block_size, num_slots, max_seq_len
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.prefix_caching = prefix_caching
        self.lengths = [0] * num_slots
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self._chains = [_Chain() for _ in range(num_slots)]
        self._shared = [0] * num_slots   # leading blocks that must not be written (shared or cached)
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self.stats = KVStats()

    # -- slots -----------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate(self, *, salt: str | None = None, cache: bool = True) -> int:
        """A slot for a new sequence, holding no block yet. ``salt``: its prefix is shared only
        with sequences of the same salt; ``cache=False``: its blocks are never cached."""
        if not self._free_slots:
            raise CapacityError(f"all {self.num_slots} sequence slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        self._chains[slot] = _Chain(salt=salt, caching=cache and self.prefix_caching)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot and its blocks back (last block first: :meth:`BlockPool.free`). Its
        cached blocks stay reusable until evicted."""
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self.pool.free(reversed(self.tables[slot]))
        self.tables[slot], self.lengths[slot], self._shared[slot] = [], 0, 0
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    # -- lengths and blocks ----------------------------------------------------------------------
    paged = True

    def blocks_needed(self, slot: int, length: int) -> int:
        """New blocks slot ``slot`` needs to hold ``length`` positions (-1: an unadmitted
        sequence, which holds none)."""
        held = len(self.tables[slot]) if slot >= 0 else 0
        return max(0, -(-min(length, self.max_seq_len) // self.block_size) - held)

    def kv_shortfall(self, needs: list[tuple[int, int]], extra_blocks: int = 0) -> int:
        """Blocks missing for every ``(slot, positions)`` of ``needs`` to hold that many, plus
        ``extra_blocks``: beyond the free ones (cached blocks no sequence holds count as
        free: taking one evicts it). 0: they fit (the scheduler preempts otherwise)."""
        want = extra_blocks + sum(self.blocks_needed(slot, length) for slot, length in needs)
        return max(0, want - self.pool.num_free)

    def reserve(self, slot: int, length: int) -> list[int]:
        """Blocks for positions up to ``length`` (a forward about to write them); returns the
        new ones. All or nothing: :class:`CapacityError` when the pool is short (the scheduler
        preempts then) or past ``max_seq_len``."""
        if length > self.max_seq_len:
            raise CapacityError(f"sequence of {length} tokens exceeds the context length "
                                f"of {self.max_seq_len}")
        new = self.pool.allocate(self.blocks_needed(slot, length))
        self.tables[slot].extend(new)
        return new

    def advance(self, slot: int, num_tokens: int) -> None:
        """The slot's length grows by a forward's ``num_tokens`` (reserved before)."""
        length = self.lengths[slot] + num_tokens
        assert -(-length // self.block_size) <= len(self.tables[slot]), "reserve before writing"
        self.lengths[slot] = length

    def rollback(self, slot: int, length: int) -> None:
        """Forget every position at or after ``length`` (rejected drafts). The blocks stay
        held (the next step writes there again); :meth:`trim` gives them back."""
        if not self._shared[slot] * self.block_size <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} from {self.lengths[slot]} to {length} "
                             f"(its first {self._shared[slot] * self.block_size} positions are shared)")
        self.lengths[slot] = length

    def trim(self, slot: int) -> int:
        """Give back the blocks past the slot's length; returns how many."""
        keep = -(-self.lengths[slot] // self.block_size)
        extra = self.tables[slot][keep:]
        self.pool.free(reversed(extra))
        del self.tables[slot][keep:]
        return len(extra)

    def writable_from(self, slot: int) -> int:
        """The first position a forward may write in this slot."""
        return self._shared[slot] * self.block_size

    # -- sharing ---------------------------------------------------------------------------------
    def match(self, slot: int, tokens: list[int], salt: str | None = None) -> int:
        """A new sequence (no blocks yet) starts with the longest cached prefix of its prompt
        ``tokens``, all but its last token at most; returns the positions it need not compute
        (a multiple of ``block_size``). ``salt``: as :meth:`allocate`'s (it replaces it)."""
        assert not self.tables[slot] and self.lengths[slot] == 0, "match a new sequence only"
        chain = self._chains[slot]
        if salt is not None:
            chain.salt = salt
        self.stats.queries += len(tokens)
        if not chain.caching:
            return 0
        hashes = hash_blocks(tokens[:len(tokens) - 1], self.block_size, salt=chain.salt)
        blocks = self.pool.lookup(hashes)
        self.pool.take(blocks)
        self.tables[slot] = list(blocks)
        self.lengths[slot] = cached = len(blocks) * self.block_size
        self._shared[slot] = chain.blocks = len(blocks)
        chain.last = hashes[len(blocks) - 1] if blocks else None
        self.stats.hits += cached
        return cached

    def commit(self, slot: int, tokens: list[int]) -> int:
        """``tokens``: the sequence's committed tokens (prompt, then accepted outputs), after
        the step's rollback. Caches the full blocks among those whose keys and values are in
        the cache (the first ``length``: the newest token has none yet) not cached before;
        returns how many it cached."""
        chain = self._chains[slot]
        if not chain.caching:
            return 0
        tokens = tokens[:self.lengths[slot]]
        if chain.blocks:
            hashes = hash_blocks(tokens, self.block_size, salt=chain.salt, parent=chain.last,
                                 start=chain.blocks)
        else:
            hashes = hash_blocks(tokens, self.block_size, salt=chain.salt)
        cached = sum(self.pool.cache(self.tables[slot][i], h)
                     for i, h in enumerate(hashes, start=chain.blocks))
        if hashes:
            chain.blocks += len(hashes)
            chain.last = hashes[-1]
            self._shared[slot] = chain.blocks  # cached blocks are read-only from now on
        return cached

    def fork(self, src: int, dst: int, length: int) -> tuple[int, int] | None:
        """New sequence ``dst`` (no blocks yet) starts as ``src``'s first ``length`` positions:
        ``n > 1`` samples of one prompt. Full blocks are shared; a partly filled last block
        is a new block of ``dst``'s, returned as ``(src_block, dst_block)`` for the storage to
        copy (None when ``length`` is a whole number of blocks)."""
        assert not self.tables[dst] and src != dst and 0 <= length <= self.lengths[src]
        full, rest = divmod(length, self.block_size)
        shared = self.tables[src][:full]
        copy = None
        if rest:
            new = self.pool.allocate(1)[0]  # before taking: all or nothing
            copy = (self.tables[src][full], new)
        self.pool.take(shared)
        self.tables[dst] = [*shared, *([copy[1]] if copy else [])]
        self.lengths[dst] = length
        self._shared[dst] = full
        self._shared[src] = max(self._shared[src], full)  # src must not overwrite them either
        src_chain = self._chains[src]
        assert src_chain.blocks <= full, "a fork shares every block its source has cached"
        self._chains[dst] = _Chain(salt=src_chain.salt, blocks=src_chain.blocks,
                                   last=src_chain.last, caching=src_chain.caching)
        self.stats.forks += 1
        self.stats.copied_blocks += copy is not None
        return copy

    # -- what the storage reads ------------------------------------------------------------------
    def table_rows(self, slots: list[int], width: int | None = None) -> list[list[int]]:
        """The block tables of ``slots``, each cut or padded with its last block (or 0) to
        ``width`` blocks (default: the longest): the rows of the block-table tensor a forward
        reads (padding is past every key a row reads)."""
        width = width or max((len(self.tables[s]) for s in slots), default=1)
        return [(t + [t[-1] if t else 0] * (width - len(t)))[:width]
                for t in (self.tables[s] for s in slots)]

    def check(self) -> None:
        """Assert the invariants: every held block counted once per table holding it."""
        self.pool.check()
        counts = [0] * self.pool.num_blocks
        for slot, table in enumerate(self.tables):
            assert len(table) * self.block_size >= self.lengths[slot]
            for block in table:
                counts[block] += 1
        assert counts == self.pool.ref_counts
