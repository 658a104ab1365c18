"""The KV caches: slots, and paged blocks.

**Slots** (:class:`SlotKVCache`, ``kv_cache.layout: slots``): each sequence owns one *slot*, a
row of preallocated key/value storage in every layer, and a *length*, the number of leading
positions whose keys and values are valid. A forward pass appends at ``length`` and moves it
forward; rollback after a rejected draft is simply setting the length back (the stale entries
beyond it are overwritten by the next forward). Every slot holds ``max_seq_len`` positions.

**Paged** (:class:`PagedKVCache`, ``layout: paged``): the same interface (a
sequence is still a slot, ``lengths[slot]`` its positions), the storage a pool of blocks of
``block_size`` positions, each sequence's blocks listed by its block table
(:mod:`~specserve.engine.kv.kv_manager`), so memory follows the tokens held, and full blocks of
committed tokens stay cached for the next request with the same prefix
(:mod:`~specserve.engine.kv.block_pool`). The kernels read both through block tables (a slot is
one block the length of the slot), with the same arithmetic.
"""

from __future__ import annotations

import torch

from specserve.engine.kv.kv_manager import KVManager
from specserve.errors import CapacityError


def new_tokens(slots: list[int], starts: list[int], lens: list[int]) -> list[tuple[int, int]]:
    """``(slot, position)`` of each new token of a forward, row by row in order (row ``i``'s
    ``lens[i]`` tokens from ``starts[i]``; every row has at least one)."""
    return [(slot, p) for slot, s, n in zip(slots, starts, lens) for p in range(s, s + n)]


