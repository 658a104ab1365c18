"""What a client sends: the OpenAI-compatible request models (and our ``speculation``
extension) the ingress parses, and the error object it gets back (what the ingress hands a
unit is in :mod:`~specserve.serve.unit_messages`).

Three rules decide what a request may carry:

- **Known fields are validated strictly**: a string where a number belongs is a 400, not a
  coercion, and NaN / ±Infinity (which JSON parsers accept as ``NaN``, ``Infinity``, ``1e999``)
  never reach a sampler. An explicit ``null`` means the default, as OpenAI's spec allows for
  every optional field (``"max_tokens": null`` on /v1/completions is 16).
- **Features we do not implement are refused**, with a 400 whose ``param`` names the field
  (``response_format is not supported by this server``), whenever the value would change the
  output: ``best_of``, ``prediction``, ``audio``... A value that asks for nothing
  (``best_of: 1``, ``tools: []``, ``response_format: {"type": "text"}``) is accepted.
  Silently ignoring one would hand a client output it did not ask for.
- **Unknown fields are ignored**, as OpenAI's own API and vLLM do, so clients that send newer
  fields without semantics for generation (``store``, ``metadata``, ``service_tier``,
  ``parallel_tool_calls``...) keep working.

The JSON schema of each model says which values are accepted (``/openapi.json`` is built from
it), so a client generator or a fuzzer sees the refused values as invalid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specserve.config import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    BadWord,
    Bias,
    MinP,
    MinTokens,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    SpecMethod,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from specserve.engine.grammar import GrammarSpec
from specserve.errors import InvalidRequestError
from specserve.serve.chat_messages import RESERVED_TEMPLATE_KEYS, ChatMessage, NamedToolChoice, Tool
from specserve.serve.tools import ToolPlan

UNSUPPORTED = "unsupported_parameter"  # the pydantic error type, and the API error's code


def _only(harmless: Callable[[Any], bool], what: str | None = None, hint: str = "") -> AfterValidator:
    """Refuse a value that would ask for a feature this server does not implement; ``harmless``
    says which values ask for nothing. ``what`` names the feature (default: the field)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if harmless(value):
            return value
        raise PydanticCustomError(UNSUPPORTED, "{what} is not supported by this server{hint}",
                                  {"what": what or info.field_name, "hint": hint})

    return AfterValidator(check)


def _never(_: Any) -> bool:
    return False


def _empty(value: Any) -> bool:
    return not value


# Each alias is the type a client may send, the JSON schema of the values accepted, and the rule.
Refused = Annotated[Any, WithJsonSchema({"type": "null"}), _only(_never)]
EmptyList = Annotated[list[Any], WithJsonSchema({"type": "array", "maxItems": 0}), _only(_empty)]
NoneChoice = Annotated[str | dict[str, Any], WithJsonSchema({"type": "string", "enum": ["none"]}),
                       _only(lambda v: v == "none")]
No = Annotated[bool, WithJsonSchema({"type": "boolean", "enum": [False]}), _only(lambda v: not v)]
Yes = Annotated[bool, WithJsonSchema({"type": "boolean", "enum": [True]}), _only(lambda v: v)]


def _engines(name: str, **bounds: Any) -> Any:
    """The engine's field ``name`` (:class:`SamplingParams`): its default and description
    (``bounds``: a list's, which its API type cannot carry)."""
    field_info = SamplingParams.model_fields[name]
    return Field(field_info.default, description=field_info.description, **bounds)


def _null_means_default(schema: dict[str, Any]) -> None:
    """The JSON schema side of :meth:`_Lenient._drop_nulls`: every optional property also
    takes null."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or prop.get("type") == "null" or {"type": "null"} in prop.get("anyOf", ()):
            continue
        meta = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}


class _Lenient(BaseModel):
    """Strict types, finite numbers, and ``null`` as "the default"."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              json_schema_extra=_null_means_default)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        """OpenAI's spec allows an explicit null for every optional field and its clients send
        them; dropping the key lets the field's default apply (and its bounds stay simple)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class SpeculationOptions(_Lenient):
    """Per-request control of speculation (our extension; absent = the router decides)."""

    model_config = ConfigDict(extra="forbid")  # our own extension: a typo is an error

    enabled: bool | None = Field(None, description="Force speculation on or off for this request.")
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="K for this request.")
    method: SpecMethod | None = Field(
        None, description="Proposer; must be the one the deployment runs.")
    traffic_class: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Prompt class for the router's acceptance tracking (with the route, the API "
                    "key and OpenAI's `user`), e.g. 'summarize' or 'code'.")


def _schema_spec(schema: dict[str, Any] | str) -> GrammarSpec:
    """A JSON schema's spec, the schema given as an object or as JSON text."""
    return GrammarSpec("json_schema", schema) if isinstance(schema, str) else GrammarSpec.json_schema(schema)


class StructuredOutputs(_Lenient):
    """vLLM's ``structured_outputs``: exactly one of its constraints (its other keys, such as
    ``structural_tag`` or the whitespace options, are refused by name)."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(None, alias="json",
                                                     description="A JSON schema (object or JSON text).")
    regex: str | None = Field(None, min_length=1, max_length=10_000)
    choice: list[Annotated[str, Field(min_length=1, max_length=10_000)]] | None = Field(
        None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, min_length=1, max_length=100_000, description="Lark or GBNF.")
    json_object: bool = False

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [v for v in (self.json_schema, self.regex, self.choice, self.grammar) if v is not None]
        if len(given) + self.json_object != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self

    def spec(self) -> GrammarSpec:
        if self.json_schema is not None:
            return _schema_spec(self.json_schema)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", tuple(self.choice))
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        return GrammarSpec("json_object")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: with include_usage, "
                                         "every chunk carries its choice's usage so far.")


class _Request(_Lenient):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: Temperature = Field(1.0, description="0 is greedy; so is anything below 1e-5, as in vLLM.")
    top_p: TopP = 1.0
    top_k: TopK = Field(0, json_schema_extra={"minimum": -1}, description="vLLM extension; 0 or -1 disables.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        [], max_length=64, description="vLLM extension: token ids that end generation.")
    seed: Seed | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    speculation: SpeculationOptions | None = None
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256,
        description="vLLM extension: cached prompt prefixes are shared only between requests "
                    "with the same salt (none: with every request without one).")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM extension: keep only the prompt's last this many tokens "
                                 "(-1: as many as the context holds); counted after the chat template.")

    # -- accepted only with the value that asks for nothing (see the module docstring) --------
    n: int = Field(1, ge=1, description="Choices to sample from the prompt, which is "
                   "computed once; at most the unit's max_num_seqs. Choice i of a seeded request "
                   "is the single request with seed + i.")
    best_of: Annotated[int, _only(lambda v: v == 1, "best_of > 1")] = \
        Field(1, ge=1, json_schema_extra={"maximum": 1})
    presence_penalty: Penalty = _engines("presence_penalty")
    frequency_penalty: Penalty = _engines("frequency_penalty")
    repetition_penalty: RepetitionPenalty = _engines("repetition_penalty")
    min_p: MinP = _engines("min_p")
    min_tokens: MinTokens = _engines("min_tokens")
    allowed_token_ids: list[TokenId] | None = _engines("allowed_token_ids", min_length=1,
                                                       max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[BadWord] = _engines("bad_words", max_length=MAX_BAD_WORDS)
    logit_bias: dict[str, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS, description=(
        "Token id (a string: a JSON key) -> a bias added to its logit before sampling or argmax."))
    response_format: Annotated[
        dict[str, Any], WithJsonSchema({"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"},
                "strict": {"type": "boolean"}}, "required": ["schema"]}},
            "required": ["type"]})] | None = Field(
        None, description="Structured output: text (free), json_object (any JSON object) or "
                          "json_schema (the output follows the schema; keywords the grammar "
                          "library cannot enforce are a 400).")
    tools: EmptyList | None = None          # (chat requests take tools)
    tool_choice: NoneChoice | None = None
    functions: EmptyList | None = None
    function_call: NoneChoice | None = None
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM extension: a JSON schema (object or JSON text) the output follows.")
    guided_regex: str | None = Field(
        None, min_length=1, max_length=10_000,
        description="vLLM extension: a regular expression the whole output matches (Rust regex "
                    "syntax: no look-around or backreferences).")
    guided_choice: list[Annotated[str, Field(min_length=1, max_length=10_000)]] | None = Field(
        None, min_length=1, max_length=1024,
        description="vLLM extension: the output is exactly one of these strings.")
    guided_grammar: str | None = Field(
        None, min_length=1, max_length=100_000,
        description="vLLM extension: a context-free grammar the whole output follows, in Lark's "
                    "syntax (start: ...) or llama.cpp's GBNF (root ::= ...).")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension (its newer spelling of the guided_* fields): one of "
                           "json, regex, choice, grammar, json_object.")
    prediction: Refused = None
    audio: Refused = None
    modalities: Annotated[list[str], _only(lambda v: v == ["text"], hint='; only ["text"]'),
                          WithJsonSchema({"type": "array", "items": {"enum": ["text"]},
                                          "minItems": 1, "maxItems": 1})] | None = None
    use_beam_search: No = False
    return_tokens_as_token_ids: bool = Field(False, description="vLLM extension: logprobs name each "
                                             "token token_id:<id>, not by its text.")
    return_token_ids: bool = Field(False, description="vLLM extension: the prompt's token ids "
                                   "(prompt_token_ids) and each choice's output ids (token_ids) in "
                                   "the response; streaming, the prompt's on a choice's first chunk.")
    spaces_between_special_tokens: Yes = True
    logits_processors: Refused = None
    guided_whitespace_pattern: Refused = None
    add_special_tokens: bool | None = Field(None, description="vLLM extension: the tokenizer's "
                                            "BOS and such around the prompt (default: completions "
                                            "yes, chat no: the template has its own).")
    include_stop_str_in_output: bool = _engines("include_stop_str_in_output")
    skip_special_tokens: bool = _engines("skip_special_tokens")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="vLLM extension: each prompt token's log-probability given "
                                       "the tokens before it, its rank and this many likeliest "
                                       "alternatives (the first token: null); not with stream.")

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            GrammarSpec.from_response_format(value)
        except InvalidRequestError as exc:
            raise ValueError(str(exc)) from None
        return value

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """The structured output asked for, and the field that asked (None: free text).
        Raises :class:`InvalidRequestError` for a value that is no grammar (a schema that is
        not an object, ...); :meth:`refusal` has refused two at once already."""
        if self.response_format is not None:
            spec = GrammarSpec.from_response_format(self.response_format)
            if spec is not None:
                return spec, "response_format"
        if self.guided_json is not None:
            return _schema_spec(self.guided_json), "guided_json"
        if self.guided_regex is not None:
            return GrammarSpec("regex", self.guided_regex), "guided_regex"
        if self.guided_choice is not None:
            return GrammarSpec("choice", tuple(self.guided_choice)), "guided_choice"
        if self.guided_grammar is not None:
            return GrammarSpec("grammar", self.guided_grammar), "guided_grammar"
        if self.structured_outputs is not None:
            return self.structured_outputs.spec(), "structured_outputs"
        return None

    def grammar_fields(self) -> list[str]:
        """The fields that ask for a structured output."""
        asked = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.get("type") != "text":
            asked.insert(0, "response_format")
        return asked

    def _shared_refusal(self) -> tuple[str, str] | None:
        """What both routes refuse: several structured outputs at once; prompt_logprobs in a
        stream (vLLM's rule too)."""
        if self.stream and self.prompt_logprobs is not None:
            return "prompt_logprobs is not available with stream: true", "prompt_logprobs"
        asked = self.grammar_fields()
        if len(asked) > 1:
            return f"{' and '.join(asked)}: give one structured output, not several", asked[1]
        return None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Each key a token id: decimal digits (the vocabulary's bound is the engine's check)."""
        if bad := [key for key in value or () if not (key.isascii() and key.isdigit()) or len(key) > 10]:
            raise ValueError(f"keys must be token ids (decimal integers as strings); got {bad[0]!r}")
        return value

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_minus_one_disables(cls, value: Any) -> Any:
        """vLLM spells "no top-k" -1; ours is 0. (``type`` check: ``True == 1``, ``-1.0 == -1``.)"""
        return 0 if type(value) is int and value == -1 else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s or len(s) > 1024 for s in stops):
            raise ValueError("stop strings must be 1 to 1024 characters")
        return stop

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives to report per output token; None: no logprobs (per route)."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives to score per prompt token; None: the prompt is not scored."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine's parameters: every field of the same name as it is (a new sampling
        parameter is copied without a line here), and the ones each route spells its own way."""
        same = {name: getattr(self, name) for name in SamplingParams.model_fields
                if name in type(self).model_fields}
        bias = tuple(sorted((int(token), value) for token, value in (self.logit_bias or {}).items()))
        return SamplingParams(**{**same, "max_tokens": max_tokens, "stop": tuple(self.stop_list),
                                 "logprobs": self.num_logprobs, "logit_bias": bias,
                                 "prompt_logprobs": self.num_prompt_logprobs})


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text, a list of token ids, or a list of exactly one string or one list of "
                    "token ids (what batching clients such as lm-evaluation-harness send).")
    max_tokens: int | None = Field(16, ge=0, description="OpenAI's default for completions is 16; "
                                                         "0, with echo, only scores the prompt.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Each output token's log-probability under the target "
                                       "and this many likeliest alternatives (OpenAI: at most 5; "
                                       "vLLM: 20). Sampled requests: after temperature / top-k / "
                                       "top-p; greedy ones: the model's softmax.")

    echo: bool = Field(False, description="Return the prompt before the completion; with "
                                          "logprobs, the prompt tokens' too (the first one null: "
                                          "log-likelihoods, as evaluation harnesses read them).")

    def refusal(self) -> tuple[str, str] | None:
        """A combination of fields the route refuses: ``(message, param)`` (a model validator
        could not name the param in the 400)."""
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            return ("max_tokens 0 generates nothing; it only makes sense with echo or "
                    "prompt_logprobs"), "max_tokens"
        return self._shared_refusal()

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        if asked:  # (each answer takes its own number of alternatives of the most asked)
            return max(asked)
        return 0 if self.max_tokens == 0 else None  # echo alone: nothing to generate, still a step
    suffix: Annotated[str, WithJsonSchema({"type": "string", "maxLength": 0}), _only(_empty)] = ""

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise ValueError("batched prompts are not supported; send one prompt per request")
        if isinstance(prompt, list) and isinstance(prompt[0], list) and not prompt[0]:
            raise ValueError("prompt must not be empty")
        return prompt


