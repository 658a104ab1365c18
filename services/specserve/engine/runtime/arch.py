"""The numbers of a Llama-family architecture (:class:`ModelArch`), read from a
``transformers`` config, and the model types the runtime supports."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArch:
    """The numbers of a Llama-family architecture, read from a ``transformers`` config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before RoPE

    @property
    def window(self) -> int | None:
        """The sliding window of the layers that have one (:func:`one_window`)."""
        return one_window(self.sliding_windows)

    @classmethod
    def from_hf_config(cls, config) -> ModelArch:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
            raise ConfigError("dynamic NTK RoPE depends on the sequence length and is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias covers all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_windows=_sliding_windows(config),
            qk_norm=model_type == "qwen3",
        )


def one_window(sliding_windows: tuple[int | None, ...]) -> int | None:
    """The sliding window of the layers that have one (one size per model), or None."""
    windows = {w for w in sliding_windows if w is not None}
    assert len(windows) <= 1, "one sliding window size per model"
    return next(iter(windows), None)


def _sliding_windows(config) -> tuple[int | None, ...]:
    """Per-layer sliding window, following how each ``transformers`` model decides it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return (window,) * n
    if config.model_type in ("qwen2", "qwen3"):
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * n
