"""Attention that reads only each row's own keys: FlexAttention over the cache's storage.

The GPU's attention (``attention: flex``, the default on CUDA for ``kernels: library`` and
``compiled``). Why not torch's SDPA: with a boolean mask and grouped-query heads SDPA runs
its math backend (float32 upcast, keys and values repeated per query head), and a
static-shape forward that gathers each row's whole slot reads ``max_seq_len`` keys per row
and layer whatever the row's length, so its cost grew with batch x max_model_len.
FlexAttention (Dong et al. 2024, ``torch.nn.attention.flex_attention``) takes grouped-query
heads natively, bfloat16 as it is (float32 accumulators), and a *block mask*: per row, the
list of key blocks to read, plus a ``mask_mod`` for the exact rule inside those blocks.

The design, for a forward of ``B`` rows of ``T`` queries each:

- **Keys in place.** A layer's cache tensor ``[slots, Hk, S, D]`` is viewed, without a copy,
  as one long key sequence per KV head ``[1, Hk, L, D]`` (:func:`storage_view`): key ``n``
  of head ``h`` is storage row ``h * S + n``, so position ``p`` of slot ``s`` is key
  ``s * Hk * S + p`` for every head (the view overlaps itself, which reading allows).
  FlexAttention broadcasts a key/value batch of 1 against the queries' batch, so the queries
  stay ``[B, H, T, D]``, one row per sequence: no gather of slots, and no scatter of queries
  into a ``[slots, H, T, D]`` tensor either (its output and the decoding kernel's split
  buffers would grow with the slot count, not with the batch).
- **Blocks of the row's own keys** (:func:`key_blocks`): for each row and 128-query tile, the
  64-key blocks of its own slot from the one holding its first visible key to the one
  holding its last, ``ceil((last + 1) / 64)`` blocks for full attention, as block indices
  into that view. A row reads nothing past its own last token, and a slot outside the batch
  is never read. Blocks every query of a tile sees whole are listed apart (``full_*``: no
  mask_mod there) for prefills only: torch's decoding kernel (under 128 queries) splits a
  row's keys across thread blocks by the whole key length once it is given full blocks.
- **The exact rule** (:func:`block_mask`'s mask_mod): key ``n`` is row ``b``'s position
  ``n - base[b]``, visible to a query when it is in the row's slot (>= 0) and at most the
  query's last key (its position, capped at the row's last real token so a padding query
  reads nothing the blocks leave out); inside the sliding window; on the query's path of a
  token tree (``ForwardContext.visible``'s bitmask). The mask_mod alone is the whole rule
  (torch's eager FlexAttention, on a CPU, reads every key and ignores the block lists); the
  block lists are what a GPU kernel reads.
- **Static shapes.** Every tensor here has a shape fixed by ``(B, T, slots, S)``; the
  compiled path builds :class:`KeyBlocks` outside its graph and the BlockMask inside it, so
  the mask's tensors are graph inputs and a bucket is one graph (``compiled.py``).

- **Paged**: a block pool ``[blocks, Hk, BS, D]`` (``BS`` a multiple of 64)
  views the same way, as a slot cache of ``BS``-long slots: a row's blocks are listed
  through its block table (:func:`table_storage`; a slot cache's table is the row's slot, one
  block of the whole slot), and the mask_mod maps a key to its row's position through a
  physical-to-logical map, ``[B, blocks]``, made from the tables once a forward on the
  device (inside the compiled graph, as one opaque op: only the tables travel), as vLLM's
  FlexAttention backend does (:func:`logical_blocks`). Tables are padded with the pool's
  spare block, which a real row never sees and a padding row reads as its position 0 (where
  it wrote).

On a GPU FlexAttention must be compiled (eagerly it materializes the scores over the whole
view): the compiled layer stack traces it with the rest, and the library path calls it
through one ``torch.compile`` (:func:`attend`), its rows padded to a power of two (the
decoding kernel needs a static batch). On a CPU it runs eagerly, for the tests: the C
kernels are the CPU's path, and inductor's CPU FlexAttention wants block lists as long as
the whole view.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from specserve.engine.runtime.forward_batch import Upload
from specserve.engine.runtime.kernels import KV_BLOCK

KEY_BLOCK = KV_BLOCK  # keys per block: the cache's own allocation unit, so a slot is whole blocks
QUERY_BLOCK = 128     # queries per tile: torch's default; decodes and verifies are one tile
# Torch's FlexAttention takes its decoding kernel below this many queries (a tile); only
# longer forwards (prefills) get full blocks (module docstring).
DECODE_QUERIES = 128


@dataclasses.dataclass
class KeyBlocks:
    """What one FlexAttention call reads, for ``B`` rows of ``T`` queries: made once per
    forward (and window kind), shared by the layers. Shapes fixed by ``(B, T, slots, S)``."""

    base: torch.Tensor | None       # [B] int64: the key (in storage_view) of each row's position 0
    last: torch.Tensor              # [B, T] int64: the last position each query may see
    num_blocks: torch.Tensor        # [B, 1, NQ] int32: blocks to read (masked) per query tile
    indices: torch.Tensor           # [B, 1, NQ, J] int32: their storage_view block indices, in order
    full_num_blocks: torch.Tensor | None = None  # the same for blocks every query sees whole
    full_indices: torch.Tensor | None = None
    window: int | None = None       # the sliding window, or None (full attention)
    tree: torch.Tensor | None = None         # [B, T] int64 bitmasks (ForwardContext.tree)
    tree_starts: torch.Tensor | None = None  # [B] int64: each tree row's base (-1: a chain)
    table: torch.Tensor | None = None  # paged: [B, W] int64 each row's blocks (base is None)
    logical: torch.Tensor | None = None  # paged: [B, blocks] the map from table (with_map)

    def to(self, device: torch.device) -> KeyBlocks:
        """On ``device``, made on the host: in one queued copy (an :class:`Upload`; one
        ``.to`` per tensor would be as many pageable copies, each a wait for the device)."""
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        if all(getattr(self, name).device == torch.device(device) for name in names):
            return self
        upload = Upload()
        index = {name: upload.add(getattr(self, name)) for name in names}
        upload.send(device)
        return dataclasses.replace(self, **{name: upload[i] for name, i in index.items()})

    def with_map(self, num_blocks: int) -> KeyBlocks:
        """Paged, on the device: with the physical-to-logical map of a pool of ``num_blocks``
        blocks (:func:`logical_blocks`), made once for every layer that reads these blocks."""
        if self.table is None or self.logical is not None:
            return self
        return dataclasses.replace(self, logical=logical_blocks(self.table, num_blocks))


def storage_view(storage: torch.Tensor) -> torch.Tensor:
    """A layer's keys or values ``[slots, Hk, S, D]`` as ``[1, Hk, L, D]``, no copy: key
    ``n`` of head ``h`` is row ``h * S + n`` of the storage, so slot ``s``'s position ``p``
    is key ``s * Hk * S + p`` in every head (L = ((slots - 1) * Hk + 1) * S)."""
    assert storage.ndim == 4 and storage.is_contiguous()
    slots, hk, s, d = storage.shape
    length = ((slots - 1) * hk + 1) * s
    return storage.as_strided((1, hk, length, d), (storage.numel(), s * d, d, 1))


def table_storage(table: torch.Tensor, num_kv_heads: int, block_len: int) -> torch.Tensor:
    """``[B, J]``: the storage_view key block holding each row's logical key block ``j``,
    through its block table ``[B, W]`` of storage blocks of ``block_len`` positions
    (J = W * block_len / 64). A slot cache's table is each row's slot, one block of the whole
    slot: its key blocks are consecutive.

    >>> table_storage(torch.tensor([[3, 1]]), num_kv_heads=2, block_len=128).tolist()
    [[12, 13, 4, 5]]
    """
    per = block_len // KEY_BLOCK
    first = table.long() * (num_kv_heads * per)                      # [B, W]
    return (first[:, :, None] + torch.arange(per)).flatten(1)        # [B, J]


def key_blocks(positions: torch.Tensor, last: torch.Tensor, table: torch.Tensor, *,
               num_kv_heads: int, block_len: int, paged: bool = False,
               window: int | None = None, tree: torch.Tensor | None = None,
               tree_starts: torch.Tensor | None = None) -> KeyBlocks:
    """The blocks and rule of a forward: ``positions`` ``[B, T]`` int64, each query's
    position (padding included); ``last`` ``[B]``, each row's last real key; ``table``
    ``[B, W]``, each row's storage blocks of ``block_len`` positions: its slot (``[B, 1]``,
    the cache's S; rows may share one: padding) or, ``paged``, its block table padded with
    the pool's spare block (the last; a padding row's is the spare block alone).

    >>> kb = key_blocks(torch.tensor([[70, 71], [5, 6]]), torch.tensor([70, 6]),
    ...                 torch.tensor([[3], [0]]), num_kv_heads=2, block_len=128)
    >>> kb.num_blocks.flatten().tolist(), kb.indices[:, 0, 0].tolist()  # rows end in blocks 1, 0
    ([2, 1], [[12, 13], [0, 1]])
    """
    assert positions.ndim == 2 and last.shape == positions.shape[:1] == table.shape[:1]
    assert block_len % KEY_BLOCK == 0, "a storage block is whole key blocks"
    query_last = torch.minimum(positions, last[:, None])                       # [B, T]
    storage = table_storage(table, num_kv_heads, block_len)                    # [B, J]
    seen, whole = block_visibility(query_last, storage.shape[1], window, tree_starts)
    if positions.shape[1] < DECODE_QUERIES:
        whole = torch.zeros_like(whole)
    num_blocks, indices = _ordered(seen & ~whole, storage)
    full = _ordered(whole, storage) if whole.any() else (None, None)
    return KeyBlocks(base=None if paged else table[:, 0].long() * num_kv_heads * block_len,
                     last=query_last, num_blocks=num_blocks, indices=indices,
                     full_num_blocks=full[0], full_indices=full[1], window=window, tree=tree,
                     tree_starts=None if tree_starts is None else tree_starts.long(),
                     table=table.long() if paged else None)


@torch.library.custom_op("specserve::logical_blocks", mutates_args=())
def logical_blocks(table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks]`` int64: each storage block's index in row ``b``'s block table
    ``table`` ``[B, W]``, -1 where the row does not hold it. The tables' padding is the
    spare block (the last): position 0 of a row that holds nothing else (a padding row
    reads what it wrote there), of no other row. Made on the tables' device, inside the
    compiled graph (the map is ``num_blocks`` wide; the tables are what travel).

    One opaque op, so the compiled graph holds its result in a buffer of its own. The
    mask_mod reads the map, and inductor inlines what a mask_mod reads into FlexAttention's
    Triton template: the map's own ops inlined failed its code generation on an H200 twice,
    a ``cat``'s masked loads first (2026-11-28), then a ``scatter``'s buffer not yet laid out
    ("convert FlexibleLayout to FixedLayout first", 2026-12-04; docs/BENCHMARKS.md). A
    custom op's output is laid out when it is made, and the template only loads from it.

    >>> logical_blocks(torch.tensor([[2, 0, 3], [3, 3, 3]]), 4).tolist()
    [[1, -1, 0, -1], [-1, -1, -1, 0]]
    """
    rows, width = table.shape
    columns = torch.arange(width, device=table.device).expand(rows, width)
    logical = torch.full((rows, num_blocks), -1, dtype=torch.long, device=table.device)
    logical = logical.scatter(1, table, columns)  # the spare block's duplicates: set below
    spare = torch.where(table[:, 0] == num_blocks - 1, 0, -1)               # [B]
    is_spare = torch.arange(num_blocks, device=table.device) == num_blocks - 1  # [num_blocks]
    return torch.where(is_spare, spare[:, None], logical)


