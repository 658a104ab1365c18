"""The context of one ragged forward: :class:`ForwardContext` (what every layer shares: RoPE
rows, cache writes, each query's keys, token-tree masks), :class:`PackedContext` (row groups
in one pass) and their preparation from a batch (:func:`prepare`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.engine.kv.kv_cache import SlotKVCache
from specserve.engine.runtime import block_attention, native
from specserve.engine.runtime.arch import one_window
from specserve.engine.runtime.block_attention import KeyBlocks
from specserve.engine.runtime.compiled import bucket
from specserve.engine.runtime.forward_batch import Upload, check_rows
from specserve.engine.runtime.kernels import KV_BLOCK, hidden_keys
from specserve.engine.runtime.token_tree import validate_tree
from specserve.errors import InvalidRequestError


def _on_first_use(name: str, doc: str) -> property:
    """A :class:`ForwardContext` tensor read from :attr:`ForwardContext.made` (``_made``)."""
    return property(lambda self: self._made(name), doc=doc)


@dataclass
class ForwardContext:
    """Everything one ragged forward shares across layers (computed once per call)."""

    slots: list[int]
    kv_len: int                    # S: longest (start + num_new) in the batch, in whole KV blocks
    cos: torch.Tensor              # [B, T, 1, D]
    sin: torch.Tensor              # [B, T, 1, D]
    kv_used: int                   # the longest (start + num_new) in the batch
    window: int | None             # the sliding window of the layers that have one
    shape: tuple[int, int]         # (B, T): rows, and tokens a row (padding included)
    # Token trees (``LlamaRuntime.forward(trees=...)``): [B, T] int64, bit i of query (b, t) set
    # where it sees the i-th token from its row's base (its ancestors and itself), and [B]
    # int32, each tree row's base position (-1: a chain row; ``_trees``).
    # None: every row is a chain.
    tree: torch.Tensor | None = None
    tree_starts: torch.Tensor | None = None
    table: torch.Tensor | None = None  # [B, W] int32: each row's block table (the C kernels)
    # each row's start and number of new tokens as the host's lists: what the C kernels'
    # int32 inputs are made from, without torch operations (a decode's Python, issue 71)
    rows: tuple[list[int], list[int]] = ((), ())
    # The per-token tensors (the properties below), made where the forward was prepared for a
    # device (they go in its one copy); on the host, each on first use: the C kernels read
    # none of them, and a decode's Python made six tensors a token that nothing read.
    made: dict = field(default_factory=dict)
    locate: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None  # the cache's locate_new
    _hidden: dict = field(default_factory=dict)
    _ranges: dict = field(default_factory=dict)

    valid = _on_first_use("valid", "``[B, T]`` bool: real tokens, not padding.")
    real = _on_first_use("real", "``[N]`` int64: each real token's index in ``[B * T]`` "
                         "(``x.flatten(0, 1)[real]``: valid as an index without a boolean mask, "
                         "which reads its count back from the device: a wait).")
    write_slots = _on_first_use("write_slots", "``[N]``: each real token's storage row (its slot, "
                                "or block).")
    write_positions = _on_first_use("write_positions", "``[N]``: each real token's offset in its "
                                    "storage row (its position, or in the block).")
    positions = _on_first_use("positions", "``[B, T]`` int64 on the host: each query's position "
                              "(padding included).")
    lens = _on_first_use("lens", "``[B]`` int64 on the host: each row's real new tokens.")
    on_device = _on_first_use("on_device", ":attr:`positions`, :attr:`tree` and :attr:`tree_starts` "
                              "on the forward's device (the library's mask is made there from them).")

    def _made(self, name: str) -> torch.Tensor:
        if name not in self.made:  # a host forward's, on first use
            starts, lens = self.rows
            t = self.shape[1]
            if name in ("write_slots", "write_positions"):
                self.made["write_slots"], self.made["write_positions"] = self.locate()
            elif name == "on_device":
                self.made[name] = (self.positions, self.tree, self.tree_starts)
            else:
                self.made[name] = _row_tensors[name](starts, lens, t)
        return self.made[name]

    def _key_ends(self) -> list[int]:
        """Each query's key end, ``[B * T]`` in row order on the host (from :attr:`rows`): it
        reads keys before ``position + 1``, a padding query's position capped at its row's last
        real token (its output is never read, and a paged row holds blocks for its real tokens
        only: nothing past them may be read)."""
        t = self.shape[1]
        return [min(s + j, s + n - 1) + 1 for s, n in zip(*self.rows) for j in range(t)]

    def _window_starts(self, ends: list[int]) -> list[int]:
        """The first key each query reads within the sliding window, from its :meth:`_key_ends`."""
        return [max(e - self.window, 0) for e in ends]

    @property
    def key_end(self) -> torch.Tensor:
        """``[B, T]`` int32: each query's key end (:meth:`_key_ends`)."""
        if "end" not in self._ranges:
            self._ranges["end"] = torch.tensor(self._key_ends(), dtype=torch.int32).view(self.shape)
        return self._ranges["end"]

    @property
    def row_starts(self) -> torch.Tensor:
        """``[B]`` int32: each row's first new position."""
        if "starts" not in self._ranges:
            self._ranges["starts"] = torch.tensor(self.rows[0], dtype=torch.int32)
        return self._ranges["starts"]

    @property
    def row_lens(self) -> torch.Tensor:
        """``[B]`` int32: each row's number of new (real) tokens."""
        if "lens" not in self._ranges:
            self._ranges["lens"] = torch.tensor(self.rows[1], dtype=torch.int32)
        return self._ranges["lens"]

    def library_mask(self, window: bool) -> torch.Tensor | None:
        """``[B, 1, T, kv_used]`` for torch's attention, None where every key is visible."""
        key = ("library", window)
        if key not in self._ranges:
            visible = self.visible(window)[..., :self.kv_used]
            self._ranges[key] = None if self._ranges[("every", window)] else visible[:, None]
        return self._ranges[key]

    def visible(self, window: bool) -> torch.Tensor:
        """``[B, T, S]`` bool, True where a query may attend (made on first use, on the
        forward's device from its positions: the C kernels take key ranges instead, so the
        default CPU path never builds it).

        A query at position ``p`` sees keys ``0..p`` of its own slot, and with ``window`` the
        last ``self.window`` of them. Padding queries keep the same rule; they always see key
        0, so no softmax row is empty, and their outputs are never read.
        """
        key = ("visible", window)
        if key not in self._ranges:
            self._ranges[("every", window)] = self._every(window)
            positions, tree, tree_starts = self.on_device
            self._ranges[key] = _visible(positions, self.kv_len, self.window if window else None,
                                         tree, tree_starts)
        return self._ranges[key]

    def _every(self, window: bool) -> bool:
        """Whether every query sees every key below ``kv_used`` (read off the host's
        positions: no device read). Each query sees the keys up to its own position, which
        is at least its row's start; a window hides keys of a query at or past it; a token
        tree hides a branch from its siblings."""
        if self.tree_starts is not None and bool((self.tree_starts >= 0).any()):
            return False
        if int(self.positions[:, 0].min()) < self.kv_used - 1:
            return False
        return not window or int(self.positions.max()) < self.window

    def key_start(self, window: bool) -> torch.Tensor:
        """``[B, T]`` int32: the first key each query reads (0, or the window's start)."""
        key = ("start", window)
        if key not in self._ranges:
            self._ranges[key] = (torch.tensor(self._window_starts(self._key_ends()), dtype=torch.int32)
                                 .view(self.shape) if window and self.window else
                                 torch.zeros(self.shape, dtype=torch.int32))
        return self._ranges[key]

    def native_forward(self, cache: SlotKVCache, layer: native.LayerRef) -> native.ForwardRef:
        """What :func:`native.decoder_layer` reads of this forward (made once; its tensors
        held here), with scratch for ``layer``. The C kernels trust the block table, so the
        bounds are checked here, once for every layer. Its int32 inputs (each row's start and
        new tokens, each query's key range: :attr:`row_starts`, :attr:`row_lens`,
        :meth:`key_start`, :attr:`key_end`) are one tensor made from :attr:`rows`, the C
        kernels pointed into it: one operation a forward, not four."""
        b, t = self.shape
        floats = native.layer_scratch(layer, b * t)
        held = self._ranges.get("native")
        if held is None:
            table = self.table
            native.check_table(table, b, cache.k[0].shape[2], self.kv_used)  # every query's end
            starts, lens = self.rows
            ends = self._key_ends()
            windowed = self._window_starts(ends) if self.window is not None else []
            ints = torch.tensor([*starts, *lens, *ends, *[0] * (b * t), *windowed], dtype=torch.int32)
            at = ints.data_ptr()  # int32 is 4 bytes: starts, lens, hi, lo, then the window's lo
            hi, lo = at + 8 * b, at + 4 * (2 * b + b * t)
            lo_window = lo + 4 * b * t if windowed else lo
            ref = native.ForwardRef(b, t, cache.k[0].shape[2], table.shape[1], torch.get_num_threads(),
                                    self.cos.data_ptr(), self.sin.data_ptr(), table.data_ptr(), at,
                                    at + 4 * b, lo, lo_window, hi, *(None if x is None else x.data_ptr()
                                                                     for x in (self.tree_starts, self.tree)),
                                    None)
            held = self._ranges["native"] = [ref, None, (self.cos, self.sin, table, ints, self.tree_starts,
                                                         self.tree)]
        if held[1] is None or held[1].numel() < floats:
            held[1] = torch.empty(floats, dtype=torch.float32)
            held[0].scratch = held[1].data_ptr()
        return held[0]

    def key_blocks(self, cache: SlotKVCache, window: bool) -> KeyBlocks:
        """The key blocks each row reads in :mod:`~specserve.engine.runtime.block_attention` (made
        once per forward and window kind). Rows are padded to a power of two with copies of
        row 0 (their outputs are dropped): a compiled kernel then sees a handful of batch
        sizes, not every one."""
        key = ("blocks", window)
        if key not in self._ranges:
            b = len(self.slots)
            rows = torch.cat([torch.arange(b), torch.zeros(bucket(b) - b, dtype=torch.long)])
            last = self.positions[:, 0] + self.lens - 1                       # [B]
            tree = None if self.tree is None else self.tree[rows]
            starts = None if self.tree_starts is None else self.tree_starts[rows]
            table = (cache.static_table(self.slots, b) if cache.paged
                     else torch.tensor(self.slots)[:, None])
            blocks = block_attention.key_blocks(
                self.positions[rows], last[rows], table[rows], num_kv_heads=cache.k[0].shape[1],
                block_len=cache.k[0].shape[2], paged=cache.paged,
                window=self.window if window else None, tree=tree, tree_starts=starts)
            self._ranges[key] = blocks.to(self.valid.device).with_map(cache.k[0].shape[0])
        return self._ranges[key]

    def hidden_keys(self, group: int, window: bool) -> torch.Tensor:
        """The attention mask for ``group`` query heads per key/value head (made once)."""
        key = (group, window)
        if key not in self._hidden:
            self._hidden[key] = hidden_keys(self.visible(window), group)
        return self._hidden[key]


