"""A chat request's messages and tools, as the API takes them (the request models are in
:mod:`~specserve.serve.protocol`), and what a request may ask of the chat template."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# apply_chat_template's own arguments, and the template's messages: not template variables a
# client may set (``chat_template_kwargs``): ``chat_template`` there would swap the template
RESERVED_TEMPLATE_KEYS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class _Strict(BaseModel):
    """Strict types; fields a newer client adds are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1_000_000)


class ToolCall(_Strict):
    """A call in an assistant message of the history (what a reply's ``tool_calls`` held)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls "
                             "may omit it)")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments object (absent: no arguments).")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction
