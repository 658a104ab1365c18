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
import json
from pathlib import Path

import torch
from torch import nn

from specserve.engine.kernels import Linear
from specserve.engine.model import LlamaRuntime, ModelArch, default_kernels, rms_norm
from specserve.errors import ConfigError
from specserve.methods import DRAFT_KINDS

EMBEDDED_DRAFT = "embedded-eagle"  # the shipped EAGLE draft of the embedded target
EMBEDDED_DRAFT_DIR = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-eagle"
DRAFT_FILE = "draft.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


def draft_path(source: str | Path) -> Path:
    """Where a draft source lives: ``embedded-eagle`` is the shipped default's directory."""
    return EMBEDDED_DRAFT_DIR if str(source) == EMBEDDED_DRAFT else Path(source).expanduser()


def is_draft_dir(source: str | Path) -> bool:
    return (draft_path(source) / DRAFT_FILE).is_file()


def load_draft_vocab(source: str | Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(draft_path(source) / WEIGHTS_FILE), framework="pt") as f:
        return f.get_tensor("draft_vocab")


def read_draft_meta(source: str | Path) -> dict:
    path = draft_path(source)
    try:
        meta = json.loads((path / DRAFT_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable specserve draft ({DRAFT_FILE}): {exc}") from exc
    if meta.get("format_version") != FORMAT_VERSION or meta.get("kind") not in DRAFT_KINDS:
        raise ConfigError(f"{path / DRAFT_FILE}: unsupported format {meta.get('format_version')!r} "
                          f"or kind {meta.get('kind')!r}")
    return meta


class DraftHead(LlamaRuntime):
    """A :class:`LlamaRuntime` with a reduced-vocabulary head and, for ``eagle``, a feature fuser.

    The cached forward (serving) is the runtime's; ``features`` go to :meth:`_inputs`.
    :meth:`train_forward` is the same computation over whole sequences, for training.
    """

    fixed_head = False  # its logits only propose: their rounding never changes an output

    def __init__(self, arch: ModelArch, rope_cos: torch.Tensor, rope_sin: torch.Tensor, *,
                 kind: str, draft_vocab: torch.Tensor) -> None:
        assert kind in DRAFT_KINDS and not arch.tie_word_embeddings
        super().__init__(arch, rope_cos, rope_sin)
        self.kind = kind
        hidden = arch.hidden_size
        self.lm_head = Linear(hidden, len(draft_vocab), bias=False)
        self.fc = Linear(2 * hidden, hidden, bias=False) if kind == "eagle" else None
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)

    @property
    def uses_features(self) -> bool:
        return self.fc is not None

    def _inputs(self, tokens: torch.Tensor, ctx, features: torch.Tensor | None) -> torch.Tensor:
        if self.fc is None:
            assert features is None, "a decoder draft takes no features"
            return self.embed(tokens)
        padded = features.new_zeros(*tokens.shape, features.shape[-1])  # [B, T, hidden]
        padded[ctx.valid] = features
        return self._fuse(tokens, padded)

    def _fuse(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input ``[B, T, hidden]``: the token embeddings, for ``eagle``
        fused with the features ``[B, T, hidden]`` by ``fc``."""
        x = self.embed(tokens)
        return x if self.fc is None else self.fc(torch.cat([x, features.to(x.dtype)], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ``[N, vocab]`` logits: the draft vocabulary's, -inf elsewhere."""
        small = self.lm_head(hidden).float()
        full = small.new_full((small.shape[0], self.arch.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_vocab, small)

    def train_forward(self, tokens: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[B, T, hidden]`` of whole right-padded sequences starting at
        position 0 (``features``: ``[B, T, hidden]`` for ``eagle``). With grad, no cache."""
        x = self._fuse(tokens, features)
        t = tokens.shape[1]
        cos, sin = self.rope_cos[None, :t, None], self.rope_sin[None, :t, None]
        for layer in self.layers:
            x = layer.forward_full(x, cos, sin)
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)


def draft_arch(target: ModelArch, num_layers: int) -> ModelArch:
    """The target's layer shape, ``num_layers`` deep, untied, full attention."""
    return dataclasses.replace(target, num_layers=num_layers, tie_word_embeddings=False,
                               sliding_windows=(None,) * num_layers)


def new_draft_head(target: LlamaRuntime, *, kind: str, num_layers: int,
                   draft_vocab: torch.Tensor, seed: int = 0) -> DraftHead:
    """An untrained draft initialised from the target: its norm, the draft vocabulary's rows
    of its LM head, and copies of its first (``decoder``) or last (``eagle``: they see
    late-stage features) ``num_layers`` layers. ``eagle``'s fuser starts as "take the
    feature" (plus seeded noise); embeddings are the target's tensor itself (frozen, shared)."""
    if kind not in DRAFT_KINDS:
        raise ConfigError(f"draft kind must be one of {', '.join(DRAFT_KINDS)}")
    if not 1 <= num_layers <= target.arch.num_layers:
        raise ConfigError(f"num_layers must be in [1, {target.arch.num_layers}]")
    arch = draft_arch(target.arch, num_layers)
    head = DraftHead(arch, target.rope_cos, target.rope_sin, kind=kind, draft_vocab=draft_vocab)
    head.embed.weight = target.embed.weight
    source = target.layers[:num_layers] if kind == "decoder" else target.layers[-num_layers:]
    with torch.no_grad():
        for mine, theirs in zip(head.layers, source):
            mine.load_state_dict(theirs.state_dict())
        head.norm.copy_(target.norm)
        head.lm_head.weight.copy_(target.lm_head.weight[draft_vocab])
        if head.fc is not None:
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
    ``kernels``: the draft's ``ModelConfig.kernels``; ``auto`` picks what a target on that
    device gets (:func:`~specserve.engine.model.default_kernels`: the C kernels on a CPU,
    the library's with FlexAttention on CUDA), never the CPU fallbacks on a GPU."""
    from safetensors.torch import load_file

    path = draft_path(path)
    meta = read_draft_meta(path)
    arch_fields = {**meta["arch"], "sliding_windows": tuple(meta["arch"]["sliding_windows"])}
    arch = ModelArch(**arch_fields)
    if target is not None:
        embed, cos, sin = target.embed.weight, target.rope_cos, target.rope_sin
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
    return head.use_kernels(default_kernels(head.embed.weight.device) if kernels == "auto" else kernels)