@dataclass
class PackedContext:
    """Several row groups in one pass (:meth:`LlamaRuntime.forward`, ``groups``): each
    group's context in its own ``[B, T]`` layout, and its span of the packed tokens."""

    groups: list[ForwardContext]
    spans: list[tuple[int, int]]  # [start, end) of each group's B x T tokens in the pack


def prepare(cache: SlotKVCache, slots: list[int], token_ids: list[list[int]],
            trees: list[list[int] | None] | None = None, *, rope_cos: torch.Tensor,
            rope_sin: torch.Tensor, sliding_windows: tuple[int | None, ...],
            decode_width: int | None, device: torch.device, upload: Upload | None = None
            ) -> tuple[ForwardContext, torch.Tensor]:
    """The context of a forward appending ``token_ids[i]`` to slot ``slots[i]``, and its tokens
    ``[B, T]`` (each row padded to the longest, or to ``decode_width``), both on ``device``.
    ``rope_cos``/``rope_sin``: the runtime's ``[max_len, D]`` tables; ``sliding_windows``: its
    layers' (:attr:`ModelArch.sliding_windows`); ``trees``: as :meth:`LlamaRuntime.forward`
    takes them. What the device needs of the batch goes in one copy, with whatever the caller
    put in ``upload``. Reserves the rows' blocks in a paged cache."""
    starts, lens = check_rows(cache, slots, token_ids)
    kv_used = max(s + n for s, n in zip(starts, lens))
    kv_len = -(-kv_used // KV_BLOCK) * KV_BLOCK  # kernels read whole blocks
    t = max(lens)
    if decode_width is not None and t <= decode_width:
        t = decode_width  # a decode's GEMMs take a verify's shape (use_kernels)
    # [B, T] each from the host's lists in one tensor, not a handful of small operations
    tokens = torch.tensor([[*ids, *[0] * (t - len(ids))] for ids in token_ids], dtype=torch.long)
    window = one_window(sliding_windows)
    tree, tree_starts = None, None
    if trees is not None and any(parents is not None for parents in trees):
        rope_positions, tree, tree_starts = _trees(trees, starts, lens, t, window)
        table_pos = rope_positions.clamp(max=rope_cos.shape[0] - 1)
    else:
        table_pos = _table_positions(starts, t, rope_cos.shape[0])
    fields = dict(slots=slots, kv_len=kv_len, kv_used=kv_used, window=window, shape=(len(slots), t),
                  tree=tree, tree_starts=tree_starts, table=cache.block_table(slots), rows=(starts, lens))
    upload = upload or Upload()
    if torch.device(device).type == "cpu":  # read as they are: the per-token tensors on first use
        upload.send(device)
        return ForwardContext(cos=_rope_rows(rope_cos, table_pos), sin=_rope_rows(rope_sin, table_pos),
                              locate=lambda: cache.locate_new(slots, starts, lens), **fields), tokens
    # What the device needs of the batch: [B, T] token ids, RoPE rows, validity and positions,
    # where each real token's key goes ([N] each: cache.locate), a tree's masks and bases.
    positions, valid, real = (_row_tensors[name](starts, lens, t) for name in ("positions", "valid", "real"))
    if isinstance(table_pos, slice):
        table_pos = positions
    parts = [upload.add(x) for x in (tokens, table_pos, valid, real, *cache.locate_new(slots, starts, lens),
                                     positions, *(() if tree is None else (tree, tree_starts)))]
    upload.send(device)
    tokens_d, table_pos_d, valid_d, real_d, write_slots, write_positions, positions_d, *tree_d = (
        upload[i] for i in parts)
    made = {"valid": valid_d, "real": real_d, "write_slots": write_slots, "write_positions": write_positions,
            "positions": positions, "on_device": (positions_d, *(tree_d or (None, None)))}
    return ForwardContext(cos=rope_cos[table_pos_d].unsqueeze(2), sin=rope_sin[table_pos_d].unsqueeze(2),
                          made=made, **fields), tokens_d


def _table_positions(starts: list[int], t: int, table_len: int) -> torch.Tensor | slice:
    """The RoPE table's row of each query of chain rows, its position capped at the table's
    last row (padding past the context): ``[B, T]``; for one row that needs no cap, the
    slice of its rows (:func:`_rope_rows` then takes a view, not a copy)."""
    if len(starts) == 1 and starts[0] + t <= table_len:
        return slice(starts[0], starts[0] + t)
    return torch.tensor([[min(s + j, table_len - 1) for j in range(t)] for s in starts], dtype=torch.long)


def _rope_rows(table: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """``[B, T, 1, D]``: ``table``'s rows at ``rows`` (:func:`_table_positions`'); contiguous
    either way."""
    if isinstance(rows, slice):
        return table[rows][None, :, None]
    return table[rows].unsqueeze(2)


_row_tensors: dict[str, Callable[[list[int], list[int], int], torch.Tensor]] = {
    # a host forward's per-token tensors, from its rows' starts and lengths and its width T
    "positions": lambda starts, lens, t: torch.tensor([list(range(s, s + t)) for s in starts],
                                                      dtype=torch.long),
    "valid": lambda starts, lens, t: torch.tensor([[j < n for j in range(t)] for n in lens],
                                                  dtype=torch.bool),
    "real": lambda starts, lens, t: torch.tensor([i * t + j for i, n in enumerate(lens)
                                                  for j in range(n)], dtype=torch.long),
    "lens": lambda starts, lens, t: torch.tensor(lens),
}


def chains(trees: list[list[int] | None] | None) -> bool:
    """Whether every row of a forward with ``trees`` is a chain (no token tree after all:
    none given, or each token's parent the token before it).

    >>> chains(None), chains([None, [-1, 0, 1]]), chains([[-1, 0, 0]])
    (True, True, False)
    """
    return trees is None or all(parents is None or (parents[:1] == [-1] and all(
        p == j - 1 for j, p in enumerate(parents) if j)) for parents in trees)


def _visible(positions: torch.Tensor, kv_len: int, window: int | None, tree: torch.Tensor | None,
             tree_starts: torch.Tensor | None) -> torch.Tensor:
    """:meth:`ForwardContext.visible` on ``positions``' device."""
    keys = torch.arange(kv_len, device=positions.device)[None, None, :]  # [1, 1, S]
    visible = keys <= positions[:, :, None]                              # [B, T, S]
    if window:
        visible &= keys > positions[:, :, None] - window
    if tree is not None:  # a tree row's query: its prefix, ancestors and itself
        rel = keys - tree_starts.long()[:, None, None]                   # [B, 1, S]
        bit = (tree[:, :, None] >> rel.clamp(0, 63)) & 1                 # [B, T, S]
        seen = (rel < 0) | ((rel < 64) & (bit == 1))
        visible = torch.where((tree_starts >= 0)[:, None, None], visible & seen, visible)
    return visible


def _trees(trees: list[list[int] | None], starts: list[int], lens: list[int], t: int,
           window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE positions ``[B, T]`` (a node's: its row start + its depth), the visibility
    bitmasks ``[B, T]`` and the tree rows' bases ``[B]`` (-1: chain) of a forward.

    A row's tokens up to its *base* form a chain that every later token descends from
    (the base: the lowest parent of a token that does not follow the token before it;
    a verify's base is the row's last token, a prompt's tail before it): the kernels
    read keys before the base as a chain's, and bit i of a query's mask stands for the
    base's i-th token after it, so a tree of up to 63 drafts fits whatever came before."""
    if window is not None:
        raise InvalidRequestError("token trees are not supported with sliding-window attention")
    depth = torch.arange(t).repeat(len(starts), 1)          # [B, T]: chains (and padding)
    masks = torch.zeros(len(starts), t, dtype=torch.int64)
    bases = torch.full((len(starts),), -1, dtype=torch.int32)
    for b, parents in enumerate(trees):
        if parents is None:
            continue
        past = len(parents) - lens[b]  # the tree's tokens stored by earlier forwards
        if not 0 <= past <= starts[b]:
            raise InvalidRequestError(f"a tree needs one parent per new token and at most one "
                                      f"per cached token (row {b}: {len(parents)} parents, "
                                      f"{lens[b]} new tokens, {starts[b]} cached)")
        try:  # the drafts after token 0, numbered as token_tree numbers them
            if not parents or parents[0] != -1:
                raise ValueError("token 0's parent must be -1 (it follows the cache)")
            validate_tree([p - 1 for p in parents[1:]])
        except ValueError as exc:
            raise InvalidRequestError(f"row {b}: malformed token tree ({exc})") from None
        branching = [p for j, p in enumerate(parents) if j and p != j - 1]
        if not branching:
            continue  # a chain after all
        base = min(branching)
        if len(parents) - base > 64:
            raise InvalidRequestError(f"row {b}: a tree of {len(parents) - base} tokens after "
                                      "its base; at most 64")
        # Depth and mask of every token of the tree, cached ones included (index j is
        # stored at starts[b] - past + j); the new tokens take theirs.
        tree_depth, tree_mask = list(range(base + 1)), [0] * base + [1]
        for j in range(base + 1, len(parents)):
            tree_depth.append(tree_depth[parents[j]] + 1)
            tree_mask.append(tree_mask[parents[j]] | _bit(j - base))
        for j in range(lens[b]):
            depth[b, j] = tree_depth[past + j] - past
            masks[b, j] = tree_mask[past + j]
        for j in range(lens[b], t):  # padding: sees the row's tokens; never read
            depth[b, j] = j
            bit = past + j - base
            masks[b, j] = masks[b, j - 1] | _bit(bit) if bit < 64 else masks[b, j - 1]
        bases[b] = starts[b] - past + base
    return torch.tensor(starts)[:, None] + depth, masks, bases


def _bit(j: int) -> int:
    """Bit j of an int64 (bit 63 is the sign)."""
    return 1 << j if j < 63 else -(1 << 63)
