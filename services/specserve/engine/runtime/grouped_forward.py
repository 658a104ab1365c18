"""A forward of several row groups in one pass (:meth:`LlamaRuntime.forward` of a batch
with ``groups``): each group padded to its own longest row, and on the ``invariant`` kernels
every group's tokens packed through the layers together (:class:`PackedContext`)."""

from __future__ import annotations

from itertools import accumulate, pairwise

import torch

from specserve.engine.kv.kv_cache import SlotKVCache
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.forward_context import PackedContext


def forward_groups(runtime, cache: SlotKVCache, batch: ForwardBatch, num_logits: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`LlamaRuntime.forward` of rows in ``batch.groups`` (its docstring) on ``runtime``:
    logits and hidden states (None unless ``batch.hidden``) in row order. ``num_logits``:
    the batch's, its default filled in."""
    slots, token_ids, trees, features = batch.slots, batch.token_ids, batch.trees, batch.features
    spans = list(pairwise(accumulate(batch.groups, initial=0)))  # each group's rows
    feats: list[torch.Tensor | None] = [None] * len(spans)
    if features is not None:
        feats = list(features.split([sum(map(len, token_ids[a:b])) for a, b in spans]))
    part = (lambda a, b: None) if trees is None else (lambda a, b: trees[a:b])
    if runtime.kernels != "invariant":
        outs = [runtime.forward(cache, ForwardBatch(slots[a:b], token_ids[a:b], num_logits[a:b],
                                                    trees=part(a, b), features=f, hidden=batch.hidden,
                                                    upload=batch.upload if a == 0 else None))
                for (a, b), f in zip(spans, feats)]  # the caller's uploads go with the first
        return (torch.cat([out.logits for out in outs]),
                torch.cat([out.hidden for out in outs]) if batch.hidden else None)
    prepared = [runtime._prepare(cache, slots[a:b], token_ids[a:b], part(a, b),
                                 batch.upload if a == 0 else None) for a, b in spans]
    x = torch.cat([runtime._inputs(tokens, ctx, f).flatten(0, 1)
                   for (ctx, tokens), f in zip(prepared, feats)])[None]  # [1, N, hidden]
    packed = PackedContext([ctx for ctx, _ in prepared],
                           list(pairwise(accumulate((ctx.valid.numel() for ctx, _ in prepared),
                                                    initial=0))))
    x, captured = runtime._layers(x, packed, cache, batch.hidden and runtime.feature_layers is not None)
    for slot, ids in zip(slots, token_ids):
        cache.lengths[slot] += len(ids)
    where = []  # each row's new tokens in the pack, rows in order
    for (a, b), ctx, (first, _) in zip(spans, packed.groups, packed.spans):
        t = ctx.valid.shape[1]
        where += [range(first + j * t, first + j * t + len(ids))
                  for j, ids in enumerate(token_ids[a:b])]
    asked = [i for r, n in zip(where, num_logits) for i in r[len(r) - n:]]
    if not batch.hidden:
        return runtime.logits(runtime.final_norm(x[0, asked])), None
    if runtime._own_features(batch.hidden):
        return (runtime.logits(runtime.final_norm(x[0, asked])),
                runtime._features(x, captured)[0, [i for r in where for i in r]])
    hidden = runtime.final_norm(x[0, [i for r in where for i in r]])
    ends = list(accumulate(map(len, where)))
    rows = [i for end, n in zip(ends, num_logits) for i in range(end - n, end)]
    return runtime.logits(hidden[rows]), hidden
