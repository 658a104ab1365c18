"""A tiny byte-level BPE tokenizer, trained in milliseconds from text in this file.

Tests use it instead of a downloaded one: it has exactly 512 ids (so a tiny model with
``vocab_size=512`` matches), the ChatML specials SmolLM2 uses, and a corpus that leaves most
non-ASCII characters (CJK, emoji) split over several byte tokens, so multi-byte handling is
exercised.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)  # (enable_thinking: a template variable as Qwen3's, for chat_template_kwargs)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.
Speculative decoding lets a small draft model propose tokens that a large target model
verifies in one forward pass. When the draft is right, several tokens are accepted at once;
when it is wrong, the target model's own token is used instead, so the output distribution
is exactly the one the target model would have produced on its own.
A server streams text to the client as soon as it is ready. It must never send half of a
character, and it must never send the beginning of a stop string that later matches.
The model reads the prompt, then writes the answer one token at a time. The answer is
decoded into text, and the text is sent to the client in small pieces.
Once upon a time there was a little cat who lived in a house by the sea. Every morning the
little cat walked along the beach and looked at the boats. Every evening the little cat
came home and slept by the fire. The people in the house loved the little cat very much.
Hello, world! Hello, world! How are you today? I am fine, thank you. And you?
What is the capital of France? The capital of France is Paris. What is the capital of
Japan? The capital of Japan is Tokyo. What is two plus two? Two plus two is four.
We met at the café; she ordered a café au lait, and I ordered a café crème.
It would be naïve to think the naïve approach is always fast enough.
日本語のテキストも少し含めます。東京は日本の首都です。
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000 2024 3.14159 2.71828
"""

_CODE = '''\
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def greet(name: str) -> str:
    return f"Hello, {name}!"


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self) -> int:
        self.count += 1
        return self.count


for i in range(10):
    print(i, fibonacci(i))

numbers = [1, 2, 3, 4, 5]
squares = [x * x for x in numbers]
total = sum(squares)
print("total:", total)
if total > 10:
    print("large")
else:
    print("small")

import os
import sys

def main() -> None:
    path = os.path.join("data", "input.txt")
    with open(path, encoding="utf-8") as f:
        for line in f:
            print(line.strip())
    sys.exit(0)


if __name__ == "__main__":
    main()
'''

# Each emoji appears once, so no merge can join all four of its bytes into one token.
_RARE = "Rocket launch: 🚀. Smile: 🙂."

CORPUS = [_ENGLISH, _CODE, _RARE]


@functools.cache
def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer (built once per process; the same vocabulary every time)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        # Pairs seen once stay unmerged, which keeps emoji split into byte tokens.
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    # The trainer stops early when it runs out of frequent pairs; a tiny model built with
    # vocab_size=512 would then disagree with the tokenizer, so fail here, loudly.
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    return tokenizer
