"""Token trees in the runtime (issue 20): a tree forward gives every node the logits of its
root-to-node path decoded as a chain, bit for bit on the C kernels, beside chain rows in one
batch; compacting the accepted path leaves the cache a chain's; malformed trees are refused."""

from __future__ import annotations

import random

import pytest
import torch
from specserve.engine.runtime import layers, native
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.token_tree import tree_ancestors
from specserve.errors import InvalidRequestError

from tests.models import VOCAB, random_sequences, runtime_of, tiny_hf_model


def random_tree(rng: random.Random, size: int) -> list[int]:
    """Parents over a row's new tokens: token 0 (the root) follows the cache, the others an
    earlier token, with bushy and deep shapes alike."""
    return [-1] + [rng.randrange(0, j) if rng.random() < 0.6 else j - 1 for j in range(1, size)]


def path_of(parents: list[int], j: int) -> list[int]:
    """New-token indices from the root (token 0) to token j. (tree_ancestors numbers the
    nodes after the root from 0, the root being -1.)"""
    if j == 0:
        return [0]
    nodes = tree_ancestors([p - 1 for p in parents[1:]])[j - 1]
    return [0, *(a + 1 for a in nodes), j]


def chain_logits(rt, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits after the last of ``tokens``, decoded as a chain after ``prefix`` in a fresh
    cache (prefix prefilled, then the tokens in one forward, as a verify would)."""
    cache = rt.make_cache(num_slots=1, max_seq_len=128)
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [prefix]))
    return rt(cache, ForwardBatch([slot], [tokens], [len(tokens)])).logits[-1]


@pytest.fixture(scope="module")
def rt():
    return runtime_of(tiny_hf_model("llama-gqa", logit_scale=4.0), max_len=256)


def test_every_node_has_its_paths_chain_logits_beside_chain_rows(rt):
    """Batches of 1-4 rows mixing trees (up to 24 nodes) and chains: each node's logits equal
    the chain of its path's, and each chain row's equal its chain alone (C kernels: exact)."""
    assert native.library() is not None, native.unavailable_reason()
    rng = random.Random(0)
    for trial in range(12):
        rows = rng.randrange(1, 5)
        prefixes = random_sequences(tuple(rng.randrange(3, 40) for _ in range(rows)), seed=trial)
        trees = [random_tree(rng, rng.randrange(2, 25)) if rng.random() < 0.7 else None
                 for _ in range(rows)]
        tokens = [[rng.randrange(3, VOCAB) for _ in range(len(t) if t else rng.randrange(1, 6))]
                  for t in trees]
        cache = rt.make_cache(num_slots=4, max_seq_len=128)
        slots = [cache.allocate() for _ in range(rows)]
        rt(cache, ForwardBatch(slots, prefixes))
        out = rt(cache, ForwardBatch(slots, tokens, [len(t) for t in tokens], trees=trees))
        logits = out.logits.split([len(t) for t in tokens])
        for prefix, parents, ids, got in zip(prefixes, trees, tokens, logits):
            for j in range(len(ids)):
                path = path_of(parents, j) if parents else list(range(j + 1))
                want = chain_logits(rt, prefix, [ids[i] for i in path])
                assert torch.equal(got[j], want), (trial, j, path)


def test_the_kept_path_leaves_the_cache_a_chains(rt):
    """After a tree forward, keep() moves the accepted path's keys and values next to the
    root; the next step's logits equal those of the chain that decoded that path."""
    rng = random.Random(1)
    prefix = random_sequences((17,), seed=5)[0]
    for trial in range(6):
        parents = random_tree(rng, 16)
        ids = [rng.randrange(3, VOCAB) for _ in parents]
        cache = rt.make_cache(num_slots=2, max_seq_len=128)
        slot = cache.allocate()
        rt(cache, ForwardBatch([slot], [prefix]))
        rt(cache, ForwardBatch([slot], [ids], [len(ids)], trees=[parents]))
        leaf = rng.randrange(0, len(ids))
        path = path_of(parents, leaf)  # starts at the root, token 0
        cache.keep(slot, [len(prefix) + j for j in path[1:]], len(prefix) + 1)
        assert cache.lengths[slot] == len(prefix) + len(path)
        nxt = rng.randrange(3, VOCAB)
        got = rt(cache, ForwardBatch([slot], [[nxt]])).logits[0]
        want = chain_logits(rt, prefix, [ids[j] for j in path] + [nxt])
        assert torch.equal(got, want), (trial, path)


def test_trees_on_the_torch_paths_agree_up_to_rounding(monkeypatch):
    """The torch fallback (no C compiler) and ``library`` take a tree through the visibility
    mask: the same logits up to rounding (bit-identity is the C kernels' property)."""
    hf = tiny_hf_model("llama-gqa", logit_scale=4.0)
    rng = random.Random(2)
    parents = random_tree(rng, 12)
    ids = [rng.randrange(3, VOCAB) for _ in parents]
    prefix = random_sequences((9,), seed=3)[0]
    outs = []
    for kernels, native_on in (("invariant", True), ("invariant", False), ("library", True)):
        rt = runtime_of(hf).use_kernels(kernels)
        cache = rt.make_cache(num_slots=1, max_seq_len=64)
        slot = cache.allocate()
        rt(cache, ForwardBatch([slot], [prefix]))
        with monkeypatch.context() as patch:
            if not native_on:  # the attention of a machine without a C compiler
                patch.setattr(layers, "native_ready", lambda x: False)
            outs.append(rt(cache, ForwardBatch([slot], [ids], [len(ids)], trees=[parents])).logits)
    for other in outs[1:]:
        assert torch.allclose(outs[0], other, atol=1e-4)


@pytest.mark.parametrize("parents", [[0, 0], [-1, -1], [-1, 1], [-1, 0, 3]])
def test_malformed_trees_are_refused(rt, parents):
    cache = rt.make_cache(num_slots=1, max_seq_len=64)
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [[5, 6, 7]]))
    with pytest.raises(InvalidRequestError):
        rt(cache, ForwardBatch([slot], [[9] * len(parents)], trees=[parents]))
    with pytest.raises(InvalidRequestError):  # one parent per token
        rt(cache, ForwardBatch([slot], [[9, 9, 9]], trees=[[-1, 0]]))


