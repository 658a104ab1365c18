"""A sequence's stop checks: a step's tokens are appended one at a time and the first that
stops the sequence ends it, exactly where target-only decoding would have stopped."""

from __future__ import annotations

import pytest
from specserve.config import SamplingParams
from specserve.engine.step.sequence import Sequence
from specserve.engine.tokenizer import IncrementalDetokenizer

from tests.tiny import make_tiny_tokenizer

EOS = frozenset({2})
PROMPT = [40, 41, 42]


def sequence(**params) -> Sequence:
    sp = SamplingParams(temperature=0.0, **params)
    detokenizer = IncrementalDetokenizer(make_tiny_tokenizer(), PROMPT, stop=sp.stop,
                                         skip_special_tokens=sp.skip_special_tokens,
                                         include_stop=sp.include_stop_str_in_output)
    return Sequence(seq_id=0, prompt_len=len(PROMPT), token_ids=list(PROMPT), params=sp,
                    num_speculative_tokens=4, adaptive=False, sample_seed=0, detokenizer=detokenizer)


@pytest.mark.parametrize(("params", "max_model_len", "emitted", "kept", "reason"), [
    ({}, 64, [50, 51, 52, 53], [50, 51, 52, 53], None),
    ({}, 64, [50, 2, 52, 53], [50, 2], "stop"),                      # EOS inside the window
    ({"ignore_eos": True}, 64, [50, 2, 52, 53], [50, 2, 52, 53], None),
    ({"stop_token_ids": (51,)}, 64, [50, 51, 52, 53], [50, 51], "stop"),
    ({"max_tokens": 3}, 64, [50, 51, 52, 53], [50, 51, 52], "length"),
    ({}, 5, [50, 51, 52, 53], [50, 51], "length"),                   # the context is full
])
def test_a_stop_inside_the_window_drops_the_tokens_after_it(params, max_model_len, emitted, kept,
                                                             reason):
    seq = sequence(**params)
    seq.append_tokens(emitted, eos_token_ids=EOS, max_model_len=max_model_len)
    assert seq.output_token_ids == kept and seq.finish_reason == reason


def test_a_stop_string_stops_the_sequence():
    tokenizer = make_tiny_tokenizer()
    ids = tokenizer.encode(" fox jumps over", add_special_tokens=False)
    seq = sequence(stop=("jumps",))
    seq.append_tokens(ids, eos_token_ids=EOS, max_model_len=64)
    assert seq.finish_reason == "stop" and len(seq.output_token_ids) < len(ids)
    assert seq.stop_reason(ids[0], eos_token_ids=EOS, max_model_len=64) == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_the_text_of_what_stopped_the_output_is_left_out_unless_asked_for(include):
    """vLLM's rule: a stop string, a stop token id's text and (with special tokens shown)
    EOS's end the text before them; ``include_stop_str_in_output`` keeps them."""
    tokenizer = make_tiny_tokenizer()
    ids = tokenizer.encode(" fox jumps over", add_special_tokens=False)
    for params, emitted, stopper in (
            ({"stop": ("jumps",)}, ids, "jumps"),
            ({"stop_token_ids": (ids[-1],)}, ids, tokenizer.decode(ids[-1:])),
            ({"skip_special_tokens": False}, [*ids, 2], "<|im_end|>")):
        seq = sequence(include_stop_str_in_output=include, **params)
        seq.append_tokens(emitted, eos_token_ids=EOS, max_model_len=64)
        seq.detokenizer.pop_delta(final=True)
        text = seq.detokenizer.text
        assert seq.finish_reason == "stop" and text.endswith(stopper) is include, (params, text)
        assert text.startswith(" fox") and stopper not in text[:-len(stopper)], (params, text)
