"""The runtime's logits equal the ``transformers`` forward of the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch
from specserve.engine.runtime.forward_batch import ForwardBatch

from tests.models import TINY_CONFIGS, VOCAB, random_sequences, runtime_of, tiny_hf_model

ATOL = 1e-4
# SmolLM2: 30 layers and logits of about 20; the runtime's kernels sum in another order than
# transformers' (see specserve.engine.runtime.kernels), which shows at the 6th significant digit.
ATOL_SMOLLM2 = 3e-4


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """``transformers`` logits at every position of one sequence, no cache: ``[T, V]``."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_ragged_batch_matches_transformers(kind):
    hf = tiny_hf_model(kind)
    rt = runtime_of(hf)
    cache = rt.make_cache(num_slots=4, max_seq_len=64)
    seqs = random_sequences((5, 17, 9))
    slots = [cache.allocate() for _ in seqs]
    # Prefill ragged prompts of different lengths (partial), then ragged continuations.
    cut = [3, 11, 9]
    first = rt(cache, ForwardBatch(slots, [s[:c] for s, c in zip(seqs, cut)], cut)).logits
    second = rt(cache, ForwardBatch(slots[:2], [s[c:] for s, c in zip(seqs[:2], cut[:2])],
                                    [2, 6])).logits
    out = list(first.split(cut)) + list(second.split([2, 6]))
    expected = [reference_logits(hf, s) for s in seqs]
    for got, ref in zip(out[:3], [e[:c] for e, c in zip(expected, cut)]):
        assert (got - ref).abs().max() <= ATOL
    assert (out[3] - expected[0][3:]).abs().max() <= ATOL
    assert (out[4] - expected[1][11:]).abs().max() <= ATOL
    assert [cache.lengths[s] for s in slots] == [5, 17, 9]


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias", "mistral-window"])
def test_rollback_then_continue_matches_transformers(kind):
    """Write rejected tokens, roll back, write the real ones: stale cache entries never leak."""
    hf = tiny_hf_model(kind)
    rt = runtime_of(hf)
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [ids[:10]]))
    for start in range(10, 30, 4):
        garbage = [(t + 7) % VOCAB for t in ids[start:start + 6]]
        rt(cache, ForwardBatch([slot], [garbage], [len(garbage)]))
        cache.rollback(slot, start)
        chunk = ids[start:start + 4]
        got = rt(cache, ForwardBatch([slot], [chunk], [len(chunk)])).logits
        ref = reference_logits(hf, ids[:start + len(chunk)])[start:]
        assert (got - ref).abs().max() <= ATOL, f"after rollback to {start}"


def test_non_contiguous_slots_and_decode_batch():
    """Slots 0 and 2 (not consecutive) decode together with different lengths."""
    hf = tiny_hf_model("llama-gqa")
    rt = runtime_of(hf)
    cache = rt.make_cache(num_slots=3, max_seq_len=64)
    a, b, c = (cache.allocate() for _ in range(3))
    cache.free(b)
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (12, 4))
    rt(cache, ForwardBatch([a], [x[:-1]]))
    rt(cache, ForwardBatch([c], [y[:-1]]))
    got = rt(cache, ForwardBatch([a, c], [[x[-1]], [y[-1]]])).logits
    assert (got[0] - reference_logits(hf, x)[-1]).abs().max() <= ATOL
    assert (got[1] - reference_logits(hf, y)[-1]).abs().max() <= ATOL


def test_context_overflow_is_refused_without_state_change():
    from specserve.errors import InvalidRequestError

    rt = runtime_of(tiny_hf_model())
    cache = rt.make_cache(num_slots=1, max_seq_len=8)
    slot = cache.allocate()
    rt(cache, ForwardBatch([slot], [[1, 2, 3, 4, 5]]))
    with pytest.raises(InvalidRequestError, match="context length"):
        rt(cache, ForwardBatch([slot], [[1, 2, 3, 4]]))
    assert cache.lengths[slot] == 5


