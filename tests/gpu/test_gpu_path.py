"""The runtime's GPU path on a GPU (issue 33): what no CPU test can run. Triton's
FlexAttention kernels (``engine/runtime/block_attention.py``), inductor's CUDA code and CUDA graphs
(``kernels: compiled``, ``engine/runtime/compiled.py``), and the library path on CUDA.

Run only by ``make gpu-check`` on a lent GPU machine (every test is marked ``gpu``;
``tests/conftest.py`` skips them elsewhere). The machine has torch, transformers and pytest
and no Ray: these tests import the engine's model modules and ``tests/models.py`` only. Each
builds a small model (2 layers, hidden 256, head size 64) and keeps to one or two buckets,
so its compiles take seconds, not minutes.
"""

from __future__ import annotations

import pytest
import torch
from specserve.engine.runtime.block_attention import KEY_BLOCK, attend, key_blocks
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.model import build_runtime
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.models import random_sequences, tiny_hf_model

pytestmark = pytest.mark.gpu

FP32_ATOL = 2e-3  # float32 on a GPU vs transformers on the CPU: other summation orders


@pytest.fixture(scope="module")
def hf():
    """Sharpened logits (about +-25), so argmax margins stand above bfloat16's rounding."""
    return tiny_hf_model("llama-gqa", logit_scale=3.0, hidden_size=256, intermediate_size=512)


def gpu_runtime(hf, kernels: str, dtype: torch.dtype = torch.bfloat16, **options):
    runtime = build_runtime(hf.config, hf.state_dict(), max_len=256, dtype=dtype, device="cuda")
    return runtime.requires_grad_(False).use_kernels(kernels, **options)


def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits on the CPU at every position of ``ids``: ``[T, V]``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_compiled_matches_library_in_bfloat16(hf):
    """The same verifies, decodes and a ragged step through ``compiled`` (CUDA graphs) and
    ``library`` (both on FlexAttention, decodes at the verify's width): the logits agree to
    bfloat16's rounding (measured on a CPU's bfloat16: about 2% of the logit scale at most,
    under 1% on average) and pick the same argmax on most rows."""
    seqs = random_sequences((40, 31), seed=1)
    logits = {}
    for kernels in ("library", "compiled"):
        rt = gpu_runtime(hf, kernels, verify_tokens=4)
        assert rt.attention == "flex"
        cache = rt.make_cache(num_slots=2, max_seq_len=128)
        slots = [cache.allocate() for _ in seqs]
        rt(cache, ForwardBatch(slots, [s[:20] for s in seqs]))  # prefill: the library path either way
        steps = [rt(cache, ForwardBatch(slots, [s[20:24] for s in seqs], [4, 4])).logits,
                 rt(cache, ForwardBatch(slots, [s[24:25] for s in seqs])).logits,
                 rt(cache, ForwardBatch(slots, [seqs[0][25:28], seqs[1][25:26]], [3, 1])).logits]
        logits[kernels] = torch.cat(steps).float().cpu()
    library, compiled = logits["library"], logits["compiled"]
    scale = library.abs().max()
    diff = (compiled - library).abs()
    assert diff.max() <= 0.1 * scale and diff.mean() <= 0.02 * scale, (diff.max(), diff.mean())
    assert (compiled.argmax(-1) == library.argmax(-1)).float().mean() >= 0.75


def test_row_groups_run_each_group_at_its_own_shape(hf):
    """``LlamaRuntime.forward``'s ``groups`` on CUDA (a step's verifying rows and a prompt's
    chunk in one call): each group runs as the forward it would be alone (the compiled
    bucket for the verifies, the library's prefill for the chunk), so logits and hidden
    states are the separate forwards' bits."""
    seqs = random_sequences((40, 31, 60), seed=2)
    rows = [seqs[0][20:24], seqs[1][20:21], seqs[2][:32]]
    outs = []
    for grouped in (True, False):
        rt = gpu_runtime(hf, "compiled", verify_tokens=4)
        cache = rt.make_cache(num_slots=3, max_seq_len=128)
        slots = [cache.allocate() for _ in seqs]
        rt(cache, ForwardBatch(slots[:2], [s[:20] for s in seqs[:2]]))
        if grouped:
            out = rt(cache, ForwardBatch(slots, rows, [4, 1, 0], groups=[2, 1], hidden=True))
            outs.append((out.logits, out.hidden))
        else:
            parts = [rt(cache, ForwardBatch(slots[:2], rows[:2], [4, 1], hidden=True)),
                     rt(cache, ForwardBatch(slots[2:], rows[2:], [0], hidden=True))]
            outs.append((torch.cat([p.logits for p in parts]), torch.cat([p.hidden for p in parts])))
    (logits, hidden), (ref_logits, ref_hidden) = outs
    assert logits.shape[0] == 5 and hidden.shape[0] == 37
    assert torch.equal(logits, ref_logits) and torch.equal(hidden, ref_hidden)


