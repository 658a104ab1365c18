"""Tools (OpenAI function calling) for models whose chat template knows none: the tools go
into the system message in the Hermes format (the one Qwen2.5 and NousResearch's models are
trained on), the model answers with ``<tool_call>`` blocks, and the reply's text is parsed
back into OpenAI ``tool_calls``.

``tool_choice`` decides how much the output is constrained, on the structured-output
machinery (:mod:`~specserve.engine.grammar`), as vLLM does:

- ``none`` (or no tools): the tools are not shown; plain text.
- ``auto`` (the default with tools): free text; ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks in it become tool calls (text outside them the content).
- ``required``: the output is a JSON array of one or more ``{"name", "arguments"}`` objects,
  each a declared function with arguments that follow its parameters' schema.
- a named function: the output is that function's arguments, a JSON object following its
  parameters' schema.

The grammar makes ``required`` and named calls well-formed by construction; only a reply cut
by ``max_tokens`` can fail to parse, and it is then returned as text (``finish_reason``
``length``). Assistant messages with ``tool_calls`` and ``tool`` results in the history are
rendered in the same format, so multi-turn tool use reads the way the model is prompted.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.engine.grammar import GrammarSpec

TOOL_PROMPT = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the output: ``mode`` (``auto``, ``required`` or
    ``named``), the functions (name -> parameters schema) and, for ``named``, which one."""

    mode: str
    functions: dict[str, dict]
    name: str | None = None

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: str | dict | None) -> ToolPlan | None:
        """The plan of a request's ``tools`` and ``tool_choice`` (validated by the protocol
        models: names exist, are unique); None: no tools in play."""
        if not tools or tool_choice == "none":
            return None
        functions = {t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS
                     for t in tools}
        if isinstance(tool_choice, dict):
            return cls("named", functions, tool_choice["function"]["name"])
        return cls(tool_choice or "auto", functions)

    def grammar(self) -> GrammarSpec | None:
        """The output's grammar: None for ``auto`` (free text)."""
        if self.mode == "named":
            return GrammarSpec.json_schema(self.functions[self.name])
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, params in self.functions.items()]
            return GrammarSpec.json_schema({"type": "array", "minItems": 1,
                                            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})
        return None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A reply's ``(content, tool_calls)`` in OpenAI's shape; no calls: ``(text, [])``."""
        try:
            if self.mode == "named":
                return None, [_call(self.name, json.loads(text))]
            if self.mode == "required":
                return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []  # cut short by max_tokens: what there is, as text
        calls = []
        for block in _CALL.findall(text):
            try:
                call = json.loads(block)
            except ValueError:
                continue
            if isinstance(call, dict) and call.get("name") in self.functions:
                calls.append(_call(call["name"], call.get("arguments", {})))
        if not calls:
            return text, []
        rest = _CALL.sub("", text).strip()
        return rest or None, calls


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def render_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Chat messages as a template without tool support reads them: ``{role, content}``
    with string content. With ``tools``, their signatures join the system message (one is
    added first if there is none); an assistant's ``tool_calls`` become ``<tool_call>``
    blocks after its text, a tool's result a ``<tool_response>`` block."""
    out = []
    for m in messages:
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": _arguments(c["function"]["arguments"])},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            content = "\n".join([*([_text(content)] if content else []),
                                 *(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)])
        elif m["role"] == "tool" and tools:
            content = f"<tool_response>\n{_text(content)}\n</tool_response>"
        out.append({"role": m["role"], "content": content if content is not None else ""})
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{_text(out[0]['content'])}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _text(content: Any) -> str:
    """A message's content as text (a list of text parts joined, as the tokenizer does)."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _arguments(arguments: str) -> Any:
    """A history call's arguments: OpenAI sends a JSON string; shown as the object it holds
    (as text if it holds none)."""
    try:
        return json.loads(arguments)
    except (ValueError, TypeError):
        return arguments