class _ChatTemplate(_Lenient):
    """What a chat request may ask of the model's chat template (vLLM's extensions)."""

    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt ready "
                                                          "for the assistant's reply.")
    continue_final_message: bool = Field(
        False, description="vLLM extension: the reply continues the last message, an assistant's "
                           "(with add_generation_prompt false).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=64, description="vLLM extension: more variables for the chat template "
                                         "(Qwen3's enable_thinking, say).")
    chat_template: Refused = None  # (a template of the client's own)
    documents: Refused = None

    def template_refusal(self, messages: list[ChatMessage] | None) -> tuple[str, str] | None:
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message needs add_generation_prompt false", "continue_final_message"
        if self.continue_final_message and messages and messages[-1].role != "assistant":
            return ("continue_final_message: the last message must be the assistant's",
                    "continue_final_message")
        if reserved := sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KEYS):
            return (f"chat_template_kwargs: {reserved[0]!r} is not a template variable a request "
                    "may set"), "chat_template_kwargs"
        return None

    def template_options(self) -> dict[str, Any]:
        """:func:`~specserve.engine.tokenizer.encode_chat`'s keyword arguments."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": self.chat_template_kwargs or {}}


class ChatCompletionRequest(_Request, _ChatTemplate):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    tools: list[Tool] | None = Field(
        None, max_length=128, description="Functions the model may call (serve/tools.py: the "
                                          "Hermes format in the system message).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools: free text, <tool_call> blocks "
                          "parsed), required (one or more calls, grammar-constrained) or a "
                          "named function (its arguments, grammar-constrained).")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")
    echo: No = False  # (vLLM's chat echo: the reply prepended with the last message)
    logprobs: bool = Field(False, description="Each output token's log-probability under the "
                                              "target (sampled requests: after temperature / "
                                              "top-k / top-p; greedy ones: the model's softmax).")
    top_logprobs: int = Field(0, ge=0, le=20, description="With logprobs: this many likeliest "
                                                          "alternatives per token.")

    def refusal(self) -> tuple[str, str] | None:
        """See :meth:`CompletionRequest.refusal`."""
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs: true", "top_logprobs"
        if refused := self.template_refusal(self.messages):
            return refused
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            return "tools: function names must be unique", "tools"
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            return "tool_choice needs tools", "tool_choice"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return f"tool_choice names {choice.function.name!r}, which is not among the tools", \
                "tool_choice"
        if self.tool_plan() is not None and self.tool_plan().mode != "auto" and self.grammar_fields():
            return ("tool_choice and " + self.grammar_fields()[0] + ": give one structured "
                    "output, not several"), "tool_choice"
        return self._shared_refusal()

    def tool_plan(self) -> ToolPlan | None:
        """What the tools ask of the output (None: no tools in play)."""
        choice = self.tool_choice
        return ToolPlan.of([t.model_dump(exclude_none=True) for t in self.tools or ()],
                           choice.model_dump() if isinstance(choice, NamedToolChoice) else choice)

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        plan = self.tool_plan()
        if plan is not None and plan.mode != "auto":
            return plan.grammar(), "tools"
        return super().grammar()

    @property
    def num_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_ChatTemplate):
    """vLLM's ``/tokenize``: a completion prompt, or chat messages rendered as
    ``/v1/chat/completions`` renders them (with ``tools`` where given), to token ids."""

    model: str | None = Field(None, min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    tools: list[Tool] | None = Field(None, max_length=128)
    add_special_tokens: bool | None = Field(None, description="The tokenizer's BOS and such "
                                            "(default: a prompt yes, messages no).")
    return_token_strs: bool = False

    def refusal(self) -> tuple[str, str] | None:
        if (self.prompt is None) == (self.messages is None):
            return "give either prompt or messages", "prompt"
        if self.tools and self.messages is None:
            return "tools go with messages", "tools"
        return self.template_refusal(self.messages)


class DetokenizeRequest(_Lenient):
    """vLLM's ``/detokenize``: token ids to text (special tokens included)."""

    model: str | None = Field(None, min_length=1, max_length=256)
    tokens: list[TokenId] = Field(max_length=1_000_000)

    def refusal(self) -> tuple[str, str] | None:
        return None


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


class ErrorObject(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body (and an in-band stream error): OpenAI's error object."""

    error: ErrorObject