def test_padding_writes_only_the_spare_slot(hf):
    """tests/engine/runtime/test_compiled.py's check on CUDA: padding rows and tokens of bucket
    (2, 4) land in the spare slot; no sequence's keys change outside its new tokens."""
    rt = gpu_runtime(hf, "compiled", verify_tokens=4)
    cache = rt.make_cache(num_slots=4, max_seq_len=64)
    a, b, idle = (cache.allocate() for _ in range(3))
    for slot, n in ((a, 20), (b, 17), (idle, 18)):  # prefills: the library path
        rt(cache, ForwardBatch([slot], [list(range(3, 3 + n))]))
    before = [t.clone() for t in cache.k + cache.v]
    rt(cache, ForwardBatch([a, b], [[4], [5, 6, 7]], [1, 3]))  # a's row has 3 padding tokens
    for old, new in zip(before, cache.k + cache.v):
        changed = (old != new).any(-1).any(1).cpu()  # [slots + 1, S]: positions that changed
        assert changed[a].nonzero().flatten().tolist() == [20]
        assert changed[b].nonzero().flatten().tolist() == [17, 18, 19]
        assert not changed[idle].any() and cache.spare_slot == 4
    assert rt.static.buckets == {(2, 4)}


def test_warm_up_leaves_one_cuda_graph_per_bucket_and_nothing_to_compile(hf):
    """inductor with CUDA graphs: warm_up compiles buckets (1, 4) and (2, 4), none skips its
    CUDA graph, and serving's decodes and verifies afterwards compile nothing new."""
    rt = gpu_runtime(hf, "compiled", verify_tokens=4)
    assert rt.static.cuda_graphs
    cache = rt.make_cache(num_slots=2, max_seq_len=128)
    report = rt.warm_up(cache)
    assert [(b["rows"], b["tokens"]) for b in report["buckets"]] == [(1, 4), (2, 4)]
    # (graphs: what this warm-up compiled; a runtime of the same shapes made earlier in the
    # process shares its graphs, weights being graph inputs, so no exact count here)
    assert report["cudagraph_skips"] == 0, report
    assert [p["tokens"] for p in report["prefills"]] == [17, 18]
    assert cache.num_free_slots == 2 and cache.lengths == [0, 0]
    slots = [cache.allocate(), cache.allocate()]
    rt(cache, ForwardBatch(slots[:1], [list(range(3, 30))]))  # prefills before counting: not buckets
    rt(cache, ForwardBatch(slots[1:], [list(range(3, 25))]))
    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    for _ in range(3):  # replays
        rt(cache, ForwardBatch(slots, [[5], [6]]))
        rt(cache, ForwardBatch(slots, [[5, 6, 7, 8], [9, 10]], [4, 2]))
        rt(cache, ForwardBatch(slots[:1], [[5]]))
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert rt.static.buckets == {(1, 4), (2, 4)}


def test_trees_and_prefills_take_the_library_path_and_match_transformers(hf):
    """On the compiled runtime, prefills (more than 16 new tokens) and token trees run the
    library path (no bucket), in float32 their logits are transformers' own: a tree node's
    are those of its root-to-node path decoded as a chain."""
    rt = gpu_runtime(hf, "compiled", dtype=torch.float32, verify_tokens=4)
    cache = rt.make_cache(num_slots=2, max_seq_len=128)
    prefix, other = random_sequences((70, 33), seed=2)
    slots = [cache.allocate(), cache.allocate()]
    got = rt(cache, ForwardBatch(slots, [prefix, other], [70, 33])).logits.cpu().split([70, 33])
    for ids, logits in zip((prefix, other), got):
        torch.testing.assert_close(logits, reference_logits(hf, ids), atol=FP32_ATOL, rtol=1e-3)
    parents, tokens = [-1, 0, 0, 1, 1, 2], [11, 12, 13, 14, 15, 16]
    tree = rt(cache, ForwardBatch(slots[:1], [tokens], [6], trees=[parents])).logits.cpu()
    for j, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5]]):
        want = reference_logits(hf, prefix + [tokens[i] for i in path])[-1]
        torch.testing.assert_close(tree[j], want, atol=FP32_ATOL, rtol=1e-3)
    assert rt.static.buckets == set()


