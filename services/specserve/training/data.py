"""Training data for self-distillation: the target's own greedy answers, with its features.

For each prompt the target decodes greedily (our runtime, batched) and we keep, per sequence,
the token ids (prompt + answer) and the target's final hidden state at every position but the
last. Those features are all distillation needs: the target's next-token distribution at a
position is its LM head applied to the feature there, so the training loss can use the
target's full soft labels without storing any logits, and an EAGLE head reads them as input.

Data is written in shards of ``SHARD_SIZE`` sequences under ``<out>/data/`` (features in
float16), each recorded in the manifest with its prompts' hash; a rerun skips the shards made
from the same prompts, so an interrupted run resumes and a longer prompt list reuses them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.tokenizer import encode_chat
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError

log = logging.getLogger(__name__)

PROMPTS_DIR = Path(__file__).parent / "prompts"
SHIPPED = ("chat", "code", "summarize")  # training sets; eval-chat is the held-out one
SHARD_SIZE = 64


@dataclass
class Sample:
    """One sequence: ``token_ids`` (prompt + answer) and ``features[t]`` for t < len - 1."""

    token_ids: list[int]
    prompt_len: int
    features: torch.Tensor  # [len(token_ids) - 1, hidden], float16

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def self_prompt_count(spec: str) -> int:
    """N of a ``self:N`` item in ``spec`` (prompts the target writes: ``self_prompts.py``); 0 if none."""
    counts = [item.strip()[5:] for item in spec.split(",") if item.strip().startswith("self:")]
    if len(counts) > 1 or (counts and not (counts[0].isdigit() and int(counts[0]) >= 1)):
        raise ConfigError(f"prompt sets {spec!r}: at most one self:N item, with N a positive integer")
    return int(counts[0]) if counts else 0


def read_prompts(spec: str, *, allow_empty: bool = False) -> list[list[dict]]:
    """Chat message lists from a comma-separated list of shipped set names and/or JSONL files
    (a ``self:N`` item is skipped here: see ``self_prompt_count``).

    A JSONL line is ``{"messages": [...]}`` (OpenAI chat format) or ``{"prompt": "..."}``
    (taken as one user message); a ``.txt`` file has one prompt per line.
    """
    out: list[list[dict]] = []
    self_prompt_count(spec)  # checks the self:N item
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item.startswith("self:"):
            continue
        shipped = PROMPTS_DIR / f"{item}.jsonl"
        path = shipped if "/" not in item and shipped.is_file() else Path(item).expanduser()
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl")))
            raise ConfigError(f"prompt set {item!r}: no such shipped set ({names}) or file")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".txt":
                out.append([{"role": "user", "content": line}])
                continue
            try:
                row = json.loads(line)
                messages = row["messages"] if "messages" in row else [
                    {"role": "user", "content": str(row["prompt"])}]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{n}: expected {{\"messages\": [...]}} or "
                                  f"{{\"prompt\": \"...\"}}: {exc}") from exc
            out.append(messages)
    if not out and not allow_empty:
        raise ConfigError(f"no prompts in {spec!r}")
    return out


def encode(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """The prompt ids the API builds for ``messages`` (``encode_chat``; without a chat
    template, the contents joined by newlines), the last ``max_prompt_tokens`` of them."""
    if getattr(tokenizer, "chat_template", None):
        ids = encode_chat(tokenizer, messages)
    else:
        ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    return list(ids)[-max_prompt_tokens:]


@torch.inference_mode()
def greedy_with_features(worker: ModelWorker, prompts: list[list[int]], *, max_new_tokens: int,
                         eos_token_ids: frozenset[int]) -> list[Sample]:
    """Greedy answers of a batch of prompts, with the target's features at every position.

    Prefill runs per prompt (no padding), then all unfinished rows decode together.
    """
    slots = [worker.allocate() for _ in prompts]
    try:
        tokens = [list(p) for p in prompts]
        feats: list[list[torch.Tensor]] = [[] for _ in prompts]
        nxt: list[int] = []
        for i, p in enumerate(prompts):
            out = worker.forward(ForwardBatch([slots[i]], [p], [1], hidden=True, argmax=True))
            feats[i].append(out.hidden.half())
            nxt.append(int(out.token_ids[0]))
        live = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            for i in live:
                tokens[i].append(nxt[i])
            live = [i for i in live if nxt[i] not in eos_token_ids
                    and len(tokens[i]) - len(prompts[i]) < max_new_tokens
                    and len(tokens[i]) < worker.max_seq_len]
            if not live:
                break
            out = worker.forward(ForwardBatch([slots[i] for i in live], [[nxt[i]] for i in live],
                                              [1] * len(live), hidden=True, argmax=True))
            for j, i in enumerate(live):
                feats[i].append(out.hidden[j:j + 1].half())
                nxt[i] = int(out.token_ids[j])
        return [Sample(t, len(p), torch.cat(f)[:len(t) - 1]) for t, p, f in zip(tokens, prompts, feats)]
    finally:
        for slot in slots:
            worker.free(slot)


def build_dataset(worker: ModelWorker, tokenizer, prompt_ids: list[list[int]], out: Path, *,
                  max_new_tokens: int, eos_token_ids: frozenset[int], batch_size: int,
                  desc: str = "data", progress: bool = True) -> list[Sample]:
    """Generate (or reuse) every shard of ``out``; returns all samples in prompt order.

    A shard is reused when the manifest records the same prompts for it (a hash per shard), so
    an interrupted run resumes and a longer prompt list, the old one plus more, generates only
    the new shards. A shard made from other prompts is generated again.
    """
    out.mkdir(parents=True, exist_ok=True)
    mf = out / "manifest.json"
    manifest = json.loads(mf.read_text()) if mf.is_file() else {}
    if manifest.get("max_new_tokens", max_new_tokens) != max_new_tokens:
        raise ConfigError(f"{out} holds answers of up to {manifest['max_new_tokens']} tokens, not "
                          f"{max_new_tokens}; use another --work-dir or delete it")
    made = manifest.get("shards", {})
    timing = out / "generation_seconds.json"  # per shard, so a resumed run still knows the total
    seconds = json.loads(timing.read_text()) if timing.is_file() else {}
    samples: list[Sample] = []
    num_shards = (len(prompt_ids) + SHARD_SIZE - 1) // SHARD_SIZE
    with tqdm(total=len(prompt_ids), desc=desc, unit="seq", disable=not progress) as bar:
        for shard in range(num_shards):
            path = out / f"shard-{shard:05d}.pt"
            chunk = prompt_ids[shard * SHARD_SIZE:(shard + 1) * SHARD_SIZE]
            key = _hash(chunk)
            if path.is_file() and made.get(path.name) == key:
                got = [Sample(**s) for s in torch.load(path)]
                bar.update(len(got))
                samples += got
                continue
            started = time.perf_counter()
            got = []
            for start in range(0, len(chunk), batch_size):
                got += greedy_with_features(worker, chunk[start:start + batch_size],
                                            max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
                bar.update(min(batch_size, len(chunk) - start))
            tmp = path.with_suffix(".tmp")
            torch.save([s.__dict__ for s in got], tmp)
            tmp.rename(path)
            made[path.name] = key
            mf.write_text(json.dumps({"max_new_tokens": max_new_tokens, "shards": made}))
            seconds[path.name] = round(time.perf_counter() - started, 1)
            timing.write_text(json.dumps(seconds))
            samples += got
    return samples


def generation_seconds(folder: Path, num_shards: int | None = None) -> float:
    """Seconds the target spent generating the shards in ``folder`` (the first ``num_shards``;
    shards made by earlier, interrupted runs included; 0 for shards from before this was
    recorded)."""
    timing = folder / "generation_seconds.json"
    if not timing.is_file():
        return 0.0
    names = None if num_shards is None else {f"shard-{i:05d}.pt" for i in range(num_shards)}
    return sum(v for k, v in json.loads(timing.read_text()).items() if names is None or k in names)


def _hash(prompt_ids: list[list[int]]) -> str:
    import hashlib

    h = hashlib.sha1()
    for p in prompt_ids:
        h.update(json.dumps(p).encode())
    return h.hexdigest()[:16]


def select_prompts(spec: str, *, num_prompts: int | None, seed: int,
                   allow_empty: bool = False) -> list[list[dict]]:
    """``read_prompts(spec)``, shuffled with ``seed``, the first ``num_prompts`` (all: None)."""
    import random

    prompts = read_prompts(spec, allow_empty=allow_empty)
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts] if num_prompts else prompts
