"""EAGLE heads in the formats they are published in, loaded as a :class:`DraftHead`.

Three layouts, each detected from the checkpoint's own files (docs/DRAFTS.md says where every
field and tensor name comes from). Two of EAGLE-3's tensors:

- ``eagle3``: the EAGLE authors' checkpoints and SpecForge's output. A Llama-style config with
  ``draft_vocab_size`` (and ``architectures: ["LlamaForCausalLMEagle3"]`` from SpecForge), the
  layer's tensors under ``midlayer.``, weights in ``model.safetensors`` or ``pytorch_model.bin``.
- ``speculators``: the format vLLM reads (``speculators_model_type: "eagle3"``), the layer's
  config under ``transformer_layer_config``, its tensors under ``layers.0.``.

Both hold ``fc`` (the three target states to one feature), the layer, ``norm``, ``lm_head``
over the draft vocabulary, and ``d2t`` (draft id i is target id ``i + d2t[i]``); ``t2d`` and
an ``embed_tokens`` copy are skipped (the head reads the target's own embedding, as SGLang
does). Which target layers feed ``fc``: ``speculators``' ``eagle_aux_hidden_state_layer_ids``
as vLLM reads them (the residual stream entering layer i); SpecForge's
``eagle_config.eagle_aux_hidden_state_layer_ids`` count "the output of layer i", so i + 1
here (as SGLang reads them); absent, (2, L // 2, L - 3) for a target of L layers, the layers
every published head was trained on.

And EAGLE-1/2 heads (``eagle1``: the EAGLE authors' ``yuhuili/EAGLE-*``): a plain Llama config
and ``fc`` ([H, 2H], a bias unless the config says ``"bias": false``), ``layers.{i}.*``
whose first layer has no input norm, no final norm and no LM head: the head reads the target's
final (normed) hidden states, and its output, un-normed, goes through the target's LM head
and back in as the next feature.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from specserve.engine.runtime.arch import ModelArch
from specserve.engine.runtime.model import rope_tables
from specserve.errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HEAD_FILES = [CONFIG_FILE, *WEIGHT_FILES]  # what a head's download fetches
SKIPPED = ("t2d", "embed_tokens.weight")  # training's target mask; the target's embedding

# a layer's tensor (after its prefix) -> ours (after "layers.{i}."), fused in this order
_LAYER_NAMES = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}
_LAYER_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "hidden_norm": "hidden_norm", "attn.q_norm": "self_attn.q_norm",
                "attn.k_norm": "self_attn.k_norm"}


def published_format(path: Path) -> str | None:
    """``"eagle3"``, ``"speculators"`` (any ``speculators_model_type``; only eagle3 loads),
    ``"eagle1"``, or None where ``path`` holds no published draft."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if (fmt := config_format(config)) is not None:
        return fmt
    names = _weight_names(Path(path))
    if "fc.weight" in names and not any(n.startswith("model.") for n in names):
        return "eagle1"
    return None


def config_format(config: dict) -> str | None:
    """``"speculators"`` or ``"eagle3"`` where a ``config.json`` alone says so, else None (an
    EAGLE-1 head's config is a plain Llama one: its weights tell it)."""
    if "speculators_model_type" in config:
        return "speculators"
    if "draft_vocab_size" in config or any("Eagle3" in str(a) for a in config.get("architectures") or ()):
        return "eagle3"
    return None