def test_flex_attention_reads_only_each_rows_keys():
    """Rows in scattered slots, one a decode padded to the verify's width, ending in and
    across 64-key blocks: each row's block list holds ceil((last + 1) / 64) blocks, and with
    every other key and value set to NaN (other slots, the row's blocks past its last) the
    outputs are finite and SDPA's (math backend, float32): the kernel read nothing else."""
    gen = torch.Generator().manual_seed(0)
    hk, s, h, d, t = 2, 256, 8, 64, 5
    keys, values = (torch.randn(5, hk, s, d, generator=gen) for _ in range(2))
    q = torch.randn(4, t, h, d, generator=gen)
    positions = torch.tensor([[0], [60], [64], [200]]) + torch.arange(t)    # [B, T]
    last = positions[:, -1].clone()
    last[0] = 0  # a decode: one real token, four padding
    slots = torch.tensor([4, 0, 2, 1])
    blocks = key_blocks(positions, last, slots[:, None], num_kv_heads=hk, block_len=s)
    counts = blocks.num_blocks.flatten().tolist()
    assert counts == [(int(n) + KEY_BLOCK) // KEY_BLOCK for n in last] == [1, 2, 2, 4]
    read = torch.zeros(5, s, dtype=torch.bool)  # [slots, S]
    for b, slot in enumerate(slots.tolist()):
        read[slot, :counts[b] * KEY_BLOCK] = True
    poisoned = [x.clone() for x in (keys, values)]
    for x in poisoned:
        x.transpose(1, 2)[~read] = float("nan")
    out = attend(q.cuda(), poisoned[0].cuda(), poisoned[1].cuda(), blocks.to(torch.device("cuda")),
                 d ** -0.5).view(4, t, h, d)
    assert torch.isfinite(out).all()
    end = torch.minimum(positions, last[:, None])                           # [B, T]
    mask = torch.arange(s)[None, None, :] <= end[:, :, None]                # [B, T, S]
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.cuda().transpose(1, 2), keys[slots].cuda(), values[slots].cuda(),
            attn_mask=mask[:, None].cuda(), enable_gqa=True).transpose(1, 2)  # [B, T, H, D]
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_a_bucket_reads_a_pinned_static_buffer_and_a_verify_times_with_events(hf):
    """Issue 52's pieces that only CUDA has: the bucket's host twin is pinned (its copy
    can be asynchronous, and is not rewritten before it ran) and its device buffer keeps
    its address across replays; the
    worker's forward clock reads CUDA events after the result, with no synchronisation
    of its own."""
    from specserve.engine.worker import ForwardClock

    rt = gpu_runtime(hf, "compiled", verify_tokens=5)
    cache = rt.make_cache(num_slots=2, max_seq_len=128)
    slot = cache.allocate()
    seq = random_sequences((8,))[0]
    first = rt(cache, ForwardBatch([slot], [seq[:5]], [5])).logits
    (buffer,) = rt.static._buffers.values()
    address = buffer.device.data_ptr()
    cache.lengths[slot] = 0
    again = rt(cache, ForwardBatch([slot], [seq[:5]], [5])).logits
    assert buffer.host.is_pinned() and buffer.device.data_ptr() == address
    assert torch.equal(first, again)
    # two forwards of the bucket back to back (row groups), no read between: the second
    # refills the host twin only after the first copy ran, so each group gets its own
    other = cache.allocate()
    cache.lengths[slot] = 0
    both = rt(cache, ForwardBatch([slot, other], [seq[:5], seq[3:8]], [5, 5], groups=[1, 1])).logits
    cache.lengths[slot] = cache.lengths[other] = 0
    alone = [rt(cache, ForwardBatch([s], [ids], [5])).logits
             for s, ids in ((slot, seq[:5]), (other, seq[3:8]))]
    assert torch.equal(both, torch.cat(alone))
    clock = ForwardClock(buffer.device.device)
    x = torch.randn(1024, 1024, device="cuda")
    y = x @ x
    clock.forward_done()
    y.sum().item()  # the read
    forward_s, rest_s = clock.split()
    assert forward_s > 0 and rest_s >= 0
