"""A model and its slot cache: what a target rank or a draft model holds.

The speculation loop only talks to this interface (``forward`` / ``allocate`` / ``free`` /
``rollback`` / ``keep`` / ``length``), which is why the same loop drives an in-process model here and a
tensor-parallel group of Ray actors in the Serve units.
"""

from __future__ import annotations

import torch

from specserve.engine.kv_cache import SlotTable
from specserve.engine.malloc import keep_freed_memory
from specserve.engine.model import LlamaRuntime


class SlotOwner:
    """The slot half of the worker interface, answered from ``self.table``."""

    table: SlotTable

    @property
    def num_free_slots(self) -> int:
        return self.table.num_free_slots

    def allocate(self) -> int:
        return self.table.allocate()

    def free(self, slot: int) -> None:
        self.table.free(slot)

    def length(self, slot: int) -> int:
        return self.table.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        self.table.rollback(slot, length)


class ModelWorker(SlotOwner):
    """Owns a :class:`LlamaRuntime` and a :class:`SlotKVCache` shaped for it."""

    def __init__(self, runtime: LlamaRuntime, *, num_slots: int, max_seq_len: int) -> None:
        keep_freed_memory()
        self.runtime = runtime
        self.cache = self.table = runtime.make_cache(num_slots, max_seq_len)

    @property
    def vocab_size(self) -> int:
        return self.runtime.arch.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def keep(self, slot: int, positions: list[int], at: int) -> None:
        """A verified token tree's accepted path moves to ``at, at + 1, ...`` (the cache's
        :meth:`~specserve.engine.kv_cache.SlotKVCache.keep`)."""
        self.cache.keep(slot, positions, at)

    def forward(self, slots: list[int], token_ids: list[list[int]], num_logits: list[int],
                argmax_only: bool = False, return_hidden: bool = False,
                trees: list[list[int] | None] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append tokens to slots; ``[sum(num_logits), vocab]`` float32 logits, or with
        ``argmax_only`` just ``[sum(num_logits)]`` token ids (all a greedy batch needs, and
        much less to move when the model is in another process). ``return_hidden``:
        ``(logits, hidden)``, with the final hidden state of every new token (what an EAGLE
        proposer reads; see ``LlamaRuntime.forward``). ``trees``: token trees over rows' new
        tokens (``LlamaRuntime.forward``)."""
        out = self.runtime(self.cache, slots, token_ids, num_logits, return_hidden=return_hidden,
                           trees=trees)
        logits, hidden = out if return_hidden else (out, None)
        if argmax_only:
            logits = logits.argmax(dim=-1)
        return (logits, hidden) if return_hidden else logits
