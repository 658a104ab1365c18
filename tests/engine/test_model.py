"""The runtime's logits equal the ``transformers`` forward of the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.models import TINY_CONFIGS, VOCAB, random_sequences, runtime_of, tiny_hf_model

ATOL = 1e-4
# SmolLM2: 30 layers and logits of about 20; the runtime's kernels sum in another order than
# transformers' (see specserve.engine.kernels), which shows at the 6th significant digit.
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
    first = rt(cache, slots, [s[:c] for s, c in zip(seqs, cut)], cut)
    second = rt(cache, slots[:2], [s[c:] for s, c in zip(seqs[:2], cut[:2])], [2, 6])
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
    rt(cache, [slot], [ids[:10]])
    for start in range(10, 30, 4):
        garbage = [(t + 7) % VOCAB for t in ids[start:start + 6]]
        rt(cache, [slot], [garbage], [len(garbage)])
        cache.rollback(slot, start)
        chunk = ids[start:start + 4]
        got = rt(cache, [slot], [chunk], [len(chunk)])
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
    rt(cache, [a], [x[:-1]])
    rt(cache, [c], [y[:-1]])
    got = rt(cache, [a, c], [[x[-1]], [y[-1]]])
    assert (got[0] - reference_logits(hf, x)[-1]).abs().max() <= ATOL
    assert (got[1] - reference_logits(hf, y)[-1]).abs().max() <= ATOL


def test_context_overflow_is_refused_without_state_change():
    from specserve.errors import InvalidRequestError

    rt = runtime_of(tiny_hf_model())
    cache = rt.make_cache(num_slots=1, max_seq_len=8)
    slot = cache.allocate()
    rt(cache, [slot], [[1, 2, 3, 4, 5]])
    with pytest.raises(InvalidRequestError, match="context length"):
        rt(cache, [slot], [[1, 2, 3, 4]])
    assert cache.lengths[slot] == 5


def test_unsupported_architecture_is_refused():
    from specserve.engine.model import ModelArch
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
    got = rt(cache, [sa, sb], [x[:30], y], [30, 23])
    assert (got[:30] - reference_logits(hf, x)[:30]).abs().max() <= ATOL_SMOLLM2
    assert (got[30:] - reference_logits(hf, y)).abs().max() <= ATOL_SMOLLM2
    rt(cache, [sa], [[5] * 6], [6])
    cache.rollback(sa, 30)
    got = rt(cache, [sa], [x[30:]], [10])
    assert (got - reference_logits(hf, x)[30:]).abs().max() <= ATOL_SMOLLM2
