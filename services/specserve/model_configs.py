"""The ``config.json`` numbers of the models this project's docs and Helm values name, as
their publishers give them on huggingface.co, so the memory estimate can size them where
nothing can be downloaded: the chart's preflight in its cluster, the tests, a laptop.

Only the fields :meth:`specserve.memory.ModelShape.from_config` reads are kept. A model not
listed is read from its own ``config.json`` where its source is a local directory; anything
else is not estimated (``specserve memory-estimate --config`` takes any file).
"""

from __future__ import annotations

import json
from pathlib import Path

_LLAMA_31 = {"model_type": "llama", "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072}
_QWEN3 = {"model_type": "qwen3", "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
          "max_position_embeddings": 40960}

PUBLISHED: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B-Instruct": {
        **_LLAMA_31, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "intermediate_size": 14336, "tie_word_embeddings": False},
    "meta-llama/Llama-3.1-70B-Instruct": {
        **_LLAMA_31, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "intermediate_size": 28672, "tie_word_embeddings": False},
    "meta-llama/Llama-3.2-1B-Instruct": {
        **_LLAMA_31, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True},
    # An EAGLE-3 head: one decoder layer of the target's width. Estimated as a one-layer
    # Llama with the target's vocabulary: an upper bound (its own LM head has 32,000 rows).
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": {
        **_LLAMA_31, "hidden_size": 4096, "num_hidden_layers": 1, "num_attention_heads": 32,
        "intermediate_size": 14336, "tie_word_embeddings": False},
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "intermediate_size": 12288,
                      "tie_word_embeddings": False},
    "Qwen/Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "intermediate_size": 3072,
                        "tie_word_embeddings": True},
    "Qwen/Qwen2.5-14B-Instruct": {
        "model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "intermediate_size": 13824, "vocab_size": 152064,
        "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 49152,
        "tie_word_embeddings": True, "max_position_embeddings": 8192},
}


def model_config(source: str) -> dict | None:
    """``source``'s ``config.json`` as a dict: the published numbers above, or the file in a
    local model directory; None where neither can be had."""
    if source in PUBLISHED:
        return PUBLISHED[source]
    path = Path(source) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
