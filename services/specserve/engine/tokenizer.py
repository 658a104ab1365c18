"""Prompt encoding and incremental (streaming) detokenization.

Decoding tokens one by one and concatenating the pieces is wrong in two ways: a byte-level
BPE token may hold only part of a UTF-8 character (an emoji is often four byte tokens), and
SentencePiece-style tokenizers drop the leading space of the first token in a decode call.
Re-decoding the whole output after every token is right but quadratic.

``IncrementalDetokenizer`` does what TGI and vLLM do: it keeps two offsets into the token ids,
``prefix_offset`` and ``read_offset``, and per token decodes only the short window
``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``. The new text is the difference
of the two. When the window's text ends with U+FFFD the last character is incomplete, so the
offsets stay put and the next token retries with more bytes. A few prompt tokens seed the
window so the first output token decodes with its leading space.

Stop strings are searched in the visible text (after special tokens are skipped). The text is
cut at the first match, and ``pop_delta`` holds back the last ``max_stop_len - 1`` characters
while generation may still go on, so a streaming client never sees the start of a stop
string that the next token completes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from specserve.errors import InvalidRequestError

# Enough tokens of context for a SentencePiece decode to keep the first output token's space.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class IncrementalDetokenizer:
    """Turns output token ids, one at a time, into text and stream-safe deltas.

    After a stop string matched, ``add`` ignores further tokens (the engine may have sampled
    a few more in the same speculative step); ``stop_reason`` says which string matched. The
    text ends before it, or after it with ``include_stop`` (vLLM's
    ``include_stop_str_in_output``).
    Once ``pop_delta(final=True)`` was called, ``add`` ignores tokens too. Stop strings are
    looked for from the ``min_tokens``-th output token on (vLLM's rule: text completed
    before it does not stop the output, then or later).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *,
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self._tokenizer = tokenizer
        self._min_tokens, self._added = min_tokens, 0
        self._skip_special, self._include_stop = skip_special_tokens, include_stop
        self._stop = tuple(s for s in stop if s)  # an empty stop string would match at once
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # The context is decoded but never output: text comes from offsets at or past it.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        self._sent = 0  # characters of _text already handed out by pop_delta
        self._finished = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The output text so far, cut before the stop string if one matched."""
        return self._text

    def add(self, token_id: int) -> None:
        """Append one output token; a no-op after a stop string matched or after final."""
        if self.stop_reason is not None or self._finished:
            return
        self._ids.append(token_id)
        self._added += 1
        self._advance(flush=False)

    def pop_delta(self, final: bool = False) -> str:
        """The text not handed out yet; ``final`` also hands out what was being held back."""
        if final and not self._finished:
            # Bytes still waiting for the rest of a character come out as U+FFFD, which is
            # what a full decode of the same ids gives.
            self._advance(flush=True)
            self._finished = True
        end = len(self._text)
        if self._stop and self.stop_reason is None and not self._finished:
            end -= self._max_stop_len - 1
        if end <= self._sent:
            return ""
        delta = self._text[self._sent:end]
        self._sent = end
        return delta

    def _advance(self, flush: bool) -> None:
        """Move newly complete text from the token window into ``_text``."""
        if self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        # Shorter or equal text: a skipped special token, or bytes that do not yet make a
        # character; keep the offsets so the next decode sees them again.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not flush):
            return
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        if self._added >= self._min_tokens:
            self._check_stop(len(delta))

    def _check_stop(self, delta_len: int) -> None:
        """Cut ``_text`` at the earliest stop string that the last ``delta_len`` chars completed."""
        if not self._stop:
            return
        # No match existed before, so a new one must end inside the delta.
        start = max(0, len(self._text) - delta_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            pos = self._text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self._text = self._text[:best[0] + (len(best[1]) if self._include_stop else 0)]
            self.stop_reason = best[1]

    def _decode(self, ids: list[int]) -> str:
        # Cleanup of tokenization spaces rewrites text around later tokens, so windows would
        # not line up; never apply it.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)


def encode_prompt(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a raw completion prompt, with the tokenizer's special tokens (its BOS...)
    unless ``add_special_tokens`` is False."""
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                *, continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """Token ids of chat ``messages`` rendered by the tokenizer's chat template, ready for
    the assistant's reply (unless ``add_generation_prompt`` is False), or continuing the last
    message (``continue_final_message``), with the template's own variables
    ``template_kwargs`` (Qwen3's ``enable_thinking``, say); the tokenizer's special tokens
    added around the text only with ``add_special_tokens`` (the template has its own)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise InvalidRequestError(f"model {name} has no chat template; use /v1/completions")
    conversation = _validate_messages(messages)
    # Render to text first: apply_chat_template(tokenize=True) returns a BatchEncoding in
    # some transformers versions. The template already holds the special tokens it wants.
    text = _render(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                   continue_final_message=continue_final_message, **(template_kwargs or {}))
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _render(tokenizer: Any, conversation: list[dict[str, str]], **options: Any) -> str:
    """The chat template's text, or InvalidRequestError when the template refuses the
    messages. Templates check what the model was trained on and say so with
    ``raise_exception`` (a jinja ``TemplateError``): roles must alternate, no system role...
    A template that does not even compile is the deployment's fault, not the request's: that
    ``TemplateSyntaxError`` propagates (a 500, logged)."""
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **options)
    except TemplateSyntaxError:
        raise
    except TemplateError as exc:
        raise InvalidRequestError(f"messages: this model's chat template refuses them: "
                                  f"{exc.message or type(exc).__name__}") from exc
    except ValueError as exc:  # transformers' own checks (continue_final_message's)
        raise InvalidRequestError(f"messages: {exc}") from exc


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    """Messages reduced to ``{"role", "content"}`` with string content, or InvalidRequestError."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}; got {role!r}")
        out.append({"role": role, "content": _content_text(message.get("content"), i)})
    return out


def _content_text(content: Any, i: int) -> str:
    """A message's content as one string; text parts are joined with newlines, as vLLM does."""
    if isinstance(content, str):
        return content
    if content is None:
        raise InvalidRequestError(f"messages[{i}].content is missing")
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise InvalidRequestError(
                f'messages[{i}].content[{j}] must be {{"type": "text", "text": <string>}}; '
                "only text is supported")
        texts.append(part["text"])
    return "\n".join(texts)
