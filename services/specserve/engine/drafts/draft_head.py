"""Trained drafts: a few decoder layers on top of the target's own embeddings (``specserve
train-draft`` makes them).

Two kinds, one module (:class:`DraftHead`):

- ``decoder``: a small separate decoder. Position t reads token x_t and predicts x_{t+1},
  like any language model; the proposer is :class:`~.proposers.draft_model.DraftModelProposer`.
- ``eagle``: an EAGLE-style head (Li et al. 2024). Position t reads the pair
  ``(x_{t+1}, f_t)``: the next token and the target's final hidden state at t, fused by one
  linear layer; it predicts f_{t+1}, whose logits draft x_{t+2}. Drafting k > 1 tokens feeds
  its own predicted features back in. The target's features are far richer than tokens, so
  one layer drafts well; the proposer (:class:`~.proposers.eagle.EagleProposer`) gets them
  from the target's verify forward each step.

- ``eagle3``: an EAGLE-3 head (Li et al. 2025), loaded from the published formats
  (:mod:`~specserve.engine.drafts.published_drafts`, docs/DRAFTS.md). The target's features are the
  residual stream entering three of its layers (low, middle, high: ``target_layers``),
  concatenated; ``fc`` fuses them into one (:meth:`DraftHead.from_target`). Its first layer
  attends over ``[norm(token embedding), norm(feature)]`` (2H wide, :class:`Eagle3Layer`), its
  logits are over its reduced vocabulary, and the feature it feeds back for k > 1 is its own
  output *before* the final norm.

Both keep the saved draft small: the embeddings are the target's (not saved; loaded from the
target's weights at start), and the LM head covers only the ``draft_vocab`` most frequent
output tokens (FR-Spec / EAGLE-3's reduced draft vocabulary): most of a small draft's cost is
its LM head. Logits outside that vocabulary are -inf, so the draft never proposes those tokens;
losslessness does not care (the target verifies everything, and a sampled draft's q is just
zero there).

A draft directory holds ``draft.json`` (kind, architecture, which target), ``model.safetensors``
(bfloat16 to keep the repository small; upcast on load), the target's tokenizer, and
``eval.json`` when ``train-draft`` evaluated it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch
from torch import nn

from specserve.engine.loader import is_hub_id
from specserve.engine.runtime import native
from specserve.engine.runtime.arch import ModelArch
from specserve.engine.runtime.kernels import Linear, native_ready
from specserve.engine.runtime.layers import Attention, DecoderLayer, rms_norm
from specserve.engine.runtime.model import LlamaRuntime, default_kernels
from specserve.errors import ConfigError
from specserve.methods import DRAFT_KINDS

EMBEDDED_DRAFT = "embedded-eagle"  # the shipped EAGLE draft of the embedded target
EMBEDDED_DRAFT_DIR = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-eagle"
EMBEDDED_EAGLE3 = "embedded-eagle3"  # an EAGLE-3 head of the embedded target (speculators format)
EMBEDDED_EAGLE3_DIR = EMBEDDED_DRAFT_DIR.with_name("smollm2-135m-eagle3")
DRAFT_FILE = "draft.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
# eagle3 and eagle1 (a published EAGLE-1/2 head): loaded from a published format, not trained here
HEAD_KINDS = (*DRAFT_KINDS, "eagle3", "eagle1")
TRAINED_KINDS = (*DRAFT_KINDS, "eagle3")  # what train-draft makes (eagle3: saved as speculators)
# the method's draft kind a head kind serves (every EAGLE head drafts for method eagle)
SERVES = {"eagle3": "eagle", "eagle1": "eagle"}


def draft_path(source: str | Path) -> Path:
    """Where a draft source lives: ``embedded-eagle`` is the shipped default's directory,
    ``embedded-eagle3`` the shipped EAGLE-3 head's; a hub id of a published EAGLE head, its
    download (:func:`hub_head`)."""
    if str(source) == EMBEDDED_DRAFT:
        return EMBEDDED_DRAFT_DIR
    if str(source) == EMBEDDED_EAGLE3:
        return EMBEDDED_EAGLE3_DIR
    path = Path(source).expanduser()
    if path.exists() or not is_hub_id(str(source)):
        return path
    return hub_head(str(source)) or path


@functools.lru_cache(maxsize=32)
def hub_head(repo: str) -> Path | None:
    """A published EAGLE head on the hub (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): its
    files, downloaded once and then read from the hub cache (offline too); None where
    ``repo`` holds no such head (a plain model, which the loader resolves as one) or cannot
    be reached (the plain loader then says why). Its ``config.json`` alone tells an EAGLE-3
    head; a one-layer Llama config may be an EAGLE-1 head, told by its weights' names."""
    from huggingface_hub import hf_hub_download, snapshot_download

    from specserve.engine.drafts.published_drafts import HEAD_FILES, config_format, published_format

    try:
        config = json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
        if config_format(config) is None and config.get("num_hidden_layers") != 1:
            return None
        folder = Path(snapshot_download(repo, allow_patterns=HEAD_FILES))
    except (OSError, ValueError):  # every hub error is an OSError; a config that is not JSON
        return None
    return folder if published_format(folder) is not None else None