class SlotTable:
    """Which slots are in use and how long each is: the bookkeeping half of a cache.

    A :class:`SlotKVCache` is a table plus tensors. A coordinator that drives a remote target
    group keeps just the table and sends the start lengths with every forward, so the ranks
    never need a separate rollback call.
    """

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Reserve the lowest free slot (low slots keep a batch contiguous, see ``gather``)."""
        if not self._free:
            raise CapacityError(f"all {self.num_slots} KV cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Freeing a free slot is a bug in the caller, so it raises."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def rollback(self, slot: int, length: int) -> None:
        """Forget every position at or after ``length`` (rejected drafts)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} from {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    paged = False  # a slot holds max_seq_len positions from its allocation: nothing to run out of

    def kv_shortfall(self, needs: list[tuple[int, int]], extra_blocks: int = 0) -> int:
        """Slots hold their whole length: never short (:meth:`KVManager.kv_shortfall
        <specserve.engine.kv.kv_manager.KVManager.kv_shortfall>`)."""
        return 0

    def match(self, slot: int, tokens: list[int], salt: str | None = None) -> int:
        """Positions of ``tokens`` a new sequence finds cached: none, slots cache no prefix
        (:meth:`KVManager.match <specserve.engine.kv.kv_manager.KVManager.match>` does)."""
        return 0

    def commit(self, slot: int, tokens: list[int]) -> int:
        """Slots cache nothing
        (:meth:`KVManager.commit <specserve.engine.kv.kv_manager.KVManager.commit>`)."""
        return 0

    def fork(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` starts as a copy of ``src``'s first ``length`` positions, whatever it
        held: n sequences sampled from one prompt share its prefill (``n > 1``)."""
        if not 0 <= length <= self.lengths[src] or dst == src:
            raise ValueError(f"cannot fork {length} positions of slot {src} into slot {dst}")
        self.lengths[dst] = length


class SlotKVCache(SlotTable):
    """Keys and values for ``num_slots`` sequences of up to ``max_seq_len`` tokens each.

    Storage per layer: ``k[layer]``, ``v[layer]`` of shape
    ``[num_slots, num_kv_heads, max_seq_len, head_dim]`` (heads before positions so a
    slot's keys are the ``[B, H, S, D]`` layout ``scaled_dot_product_attention`` takes).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block: int = 1,
        spare: bool = False,
    ) -> None:
        super().__init__(num_slots)
        assert max_seq_len >= 1
        # Storage in whole blocks of ``block`` positions: a reader may take a slot's keys up
        # to the end of the block its length falls in (never-written positions are zeros).
        # ``spare``: one more slot that no sequence owns, where a static-shape forward writes
        # its padding tokens (``spare_slot``; see specserve.engine.runtime.compiled).
        shape = (num_slots + spare, num_kv_heads, -(-max_seq_len // block) * block, head_dim)
        # torch.zeros on CPU maps untouched pages lazily, so a large cache costs only what is used.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len
        self.spare_slot = num_slots if spare else None

    # -- tensor access used by the model runtime ------------------------------------------------
    def reserve(self, slots: list[int], ends: list[int]) -> None:
        """Room for positions up to ``ends`` (a slot has its whole length already)."""

    def block_table(self, slots: list[int]) -> torch.Tensor:
        """``[B, 1]`` int32: a slot is one block of the whole slot length, for the kernels
        that read through block tables (:class:`PagedKVCache` has real ones)."""
        return torch.tensor(slots, dtype=torch.int32)[:, None]

    @property
    def spare_row(self) -> int | None:
        """The storage row a static-shape forward writes its padding to (the spare slot)."""
        return self.spare_slot

    def locate(self, table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a forward's tokens are stored, on the host: the rows' :meth:`block_table`
        ``[B, W]`` (made once per forward), each token's position ``[B, T]``, the real ones
        ``valid`` ``[B, T]``; ``(row, offset)`` of the storage ``[rows, Hk, S, D]`` per real
        token ``[N]`` (:meth:`write` takes them): a slot is its row."""
        rows = table[:, :1].long().expand(positions.shape)
        return rows[valid], positions[valid]

    def locate_new(self, slots: list[int], starts: list[int], lens: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`locate` of a forward's new tokens (row ``i``'s at ``starts[i]`` onwards,
        ``lens[i]`` of them), from the host's lists: two tensors made, no torch operations."""
        rows, positions = zip(*new_tokens(slots, starts, lens))
        return torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long)

    def write(self, layer: int, rows: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values at storage ``rows`` / ``offsets`` (:meth:`locate`'s, on the
        cache's device: no read back) ``[N]``; ``k``/``v``: ``[N, H, D]``."""
        self.k[layer][rows, :, offsets] = k
        self.v[layer][rows, :, offsets] = v

    def keep(self, slot: int, positions: list[int], at: int) -> None:
        """Token-tree compaction: the keys and values at ``positions`` (increasing, each
        ``>= at``) move to ``at, at + 1, ...`` in every layer, and the slot's length becomes
        ``at + len(positions)``: a verified tree's accepted path, made contiguous as a chain's
        would be (a node's keys and values are those of the same token at the same position
        in a chain, so they move as they are)."""
        assert all(p >= at + i for i, p in enumerate(positions)) and positions == sorted(positions)
        if positions != list(range(at, at + len(positions))):
            device = self.k[0].device
            src = torch.tensor(positions, device=device)
            dst = torch.arange(at, at + len(positions), device=device)
            for storage in (*self.k, *self.v):
                storage[slot, :, dst] = storage[slot, :, src]  # the read copies before the write
        self.rollback(slot, at + len(positions))

    def fork(self, src: int, dst: int, length: int) -> None:
        """:meth:`SlotTable.fork`, with the keys and values copied in every layer."""
        super().fork(src, dst, length)
        for storage in (*self.k, *self.v):
            storage[dst, :, :length] = storage[src, :, :length]

    def gather(self, layer: int, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` up to ``kv_len``: two ``[B, H, kv_len, D]`` tensors.

        Consecutive slots are a view (no copy); otherwise an index-select copy.
        """
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return (self.k[layer][first:first + len(slots), :, :kv_len],
                    self.v[layer][first:first + len(slots), :, :kv_len])
        index = torch.tensor(slots, device=self.k[layer].device)
        return self.k[layer][index, :, :kv_len], self.v[layer][index, :, :kv_len]


class PagedKVCache:
    """Keys and values in blocks of ``block_size`` positions: per layer a pool
    ``k[layer]``, ``v[layer]`` of shape ``[num_blocks, num_kv_heads, block_size, head_dim]``,
    and each sequence's block table (:class:`~specserve.engine.kv.kv_manager.KVManager`, which
    also caches full blocks of committed tokens by prefix). The same interface as
    :class:`SlotKVCache`: a sequence is a slot, ``lengths[slot]`` its positions. A forward
    reserves its blocks first (:meth:`reserve`); the kernels read through
    :meth:`block_table`, so where a block lies changes no arithmetic, and a block taken from
    the prefix cache holds the bits a fresh prefill would write (row-invariant kernels).
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_slots: int,
                 num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 prefix_caching: bool = True, spare: bool = False) -> None:
        self.manager = KVManager(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                                 max_seq_len=max_seq_len, prefix_caching=prefix_caching)
        self.lengths = self.manager.lengths  # the runtime advances it after a forward
        self.num_slots, self.max_seq_len, self.block_size = num_slots, max_seq_len, block_size
        self.spare_slot = None
        # ``spare``: one more block that the pool never hands out, where a static-shape forward
        # writes its padding tokens (specserve.engine.runtime.compiled), and which its padding
        # rows read
        self.spare_block = num_blocks if spare else None
        self.table_width = -(-max_seq_len // block_size)  # blocks a sequence may hold
        shape = (num_blocks + spare, num_kv_heads, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    # -- sequences ------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return self.manager.num_free_slots

    def allocate(self, *, salt: str | None = None, cache: bool = True) -> int:
        return self.manager.allocate(salt=salt, cache=cache)

    def free(self, slot: int) -> None:
        self.manager.free(slot)

    def rollback(self, slot: int, length: int) -> None:
        self.manager.rollback(slot, length)

    paged = True

    def kv_shortfall(self, needs: list[tuple[int, int]], extra_blocks: int = 0) -> int:
        """:meth:`KVManager.kv_shortfall`."""
        return self.manager.kv_shortfall(needs, extra_blocks)

    def match(self, slot: int, tokens: list[int], salt: str | None = None) -> int:
        """A new sequence starts with the longest cached prefix of ``tokens`` (among those of
        the same ``salt``); returns its length (:meth:`KVManager.match`)."""
        return self.manager.match(slot, tokens, salt)

    def commit(self, slot: int, tokens: list[int]) -> int:
        """Cache the full blocks of the sequence's committed ``tokens`` (:meth:`KVManager.commit`)."""
        return self.manager.commit(slot, tokens)

    def fork(self, src: int, dst: int, length: int) -> None:
        """``dst`` starts as ``src``'s first ``length`` positions: full blocks shared, a partly
        filled last block copied."""
        copy = self.manager.fork(src, dst, length)
        if copy is not None:
            self.copy_block(*copy)

    def follow(self, slot: int, length: int, table: list[int]) -> None:
        """A tensor-parallel rank's cache follows the coordinator's
        (:class:`~specserve.serve.target_group.TargetGroup`), which owns allocation, prefix
        matching and caching: ``slot`` holds ``length`` positions in blocks ``table``, already
        reserved there (this cache's own pool is never drawn on)."""
        self.manager.tables[slot] = list(table)
        self.lengths[slot] = length

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src`` in every layer (a fork's partly filled
        last block, decided by the coordinator)."""
        for storage in (*self.k, *self.v):
            storage[dst] = storage[src]

    def keep(self, slot: int, positions: list[int], at: int) -> None:
        """:meth:`SlotKVCache.keep` through the block table."""
        assert all(p >= at + i for i, p in enumerate(positions)) and positions == sorted(positions)
        if positions != list(range(at, at + len(positions))):
            device, every = self.k[0].device, torch.ones(1, len(positions), dtype=torch.bool)
            table = self.block_table([slot])
            src_b, src_o = (x.to(device) for x in self.locate(table, torch.tensor([positions]), every))
            dst_b, dst_o = (x.to(device) for x in self.locate(
                table, torch.arange(at, at + len(positions))[None], every))
            for storage in (*self.k, *self.v):
                storage[dst_b, :, dst_o] = storage[src_b, :, src_o]  # the read copies first
        self.rollback(slot, at + len(positions))

    # -- tensor access used by the model runtime ------------------------------------------------
    def reserve(self, slots: list[int], ends: list[int]) -> None:
        """Blocks for every row's positions up to ``ends``, before a forward writes them
        (:class:`~specserve.errors.CapacityError` when the pool is short)."""
        for slot, end in zip(slots, ends):
            if self.lengths[slot] < self.manager.writable_from(slot):
                raise ValueError(f"slot {slot} would write into a shared block")
            self.manager.reserve(slot, end)  # a follower's table covers it: no block taken

    def block_table(self, slots: list[int], width: int | None = None) -> torch.Tensor:
        """``[B, W]`` int32: the rows' block tables, padded with their last block."""
        return torch.tensor(self.manager.table_rows(slots, width), dtype=torch.int32)

    def static_table(self, slots: list[int], rows: int) -> torch.Tensor:
        """``[rows, table_width]`` int64: the block tables of ``slots`` at a fixed shape, each
        padded with the spare block, then padding rows of the spare block alone (the graph
        maps the spare block to position 0 for those and to no position for the others:
        :func:`~specserve.engine.runtime.block_attention.logical_blocks`)."""
        table = torch.full((rows, self.table_width), self.spare_block, dtype=torch.long)
        for i, slot in enumerate(slots):
            blocks = self.manager.tables[slot]
            table[i, :len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
        return table

    @property
    def spare_row(self) -> int | None:
        """The storage row (block) a static-shape forward writes its padding to."""
        return self.spare_block

    def locate(self, table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`SlotKVCache.locate`: each real token's ``(block, offset)`` through its row's
        block table (the blocks reserved)."""
        blocks = table.long().gather(1, (positions // self.block_size).clamp(max=table.shape[1] - 1))
        return blocks[valid], (positions % self.block_size)[valid]

    def locate_new(self, slots: list[int], starts: list[int], lens: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`SlotKVCache.locate_new` through the block tables (the blocks reserved)."""
        bs, tables = self.block_size, self.manager.tables
        places = new_tokens(slots, starts, lens)
        blocks, offsets = zip(*((tables[slot][p // bs], p % bs) for slot, p in places))
        return torch.tensor(blocks, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)

    def write(self, layer: int, rows: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values at ``rows`` (blocks) / ``offsets`` (:meth:`locate`'s, on
        the cache's device: no read back) ``[N]``; ``k``/``v``: ``[N, H, D]``."""
        self.k[layer][rows, :, offsets] = k
        self.v[layer][rows, :, offsets] = v

    def gather(self, layer: int, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` up to ``kv_len``: two ``[B, H, kv_len, D]`` copies
        (positions past a row's blocks repeat its last block: masked by every reader)."""
        width = -(-kv_len // self.block_size)
        table = self.block_table(slots, width).to(self.k[layer].device).long()    # [B, W]

        def rows(storage: torch.Tensor) -> torch.Tensor:
            b, w = table.shape
            blocks = storage[table.view(-1)].view(b, w, *storage.shape[1:])     # [B, W, H, BS, D]
            return blocks.transpose(1, 2).reshape(b, storage.shape[1], -1, storage.shape[3])[:, :, :kv_len]

        return rows(self.k[layer]), rows(self.v[layer])
