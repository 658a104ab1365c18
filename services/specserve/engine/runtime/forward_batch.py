"""What one model forward takes and what it returns: a :class:`ForwardBatch` in, a
:class:`Forwarded` out, the same two types for every caller (decodes, verifies, prompt
chunks, a draft head's forwards) and whatever they ask for, so no flag changes what comes back.

Both are plain data: a tensor-parallel group broadcasts the batch between its ranks
(``dist.broadcast_object_list``) and returns the result over Ray (``serve/target_group.py``).

How a step's host data reaches the device, in one copy: an :class:`Upload` (what the forward
and the verification add), which the compiled path sends into its bucket's persistent
:class:`BucketBuffer` (laid out by a :class:`Layout`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from specserve.errors import InvalidRequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardBatch:
    """One forward's rows: row i appends ``token_ids[i]`` to slot ``slots[i]`` (a ragged
    batch: each row its own slot, start position and number of new tokens), and asks for the
    logits after its last ``num_logits[i]`` new tokens (:meth:`LlamaRuntime.forward
    <specserve.engine.runtime.model.LlamaRuntime.forward>` runs it).

    ``trees``: per row, None (a chain: each new token follows the one before) or a token tree
    over its new tokens: ``trees[i][j]`` is the index of new token j's parent among them
    (``[-1, 0, 0, 1]``: token 0 follows the cache, 1 and 2 both follow 0, 3 follows 1).
    A tree may grow over several forwards (a draft expanding it a level at a time,
    ``drafts/eagle.py``): ``trees[i]`` longer than ``token_ids[i]`` covers the row's last
    ``len(trees[i])`` tokens *after* this forward, the first of them stored by earlier
    forwards of the same tree (their parents as they were given then), so a new token's
    parent may be a token already in the cache.

    ``groups``: the rows as consecutive groups of these sizes, each padded to its own longest
    row (a prompt's chunk beside decode rows; the forward's docstring says how they run).

    ``features``: per-token inputs of a model that takes them (an EAGLE draft head,
    :class:`~specserve.engine.drafts.draft_head.DraftHead`), every row's new tokens in row order.
    ``hidden``: the result carries the hidden state of every new token (:attr:`Forwarded.hidden`),
    the features an EAGLE head reads. ``argmax``: the result carries the logits' argmax
    (:attr:`Forwarded.token_ids`) instead of the logits: all a greedy batch needs, and much
    less to move when the model is in another process.

    ``fed``: the last new token of each row of ``fed_rows`` (None: every row), on the device
    (``token_ids[i][-1]`` is then a placeholder): a draft chain feeds the token it just drew,
    and a verify the token its row emitted in the verify before, without reading it back
    (so the next step can be launched before this one is read). Chains in one group only.
    """

    slots: list[int]                               # [rows]
    token_ids: list[list[int]]                     # [rows][the row's new tokens]
    # [rows]: logits after the row's last n new tokens (1 for a decode or a prefill, K + 1 for
    # a verify, 0 for a prompt's chunk whose logits nobody reads); None: 1 each
    num_logits: list[int] | None = None
    trees: list[list[int] | None] | None = None    # [rows]: parents per new token; None: chains
    groups: list[int] | None = None                # sizes of consecutive row groups; None: one group
    features: torch.Tensor | None = None           # [sum(new tokens), feature width]
    hidden: bool = False                           # the result carries hidden states
    argmax: bool = False                           # the result carries argmax ids, not logits
    fed: torch.Tensor | None = None                # [fed rows] int64 on the device: their last tokens
    fed_rows: list[int] | None = None              # the rows ``fed`` is for; None: every row
    # host tensors of the caller's (a verify's drafts and sampling settings) that go to the
    # device in the forward's own input copy; None: the forward's inputs alone
    upload: Upload | None = None


class Upload:
    """Host tensors bound for the device, sent in one copy (one host-to-device copy a step,
    the forward's inputs and the verification's together). :meth:`add` a host tensor
    and keep its index; after :meth:`send`, ``upload[index]`` is that tensor on the device,
    its shape and dtype kept. Everything travels as int64: integers and booleans by value,
    floating-point values as the bits of their float64 (which holds a float32 exactly)."""

    def __init__(self) -> None:
        self._host: list[torch.Tensor] = []
        self._sent: list[torch.Tensor] = []

    def add(self, host: torch.Tensor) -> int:
        assert host.device.type == "cpu", host.device
        self._host.append(host)
        return len(self._host) - 1

    def send(self, device: torch.device | str) -> None:
        """Every tensor added since the last send, in one copy; on the host itself, none:
        the tensors are read as they are."""
        if torch.device(device).type == "cpu":
            self._sent.extend(self._host[len(self._sent):])
            return
        flat = self.pending()
        if flat:
            self.received(queued(torch.cat(flat), device))

    def pending(self) -> list[torch.Tensor]:
        """The tensors added since the last send, each flattened to int64 on the host (what
        a caller that owns the copy packs: :class:`BucketBuffer`)."""
        return [x.reshape(-1).double().view(torch.int64) if x.is_floating_point()
                else x.reshape(-1).long() for x in self._host[len(self._sent):]]

    def received(self, packed: torch.Tensor) -> None:
        """The pending tensors arrived as ``packed`` (on the device, in :meth:`pending`'s
        order): ``upload[index]`` reads them from now on."""
        new = self._host[len(self._sent):]
        for x, part in zip(new, packed.split([x.numel() for x in new])):
            part = part.view(torch.float64) if x.is_floating_point() else part
            self._sent.append(part.to(x.dtype).view(x.shape))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._sent[index]


# -- a compiled bucket's inputs ----------------------------------------------------------------
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
        return {f.name: _field(buffer, f).to(f.dtype) for f in self.fields}

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Input ``name`` as a view of ``buffer``, int64 as stored (written in place)."""
        return _field(buffer, next(f for f in self.fields if f.name == name))