def _weight_names(path: Path) -> set[str]:
    """The tensor names of the weights at ``path`` (none where there are none)."""
    for name in WEIGHT_FILES:
        file = path / name
        if file.is_file():
            if name.endswith(".safetensors"):
                from safetensors import safe_open
                with safe_open(str(file), framework="pt") as f:
                    return set(f.keys())
            return set(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
    return set()


@dataclasses.dataclass(frozen=True)
class PublishedHead:
    """What a published checkpoint says, read and checked against the target."""

    format: str               # published_format's
    arch: ModelArch           # the head's layers (vocab_size: the target's)
    layer_config: object      # its ``transformers`` config (the rope tables come from it)
    target_layers: tuple[int, ...]
    target_hidden: int
    norm_before_residual: bool
    # our names; "draft_vocab": the target id of each draft id (eagle1: no LM head, no vocab)
    state: dict[str, torch.Tensor]


def target_layers_of(path: Path, num_layers: int) -> tuple[int, ...]:
    """The layers of a ``num_layers``-layer target whose inputs the head at ``path`` reads
    (what a target group returns as its features), from the head's config alone."""
    return read_config(Path(path), num_layers)[4]


def read_config(path: Path, num_layers: int) -> tuple[str, dict, dict, bool, tuple[int, ...]]:
    """``(format, config, layer config, norm_before_residual, target layers)`` of the head at
    ``path``, for a target of ``num_layers`` layers."""
    fmt = published_format(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    if fmt == "speculators":
        if config["speculators_model_type"] != "eagle3":
            raise ConfigError(f"{path}: speculators_model_type {config['speculators_model_type']!r} "
                              "is not supported (eagle3 is)")
        layer = dict(config.get("transformer_layer_config") or {})
        ids, shift = config.get("eagle_aux_hidden_state_layer_ids"), 0
        norm_before_residual = bool(config.get("norm_before_residual", False))
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if config.get(flag):
                raise ConfigError(f"{path}: {flag}: true is not supported yet")
    elif fmt == "eagle3":
        layer = dict(config)
        ids, shift = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), 1
        norm_before_residual = False
    elif fmt == "eagle1":  # reads the target's final hidden state: no layers
        return fmt, config, dict(config), False, ()
    else:
        raise ConfigError(f"{path}: not a published EAGLE-3 head (no {CONFIG_FILE} with "
                          "draft_vocab_size or speculators_model_type)")
    return fmt, config, layer, norm_before_residual, _target_layers(path, ids, shift, num_layers)


def read_published_head(path: Path, *, target_vocab: int, target_hidden: int,
                        target_layers: int) -> PublishedHead:
    """Read and check the checkpoint at ``path`` for a target of ``target_vocab`` tokens,
    ``target_hidden`` hidden size and ``target_layers`` layers. A mismatch is a one-line
    :class:`ConfigError` naming what differs."""
    from transformers import AutoConfig

    path = Path(path)
    fmt, config, layer, norm_before_residual, layers = read_config(path, target_layers)
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    model_type = layer.pop("model_type", "llama")
    for key in ("architectures", "torch_dtype", "transformers_version", "bias"):
        layer.pop(key, None)
    try:
        layer_config = AutoConfig.for_model(model_type, **layer)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path}: its layer config does not load: {exc}") from exc
    arch = ModelArch.from_hf_config(layer_config)
    if arch.vocab_size != target_vocab:
        raise ConfigError(f"{path}: made for a target of {arch.vocab_size} tokens; this target "
                          f"has {target_vocab}")
    head_target_hidden = config.get("target_hidden_size") or arch.hidden_size
    if head_target_hidden != target_hidden:
        raise ConfigError(f"{path}: made for a target of hidden size {head_target_hidden}; this "
                          f"target has {target_hidden}")
    arch = dataclasses.replace(arch, tie_word_embeddings=False,
                               sliding_windows=(None,) * arch.num_layers)
    eagle1 = fmt == "eagle1"
    state = _our_names(path, _read_weights(path), prefix, arch, eagle1=eagle1)
    if eagle1:
        if ("fc.bias" in state) != bool(config.get("bias", True)):
            raise ConfigError(f"{path}: config says bias {config.get('bias', True)} but fc.bias is "
                              f"{'present' if 'fc.bias' in state else 'absent'}")
        _check_shapes(path, state, arch, None, 2 * target_hidden, target_vocab, attn_in=arch.hidden_size)
    else:
        _check_shapes(path, state, arch, config.get("draft_vocab_size") or target_vocab,
                      len(layers) * target_hidden, target_vocab, attn_in=2 * arch.hidden_size)
    return PublishedHead(fmt, arch, layer_config, layers, target_hidden, norm_before_residual, state)


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """(2, L // 2, L - 3): the layers every published EAGLE-3 head reads, by default."""
    return (2, num_layers // 2, num_layers - 3)


def _target_layers(path: Path, ids, shift: int, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs ``fc`` reads, in order (module docstring)."""
    if ids is None:
        layers = default_target_layers(num_layers)
    elif not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"{path}: eagle_aux_hidden_state_layer_ids must be a list of integers")
    else:
        layers = tuple(i + shift for i in ids)
    return checked_layers(layers, num_layers, f"{path}: ", "set eagle_aux_hidden_state_layer_ids")


def checked_layers(layers, num_layers: int, where: str, fix: str) -> tuple[int, ...]:
    """``layers`` sorted, once checked to be distinct layers of a ``num_layers``-layer target
    (a one-line ConfigError otherwise: ``where`` it came from, and ``fix``)."""
    if len(set(layers)) != len(layers) or not all(0 <= i < num_layers for i in layers):
        raise ConfigError(f"{where}target layers {list(layers)} are not distinct layers of this "
                          f"{num_layers}-layer target ({fix})")
    return tuple(sorted(layers))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = path / name
        if file.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
    raise ConfigError(f"{path}: no weights ({' or '.join(WEIGHT_FILES)})")


def _our_names(path: Path, raw: dict[str, torch.Tensor], prefix: str, arch: ModelArch, *,
               eagle1: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under :class:`DraftHead`'s names (q/k/v and gate/up fused)."""
    raw = {k: v for k, v in raw.items() if k not in SKIPPED}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ConfigError(f"{path}: tensor {name} is missing")
        return raw.pop(name)

    for i in range(arch.num_layers):
        theirs = prefix if i == 0 else f"layers.{i}."
        if i > 0 and prefix == "midlayer.":
            raise ConfigError(f"{path}: num_hidden_layers {arch.num_layers}: a midlayer checkpoint has one")
        for ours, parts in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                if kind == "bias" and f"{theirs}{parts[0]}.bias" not in raw:
                    continue
                tensors = [take(f"{theirs}{part}.{kind}") for part in parts]
                out[f"layers.{i}.{ours}.{kind}"] = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        for ours, theirs_norm in _LAYER_NORMS.items():
            name = f"{theirs}{theirs_norm}.weight"
            if (ours == "hidden_norm" and (i > 0 or eagle1)) or (ours == "input_norm" and i == 0 and eagle1):
                continue
            if ours.startswith("attn.") and not arch.qk_norm:
                continue
            out[f"layers.{i}.{ours}"] = take(name)
    out["fc.weight"] = take("fc.weight")
    if eagle1:
        if "fc.bias" in raw:
            out["fc.bias"] = take("fc.bias")
        if raw:
            raise ConfigError(f"{path}: tensors not supported: {', '.join(sorted(raw)[:5])}")
        return {k: v.float() for k, v in out.items()}
    out["norm"] = take("norm.weight")
    out["lm_head.weight"] = take("lm_head.weight")
    d2t = raw.pop("d2t", None)
    n = out["lm_head.weight"].shape[0]
    if d2t is None and n != arch.vocab_size:
        raise ConfigError(f"{path}: a draft vocabulary of {n} of {arch.vocab_size} tokens needs "
                          "its map d2t, which is missing")
    out["draft_vocab"] = torch.arange(n) + (d2t.long() if d2t is not None else 0)
    if raw:
        raise ConfigError(f"{path}: tensors not supported: {', '.join(sorted(raw)[:5])}")
    return {k: v if k == "draft_vocab" else v.float() for k, v in out.items()}


def _check_shapes(path: Path, state: dict[str, torch.Tensor], arch: ModelArch,
                  draft_vocab_size: int | None, fc_in: int, target_vocab: int, *, attn_in: int) -> None:
    h = arch.hidden_size
    want = {"fc.weight": (h, fc_in),
            "layers.0.attn.qkv.weight": ((arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, attn_in)}
    if draft_vocab_size is None:  # eagle1: the target's LM head
        for name, shape in want.items():
            if tuple(state[name].shape) != shape:
                raise ConfigError(f"{path}: {name} is {tuple(state[name].shape)}, expected {shape} "
                                  "(the hidden size differs from the target's)")
        return
    want.update({"lm_head.weight": (draft_vocab_size, h), "norm": (h,)})
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{path}: {name} is {tuple(state[name].shape)}, expected {shape} "
                              "(hidden size, draft vocabulary or target layers differ)")
    vocab = state["draft_vocab"]
    if vocab.min() < 0 or vocab.max() >= target_vocab or len(vocab.unique()) != len(vocab):
        raise ConfigError(f"{path}: d2t maps draft tokens outside the target's {target_vocab} "
                          "or two onto one")


def rope_of(head: PublishedHead, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's own rope tables (its config's rope_theta; 10000 where it says none, as the
    EAGLE authors' code reads it), not the target's."""
    return rope_tables(head.layer_config, max_len)


def save_speculators(head, out: Path, *, layer_config: dict, verifier: str,
                     verifier_architectures: list[str]) -> None:
    """Write an ``eagle3`` :class:`DraftHead` (``train-draft --kind eagle3``) in the
    ``speculators`` format, the one vLLM reads: ``config.json`` and ``model.safetensors``
    (bfloat16; ``d2t`` / ``t2d`` for its draft vocabulary, no embedding: the target's).
    ``layer_config``: the target's ``config.json`` fields the head's layers share (its rope
    settings among them); ``verifier``: the target's name or hub id."""
    from safetensors.torch import save_file

    arch = head.arch
    d = arch.head_dim
    qkv = [arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]
    state = {k: v.detach() for k, v in head.state_dict().items() if not k.startswith("embed.")}
    tensors: dict[str, torch.Tensor] = {}
    for i in range(arch.num_layers):
        prefix = f"layers.{i}."
        for ours, parts in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                tensor = state.get(f"{prefix}{ours}.{kind}")
                if tensor is None:
                    continue
                pieces = tensor.split(qkv) if len(parts) == 3 else tensor.chunk(len(parts))
                for part, piece in zip(parts, pieces):
                    tensors[f"{prefix}{part}.{kind}"] = piece
        for ours, theirs in _LAYER_NORMS.items():
            if f"{prefix}{ours}" in state:
                tensors[f"{prefix}{theirs}.weight"] = state[f"{prefix}{ours}"]
    vocab = head.draft_vocab.cpu()
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    tensors.update({"fc.weight": state["fc.weight"], "norm.weight": state["norm"],
                    "lm_head.weight": state["lm_head.weight"], "d2t": vocab - torch.arange(len(vocab)),
                    "t2d": t2d})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in tensors.items()}, str(out / WEIGHT_FILES[0]))
    (out / WEIGHT_FILES[0]).chmod(0o644)  # safetensors writes 0600; a draft is read by other users
    skip = ("architectures", "torch_dtype", "dtype", "transformers_version", "auto_map",
            "quantization_config")
    layer = {k: v for k, v in layer_config.items() if k not in skip}
    layer.update(num_hidden_layers=arch.num_layers, tie_word_embeddings=False)
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer, "draft_vocab_size": len(vocab),
        "norm_before_residual": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(head.target_layers),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
        "torch_dtype": "bfloat16"}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
