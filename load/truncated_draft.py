"""A truncated self-draft: the target's first N decoder layers, same embeddings, norm and head.

This is a **weak baseline draft**, for benchmarking the draft-model path when no real draft
is at hand: it needs no training and shares the target's tokenizer by construction (so the
engine's same-tokenizer check accepts it), but skipping the upper layers without any
retraining leaves its next-token guesses far from the target's, so acceptance is low.
Issue 9 trains a real draft (distilled from the target); use that once it exists.

    from load.truncated_draft import truncated_draft
    path = truncated_draft("embedded", num_layers=6)   # built once, then reused

The copy is written once as a ``transformers`` directory (config, safetensors, the target's
tokenizer and generation config) under ``default_cache_dir() / "drafts"``, keyed by the
target's location and N, and reused on later calls. ``python load/truncated_draft.py`` builds
it and prints the path.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
from pathlib import Path

MAX_LAYERS = 1024


def draft_dir(location: str, name: str, num_layers: int, cache_dir: Path) -> Path:
    """Where the truncated copy of the model at ``location`` lives (one per target and N)."""
    key = hashlib.sha1(str(location).encode()).hexdigest()[:12]
    return cache_dir / "drafts" / f"{name}-first{num_layers}-{key}"


def truncate_model(model, num_layers: int):
    """Keep the first ``num_layers`` decoder layers of a ``transformers`` causal LM, in place.
    Embeddings, the final norm and the LM head are untouched."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}] (the target has {total} layers)")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types:  # Qwen2 / Mistral-style per-layer attention kinds
        model.config.layer_types = list(layer_types)[:num_layers]
    return model


def truncated_draft(target_source: str = "embedded", num_layers: int = 6, *,
                    cache_dir: Path | None = None) -> Path:
    """The directory of a truncated self-draft of ``target_source``, building it once.

    ``target_source``: anything :func:`specserve.engine.loader.resolve` accepts. ``cache_dir``:
    default :func:`specserve.machine.default_cache_dir`.
    """
    from specserve.engine.loader import load_hf_model, load_tokenizer, resolve
    from specserve.machine import default_cache_dir

    if not 1 <= num_layers <= MAX_LAYERS:
        raise ValueError(f"num_layers must be in [1, {MAX_LAYERS}]")
    cache_dir = Path(cache_dir or default_cache_dir())
    src = resolve(target_source, cache_dir)
    target = draft_dir(src.location, src.name, num_layers, cache_dir)
    if (target / "config.json").is_file():
        return target
    model = truncate_model(load_hf_model(src), num_layers)
    tokenizer = load_tokenizer(src)
    _save_atomically(model, tokenizer, target)
    return target


def _save_atomically(model, tokenizer, target: Path) -> None:
    """Write into a temporary sibling, then rename: readers see all of it or nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)  # the generation config goes with it
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process built the same draft first; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="embedded", help="target model source (default: embedded)")
    p.add_argument("--draft-layers", type=int, default=6, help="decoder layers to keep")
    args = p.parse_args(argv)
    print(truncated_draft(args.target, args.draft_layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
