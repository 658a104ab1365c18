"""Prompts the target writes itself (``--prompts self:N``), so training data needs no corpus.

An instruction-tuned model given its chat template up to the start of a user turn, and nothing
else, writes a user message: it samples from what it was tuned on. Magpie (Xu et al. 2024)
builds instruction data this way; for a draft it also fits the goal, since the prompts come
from the target's own idea of a conversation rather than from a few templates. Template
prompts teach a head their templates: the shipped draft, trained on 640 of them, accepted 0.77
of its training answers' next tokens and 0.35 on hand-written held-out chat.

Each request samples with its own seed (``seed + i``), so a set is reproducible. Kept: user
turns that the model ended itself (EOS within ``max_tokens``: a turn cut off mid-sentence is
usually a ramble), with at least ``min_chars`` characters, not seen before and not one of the
``exclude`` texts (the held-out prompts). The set is written to ``path`` as JSONL; a rerun with
the same settings reads it back instead of sampling again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from specserve.config import SamplingParams
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.errors import ConfigError

log = logging.getLogger(__name__)

_SENTINEL = "\u2063specserve-user-turn\u2063"


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's token ids up to where a user message's text starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--prompts self:N needs a target whose tokenizer has a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise ConfigError("--prompts self:N: the chat template does not show the user message")
    return list(tokenizer(text.split(_SENTINEL)[0], add_special_tokens=False)["input_ids"])


def self_prompts(engine: SpecDecodeEngine, tokenizer, count: int, path: Path, *, seed: int,
                 exclude: set[str] = frozenset(), max_tokens: int = 96, temperature: float = 1.0,
                 top_p: float = 0.95, batch_size: int = 64, min_chars: int = 12,
                 progress: bool = True) -> tuple[list[list[dict]], float]:
    """``count`` user messages sampled from the target (fewer if it rarely ends a turn: at most
    4 x ``count`` samples are drawn), as chat message lists, and the seconds sampling them took
    (when they were made, if read back from ``path``)."""
    settings = {"count": count, "seed": seed, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "min_chars": min_chars}
    if path.is_file():
        head, *rows = path.read_text(encoding="utf-8").splitlines()
        head = json.loads(head)
        if head.get("settings") == settings:
            return [json.loads(r)["messages"] for r in rows], head["seconds"]
        raise ConfigError(f"{path} holds self prompts made with other settings; delete it or use "
                          "another --work-dir")
    prefix = user_turn_prefix(tokenizer)
    started = time.perf_counter()
    kept: list[str] = []
    seen = set(exclude)
    drawn = 0
    with tqdm(total=count, desc="self prompts", unit="prompt", disable=not progress) as bar:
        while len(kept) < count and drawn < 4 * count:
            n = min(batch_size, 4 * count - drawn)
            params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                     seed=seed + drawn + i) for i in range(n)]
            for out in engine.generate([prefix] * n, params, num_speculative_tokens=0):
                text = out.text.strip()
                if out.finish_reason == "stop" and len(text) >= min_chars and text not in seen:
                    seen.add(text)
                    if len(kept) < count:
                        kept.append(text)
                        bar.update(1)
            drawn += n
    if len(kept) < count:
        log.warning("self prompts: kept %d of %d asked for (%d sampled)", len(kept), count, drawn)
    seconds = round(time.perf_counter() - started, 1)
    messages = [[{"role": "user", "content": t}] for t in kept]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in [{"settings": settings, "seconds": seconds}]
                           + [{"messages": m} for m in messages]), encoding="utf-8")
    tmp.rename(path)
    return messages, seconds
