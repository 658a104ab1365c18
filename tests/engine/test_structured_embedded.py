"""Structured outputs on the embedded SmolLM2-135M-Instruct (issue 22's acceptance check): 50
held-out prompts in JSON mode and 50 with a JSON schema, greedy, with speculation off, with
prompt lookup (ngram) and with the shipped EAGLE head. Speculation's outputs are identical to
speculation off's token for token; every output that completed parses (JSON mode) and
validates (schema).

Issue 35: speculation off runs all 50 prompts of each kind (the parse and validate checks read
them); prompt lookup runs the even-numbered prompts and EAGLE the odd-numbered ones, in both
kinds, so every prompt is checked under speculation once, every proposer with both grammars,
in half the decoding (this module was 165 s of the suite on one core).

The prompts were written once, before any output was seen, and are not tuned to the model:
in JSON mode (any object) one or two of them (the CPU's rounding decides) send the 135M model
into a greedy repetition loop (``{"Lagos,": 2018, "Lagos,": 2018, ...``) that runs to
``max_tokens``; its output is then a valid prefix of a JSON object, as OpenAI documents for
JSON mode cut by ``max_tokens``. The
schema, whose strings and numbers are bounded, completes for all 50."""

from __future__ import annotations

import json

import jsonschema
import pytest
from specserve.config import EngineConfig, SamplingParams
from specserve.engine.builder import build_engine
from specserve.engine.grammar import GrammarCompiler, GrammarSpec
from specserve.engine.tokenizer import encode_chat

pytestmark = pytest.mark.slow

NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo"]
PROMPTS = [f"Describe a person named {n} who lives in {c} as JSON with keys name, city and age."
           for n in NAMES for c in CITIES]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "city": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "city", "age"], "additionalProperties": False}
# Completions take 22-50 tokens (measured); 96 leaves room for another CPU's rounding and
# cuts the looping prompt off early instead of after 256 tokens of a lone row (issue 35).
GREEDY = SamplingParams(temperature=0, max_tokens=96)
SPECULATION = {"off": {"method": None}, "ngram": {"method": "ngram"},
               "eagle": {"method": "eagle", "draft": {"source": "embedded-eagle"}}}
SHARE = {"off": slice(None), "ngram": slice(0, None, 2), "eagle": slice(1, None, 2)}


@pytest.fixture(scope="module")
def outputs():
    """Per speculation setting and grammar, the completions of its share of the prompts.

    A slot per prompt, so each grammar's prompts decode as one batch: a step reads the
    weights once for all of them, not once per 16, and the kernels are row-invariant, so a
    row's tokens do not depend on its batch. The chat prompts are about 50 tokens: 512
    positions hold any of them and its new tokens."""
    done = {}
    for name, speculative in SPECULATION.items():
        cfg = EngineConfig.model_validate({"target": {"source": "embedded"},
                                           "max_num_seqs": len(PROMPTS[SHARE[name]]),
                                           "max_model_len": 512,
                                           "speculative": speculative})
        engine, loaded = build_engine(cfg)
        compiler = GrammarCompiler(loaded.tokenizer, engine.target.vocab_size, loaded.eos_token_ids)
        prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}])
                   for p in PROMPTS[SHARE[name]]]
        for kind, spec in (("json_object", GrammarSpec("json_object")),
                           ("json_schema", GrammarSpec.json_schema(SCHEMA))):
            done[name, kind] = engine.generate(prompts, GREEDY, grammar=compiler.compile(spec))
        if name != "off":
            done[name, "accepted"] = engine.counters.spec.num_accepted_tokens
        del engine, loaded  # one engine's caches at a time
    return done


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_structured_output_with_speculation_is_target_onlys(outputs, method, kind):
    off, on = outputs["off", kind][SHARE[method]], outputs[method, kind]
    assert len(on) == 25
    assert [c.output_token_ids for c in on] == [c.output_token_ids for c in off]
    assert outputs[method, "accepted"] > 0


def test_json_mode_output_parses(outputs):
    """Every output that completed parses as an object; every other ran to ``max_tokens``
    inside one. How many prompts loop depends on the CPU's rounding, not on the grammar: one
    on the AVX2 machines, two on an AVX512-VNNI Xeon (2026-12-02), so the floor is loose."""
    done = outputs["off", "json_object"]
    complete = [c for c in done if c.finish_reason == "stop"]
    for c in complete:
        assert isinstance(json.loads(c.text), dict)
    cut = [c for c in done if c.finish_reason != "stop"]
    assert all(c.finish_reason == "length" and c.text.lstrip().startswith("{") for c in cut), cut
    assert len(complete) >= 45, [c.text[:80] for c in cut]


def test_json_schema_output_validates(outputs):
    done = outputs["off", "json_schema"]
    assert all(c.finish_reason == "stop" for c in done)
    for c in done:
        jsonschema.validate(json.loads(c.text), SCHEMA)