def _field(buffer: torch.Tensor, f: Field) -> torch.Tensor:
    return buffer[f.offset:f.offset + math.prod(f.shape)].view(f.shape)


class BucketBuffer:
    """A compiled bucket's inputs on the device (``device``) and their host twin (``host``,
    pinned on a GPU), ``spare`` int64 words of tail for what an upload adds.

    A CUDA graph reads its inputs at the addresses it captured, so inductor's CUDA-graph
    wrapper copies every input that is not static into its own placeholders before each
    replay: a copy for each of a step's dozens of inputs, each paid for in host time
    (docs/BENCHMARKS.md, "The compiled path's step in one graph and one copy"). So each
    bucket owns one int64 buffer on the device, marked static, whose head is laid out once
    (:class:`Layout`): the token ids, RoPE rows, cache writes and attention inputs at fixed
    offsets. What else the step sends (the forward's gather indices, a verification's
    drafts, settings and noise: an :class:`Upload`) follows in its tail. One copy from the
    host twin fills both; the compiled graph takes the buffer whole and reads its inputs as
    views of it (:meth:`Layout.read`), so besides the weights and the cache it has one input
    (:class:`~specserve.engine.runtime.compiled.StaticForward`).

    A step may fill one buffer twice (its row groups as two forwards of one bucket), so
    nothing outlives the forward in the buffer: the upload's tensors are read from a copy
    of the tail made on the device (one small device-to-device copy), and the host twin is
    rewritten only once its last copy to the device has run (an event; on a CPU the copy
    is done when it returns)."""

    def __init__(self, layout: Layout, device: torch.device, spare: int) -> None:
        self.layout = layout
        size = layout.size + spare
        self.device = torch.empty(size, dtype=torch.long, device=device)
        pinned = self.device.is_cuda and torch.cuda.is_available()
        self.host = torch.empty(size, dtype=torch.long, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None  # the host twin's last copy
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
            if self.copied is not None:
                self.copied.synchronize()  # done already unless a forward came just before
            torch.cat(parts, out=self.host[:total])
            self.device[:total].copy_(self.host[:total], non_blocking=True)
            if self.copied is not None:
                self.copied.record()
            upload.received(self.device[head:total].clone())  # the next fill may come first
            return
        log.info("a step's inputs (%d words) outgrew its bucket's buffer (%d): sent apart",
                 total, self.device.numel())
        packed = queued(torch.cat(parts), self.device.device)
        self.device[:head].copy_(packed[:head])
        upload.received(packed[head:])


class HostCopy:
    """``tensor``'s values on their way to the host. A device tensor's copy is queued now,
    behind the work that makes it, into pinned memory, with an event: :meth:`tolist` waits
    for that event alone, not for what was queued after it (the next step, launched
    before this one is read; a plain read would wait for that step too). A host
    tensor is read as it is."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.host, self.event = tensor, None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype,
                                    pin_memory=torch.cuda.is_available())
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def queued(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` copied to ``device`` without waiting: on CUDA through pinned memory, queued
    (a pageable copy, or a blocking one, waits for everything queued on the device first:
    the next step, launched before this one is read, would no longer overlap the read). A
    tensor on a device already goes as ``.to`` sends it."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu" and torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def device_index(index: list[int], device: torch.device) -> torch.Tensor:
    """``index`` as int64 on ``device``, :func:`queued` (a list used as a device tensor's
    index is a pageable copy)."""
    return queued(torch.tensor(index, dtype=torch.long), device)


def row_index(rows: list[int], n: int, device: torch.device) -> slice | torch.Tensor:
    """``rows`` of a device tensor of ``n`` rows as an index that waits for nothing: every
    row in order a slice (no copy at all), else :func:`device_index`."""
    return slice(None) if rows == list(range(n)) else device_index(rows, device)


@dataclass(frozen=True)
class Forwarded:
    """What a forward returns, rows in batch order. Each row's asked positions
    (``num_logits``) come in order, the rows one after the other: ``N = sum(num_logits)``."""

    logits: torch.Tensor | None     # [N, vocab] float32; None where the batch asked for argmax
    token_ids: torch.Tensor | None  # [N] int64, the logits' argmax, where the batch asked for it
    # [sum(len(token_ids[i])), hidden] (or the runtime's feature width: LlamaRuntime.feature_layers)
    # for every new token, where the batch asked for hidden states; else None
    hidden: torch.Tensor | None
    # [rows, 1 + W]: what the compiled graph's verdict (StaticForward.verdict, installed by
    # the verify's worker) made of each row, inside the graph; None where none ran
    verdict: torch.Tensor | None = None

    def cpu(self) -> Forwarded:
        """The same result with its tensors on the host (what crosses a process boundary)."""
        return Forwarded(*(None if x is None else x.cpu()
                           for x in (self.logits, self.token_ids, self.hidden, self.verdict)))


def check_rows(cache, slots: list[int], token_ids: list[list[int]]
               ) -> tuple[list[int], list[int]]:
    """Each row's start (its slot's length) and number of new tokens, checked: at least one
    new token, the context length kept. Reserves the rows' blocks in a paged cache."""
    starts = [cache.lengths[s] for s in slots]
    lens = [len(ids) for ids in token_ids]
    if min(lens) < 1:
        raise InvalidRequestError("every row of a forward needs at least one new token")
    ends = [s + n for s, n in zip(starts, lens)]
    if max(ends) > cache.max_seq_len:
        raise InvalidRequestError(f"sequence of {max(ends)} tokens exceeds the context length "
                                  f"of {cache.max_seq_len}")
    cache.reserve(slots, ends)  # a paged cache's blocks
    return starts, lens


def logit_positions(token_ids: list[list[int]], num_logits: list[int]) -> torch.Tensor:
    """``[2, sum(num_logits)]``: the (row, column) indices of the last ``num_logits[i]`` new
    tokens of each row, on the host."""
    rows, cols = [], []
    for i, (ids, n) in enumerate(zip(token_ids, num_logits)):
        if not 0 <= n <= len(ids):
            raise ValueError(f"row {i}: asked for {n} logits of {len(ids)} new tokens")
        rows += [i] * n
        cols += range(len(ids) - n, len(ids))
    return torch.tensor([rows, cols], dtype=torch.long)


def fed_positions(batch: ForwardBatch) -> torch.Tensor:
    """``[2, fed rows]``: the (row, column) of the last new token of each row
    :attr:`ForwardBatch.fed` is for, on the host."""
    rows = range(len(batch.token_ids)) if batch.fed_rows is None else batch.fed_rows
    return torch.tensor([list(rows), [len(batch.token_ids[i]) - 1 for i in rows]], dtype=torch.long)
