"""Prompt sets for benchmarks and load tests: ``load/prompts/<name>.jsonl``.

Each line is ``{"messages": [...OpenAI chat messages...], "category": ...}`` (one user turn,
or a conversation: system, earlier user and assistant turns); see ``load/prompts/README.md``
for what each set is for.

    from prompts import load_prompts          # scripts run from load/ (Locust, sweeps)
    rewrite = load_prompts("rewrite")         # -> list[dict], in file order
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"


def available_sets() -> list[str]:
    """The set names (file stems of ``load/prompts/*.jsonl``), sorted."""
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def load_prompts(name: str) -> list[dict]:
    """The prompt objects of set ``name``; ValueError naming the sets for an unknown name."""
    path = PROMPTS_DIR / f"{name}.jsonl"
    if "/" in name or "\\" in name or not path.is_file():
        raise ValueError(f"unknown prompt set {name!r}; available: {', '.join(available_sets())}")
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj.get("messages"), list) or not obj["messages"]:
            raise ValueError(f"{path}:{lineno}: 'messages' must be a non-empty list")
        prompts.append(obj)
    return prompts
