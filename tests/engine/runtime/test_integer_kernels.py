"""The integer kernels (``kernels: integer``, the default on a CPU): a GGUF's blocks met by 8-bit
inputs in integer dot products, llama.cpp's CPU arithmetic, with 16 bits for a block that holds
an outlier (kernels.c, "Integer dot products").

They are not the float32 path's bits, so what speculation needs is checked directly: a row's
outputs are the same bits whatever else is in the call (a decode, a verify's K + 1, a batch,
a prefill's passes), and, every operation being IEEE-defined, on every C build. Their value is
the exact integer arithmetic's, to float32 rounding (a float64 reference). Two planted
mistakes are caught: one that lets one row's inputs change another's rounding (one scale for
the rows of a call, as a per-tensor quantizer has), and one that rounds an outlier's block to
8 bits. On the embedded model: speculation on equals off token for token, at every batch shape,
K, chunk size and prefix-cache hit; and against the float32 path, perplexity within 1% and
top-1 agreement of at least 98% over 2,048 tokens of text.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from specserve.engine.runtime import native

from tests.engine.test_quantized import dequantized, random_blocks

SHAPES = [(576, 576), (960, 576), (576, 1536), (13, 96), (7, 64), (40, 96)]  # and rows off the groups of 16
ROWS = [*range(1, 10), 24, 50]


OUTLIER = 8  # kernels.c's X8_OUTLIER: a block whose max |x| is over 8 times its mean |x| is wide


def exact(kind: str, raw: torch.Tensor, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The integer arithmetic in float64: each row's inputs quantized per block of 32 to 127
    steps of the block's largest |x|, or 127 * 254 where that is an outlier's (a wide block),
    times the dequantized weight (exact: float32 weights, integers times a float32 scale)."""
    blocks = x.view(x.shape[0], k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    wide = amax * 32 > OUTLIER * blocks.abs().sum(-1, keepdim=True)
    d = amax / torch.where(wide, 127.0 * 254, 127.0)
    q = torch.round(blocks * torch.where(d != 0, 1 / d, torch.zeros_like(d)))  # ties to even
    return (q.double() * d.double()).view(x.shape[0], k) @ dequantized(kind, raw, n, k).double().T


@pytest.fixture(scope="module")
def outputs(other_builds):
    """Per kind and shape: the inputs, the raw blocks and each build's outputs for all rows."""
    out = {}
    for kind in native.QUANT_BLOCKS:
        for i, (n, k) in enumerate(SHAPES):
            raw = random_blocks(kind, n, k, seed=i)
            x = with_outliers(torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(300 + i)))
            packed = native.pack_blocks(kind, raw, n, k, x8_inputs=True)
            builds = {}
            for build in ("native", *other_builds):
                lib = native.library() if build == "native" else other_builds[build]
                builds[build] = [_call(lib, kind, x[:m], packed) for m in ROWS]
                alone = [_call(lib, kind, x[j:j + 1], packed) for j in range(max(ROWS))]
                builds[build].append(torch.cat(alone))
            out[kind, n, k] = x, raw, builds
    return out


def with_outliers(x: torch.Tensor) -> torch.Tensor:
    """``x`` with one value in every third block of 32 made 40 times larger: wide blocks
    beside narrow ones (Gaussian blocks alone are never wide: their max |x| is about 3 times
    their mean)."""
    x = x.clone()
    x.view(x.shape[0], -1, 32)[:, ::3, 5] *= 40
    return x


def _call(lib, kind: str, x: torch.Tensor, packed: native.QuantizedWeight) -> torch.Tensor:
    y = torch.empty(x.shape[0], packed.out_features)
    getattr(lib, f"linear_rows_{kind.lower()}_x8")(x.data_ptr(), packed.data.data_ptr(), None, y.data_ptr(),
                                                   x.shape[0], packed.out_features, packed.in_features, 2)
    return y


