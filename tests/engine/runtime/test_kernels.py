"""Row invariance, checked kernel by kernel and then for the whole forward, on whatever CPU
runs the suite: a token's result must not depend on how many other tokens (a verify's
drafts, other sequences of a batch) share the call. Equality is exact (``torch.equal``): a
last-bit difference is what flips a greedy near-tie.

The old runtime failed these on both CPUs this project has met (AVX2 and AVX512): ``F.linear``
(MKL) at 1 vs 2-3 vs >= 4 rows, and ``scaled_dot_product_attention`` for a query inside a
masked call (docs/BENCHMARKS.md, "Row invariance").

Every kernel set is checked: the C kernels (``engine/runtime/kernels.c``, built here at first use
for this CPU), their portable build (what a compiler that does not know the CPU builds: the
generic-vector code), their AVX2 build where this CPU has AVX512 (the code of the AVX2
machines), and the fallback where no C compiler works (oneDNN-packed linears, blocked
attention).
"""

from __future__ import annotations

import shutil
import stat

import pytest
import torch
import torch.nn.functional as F
from specserve.engine.runtime import native
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.kernels import KV_BLOCK, Linear, argmax, attention, hidden_keys
from specserve.engine.runtime.layers import rms_norm

from tests.engine.conftest import OTHER_BUILDS  # (conftest's other_builds compiles them)
from tests.models import runtime_of, tiny_hf_model

# The linear shapes of SmolLM2-135M (qkv, o, gate_up, down) and an LM head of a small vocab.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 9, 16, 33, 64]


def seeded(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def use_build(monkeypatch, name: str, other_builds) -> None:
    """Make ``name`` the kernels the runtime calls for the rest of the test."""
    if name == "native":
        assert native.library() is not None, native.unavailable_reason()
    elif name == "fallback":
        monkeypatch.setattr(native, "library", lambda: None)
    else:
        monkeypatch.setattr(native, "library", lambda: other_builds[name])


@pytest.fixture(params=["native", *OTHER_BUILDS])
def build(request, monkeypatch, other_builds):
    """Run the test on each C build."""
    use_build(monkeypatch, request.param, other_builds)
    return request.param


@pytest.fixture(params=["native", *OTHER_BUILDS, "fallback"])
def kernels(request, monkeypatch, other_builds):
    """Run the test on each C build, then on the fallback (a machine with no C compiler)."""
    use_build(monkeypatch, request.param, other_builds)
    return request.param


def test_the_c_kernels_are_built_where_a_compiler_is_found(monkeypatch, tmp_path):
    """The suite runs with a C compiler (gcc in the image): the C kernels must load, not fall
    back in silence. With none, or a compiler that fails, the runtime falls back with a reason."""
    if shutil.which("cc") or shutil.which("gcc"):
        assert native.library() is not None, native.unavailable_reason()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(native._Unavailable, match="failed"):
        native._load()
    monkeypatch.setenv("SPECSERVE_NATIVE", "0")
    with pytest.raises(native._Unavailable, match="SPECSERVE_NATIVE=0"):
        native._load()
    # A cache directory that cannot be made (a file in the way): a reason, not a crash.
    monkeypatch.delenv("SPECSERVE_NATIVE")
    monkeypatch.delenv("CC")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "file"))
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_reason", None)
    assert native.library() is None and "Error" in native.unavailable_reason()


