"""Structured outputs' grammar layer on the real library (llguidance) and the embedded
SmolLM2 tokenizer: parsing ``response_format``, refusals, masks, walks over drafts and token
trees, rollback, EOS, and masking logits. Engine integration is tested with the engine."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from specserve.engine.grammar import (
    GrammarCompiler,
    GrammarSpec,
    allocate_bitmask,
    apply_mask,
    token_bitmask,
    unpack_bitmask,
)
from specserve.errors import InvalidRequestError

from tests.leaks import leaks

EOS, END_OF_TEXT, IM_START = 2, 0, 1  # SmolLM2's <|im_end|>, <|endoftext|>, <|im_start|>
TOKENIZER_VOCAB = 49152
VOCAB = TOKENIZER_VOCAB + 64  # the model's rows past the tokenizer's: padding, never allowed
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "role", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Ada", "role": "admin", "tags": ["math"], "address": {"city": "London"}}


# -- GrammarSpec (no tokenizer) -----------------------------------------------------------------
def test_response_format_text_json_object_and_json_schema():
    assert GrammarSpec.from_response_format(None) is None
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format({"type": "json_object"}) == GrammarSpec("json_object")
    spec = GrammarSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json_schema" and json.loads(spec.value) == SCHEMA
    # Compact and in the client's key order: the order properties are generated in.
    assert spec.value == json.dumps(SCHEMA, separators=(",", ":"))
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(GrammarSpec.json_schema(SCHEMA))


@pytest.mark.parametrize("response_format, message", [
    ("json", "must be an object"),
    ({"type": "xml"}, "'text', 'json_object' or 'json_schema'"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "schema must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a boolean"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}, "name must be a string"),
])
def test_malformed_response_format_is_refused(response_format, message):
    with pytest.raises(InvalidRequestError, match=message):
        GrammarSpec.from_response_format(response_format)


def test_spec_values_are_checked_and_made_canonical():
    assert GrammarSpec("choice", ["a", "b"]).value == ("a", "b")
    assert GrammarSpec("json_schema", '{"type": "object"}') == GrammarSpec.json_schema({"type": "object"})
    for kind, value in [("xml", None), ("choice", ()), ("choice", ("a", 1)), ("regex", ""),
                        ("json_object", "{}"), ("json_schema", None), ("json_schema", "[1, 2]"),
                        ("json_schema", "{")]:
        with pytest.raises(InvalidRequestError):
            GrammarSpec(kind, value)


# -- apply_mask (no tokenizer) ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_mask_sets_exactly_the_disallowed_columns_padding_included(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab, padded = 100, 130                 # the mask covers 4 words = 128 columns of 130
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, padded, generator=gen).to(dtype)
    allowed = torch.zeros(3, padded, dtype=torch.bool)
    allowed[:, :vocab] = unpack_bitmask(bitmask, vocab)
    bitmask[:, 3] |= -1 << 4                  # bits of columns 100..127: allowed by the mask,
    allowed[:, vocab:128] = True              # so kept; 128 and 129 are past it
    out = apply_mask(logits.clone(), bitmask)
    assert torch.equal(out[allowed], logits[allowed])  # bit for bit
    assert bool((out[~allowed] == float("-inf")).all()) and int((~allowed[:, 128:]).sum()) == 6


def test_the_doctests_hold():
    import doctest

    from specserve.engine import grammar

    assert doctest.testmod(grammar).failed == 0


def test_token_bitmask_and_unpack_agree():
    row = token_bitmask([0, 31, 32, 99], 100)   # bit 31 makes word 0 negative
    assert row.shape == (4,) and row[0] < 0
    assert unpack_bitmask(row[None], 100)[0].nonzero().flatten().tolist() == [0, 31, 32, 99]


# -- with the embedded tokenizer -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from specserve.engine.loader import load_tokenizer, resolve

    return load_tokenizer(resolve("embedded"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS, END_OF_TEXT])


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def mask_now(matcher) -> torch.Tensor:
    """The matcher's mask at its current state, ``[W]``."""
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_mask(bitmask, 0)
    return bitmask[0]


def allowed_ids(mask_row: torch.Tensor) -> set[int]:
    return set(unpack_bitmask(mask_row[None], VOCAB)[0].nonzero().flatten().tolist())