@pytest.mark.parametrize("kind", list(native.QUANT_BLOCKS))
def test_a_rows_outputs_are_the_same_bits_in_any_call_and_on_every_build(outputs, kind):
    for (kind_, n, k), (x, raw, builds) in outputs.items():
        if kind_ != kind:
            continue
        alone = builds["native"][-1]
        for build, ys in builds.items():
            for m, y in zip([*ROWS, "alone"], ys):
                assert torch.equal(y, alone[:y.shape[0]]), (build, n, k, m)
        want = exact(kind, raw, x, n, k)
        assert torch.allclose(alone.double(), want, rtol=0, atol=2e-6 * float(want.abs().max())), (n, k)


def test_inputs_on_a_tie_round_to_even_and_a_zero_block_to_zeros_on_every_build(other_builds):
    """A block whose largest |x| is 127 has a step of exactly 1, so its halves are ties: every
    build (the AVX2 quantizer's vector rounding, the scalar nearbyintf, the portable one) rounds
    them to even, as the float64 reference does; a block of zeros (-0.0 among them) quantizes
    to zeros with a scale of 0."""
    n, k = 24, 576
    raw = random_blocks("Q4_1", n, k, seed=7)
    packed = native.pack_blocks("Q4_1", raw, n, k, x8_inputs=True)
    halves = torch.arange(-40, 40, dtype=torch.float32) + 0.5           # -39.5 .. 39.5
    x = halves.repeat(3 * k // len(halves) + 1)[:3 * k].view(3, k).clone()
    x.view(3, -1, 32)[:, :, 0] = 127.0                                  # a step of 1: narrow
    x[1, 64:128] = 0.0
    x[1, 64:128:2] = -0.0                                               # two zero blocks
    want = exact("Q4_1", raw, x, n, k)
    assert not torch.equal(torch.round(x), torch.floor(x + 0.5))        # the ties are there
    for build, lib in {"native": native.library(), **other_builds}.items():
        y = _call(lib, "Q4_1", x, packed)
        assert torch.allclose(y.double(), want, rtol=0, atol=2e-6 * float(want.abs().max())), build
        assert torch.equal(y, _call(native.library(), "Q4_1", x, packed)), build


def test_a_build_that_rounds_an_outliers_block_to_8_bits_is_caught(outputs, tmp_path):
    """The planted build never makes a block wide (8 bits everywhere, the arithmetic before
    outliers had 16): its rows are still the same bits in any call, but the value check
    against the float64 reference fails, while the native build passes it."""
    path = tmp_path / "narrow.so"
    native._compile(native.os.environ.get("CC") or "cc", native.FLAGS + ["-DX8_OUTLIER=1000000"], path)
    narrow = native.declare(ctypes.CDLL(str(path)))
    x, raw, builds = outputs["Q4_1", 576, 576]
    packed = native.pack_blocks("Q4_1", raw, 576, 576, x8_inputs=True)
    want = exact("Q4_1", raw, x, 576, 576)
    bound = 2e-6 * float(want.abs().max())
    assert float((builds["native"][-1].double() - want).abs().max()) <= bound
    assert float((_call(narrow, "Q4_1", x, packed).double() - want).abs().max()) > 10 * bound


def test_the_interleaved_rows_are_the_blocks_moved():
    for kind in native.QUANT_BLOCKS:
        for n, k in [(13, 96), (40, 96), (576, 576)]:
            raw = random_blocks(kind, n, k, seed=1)
            plain, moved = (native.pack_blocks(kind, raw, n, k, x8_inputs=x8) for x8 in (False, True))
            assert moved.data.shape == ((n + 15) // 16, k // 32 * 16 * native.QUANT_BLOCKS[kind][1])
            assert torch.equal(native.standard_rows(moved), plain.data)
            assert torch.equal(native.dequantize_blocks(moved), native.dequantize_blocks(plain))
            rows = torch.tensor([0, n - 1, n // 2])
            assert torch.equal(native.dequantize_blocks(moved, rows), native.dequantize_blocks(plain, rows))


def test_a_scale_shared_by_the_rows_of_a_call_is_caught(tmp_path):
    """The planted build quantizes each block with the largest input of that block in any row
    of the call (a per-tensor scale): a token's outputs then depend on its neighbours, and the
    check above fails for it."""
    path = tmp_path / "planted.so"
    native._compile(native.os.environ.get("CC") or "cc",
                    native.FLAGS + ["-DSPECSERVE_PLANTED_SHARED_SCALE"], path)
    planted = native.declare(ctypes.CDLL(str(path)))
    n, k = 576, 576
    packed = native.pack_blocks("Q4_1", random_blocks("Q4_1", n, k, seed=0), n, k, x8_inputs=True)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    x[3] *= 20  # one row with larger inputs
    for lib, caught in ((native.library(), False), (planted, True)):
        together = _call(lib, "Q4_1", x, packed)
        alone = torch.cat([_call(lib, "Q4_1", x[j:j + 1], packed) for j in range(8)])
        assert torch.equal(together, alone) is not caught


PROMPTS = ["Repeat this list three times: apples, pears, plums, figs, dates.",
           "Rewrite the sentence 'the cat sat on the mat' in five different ways.",
           "Write a Python function that adds two numbers, then the same function with type hints.",
           "List the days of the week, then list them again in reverse order.",
           "Explain what a lighthouse keeper does.",
           "Count from one to twenty in words."]


@pytest.mark.slow
def test_on_the_embedded_model_speculation_is_lossless_and_the_logits_agree_with_float32():
    """One engine on the integer kernels: speculation off, prompt lookup at K = 4 in one batch
    and at K = 2 one prompt at a time (the second pass over each prompt hits the prefix
    cache), every output the same tokens. Then the float32 path and the integer one read the
    same 2,048 tokens of English (Python's own documentation, ``pydoc_data``), four rows of
    512 teacher-forced: their perplexities differ by under 1%, and their top-1 choices agree
    at 98% or more (the figures: docs/BENCHMARKS.md)."""
    from pydoc_data.topics import topics

    from specserve.config import EngineConfig, ModelConfig, SamplingParams
    from specserve.engine.builder import build_engine
    from specserve.engine.loader import load_model
    from specserve.engine.runtime.forward_batch import ForwardBatch
    from specserve.engine.tokenizer import encode_chat

    cfg = EngineConfig.model_validate({"target": {"kernels": "integer"}, "max_num_seqs": len(PROMPTS),
                                       "max_model_len": 1024, "speculative": {"method": "ngram"}})
    engine, loaded = build_engine(cfg)
    assert all(lin.quantized.x8_inputs for lin in (loaded.runtime.lm_head, loaded.runtime.layers[0].mlp.down))
    ids = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    off = [c.output_token_ids for c in engine.generate(ids, greedy, num_speculative_tokens=0)]
    batched = [c.output_token_ids for c in engine.generate(ids, greedy, num_speculative_tokens=4)]
    alone = [engine.generate([p], greedy, num_speculative_tokens=2)[0].output_token_ids for p in ids]
    assert batched == off and alone == off
    assert engine.counters.spec.num_accepted_tokens > 0
    assert engine.counters.num_prefill_tokens < 2 * sum(map(len, ids))  # the later passes hit

    text = "\n\n".join(topics[key] for key in sorted(topics))
    tokens = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][:4 * 513]
    rows = [tokens[i * 513:(i + 1) * 513] for i in range(4)]
    scores = {}
    float32 = load_model(ModelConfig(kernels="invariant"), max_model_len=1024).runtime
    for name, runtime in (("integer", loaded.runtime), ("float32", float32)):
        cache = runtime.make_cache(num_slots=4, max_seq_len=1024)
        slots = [cache.allocate() for _ in rows]
        batch = ForwardBatch(slots, [r[:-1] for r in rows], [512] * 4)
        logits = runtime(cache, batch).logits.view(4, 512, -1)
        targets = torch.tensor([r[1:] for r in rows])
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())
        scores[name] = logits.argmax(-1), float(torch.exp(nll))
    agreement = float((scores["integer"][0] == scores["float32"][0]).float().mean())
    ppl_int, ppl_float = scores["integer"][1], scores["float32"][1]
    assert agreement >= 0.98, agreement
    assert abs(ppl_int / ppl_float - 1) < 0.01, (ppl_int, ppl_float)