def test_trees_are_refused_with_sliding_windows():
    rt = runtime_of(tiny_hf_model("mistral-window"))
    cache = rt.make_cache(num_slots=1, max_seq_len=64)
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [[5, 6, 7]]))
    with pytest.raises(InvalidRequestError, match="sliding-window"):
        rt(cache, ForwardBatch([slot], [[9, 9]], trees=[[-1, 0]]))


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
def test_native_tree_attention_equals_the_chain_of_each_nodes_path(heads):
    """The C attention alone, at head size 64: a tree row's node reads its prefix and
    ancestors gathered in order, with the arithmetic of the same keys stored as a chain
    (queries grouped 4 at a time with other nodes and heads, prefixes across KV blocks)."""
    from specserve.engine.runtime.kernels import KV_BLOCK

    h, hk = heads
    d, s, n = 64, 4 * KV_BLOCK, 13
    gen = torch.Generator().manual_seed(7)
    parents = random_tree(random.Random(3), n)
    for start in (5, KV_BLOCK + 3):
        keys, values = torch.randn(2, hk, s, d, generator=gen), torch.randn(2, hk, s, d, generator=gen)
        q = torch.randn(1, n, h, d, generator=gen)
        masks = torch.zeros(1, n, dtype=torch.int64)
        for j, parent in enumerate(parents):
            masks[0, j] = (masks[0, parent] if j else 0) | (1 << j)
        pos = torch.arange(start, start + n, dtype=torch.int32)[None]
        out = native.attention(q, keys, values, torch.tensor([[0]], dtype=torch.int32),
                               torch.zeros_like(pos), pos + 1,
                               d ** -0.5, masks, torch.tensor([start], dtype=torch.int32))
        for j in range(n):
            path = path_of(parents, j)  # lay the path out as a chain in slot 1
            keys[1, :, :start], values[1, :, :start] = keys[0, :, :start], values[0, :, :start]
            for m, node in enumerate(path):
                keys[1, :, start + m] = keys[0, :, start + node]
                values[1, :, start + m] = values[0, :, start + node]
            end = torch.tensor([[start + len(path)]], dtype=torch.int32)
            alone = native.attention(q[:, j:j + 1], keys, values, torch.tensor([[1]], dtype=torch.int32),
                                     torch.zeros_like(end), end, d ** -0.5)
            assert torch.equal(out[0, j], alone[0, 0]), (start, j, path)


