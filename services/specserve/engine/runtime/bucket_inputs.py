"""A compiled bucket's inputs in one persistent device buffer, filled by the step's one copy
(issue 52).

A CUDA graph reads its inputs at the addresses it captured, so inductor's CUDA-graph wrapper
copies every input that is not static into its own placeholders before each replay: 42
copies a step on the Llama-3-8B shape, about 1.3 ms of CPU on an H100 (docs/BENCHMARKS.md).
Here each bucket owns one int64 buffer on the device (:class:`BucketBuffer`), marked static,
whose head is laid out once (:class:`Layout`): the token ids, RoPE rows, cache writes and
attention inputs at fixed offsets. What else the step sends (the forward's gather indices,
a verification's drafts, settings and noise: an
:class:`~specserve.engine.runtime.forward_batch.Upload`) follows in its tail. One copy from a
pinned host twin fills both; the compiled graph takes the buffer whole and reads its inputs
as views of it (:meth:`Layout.read`), so besides the weights and the cache it has one input.

The host twin is rewritten by the next step's :meth:`BucketBuffer.fill`. That is safe while
every step reads its result before the next is built (today's synchronous step: the read
waits for the stream, the copy included); a step that overlaps the next one's preparation
needs two twins, alternated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from specserve.engine.runtime.forward_batch import Upload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Field:
    name: str
    offset: int                 # in int64 words from the buffer's start
    shape: tuple[int, ...]
    dtype: torch.dtype          # what the graph reads it as (every field is integer or bool)


@dataclass(frozen=True)
class Layout:
    """Where each of a bucket's inputs sits in its buffer (hashable: one buffer per layout)."""

    fields: tuple[Field, ...]
    size: int                   # int64 words of the head; the tail follows

    @classmethod
    def of(cls, host: dict[str, torch.Tensor]) -> Layout:
        """The layout of ``host``'s tensors, in its order.

        >>> Layout.of({"a": torch.zeros(2, 3, dtype=torch.long), "b": torch.zeros(2, dtype=torch.int32)}).size
        8
        """
        fields, offset = [], 0
        for name, x in host.items():
            assert not x.is_floating_point(), name
            fields.append(Field(name, offset, tuple(x.shape), x.dtype))
            offset += x.numel()
        return cls(tuple(fields), offset)

    def read(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inputs, views of ``buffer`` (inside the graph: the casts are the graph's)."""
        return {f.name: buffer[f.offset:f.offset + math.prod(f.shape)].view(f.shape).to(f.dtype)
                for f in self.fields}


class BucketBuffer:
    """A bucket's inputs on the device (``device``, static for a CUDA graph) and their host
    twin (pinned on a GPU), ``spare`` int64 words of tail for what an upload adds."""

    def __init__(self, layout: Layout, device: torch.device, spare: int) -> None:
        self.layout = layout
        size = layout.size + spare
        self.device = torch.empty(size, dtype=torch.long, device=device)
        pinned = self.device.is_cuda and torch.cuda.is_available()
        self.host = torch.empty(size, dtype=torch.long, pin_memory=pinned)
        if pinned:
            torch._dynamo.mark_static_address(self.device)  # replays read it where it is

    def fill(self, inputs: dict[str, torch.Tensor], upload: Upload) -> None:
        """``inputs`` (in :attr:`layout`'s order) at the head and ``upload``'s pending tensors
        in the tail, in one copy. A tail larger than the spare goes with the head through a
        temporary buffer (still one copy from the host) whose head is then copied into place
        on the device."""
        parts = [x.reshape(-1).long() for x in inputs.values()] + upload.pending()
        total = sum(x.numel() for x in parts)
        head = self.layout.size
        if total <= self.device.numel():
            torch.cat(parts, out=self.host[:total])
            self.device[:total].copy_(self.host[:total], non_blocking=True)
            upload.received(self.device[head:total])
            return
        log.info("a step's inputs (%d words) outgrew its bucket's buffer (%d): sent apart",
                 total, self.device.numel())
        packed = torch.cat(parts).to(self.device.device)
        self.device[:head].copy_(packed[:head])
        upload.received(packed[head:])
