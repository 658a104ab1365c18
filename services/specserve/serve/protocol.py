"""OpenAI-compatible request models (and our ``speculation`` extension).

Known fields are validated strictly (a string where a number belongs is a 400, not a
coercion); unknown fields are ignored, as OpenAI's own API and vLLM do, so clients that send
newer fields keep working. Features we do not implement (``n > 1``, logprobs, tools,
penalties) are refused with a clear message rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specserve.config import SamplingParams


class SpeculationOptions(BaseModel):
    """Per-request control of speculation (our extension; absent = the router decides)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool | None = Field(None, description="Force speculation on or off for this request.")
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="K for this request.")
    method: Literal["ngram", "draft_model", "eagle"] | None = Field(
        None, description="Proposer; must be the one the deployment runs.")
    traffic_class: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Prompt class for the router's acceptance tracking (with the route and the "
                    "tenant, OpenAI's `user`), e.g. 'summarize' or 'code'.")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000, description="vLLM extension; 0 disables.")
    n: int = Field(1, ge=1, le=1, description="Only n = 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported; must be 0.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported; must be 0.")
    logprobs: None = Field(None, description="Not supported.")
    speculation: SpeculationOptions | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = self.stop_list
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s or len(s) > 1024 for s in stops):
            raise ValueError("stop strings must be 1 to 1024 characters")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=tuple(self.stop_list),
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(
        description="Text, a list of token ids, or a list of exactly one string.")
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default for completions is 16.")
    echo: bool = Field(False, description="Not supported; must be false.")
    suffix: None = None

    @model_validator(mode="after")
    def _check_prompt(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(self.prompt[0], str) and len(self.prompt) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
        elif not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")
    tools: None = Field(None, description="Not supported.")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
