"""OpenAI's response bodies, built from a unit's chunks: the whole response, a stream's chunk
and its SSE line, and the ``logprobs`` object of a choice (with an ``echo``'s prompt in front).
Pure functions: no I/O, no state.
"""

import json
import time

LOGPROB_FLOOR = -9999.0  # OpenAI's logprob of a token the distribution excludes (JSON has no -inf)


def sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class TokenIdNames:
    """What :func:`logprobs_object` names tokens with under vLLM's
    ``return_tokens_as_token_ids``: ``token_id:<id>`` in place of the tokenizer's text (which
    a lone byte of a multibyte character does not have)."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"token_id:{t}" for t in ids)


def logprobs_object(tokenizer, items: list | None, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's ``logprobs`` object of a choice (or a chunk) from the unit's
    ``(token, logprob, [(token, logprob), ...])`` items. Chat: ``content`` entries with the
    token's text, bytes and ``top_logprobs``; completions: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (dicts that always hold the chosen token, as OpenAI's do) and
    ``text_offset`` from ``offset``. ``tokenizer`` names the tokens (its ``decode``; or
    :class:`TokenIdNames`)."""
    if items is None:
        return None
    text = {t: tokenizer.decode([t]) for t, _, top in items for t in (t, *(a for a, _ in top))}
    if chat:
        def entry(token: int, logprob: float) -> dict:
            return {"token": text[token], "logprob": max(logprob, LOGPROB_FLOOR),
                    "bytes": list(text[token].encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, lp, top in items], "refusal": None}
    offsets = []
    for t, _, _ in items:
        offsets.append(offset)
        offset += len(text[t])
    # an echoed prompt's first token has no logprob: null, as OpenAI's
    return {"tokens": [text[t] for t, _, _ in items],
            "token_logprobs": [None if lp is None else max(lp, LOGPROB_FLOOR) for _, lp, _ in items],
            "top_logprobs": [None if lp is None else
                             {text[a]: max(b, LOGPROB_FLOOR) for a, b in [*top, (t, lp)]}
                             for t, lp, top in items],
            "text_offset": offsets}


def echoed(echo: tuple[str, list[int]] | None, prompt_logprobs: list | None,
           items: list | None, alternatives: int | None = None) -> tuple[str, list | None]:
    """What an ``echo`` completion puts before its output: the prompt's text, and with
    logprobs the prompt's items (its first token with none) before the output's, each with
    at most ``alternatives`` (None: as scored; the prompt may have been scored with more for
    ``prompt_logprobs``)."""
    if echo is None:
        return "", items
    text, ids = echo
    if items is None:
        return text, None
    scored = prompt_logprobs or [(None, None, None)] * (len(ids) - 1)
    return text, [(ids[0], None, []),
                  *((t, lp, (top or [])[:alternatives]) for t, (lp, top, _) in zip(ids[1:], scored)),
                  *items]


def prompt_logprobs_object(tokenizer, ids: list[int], scored: list, alternatives: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, then ``{token id:
    {"logprob", "rank", "decoded_token"}}`` of the token and its ``alternatives`` likeliest
    (ranks 1, 2, ...), from the unit's ``(logprob, top, rank)`` per prompt token 1..."""
    out: list[dict | None] = [None]
    for token, (lp, top, rank) in zip(ids[1:], scored):
        entries = {a: (b, k + 1) for k, (a, b) in enumerate(top[:alternatives])}
        entries[token] = (lp, rank)
        out.append({str(t): {"logprob": max(v, LOGPROB_FLOOR), "rank": r,
                             "decoded_token": tokenizer.decode([t])} for t, (v, r) in entries.items()})
    return out


def joined(items: list | None, more: list | None) -> list | None:
    """Logprobs items of two chunks, in order (None: none asked for)."""
    return more if items is None else items + (more or [])


def chunk_body(rid: str, model: str, created: int, chat: bool, delta, finish: str | None,
               logprobs: dict | None = None, index: int = 0, token_ids: list[int] | None = None,
               prompt_ids: list[int] | None = None) -> dict:
    """A stream's chunk of one choice: ``chat.completion.chunk`` or ``text_completion``; with
    vLLM's ``return_token_ids``, the chunk's output ``token_ids`` and, on a choice's first
    chunk, the ``prompt_token_ids`` (chat: on the chunk, as on its response; completions: on
    the choice)."""
    ids = {} if token_ids is None else {"token_ids": token_ids}
    prompt = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
    if chat:
        choice = {"index": index, "delta": delta or {}, "finish_reason": finish,
                  "logprobs": logprobs, **ids}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice], **prompt}
    choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs,
              **prompt, **ids}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def response_body(rid: str, model: str, chat: bool, choices: list[dict], usage: dict,
                  prompt_ids: list[int] | None = None) -> dict:
    """The whole response; ``choices``: each one's ``text``, ``finish``, ``logprobs``,
    (chat) ``tool_calls`` and, with ``prompt_ids`` (vLLM's ``return_token_ids``), its
    ``token_ids``."""
    created = int(time.time())
    scored = {"prompt_logprobs": choices[0]["prompt_logprobs"]} if choices[0].get("prompt_logprobs") else {}
    prompt = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
    ids = [{} if prompt_ids is None else {"token_ids": c["token_ids"]} for c in choices]
    if chat:  # (vLLM: prompt_logprobs and prompt_token_ids on the response; on each choice for completions)
        body = [{"index": i, "message": {"role": "assistant", "content": c["text"],
                                         **({"tool_calls": c["tool_calls"]} if c["tool_calls"] else {})},
                 "finish_reason": c["finish"], "logprobs": c["logprobs"], **ids[i]}
                for i, c in enumerate(choices)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": body, "usage": usage, **scored, **prompt}
    body = [{"index": i, "text": c["text"], "finish_reason": c["finish"], "logprobs": c["logprobs"],
             **({"prompt_logprobs": c["prompt_logprobs"]} if scored else {}), **prompt, **ids[i]}
            for i, c in enumerate(choices)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": body, "usage": usage}