def step_by_step_masks(compiled, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """Masks after prefix + tokens[:j], j = 0..len(tokens), one advance at a time."""
    matcher = compiled.matcher()
    for t in prefix:
        matcher.advance(t)
    rows = [mask_now(matcher)]
    for t in tokens:
        matcher.advance(t)
        rows.append(mask_now(matcher))
    return torch.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("regex", "[a-"), "unclosed character class"),
    (GrammarSpec("regex", "a(?=b)"), "look-around"),
    (GrammarSpec.json_schema({"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (GrammarSpec.json_schema({"properties": {"x": {"$ref": "#/$defs/missing"}}}), "/$defs/missing"),
    (GrammarSpec.json_schema({"type": "strin"}), "Invalid type: strin"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum (5) is greater"),
    (GrammarSpec("grammar", "root ::= ("), "Expected ')'"),
    (GrammarSpec("grammar", "start: nope"), 'unknown name: "nope"'),
])
def test_a_grammar_the_library_refuses_is_an_invalid_request(compiler, spec, message):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    text = str(info.value)
    assert message in text and "\n" not in text and leaks(text) == []


@pytest.mark.slow
def test_compiled_grammars_are_cached_least_recently_used_out(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_size=2)
    a, b, c = GrammarSpec("regex", "a+"), GrammarSpec("regex", "b+"), GrammarSpec("regex", "c+")
    first = small.compile(a)
    assert small.compile(GrammarSpec("regex", "a+")) is first
    first_b = small.compile(b)
    small.compile(a), small.compile(c)    # b was the least recently used: out
    assert small.compile(a) is first and small.compile(b) is not first_b


@pytest.mark.slow
def test_a_schema_document_is_allowed_token_by_token_and_then_only_eos(compiler, tokenizer):
    tokens = encode(tokenizer, json.dumps(DOC))
    matcher = compiler.compile(GrammarSpec.json_schema(SCHEMA)).matcher()
    for t in tokens:
        assert not matcher.is_terminated and not matcher.accepts(EOS)
        matcher.advance(t)
    assert matcher.is_terminated and allowed_ids(mask_now(matcher)) == {EOS, END_OF_TEXT}


@pytest.mark.slow
@pytest.mark.parametrize("doc", [
    {**DOC, "extra": 1},                         # additionalProperties: false
    {**DOC, "role": "root"},                     # not in the enum
    {"name": "Ada", "role": "admin"},            # address is required
    {**DOC, "tags": ["a", "b", "c", "d"]},       # maxItems
    {**DOC, "address": {"city": "Paris", "zip": "75001"}},  # nested additionalProperties
])
def test_a_document_against_the_schema_is_cut_short(compiler, tokenizer, doc):
    tokens = encode(tokenizer, json.dumps(doc))
    _, num_allowed = compiler.compile(GrammarSpec.json_schema(SCHEMA)).matcher().walk(tokens)
    assert num_allowed < len(tokens)


@pytest.mark.slow
def test_json_object_walk_of_a_small_object_is_allowed_and_terminates(compiler, tokenizer):
    tokens = encode(tokenizer, '{"a": 1}')
    matcher = compiler.compile(GrammarSpec("json_object")).matcher()
    masks, num_allowed = matcher.walk([*tokens, EOS])
    assert num_allowed == len(tokens) + 1 and masks.shape == (len(tokens) + 2, (VOCAB + 31) // 32)
    assert allowed_ids(masks[-2]) == {EOS, END_OF_TEXT}      # after the "}": only EOS
    assert allowed_ids(masks[-1]) == {EOS, END_OF_TEXT}      # after EOS: still only EOS
    assert matcher.num_tokens == 0 and not matcher.is_terminated  # walked, then rolled back


@pytest.mark.slow
def test_walk_masks_equal_step_by_step_masks_and_the_state_is_restored(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    tokens = encode(tokenizer, json.dumps(DOC))
    prefix, drafts = tokens[:5], tokens[5:11]
    matcher = compiled.matcher()
    for t in prefix:
        matcher.advance(t)
    before = mask_now(matcher)
    masks, num_allowed = matcher.walk(drafts)
    assert num_allowed == len(drafts)
    assert torch.equal(masks, step_by_step_masks(compiled, prefix, drafts))
    assert matcher.num_tokens == len(prefix) and torch.equal(mask_now(matcher), before)


@pytest.mark.slow
def test_walk_stops_at_the_first_forbidden_token(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    tokens = encode(tokenizer, json.dumps(DOC))
    bad = encode(tokenizer, "}")[0]   # '{"name' then '}': forbidden
    drafts = [tokens[0], tokens[1], bad, *tokens[2:5]]
    masks, num_allowed = compiled.matcher().walk(drafts)
    assert num_allowed == 2 and masks.shape[0] == 3
    assert bad not in allowed_ids(masks[2])
    assert torch.equal(masks, step_by_step_masks(compiled, [], drafts[:2]))


@pytest.mark.slow
def test_the_choice_worked_example_of_walk(compiler, tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("ye", "s", "!")]
    masks, num_allowed = compiler.compile(GrammarSpec("choice", ("yes", "no"))).matcher().walk(ids)
    assert num_allowed == 2
    assert {tokenizer.decode([t]) for t in allowed_ids(masks[0])} == {"y", "ye", "yes", "n", "no"}
    assert allowed_ids(masks[1]) == {ids[1]} and allowed_ids(masks[2]) == {EOS, END_OF_TEXT}


@pytest.mark.slow
def test_walk_tree_agrees_with_walking_each_root_to_node_path(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    t = encode(tokenizer, json.dumps(DOC))
    bad = encode(tokenizer, "}")[0]
    # root ─ t0 ─ t1 ─ t2 ─ t3          a chain of the document
    #      │    └ bad ─ t2              a forbidden node, and its child (not allowed either)
    #      │    └ t1 ─ bad              a duplicate branch ending in a forbidden leaf
    #      └ bad                        a forbidden child of the root
    tokens = [t[0], t[1], bad, t[1], bad, t[2], t[2], bad, t[3]]
    parents = [-1, 0, 0, 0, -1, 1, 2, 3, 5]
    matcher = compiled.matcher()
    masks, allowed = matcher.walk_tree(tokens, parents)
    assert allowed == [True, True, False, True, False, True, False, False, True]
    assert torch.equal(masks[0], mask_now(matcher)) and matcher.num_tokens == 0
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        path_masks, num_allowed = compiled.matcher().walk(path)
        assert (num_allowed == len(path)) == allowed[i]
        expected = path_masks[-1] if allowed[i] else torch.zeros_like(masks[i + 1])
        assert torch.equal(masks[i + 1], expected)


@pytest.mark.slow
def test_walk_tree_on_a_chain_is_walk(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec("json_object"))
    chain = encode(tokenizer, '{"k": [1, 2]}')
    masks, allowed = compiled.matcher().walk_tree(chain, list(range(-1, len(chain) - 1)))
    assert all(allowed) and torch.equal(masks, compiled.matcher().walk(chain)[0])


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3, 8])
def test_rollback_after_n_tokens_restores_the_mask(compiler, tokenizer, n):
    matcher = compiler.compile(GrammarSpec.json_schema(SCHEMA)).matcher()
    tokens = encode(tokenizer, json.dumps(DOC))
    matcher.advance(tokens[0])
    before = mask_now(matcher)
    for t in tokens[1:1 + n]:
        matcher.advance(t)
    assert not torch.equal(mask_now(matcher), before)
    matcher.rollback(n)
    assert torch.equal(mask_now(matcher), before) and matcher.num_tokens == 1
    with pytest.raises(ValueError):
        matcher.rollback(2)


@pytest.mark.slow
def test_eos_is_allowed_only_where_the_text_may_end(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec("regex", "[0-9]+")).matcher()
    one = encode(tokenizer, "1")[0]
    assert not {EOS, END_OF_TEXT} & allowed_ids(mask_now(matcher)) and not matcher.accepts(EOS)
    with pytest.raises(ValueError):
        matcher.advance(EOS)
    matcher.advance(one)                            # "1": may end, or go on
    after_one = mask_now(matcher)
    assert {EOS, END_OF_TEXT, one} <= allowed_ids(after_one) and not matcher.is_terminated
    matcher.advance(END_OF_TEXT)
    assert matcher.is_terminated and allowed_ids(mask_now(matcher)) == {EOS, END_OF_TEXT}
    assert not matcher.accepts(one)
    matcher.rollback(1)                             # undoes the EOS, nothing more
    assert torch.equal(mask_now(matcher), after_one) and matcher.num_tokens == 1


@pytest.mark.slow
def test_padding_special_tokens_and_free_whitespace_are_never_allowed(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec("json_object"))
    matcher = compiled.matcher()
    for t in encode(tokenizer, '{"a": "'):           # inside a string: nearly everything goes
        matcher.advance(t)
    in_string = allowed_ids(mask_now(matcher))
    assert len(in_string) > 40_000
    assert not in_string & ({IM_START, EOS, END_OF_TEXT} | set(range(TOKENIZER_VOCAB, VOCAB)))
    matcher = compiled.matcher()
    matcher.advance(encode(tokenizer, "{")[0])       # after "{": a key's quote or "}", no whitespace
    after_brace = allowed_ids(mask_now(matcher))
    assert encode(tokenizer, '"')[0] in after_brace
    for ws in (" ", "\n", "\n\n", "  ", "\t"):
        assert encode(tokenizer, ws)[0] not in after_brace


@pytest.mark.slow
def test_accepts_agrees_with_the_mask(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.json_schema(SCHEMA)).matcher()
    for t in encode(tokenizer, '{"name": "Ada", "role": "'):
        matcher.advance(t)
    allowed = allowed_ids(mask_now(matcher))
    sample = sorted(allowed) + list(range(0, VOCAB, 97))
    assert all(matcher.accepts(t) == (t in allowed) for t in sample)
