"""Structured outputs and tools over the OpenAI API (issue 22), over real HTTP against the
session's n-gram and draft-model apps (tiny random models: the grammar, not the model, makes
their output well-formed), with the official ``openai`` client's ``parse`` and LangChain's
``ChatOpenAI`` (``with_structured_output``, ``bind_tools``) as real clients."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.models import perturbed, tiny_hf_model
from tests.serve.conftest import deployed_one, save_tiny, unit_args
from tests.serve.test_api_compat import MESSAGES, post

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "emu"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}},
    "required": ["kind", "age", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return Path(tiny_models[0]).name


@pytest.fixture(scope="module")
def tools_app(ray_cluster, tmp_path_factory, model):
    """A tiny target with 1024 positions, speculating with its own close draft: the tools'
    system message is about 400 tiny-tokenizer tokens, past the session apps' 256."""
    target = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0, max_position_embeddings=1024)
    target_dir = save_tiny(tmp_path_factory.mktemp("model"), target)
    draft_dir = save_tiny(tmp_path_factory.mktemp("tools-draft"), perturbed(target, scale=0.3))
    args = unit_args(target_dir, max_model_len=1024, speculative={
        "method": "draft_model", "num_speculative_tokens": 3, "draft": {"source": draft_dir}})
    args["served_model_name"] = model  # the session apps' name, so the tests read alike
    yield from deployed_one("tools", args)


def _chat(url: str, model: str, **extra) -> dict:
    r = post(url, {"model": model, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("app", ["ngram_app", "draft_app"])
@pytest.mark.parametrize("response_format", [
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA,
                                                                     "strict": True}}],
    ids=["json_object", "json_schema"])
def test_structured_output_with_speculation_equals_target_only(request, model, app, response_format):
    url = request.getfixturevalue(app)
    on = _chat(url, model, response_format=response_format, speculation={"enabled": True})
    off = _chat(url, model, response_format=response_format, speculation={"enabled": False})
    assert on["usage"]["speculation"]["enabled"] and not off["usage"]["speculation"]["enabled"]
    assert _content(on) == _content(off)
    if response_format["type"] == "json_schema":  # bounded: it completes
        assert on["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(_content(on)), SCHEMA)
    elif on["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(_content(on)), dict)
    else:
        assert _content(on).startswith("{")


def test_structured_output_streams_the_same_text(ngram_app, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    whole = _content(_chat(ngram_app, model, response_format=body["response_format"]))
    text = ""
    with httpx.stream("POST", ngram_app + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert text == whole


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": "[a-m]{3,8}"}, lambda t: 3 <= len(t) <= 8 and set(t) <= set("abcdefghijklm")),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= ("yes" | "no") "."'}, lambda t: t in ("yes.", "no.")),
    ({"structured_outputs": {"grammar": 'start: "a" /[b-d]+/ "!"'}},
     lambda t: re.fullmatch("a[b-d]+!", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
], ids=["regex", "choice", "guided_json", "guided_grammar", "so-grammar", "so-choice", "so-json"])
def test_vllm_guided_fields(ngram_app, model, extra, check):
    body = _chat(ngram_app, model, **extra)
    assert body["choices"][0]["finish_reason"] == "stop" and check(_content(body))


@pytest.mark.parametrize("extra, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/nothing"}}}}, "response_format", "nothing"),
    ({"guided_regex": "(?=a)b"}, "guided_regex", "grammar cannot be used"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar cannot be used"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "xtra"),
    ({"guided_grammar": 'start: "a"', "guided_regex": "a"}, "guided_grammar", "one structured"),
    ({"response_format": {"type": "xml"}}, "response_format", "'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "one structured"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "one structured"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}],
      "tool_choice": "required"}, "tools", "format"),
], ids=["unsupported-keyword", "dangling-ref", "lookaround", "bad-gbnf", "so-two", "so-unknown-key",
        "grammar-and-regex", "bad-type", "no-schema", "two",
        "choice-without-tools", "unknown-function", "duplicate-tools", "tools-and-regex", "tool-schema"])
def test_a_grammar_that_cannot_be_used_is_a_400_naming_it(tools_app, model, extra, param, needle):
    r = post(tools_app, {"model": model, "messages": MESSAGES, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


# -- real clients --------------------------------------------------------------------------------
class Pet(BaseModel):
    kind: Literal["cat", "dog", "emu"]
    age: int = Field(ge=0, le=99)
    ok: bool


def test_openai_client_parse(ngram_app, model):
    client = OpenAI(base_url=ngram_app + "/v1", api_key="none", max_retries=0)
    out = client.beta.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet,
                                             max_tokens=60, temperature=0)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and out.choices[0].finish_reason == "stop"


def _langchain(url: str, model: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=url + "/v1", api_key="none", max_retries=0,
                      temperature=0, max_tokens=60, timeout=120)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(tools_app, model, method):
    llm = _langchain(tools_app, model).with_structured_output(Pet, method=method)
    pet = llm.invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_langchain_bind_tools_gets_a_call(tools_app, model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Lima", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = _langchain(tools_app, model).bind_tools([get_weather], tool_choice="get_weather")
    message = llm.invoke("What is the weather in Lima?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Lima", "Oslo")
    again = _langchain(tools_app, model).bind_tools([get_weather], tool_choice="any").invoke(
        "What is the weather in Lima?")
    assert again.tool_calls and all(c["name"] == "get_weather" for c in again.tool_calls)


# -- tools over the raw API ------------------------------------------------------------------------
def test_required_tool_choice_returns_calls_that_follow_the_schemas(tools_app, model):
    body = _chat(tools_app, model, tools=[WEATHER, TIME], tool_choice="required")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(args, schema)


def test_named_tool_choice_streams_one_call_and_the_history_renders(tools_app, model):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = _chat(tools_app, model, tools=[WEATHER, TIME], tool_choice=named)
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME["function"]["parameters"])
    deltas = []
    with httpx.stream("POST", tools_app + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
            "tools": [WEATHER, TIME], "tool_choice": named, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas += json.loads(line[6:])["choices"]
    [streamed] = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    assert streamed["function"] == call["function"] and deltas[-1]["finish_reason"] == "tool_calls"
    # the call and its result as history: the next turn is served
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
    r = post(tools_app, {"model": model, "messages": history, "max_tokens": 8, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text


def test_auto_tool_choice_parses_tool_call_blocks():
    """``auto`` is free text: ``<tool_call>`` blocks naming a declared function become calls
    (the tiny models never write one, so the parser is checked on its own)."""
    from specserve.serve.tools import ToolPlan

    plan = ToolPlan.of([WEATHER, TIME], "auto")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "C"}}\n</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    content, calls = plan.parse(text)
    assert content.startswith("Let me check.") and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert plan.parse("no calls here") == ("no calls here", [])