def is_draft_dir(source: str | Path) -> bool:
    """A draft this module loads: ``train-draft``'s (``draft.json``) or a published EAGLE
    head (:func:`~specserve.engine.drafts.published_drafts.published_format`)."""
    return (draft_path(source) / DRAFT_FILE).is_file() or published(source) is not None


def published(source: str | Path) -> str | None:
    """The published format of the head at ``source``
    (:func:`~specserve.engine.drafts.published_drafts.published_format`); None for ``train-draft``'s
    drafts and for anything else."""
    from specserve.engine.drafts.published_drafts import published_format

    path = draft_path(source)
    return None if (path / DRAFT_FILE).is_file() else published_format(path)


def eagle3_target_layers(speculative, num_layers: int) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head of ``speculative`` (a ``SpeculativeConfig``) reads,
    for a target of ``num_layers`` layers; None without one. A unit's target group sets its
    runtime's ``feature_layers`` from this; the draft group loads the head."""
    from specserve.engine.drafts.published_drafts import target_layers_of

    draft = speculative.draft
    if draft is None or published(draft.source) in (None, "eagle1"):
        return None
    return target_layers_of(draft_path(draft.source), num_layers)


def serves(kind: str | None) -> str | None:
    """The method draft kind (``methods.PROPOSERS[...].draft_kind``) a head kind serves."""
    return SERVES.get(kind, kind)


def load_draft_vocab(source: str | Path) -> torch.Tensor:
    """The target ids a draft drafts (``train-draft``'s ``draft_vocab``; a published head's
    ``i + d2t[i]``, every id without ``d2t``)."""
    from safetensors import safe_open

    path = draft_path(source)
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        if (path / DRAFT_FILE).is_file():
            return f.get_tensor("draft_vocab")
        n = f.get_slice("lm_head.weight").get_shape()[0]
        return torch.arange(n) + (f.get_tensor("d2t").long() if "d2t" in f.keys() else 0)