def test_a_compiler_that_does_not_know_the_cpu_builds_the_portable_kernels(monkeypatch, tmp_path):
    """``-march=native`` fails where the compiler does not know the CPU: the kernels are
    built without it (the generic-vector code; the tests run on that build too, see
    ``kernels``), not left to the slower fallback."""
    real = shutil.which("cc") or shutil.which("gcc")
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\n"
                    'for a in "$@"; do [ "$a" = -march=native ] && { echo unknown >&2; exit 1; }; done\n'
                    f'exec {real} "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setattr(native, "_flags", None)
    assert native.library() is not None, native.unavailable_reason()
    assert native.build_flags() == native.PORTABLE_FLAGS
    assert len(list((tmp_path / "cache" / "native").glob("kernels-*.so"))) == 1  # that build
    x, w = seeded(5, 64), seeded(16, 64, seed=1)
    out = native.linear(x, w, None)
    assert torch.equal(out[2], native.linear(x[2:3], w, None)[0])
    assert torch.allclose(out, x @ w.T, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_rows_do_not_depend_on_the_row_count(shape, kernels):
    out_features, in_features = shape
    linear = Linear(in_features, out_features, bias=True).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(seeded(out_features, in_features, scale=0.05))
        linear.bias.copy_(seeded(out_features, seed=1))
    x = seeded(max(ROW_COUNTS), in_features, seed=2)
    with torch.inference_mode():
        alone = [linear(x[i:i + 1])[0] for i in range(max(ROW_COUNTS))]
        for n in ROW_COUNTS:
            together = linear(x[:n])
            bad = [i for i in range(n) if not torch.equal(together[i], alone[i])]
            assert not bad, f"{n} rows: rows {bad} differ from the same rows alone"
        # Leading dimensions are flattened: [B, T, in] is the same as [B*T, in].
        assert torch.equal(linear(x[:6].view(2, 3, -1)).view(6, -1), linear(x[:6]))
        assert torch.allclose(linear(x[:5]), F.linear(x[:5], linear.weight, linear.bias),
                              atol=1e-4, rtol=1e-4)


def test_linear_repacks_when_its_weight_changes_and_trains_through_the_plain_weight():
    linear = Linear(64, 32)
    x = seeded(3, 64)
    with torch.inference_mode():
        before = linear(x)
    with torch.no_grad():
        linear.weight.mul_(2)  # in place, as an optimizer step would
    with torch.inference_mode():
        after = linear(x)
    assert torch.allclose(after - linear.bias, 2 * (before - linear.bias), atol=1e-5)
    # A frozen weight with an input that wants a gradient: autograd must see the op.
    linear.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    linear(xg).sum().backward()
    assert torch.allclose(xg.grad, linear.weight.sum(0).expand(3, -1), atol=1e-5)


def test_rms_norm_rows_do_not_depend_on_the_row_count():
    x, w = seeded(64, 576, scale=3), seeded(576, seed=1)
    alone = [rms_norm(x[i:i + 1], w, 1e-5)[0] for i in range(64)]
    for n in ROW_COUNTS:
        together = rms_norm(x[:n], w, 1e-5)
        assert all(torch.equal(together[i], alone[i]) for i in range(n)), n


@pytest.mark.parametrize("n", [1536, 300], ids=["smollm", "ragged"])
def test_silu_mul_rows_do_not_depend_on_the_row_count(n):
    """From 8,192 values the rows go in pieces over the threads (a verify's 9 rows of 1,536); a
    row alone stays on one thread. 300: pieces and a row's end that are not whole vectors."""
    gate_up = seeded(64, 2 * n, scale=3)
    alone = [native.silu_mul(gate_up[i:i + 1])[0] for i in range(64)]
    assert torch.allclose(torch.stack(alone), F.silu(gate_up[:, :n]) * gate_up[:, n:], atol=1e-5)
    for rows in ROW_COUNTS:
        together = native.silu_mul(gate_up[:rows])
        assert all(torch.equal(together[i], alone[i]) for i in range(rows)), rows


def causal(starts: list[int], t: int, s: int) -> torch.Tensor:
    """``[B, T, S]``: query ``j`` of row ``b`` is at position ``starts[b] + j``."""
    positions = torch.tensor(starts)[:, None] + torch.arange(t)[None]
    return torch.arange(s)[None, None] <= positions[:, :, None]


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("start", [5, KV_BLOCK - 3, 3 * KV_BLOCK + 10])
def test_attention_for_a_query_does_not_depend_on_other_queries_or_rows(heads, start):
    """A query at position p: alone (a decode), as query j of a verify of T tokens, and in a
    batch beside a longer row (more key blocks, all masked for it)."""
    h, hk = heads
    d, s = 64, 6 * KV_BLOCK
    keys, values = seeded(3, hk, s, d, seed=1), seeded(3, hk, s, d, seed=2)
    q = seeded(3, 9, h, d, seed=3)
    scale = d ** -0.5

    def run(rows: list[int], starts: list[int], t: int, q_rows: torch.Tensor) -> torch.Tensor:
        need = max(st + t for st in starts)
        span = -(-need // KV_BLOCK) * KV_BLOCK
        return attention(q_rows, keys[rows, :, :span], values[rows, :, :span],
                         hidden_keys(causal(starts, t, span), h // hk), scale)

    for j in range(9):
        alone = run([0], [start + j], 1, q[:1, j:j + 1])[0, 0]
        for t in range(j + 1, 10):
            verify = run([0], [start], t, q[:1, :t])[0, j]
            assert torch.equal(verify, alone), (j, t)
        batch = run([0, 1, 2], [start + j, start + 2 * KV_BLOCK, 0], 1, q[:, j:j + 1])
        assert torch.equal(batch[0, 0], alone), j
    # And it is attention: the same as torch's, up to rounding.
    ref = F.scaled_dot_product_attention(
        q[:1, :4].transpose(1, 2), keys[:1, :, :start + 4], values[:1, :, :start + 4],
        attn_mask=causal([start], 4, start + 4)[:, None], enable_gqa=hk != h)
    got = run([0], [start], 4, q[:1, :4])
    assert torch.allclose(got, ref.transpose(1, 2).reshape(1, 4, h * d), atol=1e-5)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("start", [5, KV_BLOCK - 3, 3 * KV_BLOCK + 10])
def test_native_attention_for_a_query_does_not_depend_on_other_queries_or_rows(heads, start, build):
    """The C attention reads the cache storage of each row's slot directly: a query alone, as
    query j of a verify, in a batch beside longer rows, and in a sliding window."""
    h, hk = heads
    d, s = 64, 6 * KV_BLOCK
    keys, values = seeded(4, hk, s, d, seed=1), seeded(4, hk, s, d, seed=2)
    q = seeded(3, 9, h, d, seed=3)
    scale = d ** -0.5

    def run(slots: list[int], starts: list[int], t: int, q_rows: torch.Tensor, window=None):
        positions = torch.tensor(starts)[:, None] + torch.arange(t)[None]
        lo = torch.zeros_like(positions) if window is None else (positions - window + 1).clamp(min=0)
        table = torch.tensor(slots, dtype=torch.int32)[:, None]  # a slot: one block
        return native.attention(q_rows, keys, values, table, lo.to(torch.int32),
                                (positions + 1).to(torch.int32), scale)

    for j in range(9):
        alone = run([2], [start + j], 1, q[:1, j:j + 1])[0, 0]
        for t in range(j + 1, 10):
            assert torch.equal(run([2], [start], t, q[:1, :t])[0, j], alone), (j, t)
        batch = run([3, 2, 0], [start + 2 * KV_BLOCK, start + j, 0], 1, q[[1, 0, 2], j:j + 1])
        assert torch.equal(batch[1, 0], alone), j
    ref = F.scaled_dot_product_attention(
        q[:1, :4].transpose(1, 2), keys[2:3, :, :start + 4], values[2:3, :, :start + 4],
        attn_mask=causal([start], 4, start + 4)[:, None], enable_gqa=hk != h)
    assert torch.allclose(run([2], [start], 4, q[:1, :4]), ref.transpose(1, 2).reshape(1, 4, h * d),
                          atol=1e-5)
    # A window of 4 keys: the query at p reads p-3..p only.
    window = torch.zeros(1, 4, start + 4, dtype=torch.bool)
    for i in range(4):
        window[0, i, max(0, start + i - 3):start + i + 1] = True
    ref = F.scaled_dot_product_attention(
        q[:1, :4].transpose(1, 2), keys[2:3, :, :start + 4], values[2:3, :, :start + 4],
        attn_mask=window[:, None], enable_gqa=hk != h)
    assert torch.allclose(run([2], [start], 4, q[:1, :4], window=4),
                          ref.transpose(1, 2).reshape(1, 4, h * d), atol=1e-5)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
def test_native_attention_split_across_threads_gives_the_same_bits(heads, build):
    """A decode has one work item per key/value head, fewer than 2 a thread: its scores split
    by keys and its values by value vectors across the threads (``attention_split``). The
    suite's workers run 1 thread each, so the threads are asked for here: 2 and 3 threads
    give the bits of 1, for a lone decode and beside a second row, at lengths around the
    split's threshold and the tiles' 4 keys."""
    h, hk = heads
    d = 64
    keys, values = seeded(4, hk, 6 * KV_BLOCK, d, seed=1), seeded(4, hk, 6 * KV_BLOCK, d, seed=2)
    q = seeded(2, 1, h, d, seed=3)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        for n in (3, 57, 58, 61, 130, 6 * KV_BLOCK):
            hi = torch.tensor([[n], [max(1, n // 2)]], dtype=torch.int32)
            lo = torch.zeros_like(hi)
            runs = {}
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                runs[threads] = (native.attention(q[:1], keys, values, table[:1], lo[:1], hi[:1], d ** -0.5),
                                 native.attention(q, keys, values, table, lo, hi, d ** -0.5))
            for threads in (2, 3):
                assert torch.equal(runs[threads][0], runs[1][0]), (n, threads)
                assert torch.equal(runs[threads][1], runs[1][1]), (n, threads)
            assert torch.equal(runs[1][1][:1], runs[1][0]), n  # and a row's bits are its own
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "qwen2-bias", "mistral-window", "qwen3-qknorm"])
def test_a_tokens_logits_do_not_depend_on_the_forward_they_are_in(kind, kernels):
    """The whole runtime: the logits after token p are bit-identical whether p was decoded
    alone, verified among up to 8 more tokens, or decoded in a batch of rows of other lengths.
    (Greedy speculative decoding is then identical to target-only decoding by construction.)"""
    rt = runtime_of(tiny_hf_model(kind, seed=0, logit_scale=3.0), max_len=256)
    prompt = seeded(70, seed=5).abs().mul(100).long().remainder(500).tolist()
    others = [seeded(n, seed=6 + n).abs().mul(100).long().remainder(500).tolist() for n in (3, 90, 130)]
    cache = rt.make_cache(num_slots=8, max_seq_len=256)
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [prompt[:60]]))
    # One token at a time (a target-only decode).
    alone = []
    for tok in prompt[60:70]:
        alone.append(rt(cache, ForwardBatch([slot], [[tok]])).logits)
    alone = torch.cat(alone)
    for t in range(1, 10):  # a verify of t tokens from position 60
        cache.rollback(slot, 60)
        assert torch.equal(rt(cache, ForwardBatch([slot], [prompt[60:60 + t]], [t])).logits, alone[:t]), t
    # Inside a ragged batch, decode and verify rows mixed.
    cache.rollback(slot, 60)
    extra = [cache.allocate() for _ in others]
    for s_, ids in zip(extra, others):
        rt(cache, ForwardBatch([s_], [ids]))
    got = rt(cache, ForwardBatch([extra[0], slot, extra[1], extra[2]],
                                 [[7], prompt[60:65], [8, 9], [10]], [1, 5, 2, 1])).logits
    assert torch.equal(got[1:6], alone[:5])


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias", "mistral-window"])
def test_a_layer_in_one_call_is_its_modules_calls_bit_for_bit(kind, build):
    """kernels.c's decoder_layer makes the calls the layer's modules make (layers.py), in their
    order, and decoder_layers makes each layer's in turn: the same logits and the same cache
    storage as module by module, for a ragged prefill, a decode, a verify beside a decode and
    a token tree, on slots and on blocks."""
    hf = tiny_hf_model(kind, seed=0, logit_scale=3.0)
    prompt = seeded(80, seed=3).abs().mul(100).long().remainder(500).tolist()
    runs = {}
    for mode in ("stack", "layer", "modules"):
        rt = runtime_of(hf, max_len=256)
        one_call = mode != "modules"
        rt.native_stack.enabled = mode == "stack"
        for layer in rt.layers:
            layer.one_call = one_call
        out = []
        for paged in (False, True):
            cache = (rt.make_paged_cache(4, 256, block_size=16, num_blocks=64) if paged
                     else rt.make_cache(num_slots=4, max_seq_len=256))
            a, b = cache.allocate(), cache.allocate()
            for batch in (ForwardBatch([a, b], [prompt[:50], prompt[:23]], [1, 3]),
                          ForwardBatch([a], [[7]]),
                          ForwardBatch([a, b], [prompt[50:56], [9]], [6, 1]),
                          *([] if kind == "mistral-window"  # (trees are not for windows)
                            else [ForwardBatch([b], [[4, 5, 6, 7]], [4], trees=[[-1, 0, 0, 1]])])):
                out.append(rt(cache, batch).logits)
            out += [*cache.k, *cache.v]
        assert (getattr(rt.layers[0], "_native_ref", None) is not None) == one_call  # it ran
        assert (rt.native_stack._held is not None) == (mode == "stack")
        runs[mode] = out
    for mode in ("stack", "layer"):
        assert all(torch.equal(x, y) for x, y in zip(runs[mode], runs["modules"], strict=True)), mode


def test_the_stack_gathers_its_refs_once_and_again_when_a_weight_moves(build, monkeypatch):
    """The one-call stack reads each layer's refs once, not every forward (they cost about
    60 us a layer), and again after anything that may move what they point at: a weight
    assigned, a ``.to``. After each, its logits are the module-by-module ones of the model as
    it is now. (Planted: a stack that missed the new weight would read the old one, held
    alive here, and its logits would be the old model's.)"""
    from specserve.engine.runtime.layers import DecoderLayer

    gathered, own = [], DecoderLayer._native_layer

    def counted(layer, cache):
        gathered.append(layer)
        return own(layer, cache)

    monkeypatch.setattr(DecoderLayer, "_native_layer", counted)
    rt = runtime_of(tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0), max_len=128)
    cache = rt.make_cache(num_slots=2, max_seq_len=128)
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [list(range(3, 40))]))
    for token in (7, 8, 9):
        rt(cache, ForwardBatch([slot], [[token]]))
    assert len(gathered) == len(rt.layers)  # once, for four forwards
    old = rt.layers[0].mlp.down.weight
    rt.layers[0].mlp.down.weight = torch.nn.Parameter(old.detach() * 1.5, requires_grad=False)
    rt.to(torch.float32)  # (a move through _apply: no change of dtype, but a new epoch)
    logits = {}
    for enabled in (True, False):  # the stack, then layer by layer (each layer's own refs)
        rt.native_stack.enabled = enabled
        cache.rollback(slot, 39)
        logits[enabled] = rt(cache, ForwardBatch([slot], [[5, 6]], [2])).logits
        if enabled:
            assert len(gathered) == 2 * len(rt.layers)  # again, once
    assert torch.equal(logits[True], logits[False]) and old.numel() > 0


def test_library_kernels_compute_the_same_logits_up_to_rounding(kernels):
    """``kernels: library`` (F.linear + SDPA, the runtime before these kernels; kept for GPUs
    and side-by-side benchmarks) is the same model."""
    from specserve.errors import ConfigError

    hf = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)
    ours, library = runtime_of(hf), runtime_of(hf).use_kernels("library")
    prompt = list(range(3, 80))
    got = {}
    for name, rt in (("invariant", ours), ("library", library)):
        cache = rt.make_cache(num_slots=1, max_seq_len=256)
        slot = cache.allocate()
        got[name] = torch.cat([rt(cache, ForwardBatch([slot], [prompt[:70]], [5])).logits,
                               rt(cache, ForwardBatch([slot], [prompt[70:]], [7])).logits])
    assert torch.allclose(got["invariant"], got["library"], atol=1e-4)
    with pytest.raises(ConfigError, match="kernels"):
        ours.use_kernels("fast")


def test_argmax_is_torchs_index_on_ties_and_nans():
    """The host's argmax (numpy's reduction) keeps torch's answer: a row's first maximum, and
    a NaN counted as the maximum (its first), for any number of dimensions."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf]])
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 1, 0]
    for y in (torch.randn(49_152), torch.randn(3, 9, 500).round()):  # .round(): many ties
        assert torch.equal(argmax(y), y.argmax(dim=-1)) and argmax(y).dtype == torch.long
