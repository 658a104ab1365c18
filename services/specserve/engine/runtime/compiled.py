"""Static shapes for ``torch.compile`` and CUDA graphs: the runtime's GPU path (``kernels: compiled``).

On a GPU, a decode step of a model that fits is short enough that launching its kernels
costs as much as running them: ~15 kernels per layer at a few microseconds each is a few
milliseconds a step over 32 layers, about as long as a current GPU takes to read 8B bfloat16
weights. gpt-fast's recipe removes that: compile the layer stack with static shapes and
replay it as one CUDA graph. A graph needs every shape and address fixed, so this module

- pads a ragged decode or verify batch up to a *bucket*: rows to the next power of two, new
  tokens per row to the verify's bucket ("One token shape", below; else to 1, 2, 4, 8 or
  16: :data:`BUCKET_TOKENS`), and compiles the forward once per bucket
  (``dynamic=False``), from the token ids through the embedding, every layer, the final
  norm and the LM head. A unit with ``S`` slots decodes and verifies in ``log2(S) + 1``
  shapes;
- takes the bucket's inputs in one persistent buffer, filled with the rest of the step's
  uploads by one host-to-device copy (:class:`~specserve.engine.runtime.forward_batch.BucketBuffer`): one
  graph input besides the weights and the cache, at one address, so a CUDA graph replays
  without copying its inputs into place;
- reads each row's own keys in place (:mod:`specserve.engine.runtime.block_attention`,
  ``attention: flex``, the default on CUDA): FlexAttention over the cache's storage with a
  block mask listing each row's key blocks up to its last token, so no shape depends on a
  sequence's length and the cost follows the rows' real contexts. The mask's tensors are
  made per forward on the host from the rows' positions and travel in the bucket's
  buffer. ``attention: sdpa``
  keeps gpt-fast's way (each row's whole slot, gathered, with a mask: ``max_seq_len`` keys
  per row per layer), the CPU default;
- writes the new keys and values with one ``index_put`` per layer, in place on the cache
  tensors (marked static so the graph keeps their addresses). Padding tokens write to the
  cache's spare slot (:class:`~specserve.engine.kv.kv_cache.SlotKVCache` ``spare``), which no
  sequence owns;
- leaves prefill (more than :data:`BUCKET_TOKENS`\\ [-1] new tokens in a row) and token
  trees to the library path: a prefill's shapes vary anyway, and its cost is compute, not
  launches.

Compiles happen in :func:`warm_up` (every bucket serving will use, before the first request;
the unit calls it under its own timeout), and a bucket first met while serving logs a
warning. The warm-up reports inductor's ``cudagraph_skips``: a graph that runs without CUDA
graphs pays every launch again, silently otherwise.

One token shape (``verify_tokens`` = the unit's K + 1). Greedy speculation gives the
target-only output when a token's logits do not depend on whether it was decoded alone or
verified among drafts. On a GPU nothing is row-invariant by construction (the C kernels are
the CPU's way: ``kernels.py``): a GEMM's tiling, split and reduction order follow its shape,
so the design is to give decodes and verifies the *same* shapes. Every decode and verify
(T <= bucket(K + 1)) runs at the verify's token bucket, so a decode row and a verify row of
one row bucket go through the same compiled graph: the same GEMM shapes (M = rows x
bucket(K + 1)), the same kernels, one row's outputs computed as any other row's; the final
norm and LM head too, in the graph over the whole bucket. A decode
pays the verify's width; on a memory-bound GPU that is nearly free, the premise of
speculation itself. Rows stay bucketed to powers of two. (The library path on CUDA pads a
decode's tokens to K + 1 for the same reason; ``LlamaRuntime.use_kernels``.)

What it does not promise: invariance across row buckets. A step with 3 rows and one with 5
run different graphs (rows 4 vs 8), whose GEMMs may tile differently; and FlexAttention's
decoding kernel splits a row's keys across thread blocks by the row's block count when the
batch is small, so a verify whose last draft enters a new 64-key block can sum a token's
attention in another order than its decode. Both can flip a near tie (forcing one split did
not make an H200's outputs identical: docs/BENCHMARKS.md, "Second window"). How often is measured
on a GPU (``tests/gpu``, ``make gpu-check``), not promised here (README, "Precision"). On a
CPU the same code runs under inductor (``attention: sdpa``) or dynamo alone, which is how the
tests check it; the C kernels are faster there.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specserve.engine.runtime.block_attention import KeyBlocks, key_blocks
from specserve.engine.runtime.forward_batch import (
    BucketBuffer,
    ForwardBatch,
    Layout,
    Upload,
    check_rows,
    fed_positions,
    logit_positions,
)

log = logging.getLogger(__name__)

BUCKET_TOKENS = (1, 2, 4, 8, 16)  # new tokens per row a compiled forward takes

# What a step makes of a bucket inside its graph (StaticForward.verdict): from the token ids
# [R, W], their logits' argmax [R, W], each row's first asked column [R] and number of asked
# positions [R], a tensor [R, ...]
GraphVerdict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bucket(n: int, limit: int | None = None) -> int:
    """The static size ``n`` rows or tokens are padded to: the next power of two (at most
    ``limit``, itself allowed where it is not a power of two).

    >>> [bucket(n) for n in (1, 2, 3, 5, 9)]
    [1, 2, 4, 8, 16]
    >>> bucket(5, limit=6)
    6
    """
    size = 1 << max(n - 1, 0).bit_length()
    return min(size, limit) if limit is not None else size


def token_bucket(n: int, verify_tokens: int | None = None) -> int:
    """The token bucket of a forward whose longest row has ``n`` new tokens: the verify's,
    ``bucket(verify_tokens)``, for every decode and verify that fit in it (one graph for
    both: module docstring), else :func:`bucket`. A verify wider than the last bucket
    leaves decodes at 1.

    >>> [token_bucket(n, verify_tokens=5) for n in (1, 5, 8, 9)]
    [8, 8, 8, 16]
    >>> token_bucket(1), token_bucket(3), token_bucket(1, verify_tokens=17)
    (1, 4, 1)
    """
    width = bucket(verify_tokens) if verify_tokens is not None else 1
    if width > BUCKET_TOKENS[-1]:
        width = 1
    return width if n <= width else bucket(n)


@dataclass
class StaticInputs:
    """What the layers of one padded forward share; every shape fixed by the bucket
    ``(B, T)`` and the cache's storage (``slots``, ``S``). Padding rows and padding tokens
    carry the cache's spare slot. Attention reads ``keys`` (``flex``: each row's own key
    blocks) or ``visible`` (``sdpa``: each row's whole slot, masked)."""

    cos: torch.Tensor              # [B, T, 1, D]
    sin: torch.Tensor              # [B, T, 1, D]
    slots: torch.Tensor            # [B] int64: each row's slot (a paged cache's: unused)
    write_slots: torch.Tensor      # [B, T] int64: each key's storage row, slot or block (spare: padding)
    write_positions: torch.Tensor  # [B, T] int64: its offset there
    blocks: torch.Tensor | None = None    # paged: [B, W] int64 each row's block table (sdpa reads it)
    keys: KeyBlocks | None = None         # flex: the blocks each row reads
    window_keys: KeyBlocks | None = None  # the same inside the sliding window
    visible: torch.Tensor | None = None   # sdpa: [B, 1, T, S] bool, the keys each query sees
    window_visible: torch.Tensor | None = None  # the same inside the sliding window


class StaticForward:
    """A :class:`~specserve.engine.runtime.model.LlamaRuntime`'s forward at bucketed static
    shapes, from token ids to the LM head's logits, compiled (``backend``; ``None`` runs the
    same code eagerly). ``verify_tokens``: the unit's K + 1, whose bucket decodes share
    (:func:`token_bucket`).

    One graph per bucket takes one input besides the weights and the cache: the bucket's
    persistent buffer (:class:`~specserve.engine.runtime.forward_batch.BucketBuffer`), filled with the
    step's other uploads in one copy. It embeds the tokens, runs every layer, the final norm
    and the LM head over the whole bucket (so a token's logits do not depend on how many
    others asked for theirs: "One token shape"), and returns the logits, the normed hidden
    states and a target's EAGLE features (the layers' inputs it names: graph outputs, so an
    EAGLE-3 target keeps this path); the asked rows are gathered after it.

    ``verdict``: what the step makes of the logits, run inside the graph where the step's
    owner installs one (:data:`GraphVerdict`; the verify's worker installs the greedy
    verification, ``acceptance.greedy_in_bucket``, so a greedy step's result is a graph
    output, with no launch of its own). The runtime knows nothing of verification: it hands the function the
    bucket's token ids, their argmax and the asked positions, and returns its result."""

    # int64 words of a buffer's tail per bucket token: the step's other uploads (the gather
    # indices, a verification's drafts, settings and noise); a larger tail is sent apart
    TAIL_WORDS_PER_TOKEN = 16
    verdict: GraphVerdict | None = None  # the step's, installed by its owner (class docstring)

    def __init__(self, runtime, *, backend: str | None = "inductor",
                 verify_tokens: int | None = None) -> None:
        self.runtime = runtime
        self.verify_tokens = verify_tokens
        self.buckets: set[tuple[int, int]] = set()  # (rows, tokens) compiled so far
        self.warmed = False  # set by warm_up: a new bucket afterwards compiles while serving
        self.cuda_graphs = False
        self._buffers: dict[Layout, BucketBuffer] = {}
        self._step = self._graph
        if backend is not None:
            self.cuda_graphs = runtime.embed.weight.device.type == "cuda" and backend == "inductor"
            # one graph per bucket: raise dynamo's recompile limit (8) to the bucket count
            limit = len(BUCKET_TOKENS) * 16
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            self._step = torch.compile(self._graph, backend=backend, fullgraph=True, dynamic=False,
                                       mode="reduce-overhead" if self.cuda_graphs else None)

    def takes(self, num_new: int) -> bool:
        """Whether a forward whose longest row has ``num_new`` tokens runs here."""
        return num_new <= BUCKET_TOKENS[-1]

    def bucket_of(self, num_rows: int, num_new: int, num_slots: int) -> tuple[int, int]:
        """The ``(rows, tokens)`` bucket a forward of ``num_rows`` rows, the longest with
        ``num_new`` new tokens, runs in (a cache of ``num_slots`` slots)."""
        return bucket(num_rows, limit=num_slots), token_bucket(num_new, self.verify_tokens)

    def forward(self, cache, batch: ForwardBatch, num_logits: list[int], upload: Upload
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`LlamaRuntime.forward <specserve.engine.runtime.model.LlamaRuntime.forward>`'s
        logits ``[sum(num_logits), vocab]``, hidden states (None unless ``batch.hidden``) and
        :attr:`verdict`'s ``[rows, ...]`` (None without one) of a batch of chains whose rows
        have at most :data:`BUCKET_TOKENS`\\ [-1] new tokens; ``upload``'s pending tensors
        travel in the same copy. Leaves the cache's lengths to the caller."""
        starts, lens = check_rows(cache, batch.slots, batch.token_ids)
        rows, tokens = self.bucket_of(len(lens), max(lens), cache.num_slots)
        self._note(rows, tokens)
        inputs = bucket_inputs(self.runtime, cache, batch, starts, lens, num_logits, rows, tokens)
        buffer = self._buffer(Layout.of(inputs), rows * tokens)
        asked, real = (upload.add(x) for x in token_indices(batch.token_ids, num_logits, tokens))
        last = None if batch.fed is None else upload.add(fed_positions(batch))
        buffer.fill(inputs, upload)
        if last is not None:  # into the buffer's token ids, on the device
            buffer.layout.view(buffer.device, "tokens")[tuple(upload[last])] = batch.fed
        features = None
        if batch.features is not None:  # a draft head's, in row order: to their places
            features = batch.features.new_zeros(rows * tokens, batch.features.shape[-1])
            features[upload[real]] = batch.features
            features = features.view(rows, tokens, -1)
        logits, normed, own, verdict = self._step(buffer.device, buffer.layout, cache, features,
                                                  self.verdict)
        hidden = None
        if batch.hidden:  # every new token's, in row order
            hidden = (own if own is not None else normed).flatten(0, 1)[upload[real]]
        # gathers and a copy: a replay overwrites the graph's outputs
        return (logits[upload[asked]], hidden,
                None if verdict is None else verdict[:len(lens)].clone())

    def _note(self, rows: int, tokens: int) -> None:
        if (rows, tokens) in self.buckets:
            return
        if self.warmed:
            log.warning("compiling the forward for %d rows x %d tokens while serving "
                        "(a bucket warm_up did not cover)", rows, tokens)
        else:
            log.info("compiling the forward for %d rows x %d tokens", rows, tokens)
        self.buckets.add((rows, tokens))

    def _buffer(self, layout: Layout, bucket_tokens: int) -> BucketBuffer:
        if layout not in self._buffers:
            self._buffers[layout] = BucketBuffer(layout, self.runtime.embed.weight.device,
                                                 spare=self.TAIL_WORDS_PER_TOKEN * bucket_tokens)
        return self._buffers[layout]

    def _graph(self, buffer: torch.Tensor, layout: Layout, cache, features: torch.Tensor | None,
               verdict: GraphVerdict | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                 torch.Tensor | None]:
        """The compiled step: logits ``[R * W, vocab]`` float32, normed hidden states
        ``[R, W, hidden]``, for a runtime whose features are its own (``feature_layers``,
        ``hidden_prenorm``) those ``[R, W, width]``, and ``verdict``'s result."""
        rt = self.runtime
        inputs = layout.read(buffer)
        x = rt._embedded(inputs["tokens"], features)                        # [R, W, hidden]
        own = rt.feature_layers is not None or rt.hidden_prenorm
        x, captured = rt._layers(x, static_inputs(rt, inputs, cache), cache,
                                 rt.feature_layers is not None)
        normed = rt.final_norm(x)
        logits = rt.logits(normed.flatten(0, 1))
        judged = None
        if verdict is not None:
            tokens = inputs["tokens"]
            judged = verdict(tokens, logits.argmax(dim=-1).view(tokens.shape), inputs["asked.first"],
                             inputs["asked.count"])
        return logits, normed, rt._features(x, captured) if own else None, judged


def token_indices(token_ids: list[list[int]], num_logits: list[int], tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into a bucket ``[R * W]`` (``W`` = ``tokens``), on the host: the asked
    positions (:func:`~specserve.engine.runtime.forward_batch.logit_positions`) and every
    new token, rows in order.

    >>> [x.tolist() for x in token_indices([[5, 6], [7]], [1, 1], tokens=4)]
    [[1, 4], [0, 1, 4]]
    """
    rows, cols = logit_positions(token_ids, num_logits)
    real = [i * tokens + j for i, ids in enumerate(token_ids) for j in range(len(ids))]
    return rows * tokens + cols, torch.tensor(real, dtype=torch.long)


def bucket_inputs(runtime, cache, batch: ForwardBatch, starts: list[int], lens: list[int],
                  num_logits: list[int], rows: int, tokens: int) -> dict[str, torch.Tensor]:
    """A batch padded to the bucket ``(rows, tokens)``, on the host: what the graph reads
    (:func:`static_inputs`; each row's first asked column and number of asked positions, for
    :attr:`StaticForward.verdict`), named. Padding rows write their tokens at ``0 .. W - 1``
    of the spare slot (a paged cache's spare block) and read those; a real row's padding
    tokens continue its positions and write there too. A paged cache's rows read through
    their block tables (``blocks``), at the cache's fixed table width."""
    b = len(lens)
    spare = cache.spare_row
    steps = torch.arange(tokens)
    start = torch.zeros(rows, dtype=torch.long)
    start[:b] = torch.tensor(starts)
    positions = start[:, None] + steps                                      # [R, W]
    slots = torch.full((rows,), spare, dtype=torch.long)
    slots[:b] = torch.tensor(batch.slots)
    length = torch.zeros(rows, dtype=torch.long)
    length[:b] = torch.tensor(lens)
    valid = steps < length[:, None]                                         # [R, W]
    token_ids = torch.zeros(rows, tokens, dtype=torch.long)
    for i, ids in enumerate(batch.token_ids):
        token_ids[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    count = torch.zeros(rows, dtype=torch.long)
    count[:b] = torch.tensor(num_logits)
    block_len = cache.k[0].shape[2]  # a slot's positions, or a block's
    if cache.paged:
        table = cache.static_table(batch.slots, rows)                      # [R, table width]
        written = table.gather(1, (positions // block_len).clamp(max=table.shape[1] - 1))
        offsets = positions % block_len
    else:
        table, written, offsets = slots[:, None], slots[:, None].expand(-1, tokens), positions
    inputs = {"tokens": token_ids,
              "asked.first": length - count, "asked.count": count,
              "table": positions.clamp(max=runtime.max_positions - 1),     # RoPE rows
              "slots": slots,
              "write_slots": torch.where(valid, written, spare),
              "write_positions": torch.where(valid, offsets, steps)}
    if cache.paged:
        inputs["blocks"] = table
    window = runtime.arch.window
    if runtime.attention != "flex":
        return {**inputs, "positions": positions}
    last = torch.where(length > 0, start + length - 1, tokens - 1)          # [R]
    for name, w in (("keys", None), ("window_keys", window)):
        if name == "keys" or w is not None:
            blocks = key_blocks(positions, last, table, num_kv_heads=cache.k[0].shape[1],
                                block_len=block_len, paged=cache.paged, window=w)
            inputs.update({f"{name}.{f.name}": getattr(blocks, f.name)
                           for f in dataclasses.fields(blocks)
                           if isinstance(getattr(blocks, f.name), torch.Tensor)})
    return inputs


def static_inputs(runtime, inputs: dict[str, torch.Tensor], cache) -> StaticInputs:
    """What the layers of the graph share, from the bucket's inputs (:func:`bucket_inputs`,
    on the device): inside the graph."""
    window = runtime.arch.window
    table = inputs["table"]
    if runtime.attention == "flex":
        attend = {name: None if f"{name}.last" not in inputs else KeyBlocks(
            window=w, **{"base": None, **{k.split(".", 1)[1]: v for k, v in inputs.items()
                                          if k.startswith(f"{name}.")}}).with_map(cache.k[0].shape[0])
                  for name, w in (("keys", None), ("window_keys", window))}
    else:
        attend = _slot_masks(inputs["positions"], cache, window)
    return StaticInputs(cos=runtime.rope_cos[table].unsqueeze(2),
                        sin=runtime.rope_sin[table].unsqueeze(2), slots=inputs["slots"],
                        write_slots=inputs["write_slots"],
                        write_positions=inputs["write_positions"], blocks=inputs.get("blocks"),
                        **attend)


def _slot_masks(positions: torch.Tensor, cache, window: int | None) -> dict:
    """``visible`` (and ``window_visible``) ``[B', 1, T', S]``: keys up to each query's
    position in its row's whole slot (a paged cache's: its table's blocks, in order)."""
    length = cache.k[0].shape[2] * (cache.table_width if cache.paged else 1)
    keys = torch.arange(length, device=positions.device)                   # [S]
    query = positions[:, None, :, None]                                    # [B', 1, T', 1]
    visible = keys <= query                                                # [B', 1, T', S]
    return {"visible": visible,
            "window_visible": None if window is None else visible & (keys > query - window)}


# -- warm-up ----------------------------------------------------------------------------------

def warm_up(runtime, cache) -> dict:
    """Run a forward in every shape serving will use, so its compiles happen here.

    ``compiled``: every ``(rows, tokens)`` bucket: rows in powers of two up to the slots,
    tokens the verify's bucket (every decode and verify runs there). ``library`` with
    ``flex``: the row counts its attention is compiled for, at the decode width. With
    ``flex`` on CUDA, prefills of 17 and 18 tokens too (the second compiles the graph every
    prefill length of a row then shares). Other kernels compile nothing: one small forward,
    no buckets. On CUDA graphs each bucket runs three times (warm-up, capture, replay). The
    forwards use free slots, which stay free at their lengths.

    Returns ``{"kernels", "buckets": [{"rows", "tokens", "seconds"}], "prefills": [...],
    "graphs", "cudagraph_skips"}``: graphs dynamo compiled and graphs inductor left without
    CUDA graphs during the warm-up (0 is the pass).
    """
    from torch._dynamo.utils import counters

    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    width = decode_tokens(runtime)
    repeats = 3 if runtime.static is not None and runtime.static.cuda_graphs else 1
    buckets = [_timed(runtime, cache, n, width, repeats, rows)
               for rows, n in row_buckets(runtime, cache.num_slots).items()]
    if not buckets:
        _timed(runtime, cache, 1, width, 1, 1)
    prefills = []
    if runtime.kernels != "invariant" and runtime.attention == "flex" and cache.k[0].is_cuda:
        first = max(BUCKET_TOKENS[-1], width) + 1
        prefills = [_timed(runtime, cache, 1, n, 1, 1) for n in (first, first + 1)
                    if n <= cache.max_seq_len]
    if runtime.static is not None:
        runtime.static.warmed = True
    return {"kernels": runtime.kernels, "buckets": buckets, "prefills": prefills,
            "graphs": counters["stats"]["unique_graphs"] - graphs,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips}


def decode_tokens(runtime) -> int:
    """New tokens per row a decode runs with: the verify's bucket (``compiled``), the
    verify's width (``library`` on CUDA), else 1."""
    if runtime.static is not None:
        return token_bucket(1, runtime.verify_tokens)
    return runtime.decode_width or 1


def row_buckets(runtime, num_slots: int) -> dict[int, int]:
    """``{row bucket: rows to run for it}``: every bucket a decode of 1 .. ``num_slots``
    rows compiles for (the most rows of each), or none where nothing compiles per shape.
    ``compiled`` buckets rows up to the slots; the library's FlexAttention pads rows to
    powers of two (``ForwardContext.key_blocks``)."""
    if runtime.static is not None:
        return {bucket(n, limit=num_slots): n for n in range(1, num_slots + 1)}
    if runtime.kernels == "library" and runtime.attention == "flex":
        return {bucket(n): n for n in range(1, num_slots + 1)}
    return {}


def _timed(runtime, cache, num_rows: int, tokens: int, repeats: int, rows: int) -> dict:
    """Seconds of ``repeats`` forwards of ``num_rows`` rows x ``tokens`` new tokens on free
    slots (logged; ``rows``: the bucket, for the log and the report)."""
    start = time.perf_counter()
    with _free_slots(cache, num_rows) as slots:
        for _ in range(repeats):
            runtime.forward(cache, ForwardBatch(slots, [[0] * tokens] * num_rows,
                                                features=runtime.warm_up_features(num_rows * tokens)))
            for slot in set(slots):
                cache.lengths[slot] = 0
        if cache.k[0].is_cuda:
            torch.cuda.synchronize(cache.k[0].device)
    seconds = time.perf_counter() - start
    log.info("compiled %d rows x %d tokens in %.1f s", rows, tokens, seconds)
    return {"rows": rows, "tokens": tokens, "seconds": seconds}


@contextmanager
def _free_slots(cache, num_rows: int):
    """``num_rows`` slots to write into: free slots, allocated for the forward and freed
    after (a free slot's length is 0 either way), repeated where fewer are free (rows of a
    warm-up may share a slot: what they write is never read)."""
    if cache.num_free_slots == 0:
        raise RuntimeError("warm-up needs a free KV cache slot")
    taken = [cache.allocate() for _ in range(min(num_rows, cache.num_free_slots))]
    try:
        yield [taken[i % len(taken)] for i in range(num_rows)]
    finally:
        for slot in taken:
            cache.free(slot)