def read_draft_meta(source: str | Path) -> dict:
    path = draft_path(source)
    if (fmt := published(path)) is not None:
        return {"kind": "eagle1" if fmt == "eagle1" else "eagle3", "format": fmt}
    try:
        meta = json.loads((path / DRAFT_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable specserve draft ({DRAFT_FILE}): {exc}") from exc
    if meta.get("format_version") != FORMAT_VERSION or meta.get("kind") not in DRAFT_KINDS:
        raise ConfigError(f"{path / DRAFT_FILE}: unsupported format {meta.get('format_version')!r} "
                          f"or kind {meta.get('kind')!r}")
    return meta


class Eagle3Layer(DecoderLayer):
    """An EAGLE-3 head's first layer. Its input is ``[token embedding, feature]`` (2H): each
    half gets its own norm (``input_norm``, ``hidden_norm``), attention projects both, and the
    residual is the feature (normed first with ``norm_before_residual``, the variant some
    ``speculators`` heads are trained with)."""

    def __init__(self, arch: ModelArch, layer_idx: int, *, norm_before_residual: bool = False) -> None:
        super().__init__(arch, layer_idx)
        self.attn = Attention(arch, layer_idx, in_features=2 * arch.hidden_size)
        self.hidden_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.norm_before_residual = norm_before_residual

    def forward(self, x: torch.Tensor, ctx, cache) -> torch.Tensor:
        norm = native.rms_norm if self.invariant and native_ready(x) else rms_norm
        return self._layer(x, norm, lambda attn_in: self.attn(attn_in, ctx, cache))

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training: :meth:`forward` over whole sequences (see ``Attention.forward_full``)."""
        return self._layer(x, rms_norm, lambda attn_in: self.attn.forward_full(attn_in, cos, sin))

    def _layer(self, x: torch.Tensor, norm, attend) -> torch.Tensor:
        embeds, feature = x.chunk(2, dim=-1)
        normed = norm(feature, self.hidden_norm, self.eps)
        attn_in = torch.cat([norm(embeds, self.input_norm, self.eps), normed], dim=-1)
        x = (normed if self.norm_before_residual else feature) + attend(attn_in)
        return x + self.mlp(norm(x, self.post_attn_norm, self.eps))


class DraftHead(LlamaRuntime):
    """A :class:`LlamaRuntime` with a reduced-vocabulary head and, for ``eagle``, a feature fuser.

    The cached forward (serving) is the runtime's; ``features`` go to :meth:`_inputs`.
    :meth:`train_forward` is the same computation over whole sequences, for training.
    """

    fixed_head = False  # its logits only propose: their rounding never changes an output

    def __init__(self, arch: ModelArch, rope_cos: torch.Tensor, rope_sin: torch.Tensor, *,
                 kind: str, draft_vocab: torch.Tensor, target_layers: tuple[int, ...] = (),
                 target_hidden: int | None = None, norm_before_residual: bool = False,
                 fc_bias: bool = False) -> None:
        """``eagle3`` only: ``target_layers``, the target layers whose inputs it reads (their
        number times ``target_hidden`` is ``fc``'s input), and ``norm_before_residual``.
        ``eagle1`` (a published EAGLE-1/2 head): ``fc_bias``; no input norm in its first
        layer, no final norm, the target's LM head (``draft_vocab``: every token)."""
        assert kind in HEAD_KINDS and not arch.tie_word_embeddings
        super().__init__(arch, rope_cos, rope_sin)
        self.kind = kind
        hidden = arch.hidden_size
        self.lm_head = Linear(hidden, len(draft_vocab), bias=False)
        self.fc = Linear(2 * hidden, hidden, bias=False) if kind == "eagle" else None
        self.target_layers = tuple(target_layers)
        if kind == "eagle3":
            self.fc = Linear(len(target_layers) * (target_hidden or hidden), hidden, bias=False)
            self.layers[0] = Eagle3Layer(arch, 0, norm_before_residual=norm_before_residual)
            self.hidden_prenorm = True
        if kind == "eagle1":
            self.fc = Linear(2 * hidden, hidden, bias=fc_bias)
            self.layers[0].input_norm = None
            self.hidden_prenorm = True
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)

    @property
    def uses_features(self) -> bool:
        return self.fc is not None

    def warm_up_features(self, num_tokens: int) -> torch.Tensor | None:
        if self.fc is None:
            return None
        weight = self.embed.weight
        return weight.new_zeros(num_tokens, self.arch.hidden_size)  # what from_target gives

    def _embedded(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if self.fc is None:
            assert features is None, "a decoder draft takes no features"
            return self.embed(tokens)
        if self.kind == "eagle3":  # the first layer splits them (Eagle3Layer)
            x = self.embed(tokens)
            return torch.cat([x, features.to(x.dtype)], dim=-1)
        return self._fuse(tokens, features)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.kind == "eagle1" else super().final_norm(x)

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """The features the head reads, from what the target returned for it: ``eagle3``
        fuses the target layers' states (``[N, len(target_layers) * target_hidden]``) with
        ``fc``; ``eagle`` reads the target's final hidden states as they are."""
        if self.kind != "eagle3":
            return features
        return self.fc(features.to(self.fc.weight.dtype))

    def _fuse(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input ``[B, T, hidden]``: the token embeddings, for ``eagle``
        fused with the features ``[B, T, hidden]`` by ``fc``; for ``eagle3`` the two side by
        side (``[B, T, 2 hidden]``, the features already fused: :meth:`from_target`)."""
        x = self.embed(tokens)
        if self.kind == "eagle3":
            return torch.cat([x, features.to(x.dtype)], dim=-1)
        return x if self.fc is None else self.fc(torch.cat([x, features.to(x.dtype)], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ``[N, vocab]`` logits: the draft vocabulary's, -inf elsewhere."""
        small = self.lm_head(hidden).float()
        full = small.new_full((small.shape[0], self.arch.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_vocab, small)

    def train_forward(self, tokens: torch.Tensor, features: torch.Tensor | None = None, *,
                      prenorm: bool = False) -> torch.Tensor:
        """Final hidden states ``[B, T, hidden]`` of whole right-padded sequences starting at
        position 0 (``features``: ``[B, T, hidden]`` for ``eagle`` and, fused, ``eagle3``),
        after the final norm, or before it with ``prenorm``. With grad, no cache."""
        x = self._fuse(tokens, features)
        t = tokens.shape[1]
        cos, sin = self.rope_cos[None, :t, None], self.rope_sin[None, :t, None]
        for layer in self.layers:
            x = layer.forward_full(x, cos, sin)
        return x if prenorm else self.final_norm(x)


def draft_arch(target: ModelArch, num_layers: int) -> ModelArch:
    """The target's layer shape, ``num_layers`` deep, untied, full attention."""
    return dataclasses.replace(target, num_layers=num_layers, tie_word_embeddings=False,
                               sliding_windows=(None,) * num_layers)


def new_draft_head(target: LlamaRuntime, *, kind: str, num_layers: int,
                   draft_vocab: torch.Tensor, seed: int = 0,
                   target_layers: tuple[int, ...] | None = None) -> DraftHead:
    """An untrained draft initialised from the target: its norm, the draft vocabulary's rows
    of its LM head, and copies of its first (``decoder``) or last (``eagle``, ``eagle3``:
    they see late-stage features) ``num_layers`` layers. ``eagle``'s fuser starts as "take the
    feature" (plus seeded noise), ``eagle3``'s as "take the last target layer's state" (its
    first layer's projections read the embedding and the feature halves with the target
    layer's weights, halved); embeddings are the target's tensor itself (frozen, shared).
    ``target_layers`` (``eagle3``): the target layers it reads (default
    :func:`~specserve.engine.drafts.published_drafts.default_target_layers`)."""
    from specserve.engine.drafts.published_drafts import default_target_layers

    if kind not in TRAINED_KINDS:
        raise ConfigError(f"draft kind must be one of {', '.join(TRAINED_KINDS)}")
    if not 1 <= num_layers <= target.arch.num_layers:
        raise ConfigError(f"num_layers must be in [1, {target.arch.num_layers}]")
    arch = draft_arch(target.arch, num_layers)
    layers = ()
    if kind == "eagle3":
        layers = tuple(target_layers or default_target_layers(target.arch.num_layers))
    head = DraftHead(arch, target.rope_cos, target.rope_sin, kind=kind, draft_vocab=draft_vocab,
                     target_layers=layers, target_hidden=target.arch.hidden_size)
    head.embed.weight = target.embed.weight if target.embed.quantized is None else nn.Parameter(
        target.embed.float_weight(), requires_grad=False)
    source = target.layers[:num_layers] if kind == "decoder" else target.layers[-num_layers:]
    with torch.no_grad():
        for mine, theirs in zip(head.layers, source):
            state = theirs.state_dict()
            if isinstance(mine, Eagle3Layer):  # [embedding | feature] in: each half the weights
                for name in [k for k in state if k.startswith("attn.qkv.weight")]:
                    state[name] = torch.cat([state[name], state[name]], dim=1) / 2
                state["hidden_norm"] = state["input_norm"]
            mine.load_state_dict(state)
        head.norm.copy_(target.norm)
        head.lm_head.weight.copy_(target.lm_head.float_weight()[draft_vocab])
        if head.fc is not None and kind == "eagle3":
            hidden = arch.hidden_size
            head.fc.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
            head.fc.weight[:, -hidden:] += torch.eye(hidden)
        elif head.fc is not None:
            hidden = arch.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, hidden:] = torch.eye(hidden)
            head.fc.weight[:, :hidden].normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    head.embed.weight.requires_grad_(False)
    return head


def trainable_state(head: DraftHead) -> dict[str, torch.Tensor]:
    """What a draft saves: everything but the (target's) embeddings and the rope tables."""
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("embed.")}
    state["draft_vocab"] = head.draft_vocab
    return state


def save_draft(head: DraftHead, out: Path, *, target_name: str, tokenizer, extra: dict) -> None:
    """Write ``draft.json``, bfloat16 weights and the tokenizer into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in trainable_state(head).items()}
    save_file(state, str(out / WEIGHTS_FILE))
    (out / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; a draft is read by other users
    meta = {"format_version": FORMAT_VERSION, "kind": head.kind,
            "target": {"name": target_name, "vocab_size": head.arch.vocab_size,
                       "hidden_size": head.arch.hidden_size},
            "arch": dataclasses.asdict(head.arch), "draft_vocab_size": len(head.draft_vocab), **extra}
    (out / DRAFT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    tokenizer.save_pretrained(out)


def load_draft_head(path: str | Path, target: LlamaRuntime | None = None, *, target_cfg=None,
                    max_model_len: int, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu", kernels: str = "auto") -> DraftHead:
    """A saved draft, on the embeddings (and rope tables) of its target: ``target``, a runtime
    already in memory, or ``target_cfg``, a ModelConfig whose embeddings alone are read.
    ``kernels``: the draft's ``ModelConfig.kernels``; ``auto`` picks what a draft on that
    device gets (:func:`~specserve.engine.runtime.model.default_kernels`: the C kernels on a CPU,
    the library's with FlexAttention on CUDA), never the CPU fallbacks on a GPU."""
    from safetensors.torch import load_file

    path = draft_path(path)
    if not (path / DRAFT_FILE).is_file():
        return _load_published(path, target, target_cfg, max_model_len=max_model_len, dtype=dtype,
                               device=device, kernels=kernels)
    meta = read_draft_meta(path)
    arch_fields = {**meta["arch"], "sliding_windows": tuple(meta["arch"]["sliding_windows"])}
    arch = ModelArch(**arch_fields)
    if target is not None:
        embed, cos, sin = target.embed.float_weight(), target.rope_cos, target.rope_sin
    else:
        from specserve.engine.loader import load_target_parts
        embed, cos, sin = load_target_parts(target_cfg, max_model_len=max_model_len)
    if embed.shape != (arch.vocab_size, arch.hidden_size):
        raise ConfigError(f"draft {path} was trained for a target with {arch.vocab_size} tokens x "
                          f"{arch.hidden_size} hidden; this target has {tuple(embed.shape)}")
    state = load_file(str(path / WEIGHTS_FILE))
    draft_vocab = state.pop("draft_vocab")
    n = min(max_model_len, cos.shape[0])
    with torch.device("meta"):
        head = DraftHead(arch, torch.empty_like(cos[:n]), torch.empty_like(sin[:n]),
                         kind=meta["kind"], draft_vocab=torch.empty_like(draft_vocab))
    missing = head.load_state_dict({k: v.float() for k, v in state.items()},
                                   strict=False, assign=True).missing_keys
    missing = [k for k in missing if not k.startswith("embed.")]  # the target's, set below
    head.embed.weight = nn.Parameter(embed.detach(), requires_grad=False)
    head.rope_cos, head.rope_sin, head.draft_vocab = cos[:n], sin[:n], draft_vocab
    if missing:
        raise ConfigError(f"draft {path}: weights missing: {', '.join(sorted(missing))}")
    dtype = dtype or embed.dtype
    head = head.to(device=device, dtype=dtype).requires_grad_(False).eval()
    return head.use_kernels(head_kernels(head, kernels))


def _load_published(path: Path, target: LlamaRuntime | None, target_cfg, *, max_model_len: int,
                    dtype: torch.dtype | None, device: torch.device | str, kernels: str) -> DraftHead:
    """A published EAGLE head (:mod:`~specserve.engine.drafts.published_drafts`) on its target's
    embedding (and, EAGLE-1, its LM head), with its own rope tables."""
    from specserve.engine.drafts.published_drafts import read_published_head, rope_of

    if target is not None:
        embed, num_layers = target.embed.float_weight(), target.arch.num_layers
        lm_head = target.lm_head.float_weight()  # (a copy where the target's is on blocks)
    else:
        from specserve.engine.loader import (
            load_configs,
            load_target_lm_head,
            load_target_parts,
            local_folder,
            resolve,
        )
        embed, _, _ = load_target_parts(target_cfg, max_model_len=max_model_len)
        src = resolve(target_cfg.source, Path(target_cfg.cache_dir) if target_cfg.cache_dir else None)
        num_layers = load_configs(local_folder(src))[0].num_hidden_layers
        lm_head = None
    published = read_published_head(path, target_vocab=embed.shape[0], target_hidden=embed.shape[1],
                                    target_layers=num_layers)
    kind = "eagle1" if published.format == "eagle1" else "eagle3"
    cos, sin = rope_of(published, max_model_len)
    state = dict(published.state)
    if kind == "eagle1":  # the target's LM head over every token; no final norm (an unused one)
        if lm_head is None:
            lm_head = load_target_lm_head(target_cfg)
        state.update({"lm_head.weight": lm_head.detach(), "norm": torch.ones(embed.shape[1]),
                      "draft_vocab": torch.arange(embed.shape[0])})
    draft_vocab = state.pop("draft_vocab")
    with torch.device("meta"):
        head = DraftHead(published.arch, torch.empty_like(cos), torch.empty_like(sin), kind=kind,
                         draft_vocab=torch.empty_like(draft_vocab),
                         target_layers=published.target_layers, target_hidden=published.target_hidden,
                         norm_before_residual=published.norm_before_residual,
                         fc_bias="fc.bias" in state)
    result = head.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not k.startswith("embed.")]
    if missing or result.unexpected_keys:
        raise ConfigError(f"draft {path}: weights missing {missing} or unexpected {result.unexpected_keys}")
    head.embed.weight = nn.Parameter(embed.detach(), requires_grad=False)
    head.rope_cos, head.rope_sin, head.draft_vocab = cos, sin, draft_vocab
    head = head.to(device=device, dtype=dtype or embed.dtype).requires_grad_(False).eval()
    return head.use_kernels(head_kernels(head, kernels))


def head_kernels(head: DraftHead, kernels: str = "auto") -> str:
    """A draft's ``kernels``, ``auto`` resolved for its device (``default_kernels``); a head
    holds no GGUF blocks, so ``integer`` is ``invariant`` here."""
    if kernels == "auto":
        kernels = default_kernels(head.embed.weight.device, draft=True)
    return "invariant" if kernels == "integer" else kernels
