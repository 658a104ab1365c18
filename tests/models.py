"""Tiny seeded Llama-family models for tests: built from a config, nothing downloaded."""

from __future__ import annotations

import torch
from specserve.engine.runtime.model import LlamaRuntime, build_runtime
from specserve.engine.worker import ModelWorker
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 512  # the size of tests.tiny.make_tiny_tokenizer()

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# kind -> (config class, its own settings); shared sizes are added by tiny_config.
TINY_CONFIGS = {
    "llama-gqa": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                                    mlp_bias=True, tie_word_embeddings=True)),
    "llama3-rope": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1,
                                      rope_parameters=LLAMA3_ROPE)),
    "qwen2-bias": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral-window": (MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                           sliding_window=7)),
    # q/k norms per head, a head_dim that is not hidden / heads, tied embeddings (Qwen3-0.6B's)
    "qwen3-qknorm": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       tie_word_embeddings=True)),
}


def tiny_config(kind: str = "llama-gqa", **overrides):
    """Built with keyword arguments (not set afterwards): some configs derive fields, e.g.
    Qwen2's per-layer ``layer_types``, from ``num_hidden_layers`` at construction."""
    cls, own = TINY_CONFIGS[kind]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return cls(**{**base, **own, **overrides})


def tiny_hf_model(kind: str = "llama-gqa", seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A seeded random ``transformers`` model. ``logit_scale`` sharpens its distributions
    (random init is nearly uniform; real models are peaky)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # wider init than 0.02 so layers matter
            if p.ndim == 2:
                p.normal_(0, 0.15)
        for name, p in model.named_parameters():  # Qwen3's q/k norms: not all ones, so they count
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
        if logit_scale != 1.0:
            model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def random_sequences(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Seeded random token ids, one sequence per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def runtime_of(hf_model, max_len: int = 256) -> LlamaRuntime:
    return build_runtime(hf_model.config, hf_model.state_dict(), max_len=max_len).requires_grad_(False)


def worker_of(hf_model, num_slots: int = 8, max_len: int = 256, kv=None) -> ModelWorker:
    return ModelWorker(runtime_of(hf_model, max_len), num_slots=num_slots, max_seq_len=max_len, kv=kv)


def perturbed(hf_model, scale: float, seed: int = 1):
    """A copy of ``hf_model`` with Gaussian noise on every weight: a draft that agrees often
    but not always."""
    torch.manual_seed(seed)
    clone = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    clone.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return clone


def eagle_head_of(hf_model, *, feature_mix: float = 0.01, seed: int = 0, max_len: int = 256):
    """An EAGLE head that agrees with a 2-layer tiny target about half the time, untrained.

    Built as the target's own layers on a fuser that passes the token embedding through and
    mixes in a little of the target's features: the head then recomputes the target's next
    hidden state, off by its missing first position and the mixed-in features (which makes
    the features matter: without them the drafts change). Acceptance about 0.45 (greedy and
    T = 0.7) on ``tiny_hf_model("llama-gqa", logit_scale=3)``.
    """
    from specserve.engine.drafts.draft_head import new_draft_head

    target = runtime_of(hf_model, max_len)
    head = new_draft_head(target, kind="eagle", num_layers=target.arch.num_layers,
                          draft_vocab=torch.arange(target.arch.vocab_size))
    hidden = target.arch.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        head.fc.weight[:, hidden:] = torch.randn(hidden, hidden, generator=gen) * feature_mix / 8
    return head.requires_grad_(False).eval()


def decoder_head_of(hf_model, *, keep_every: int = 4, max_len: int = 256):
    """A decoder draft: the target's layers under a reduced vocabulary that leaves out every
    ``keep_every``-th id (so the draft's q is zero there, and the target must still get its
    own distribution back). Acceptance about 0.5 to 0.6."""
    from specserve.engine.drafts.draft_head import new_draft_head

    target = runtime_of(hf_model, max_len)
    vocab = torch.tensor([i for i in range(target.arch.vocab_size) if i % keep_every != keep_every - 1])
    head = new_draft_head(target, kind="decoder", num_layers=target.arch.num_layers, draft_vocab=vocab)
    return head.requires_grad_(False).eval()


def write_agreeing_eagle3_head(hf_model, path, *, layers=(0, 1), feature_mix: float = 0.01,
                               seed: int = 0) -> None:
    """A ``speculators``-format EAGLE-3 head (config.json + model.safetensors) that agrees
    with ``hf_model`` about half the time, untrained. ``hf_model``: an MHA target with
    attention biases (``tiny_hf_model("llama-mha")``); ``layers``: the target layers it names.

    Built like :func:`eagle_head_of`: its first (EAGLE-3) layer passes the token embedding
    through (attention focused on the token's own position by constant q and k biases whose
    RoPE scores peak at distance 0, values the normed embedding, rescaled to the embeddings'
    typical size; its MLP zero), then copies of every target layer, the target's norm and LM
    head: the head recomputes the target's next hidden state, off by its missing first
    position, the rescaling, and the little ``fc`` mixes in of the target's features."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    cfg = hf_model.config
    h, n, heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    assert cfg.num_key_value_heads == heads and cfg.attention_bias, "an MHA target with biases"
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    zeros = torch.zeros
    p = "layers.0."
    focus = torch.full((h,), 12.0)  # q = k = this on every head: a peak at distance 0
    embed = sd["model.embed_tokens.weight"]
    out = {
        p + "self_attn.q_proj.weight": zeros(h, 2 * h), p + "self_attn.q_proj.bias": focus,
        p + "self_attn.k_proj.weight": zeros(h, 2 * h), p + "self_attn.k_proj.bias": focus.clone(),
        p + "self_attn.v_proj.weight": torch.cat([torch.eye(h), zeros(h, h)], dim=1),
        p + "self_attn.v_proj.bias": zeros(h),
        p + "self_attn.o_proj.weight": torch.eye(h), p + "self_attn.o_proj.bias": zeros(h),
        p + "input_layernorm.weight": torch.full((h,), float(embed.pow(2).mean(-1).sqrt().mean())),
        p + "hidden_norm.weight": torch.ones(h),
        p + "post_attention_layernorm.weight": torch.ones(h),
        "fc.weight": torch.randn(h, len(layers) * h, generator=gen) * feature_mix / 8,
        "norm.weight": sd["model.norm.weight"], "lm_head.weight": sd["lm_head.weight"],
    }
    inter = cfg.intermediate_size
    for part, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        out[p + f"mlp.{part}.weight"] = zeros(shape)
        out[p + f"mlp.{part}.bias"] = zeros(shape[0])
    for i in range(n):
        for name, tensor in sd.items():
            if name.startswith(f"model.layers.{i}."):
                out[f"layers.{i + 1}." + name[len(f"model.layers.{i}."):]] = tensor
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    layer_config = {k: v for k, v in cfg.to_dict().items()
                    if k not in ("architectures", "torch_dtype", "dtype", "transformers_version")}
    layer_config.update(num_hidden_layers=n + 1, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_config, "draft_vocab_size": cfg.vocab_size,
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": list(layers),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}))
