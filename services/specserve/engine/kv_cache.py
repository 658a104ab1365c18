"""Slot-based KV cache.

Each sequence owns one *slot*: a row of preallocated key/value storage in every layer, and a
*length*, the number of leading positions whose keys and values are valid. A forward pass
appends at ``length`` and moves it forward; rollback after a rejected draft is simply setting
the length back (the stale entries beyond it are overwritten by the next forward).

This is deliberately the simplest cache that supports ragged batches and O(1) rollback. On a
GPU a paged cache (vLLM's block tables) wastes less memory for mixed lengths; the interface
here (allocate / free / length / rollback) is what the coordinator depends on, so a paged
implementation can replace it without touching the speculation logic.
"""

from __future__ import annotations

import torch

from specserve.errors import CapacityError


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
        # its padding tokens (``spare_slot``; see specserve.engine.compiled).
        shape = (num_slots + spare, num_kv_heads, -(-max_seq_len // block) * block, head_dim)
        # torch.zeros on CPU maps untouched pages lazily, so a large cache costs only what is used.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len
        self.spare_slot = num_slots if spare else None

    # -- tensor access used by the model runtime ------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. ``slots``/``positions``: ``[N]``; ``k``/``v``: ``[N, H, D]``."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

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