def test_unsupported_architecture_is_refused():
    from specserve.engine.runtime.arch import ModelArch
    from specserve.errors import ConfigError
    from transformers import GPT2Config

    with pytest.raises(ConfigError, match="not supported"):
        ModelArch.from_hf_config(GPT2Config())


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    hf, _tokenizer = smollm2
    rt = runtime_of(hf, max_len=512)
    cache = rt.make_cache(num_slots=2, max_seq_len=512)
    gen = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (40, 23))
    sa, sb = cache.allocate(), cache.allocate()
    got = rt(cache, ForwardBatch([sa, sb], [x[:30], y], [30, 23])).logits
    assert (got[:30] - reference_logits(hf, x)[:30]).abs().max() <= ATOL_SMOLLM2
    assert (got[30:] - reference_logits(hf, y)).abs().max() <= ATOL_SMOLLM2
    rt(cache, ForwardBatch([sa], [[5] * 6], [6]))
    cache.rollback(sa, 30)
    got = rt(cache, ForwardBatch([sa], [x[30:]], [10])).logits
    assert (got - reference_logits(hf, x)[30:]).abs().max() <= ATOL_SMOLLM2


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_row_groups_in_one_pass_are_the_bits_of_separate_forwards(kind, layout):
    """A prompt's chunk, a prefill's tail and decode/verify rows of a step in one forward
    (``groups``: the linears over every group's tokens at once, attention per group) give each
    token the bits of its group's own forward: logits, final hidden states and the keys and
    values stored. On the library kernels the groups run one after the other."""
    hf = tiny_hf_model(kind)
    histories = random_sequences((30, 9, 17, 60), seed=4)
    inputs = [histories[0][20:], histories[1][6:], histories[2][12:15], histories[3][:48]]
    starts = [20, 6, 12, 0]
    asked = [10, 3, 1, 0]  # a verify, a verify, a decode-length tail, a chunk (no logits)
    for kernels in ("invariant", "library"):
        caches, outs = [], []
        for grouped in (True, False):
            rt = runtime_of(hf).use_kernels(kernels)
            cache = (rt.make_paged_cache(4, 128, block_size=16, num_blocks=40) if layout == "paged"
                     else rt.make_cache(num_slots=4, max_seq_len=128))
            slots = [cache.allocate() for _ in range(4)]
            for slot, history, start in zip(slots, histories, starts):
                if start:
                    rt(cache, ForwardBatch([slot], [history[:start]]))
            if grouped:
                out = rt(cache, ForwardBatch(slots, inputs, asked, groups=[2, 1, 1], hidden=True))
                outs.append((out.logits, out.hidden))
            else:
                parts = [rt(cache, ForwardBatch(slots[a:b], inputs[a:b], asked[a:b], hidden=True))
                         for a, b in ((0, 2), (2, 3), (3, 4))]
                outs.append((torch.cat([p.logits for p in parts]), torch.cat([p.hidden for p in parts])))
            caches.append((cache, slots))
        (logits, hidden), (ref_logits, ref_hidden) = outs
        assert logits.shape == (sum(asked), VOCAB) and hidden.shape[0] == sum(map(len, inputs))
        assert torch.equal(logits, ref_logits) and torch.equal(hidden, ref_hidden), kernels
        (cache, slots), (ref_cache, ref_slots) = caches
        for slot, ref_slot, start, ids in zip(slots, ref_slots, starts, inputs):
            n = start + len(ids)
            assert cache.lengths[slot] == ref_cache.lengths[ref_slot] == n
            for layer in range(hf.config.num_hidden_layers):
                k, v = cache.gather(layer, [slot], 64)
                ref_k, ref_v = ref_cache.gather(layer, [ref_slot], 64)
                assert torch.equal(k[..., :n, :], ref_k[..., :n, :]), (kernels, slot, layer)
                assert torch.equal(v[..., :n, :], ref_v[..., :n, :]), (kernels, slot, layer)


def test_a_tied_head_built_on_a_device_takes_no_table_of_its_own():
    """A runtime built straight on a device (random weights, as the GPU harness builds its
    targets and drafts) with tied embeddings makes one vocab x hidden table: the embedding.
    A head made and then tied took another, which the allocator kept: about 0.47 GiB of a
    Llama-3.2-1B-shaped draft's peak on an H200 (docs/BENCHMARKS.md, 2026-12-04)."""
    from torch.overrides import TorchFunctionMode

    from load.bench_gpu import SHAPES, random_runtime

    class Made(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.tables: dict[tuple[int, ...], set[int]] = {}  # shape -> storages made

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.tables.setdefault(tuple(out.shape), set()).add(out.untyped_storage().data_ptr())
            return out

    config = SHAPES["tiny-draft"]
    table = (config["vocab_size"], config["hidden_size"])
    with Made() as made:
        runtime = random_runtime("tiny-draft", torch.float32, "cpu", max_len=16)
    assert runtime.lm_head.weight is runtime.embed.weight
    assert len(made.tables[table]) == 1