@logical_blocks.register_fake
def _(table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return table.new_empty((table.shape[0], num_blocks), dtype=torch.long)


def block_visibility(query_last: torch.Tensor, num_blocks: int, window: int | None,
                     tree_starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, query tile and logical key block ``[B, NQ, J]``: whether any query of the
    tile sees a key of the block (``seen``), and whether every query sees all of it
    (``whole``, a subset of ``seen``). ``query_last``: ``[B, T]``."""
    b, t = query_last.shape
    tiles = -(-t // QUERY_BLOCK)
    columns = torch.arange(tiles * QUERY_BLOCK).clamp(max=t - 1)  # a short last tile repeats its last query
    tile = query_last[:, columns].view(b, tiles, QUERY_BLOCK)     # [B, NQ, 128]
    low, high = tile.amin(-1, keepdim=True), tile.amax(-1, keepdim=True)  # [B, NQ, 1]
    start = torch.arange(num_blocks) * KEY_BLOCK                   # [J]
    end = start + KEY_BLOCK - 1
    seen, whole = start <= high, end <= low                        # [B, NQ, J]
    if window is not None:  # a query at p sees p - window + 1 .. p
        seen &= end > low - window
        whole &= start > high - window
    if tree_starts is not None:  # a tree row's queries see only their own path after its base
        base = tree_starts.long()[:, None, None]                   # [B, 1, 1]
        whole &= (base < 0) | (end < base)
    return seen, whole


def _ordered(listed: torch.Tensor, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[B, NQ, J]`` choice of logical blocks as FlexAttention's ``(num_blocks [B, 1, NQ],
    indices [B, 1, NQ, J])``: the chosen blocks' storage indices first, in key order (the
    entries after them are unread, and still the row's own blocks)."""
    order = torch.argsort((~listed).to(torch.int8), dim=-1, stable=True)    # [B, NQ, J]
    indices = storage[:, None, :].expand(listed.shape).gather(-1, order)   # [B, NQ, J]
    return (listed.sum(-1, dtype=torch.int32)[:, None],
            indices[:, None].to(torch.int32))


def block_mask(blocks: KeyBlocks, num_queries: int, storage: torch.Size) -> BlockMask:
    """FlexAttention's BlockMask of ``blocks`` over the keys of a layer's cache tensor of
    shape ``storage`` (``[slots or blocks, Hk, S or BS, D]``, seen through storage_view), its
    mask_mod the exact rule (module docstring). Made inside a compiled graph as outside."""
    base, last, window = blocks.base, blocks.last, blocks.window
    tree, tree_starts = blocks.tree, blocks.tree_starts
    rows, heads, block_len = storage[0], storage[1], storage[2]
    num_keys = ((rows - 1) * heads + 1) * block_len
    span = heads * block_len  # keys from one storage block to the next in the view
    logical = blocks.with_map(rows).logical  # made once a forward where the layers share blocks

    def position(b: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Key ``kv``'s position in row ``b`` (< 0: not the row's)."""
        if logical is None:
            return kv - base[b]
        block = kv // span
        offset = kv - block * span  # past block_len: another head's keys
        j = logical[b, block]
        return torch.where((j >= 0) & (offset < block_len), j * block_len + offset, -1)

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        pos = position(b, kv)
        seen = (pos >= 0) & (pos <= last[b, q])
        if window is not None:
            seen = seen & (pos > last[b, q] - window)
        if tree is not None:  # bit i: the i-th token after the row's base is on the path
            rel = pos - tree_starts[b]
            bit = (tree[b, q] >> rel.clamp(0, 63)) & 1
            seen = seen & ((tree_starts[b] < 0) | (rel < 0) | ((rel < 64) & (bit == 1)))
        return seen

    return BlockMask.from_kv_blocks(
        blocks.num_blocks, blocks.indices, blocks.full_num_blocks, blocks.full_indices,
        BLOCK_SIZE=(QUERY_BLOCK, KEY_BLOCK), mask_mod=visible,
        seq_lengths=(num_queries, num_keys), compute_q_blocks=False)  # no backward


def kernel_options(dtype: torch.dtype) -> dict:
    """FlexAttention's tile sizes. ``BLOCK_N``, the kernels' key tile, must divide a key
    block; some defaults (128 in bfloat16 on an H100) do not. In float32 the prefill kernel's
    default query tile (``BLOCK_M`` 128 on an H100) finds no config that fits (inductor's
    ``NoValidChoicesError``, measured on an H200); 64 does, for the prefill and the decoding
    kernel alike (docs/BENCHMARKS.md, "The GPU path")."""
    options = {"BLOCK_N": KEY_BLOCK}
    if dtype == torch.float32:
        options["BLOCK_M"] = 64
    return options


def flex_attend(q: torch.Tensor, key_storage: torch.Tensor, value_storage: torch.Tensor,
                blocks: KeyBlocks, scale: float) -> torch.Tensor:
    """``[B, T, H * D]`` attention outputs of queries ``q`` ``[B, T, H, D]`` over a layer's
    cache tensors ``[slots, Hk, S, D]`` (or a pool's ``[blocks, Hk, BS, D]``), reading what
    ``blocks`` lists."""
    b, t, h, d = q.shape
    keys, values = storage_view(key_storage), storage_view(value_storage)  # [1, Hk, L, D]
    mask = block_mask(blocks, t, key_storage.shape)
    out = flex_attention(q.transpose(1, 2), keys, values, block_mask=mask, scale=scale,
                         enable_gqa=h != keys.shape[1],
                         kernel_options=kernel_options(q.dtype))      # [B, H, T, D]
    return out.transpose(1, 2).reshape(b, t, h * d)


def attend(q: torch.Tensor, key_storage: torch.Tensor, value_storage: torch.Tensor,
           blocks: KeyBlocks, scale: float) -> torch.Tensor:
    """:func:`flex_attend`, compiled where it must be: traced with the layer stack inside a
    compiled graph, through :func:`_compiled` on a GPU, eagerly elsewhere. ``blocks`` may
    have more rows than ``q`` (padding rows, which repeat a real row): the output has
    ``q``'s."""
    b = q.shape[0]
    rows = blocks.last.shape[0]
    if rows > b:
        q = torch.cat([q, q[:1].expand(rows - b, *q.shape[1:])])  # [rows, T, H, D]
    if torch.compiler.is_compiling():
        out = flex_attend(q, key_storage, value_storage, blocks, scale)
    elif q.is_cuda:
        for tensor in (q, blocks.base, blocks.last, blocks.num_blocks, blocks.indices, blocks.table):
            if tensor is not None:
                torch._dynamo.mark_static(tensor, 0)  # the decoding kernel wants a static batch
        out = _compiled()(q, key_storage, value_storage, blocks, scale)
    else:
        with warnings.catch_warnings():  # "called without torch.compile": meant, on a CPU
            warnings.filterwarnings("ignore", message="flex_attention called without")
            out = flex_attend(q, key_storage, value_storage, blocks, scale)
    return out[:b]


@functools.cache
def _compiled():
    """The library path's compiled :func:`flex_attend`, one per process. Its shapes: rows in
    powers of two, decode and verify widths, prefill lengths (dynamic after the second),
    trees and windows: more graphs than dynamo's default limit of 8, each small."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
    return torch.compile(flex_attend, fullgraph=True)