def test_a_tree_after_a_long_prompt_tail_in_one_forward(rt):
    """A prefilling row drafts too: its prompt's 80-token tail (a chain) and a tree after it in
    one forward; the tree is counted from its base, so it fits the 64-token masks."""
    rng = random.Random(4)
    tail = random_sequences((80,), seed=9)[0]
    drafts = random_tree(rng, 12)[1:]  # parents among the drafts, in token_tree's numbering
    drafts = [p - 1 for p in drafts]
    parents = [-1, *range(len(tail) - 1)] + [len(tail) - 1 if p == -1 else len(tail) + p for p in drafts]
    ids = tail + [rng.randrange(3, VOCAB) for _ in drafts]
    cache = rt.make_cache(num_slots=1, max_seq_len=128)
    slot = cache.allocate()
    # the root's logits, then each node's
    got = rt(cache, ForwardBatch([slot], [ids], [len(drafts) + 1], trees=[parents])).logits
    sub = [-1] + [p + 1 for p in drafts]  # the root (the tail's last token) and the drafts
    for m in range(len(sub)):
        path = [len(tail) - 1 + k for k in path_of(sub, m)]
        want = chain_logits(rt, tail[:-1], [ids[k] for k in path])
        assert torch.equal(got[m], want), m


def test_a_tree_grown_over_several_forwards_equals_it_in_one(rt):
    """A draft expands its tree a level at a time (``drafts/eagle.py``): each forward
    brings new nodes whose parents were stored by earlier forwards (``trees[i]`` covers the
    cached part too). Every node's logits equal those of the whole tree in one forward, and
    so those of its path as a chain; a chain row beside it is unaffected."""
    rng = random.Random(5)
    for trial in range(6):
        prefix, other = random_sequences((rng.randrange(3, 30), 11), seed=20 + trial)
        parents = [-1] + sorted_tree(rng, rng.randrange(6, 30))
        ids = [rng.randrange(3, VOCAB) for _ in parents]
        cache = rt.make_cache(num_slots=2, max_seq_len=128)
        slot, chain_slot = cache.allocate(), cache.allocate()
        rt(cache, ForwardBatch([slot, chain_slot], [prefix, other]))
        cuts = sorted(rng.sample(range(1, len(parents)), 3)) + [len(parents)]
        got, done = [], 0
        for cut in cuts:  # nodes [done, cut) arrive now; the chain row decodes a token each time
            nxt = rng.randrange(3, VOCAB)
            out = rt(cache, ForwardBatch([slot, chain_slot], [ids[done:cut], [nxt]], [cut - done, 1],
                                         trees=[parents[:cut], None])).logits
            got.append(out[:-1])
            other = other + [nxt]
            assert torch.equal(out[-1], chain_logits(rt, other[:-1], other[-1:])[None][0]), trial
            done = cut
        got = torch.cat(got)
        for j in range(len(parents)):
            want = chain_logits(rt, prefix, [ids[i] for i in path_of(parents, j)])
            assert torch.equal(got[j], want), (trial, j)


def sorted_tree(rng: random.Random, size: int) -> list[int]:
    """Parents of ``size`` nodes after a root at index 0, level by level as a draft grows it
    (each node's parent an earlier node, depths non-decreasing)."""
    parents, depth = [], [0]
    for j in range(1, size + 1):
        parent = rng.choice([i for i in range(j) if depth[i] == max(depth[:j]) or
                             depth[i] == max(depth[:j]) - 1] or [j - 1])
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return parents
