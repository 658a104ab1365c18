"""Structured outputs: the grammar a request's text must follow, as masks over the vocabulary.

A request may constrain its output (OpenAI ``response_format``: ``json_object`` or
``json_schema``; vLLM-style ``regex``, ``choice`` and ``grammar``: Lark or llama.cpp's GBNF).
The constraint is a **grammar**; at each position the grammar's **mask** is the set of
tokens that keep the text a prefix of a sentence of the grammar, packed as bits
(``[n, ceil(V / 32)]`` int32, token t at bit ``t % 32`` of word ``t // 32``: xgrammar's and
llguidance's layout). Sampling then sets the logits of every
disallowed token to -inf (:func:`apply_mask`) before anything else sees them, so greedy,
sampled and speculative decoding all draw from the *masked* target distribution.

The parts, from request to step:

- :class:`GrammarSpec`: what the request asked for, as plain picklable data (it crosses the
  API / unit hop). :meth:`GrammarSpec.from_response_format` parses OpenAI's field.
- :class:`GrammarCompiler`: one per server, over the model's tokenizer; turns a spec into a
  :class:`CompiledGrammar` (small LRU cache: a client sends the same schema again and again).
  A schema or regex the library cannot enforce is an :class:`~specserve.errors.InvalidRequestError`
  naming the problem (an unsupported keyword, a ``$ref`` to nothing, an invalid regex): never a
  silently weaker constraint.
- :class:`Matcher`: one per sequence, the grammar's state after the tokens emitted so far:
  :meth:`~Matcher.fill_mask`, :meth:`~Matcher.accepts`, :meth:`~Matcher.advance`,
  :meth:`~Matcher.rollback`.

**Speculative decoding.** The verify forward scores K drafts at once, and position j's logits
must be masked with the grammar's state *after drafts[:j]*. :meth:`Matcher.walk` walks the
drafts forward, filling one mask per position, stops at the first draft the grammar forbids
(the masked target gives it probability 0, so the verifier rejects it and no later position
is reached) and rolls back: the matcher only ever advances by the tokens a step emits.
:meth:`Matcher.walk_tree` does the same over a token tree, in the row layout of
:mod:`~specserve.engine.runtime.token_tree` (row 0 at the root, row i + 1 after node i).

**The library: llguidance** (docs/STRUCTURED.md has the measurements and the comparison with
xgrammar and outlines-core). It has no dependencies, refuses JSON-schema keywords it cannot
enforce, computes masks lazily under fuel limits (:data:`LIMITS`: a hostile schema or regex
fails with an error instead of hanging a step), and rolls back any number of tokens.

**Whitespace.** A JSON grammar that permits arbitrary whitespace lets a small model greedily
emit newlines forever. JSON is generated in ``json.dumps``'s default layout instead
(:data:`JSON_OPTIONS`: llguidance's ``whitespace_flexible=False`` with the separators ``", "``
and ``": "``): no whitespace outside strings but one space after ``,`` and ``:``. Object keys
come in the schema's order (llguidance enforces ``properties`` order).

**EOS.** Once the grammar is complete, only the model's EOS tokens are allowed; while the text
could either end or go on (a number, a regex ``[0-9]+``), EOS is allowed beside the tokens
that continue it. EOS is handled here rather than by the library: llguidance ignores an EOS
consumed after its grammar is complete (a rollback would then undo one token too many) and
knows only one EOS when validating; here an EOS is a step like any other, and after it the
mask allows only EOS again.

**Vocabulary.** The model's vocabulary may be larger than the tokenizer's (padding rows for
an aligned embedding). Those ids, and the tokenizer's special tokens, are never allowed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

try:  # a hard dependency of the package, but the engine must import without it: a GPU
    # machine without the wheel still runs everything that has no grammar (docs/GPU.md)
    from llguidance import LLMatcher, LLParserLimits, grammar_from
except ImportError:  # pragma: no cover - exercised where llguidance is not installed
    LLMatcher = LLParserLimits = grammar_from = None

from specserve.errors import ConfigError, InvalidRequestError

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# llguidance's JSON compile options (overriding any ``x-guidance`` in a client's schema): the
# whitespace policy above, and every valid JSON string escape (by default ``\uXXXX`` is
# allowed only for control characters, and ``json.dumps`` writes ``\u00e9``).
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "json_allow_general_unicode_escapes": True,
}

# llguidance's resource limits, pinned at its documented defaults so an upgrade cannot move
# them. Past one of them a grammar fails (at compile, or at the step) with an error; it never
# runs unbounded. The speeds are llguidance's own estimates.
LIMITS = {
    "max_grammar_size": 500_000,     # symbols in the grammar's productions
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes: ~20 ms of work
    "step_lexer_fuel": 200_000,      # one mask's lexer work: ~14 ms
    "step_max_items": 50_000,        # one mask's Earley items: ~2.5 ms
    "max_lexer_states": 250_000,     # lexer states, ~1-2 kB each
    "verbose_errors": False,         # an error message goes to the client: no parser dump
}

# The grammar of ``json_object``: any JSON object (OpenAI's JSON mode).
ANY_OBJECT = {"type": "object"}
ERROR_CHARS = 500  # at most this much of a library's error message goes to the client


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match, as plain data (hashable: the compiler's cache key).

    ``kind``: one of :data:`KINDS`. ``value``: ``json_object``: None; ``json_schema``: the
    schema as JSON text, made canonical here (compact; key order kept, since it is the order
    object properties are generated in); ``regex``: the pattern (Rust ``regex`` syntax, matched
    in full: no look-around, no backreferences); ``choice``: a tuple of the allowed strings (a
    list is turned into one); ``grammar``: a context-free grammar, in Lark's syntax (llguidance's
    dialect: ``start: ...``) or in llama.cpp's GBNF (``root ::= ...``), as vLLM takes both.
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "choice" and isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))
        _check_value(self.kind, self.value)
        if self.kind == "json_schema":
            object.__setattr__(self, "value", _canonical_schema(self.value))

    @classmethod
    def json_schema(cls, schema: Mapping) -> GrammarSpec:
        """The spec of a JSON schema given as a dict."""
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def from_response_format(cls, response_format: Mapping | None) -> GrammarSpec | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (or None) is no grammar;
        ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}, "strict": true}}``.

        ``strict`` is accepted either way and changes nothing: the output always follows the
        schema exactly as written (a schema without ``"additionalProperties": false`` allows
        other properties, as JSON Schema says).
        """
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise InvalidRequestError("response_format must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            return cls.json_schema(_schema_of(response_format.get("json_schema")))
        raise InvalidRequestError("response_format.type must be 'text', 'json_object' or "
                                  f"'json_schema'; got {kind!r}")


def _check_value(kind: str, value) -> None:
    """Refuse a value that does not fit its kind (the API builds specs from client input)."""
    if kind == "json_object" and value is not None:
        raise InvalidRequestError("a json_object grammar takes no value")
    if kind in ("json_schema", "regex", "grammar") and not (isinstance(value, str) and value):
        raise InvalidRequestError(f"a {kind} grammar needs a non-empty string")
    if kind == "choice" and not (isinstance(value, tuple) and value
                                 and all(isinstance(c, str) for c in value)):
        raise InvalidRequestError("a choice grammar needs a non-empty list of strings")


def _canonical_schema(text: str) -> str:
    """A JSON schema's text in one form (the same schema is one cache entry), checked to be
    a JSON object."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be a JSON object")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _schema_of(json_schema) -> dict:
    """The schema inside ``response_format.json_schema``, checked for shape."""
    if not isinstance(json_schema, Mapping):
        raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'")
    name, strict = json_schema.get("name"), json_schema.get("strict")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError("response_format.json_schema.name must be a string")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean")
    schema = json_schema.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object")
    return dict(schema)


# -- masks (pure functions) --------------------------------------------------------------------
def num_words(vocab_size: int) -> int:
    """Int32 words of one mask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_bitmask(n: int, vocab_size: int) -> torch.Tensor:
    """``[n, ceil(vocab_size / 32)]`` int32 on the CPU (where masks are filled), all allowed."""
    return torch.full((n, num_words(vocab_size)), -1, dtype=torch.int32)


def token_bitmask(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """One ``[ceil(V / 32)]`` int32 row that allows exactly ``token_ids``."""
    words = np.zeros(num_words(vocab_size), dtype=np.uint32)
    for t in token_ids:
        assert 0 <= t < vocab_size
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return torch.from_numpy(words.view(np.int32))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, vocab_size]`` bool, True where allowed (columns past the mask's are not).

    >>> unpack_bitmask(token_bitmask([0, 33], 40)[None], 40).nonzero()[:, 1].tolist()
    [0, 33]
    """
    assert bitmask.ndim == 2 and bitmask.dtype == torch.int32
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).flatten(1).bool()  # [n, 32 W]
    out = torch.zeros(bitmask.shape[0], vocab_size, dtype=torch.bool, device=bitmask.device)
    width = min(vocab_size, bits.shape[1])
    out[:, :width] = bits[:, :width]
    return out


# Float dtypes, the integer dtypes of their width (to edit a float's bits in place), and -inf's
# bits as that integer.
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16,
                   torch.float16: torch.int16, torch.float64: torch.int64}
_NEG_INF_BITS = {f: torch.tensor(float("-inf"), dtype=f).view(i).item() for f, i in _SAME_WIDTH_INT.items()}


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place, on the logits' device.

    logits: ``[n, V]`` float (V may exceed ``32 * W``: the columns past the mask, padding
    rows of the vocabulary, are disallowed); bitmask: ``[n, W]`` int32, on any device (it is
    copied to the logits'). Returns ``logits``.

    Works on the floats' bits: AND with all-ones words where allowed and all-zeros where not,
    then OR in -inf's bit pattern where not. Exact (an allowed logit keeps its bits), and
    branch-free, so its time does not depend on the mask: faster than unpacking to booleans
    and ``masked_fill_`` (whose loop branches per element), and than llguidance's own kernel,
    a ``torch.compile`` function that also compiles in every process (figures:
    docs/BENCHMARKS.md, "Structured outputs").
    """
    assert logits.ndim == 2 and bitmask.ndim == 2 and logits.shape[0] == bitmask.shape[0]
    assert bitmask.dtype == torch.int32 and logits.dtype in _SAME_WIDTH_INT
    int_dtype = _SAME_WIDTH_INT[logits.dtype]
    width = min(logits.shape[1], 32 * bitmask.shape[1])
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    keep = -((words[:, :, None] >> shifts) & 1)                 # [n, W, 32]: -1 allowed, 0 not
    keep = keep.flatten(1)[:, :width].to(int_dtype)              # [n, width]
    bits = logits.view(int_dtype)[:, :width]                     # the same memory as logits
    bits.bitwise_and_(keep).bitwise_or_(~keep & _NEG_INF_BITS[logits.dtype])
    logits[:, width:] = float("-inf")
    return logits


def masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` (``[n, V]``) with the tokens ``mask`` (``[n, W]`` packed int32)
    disallows at -inf, on the logits' device."""
    assert logits.ndim == 2 and mask.shape[0] == logits.shape[0], "one mask row per logits row"
    return apply_mask(logits.clone(), mask)


# -- compiling ---------------------------------------------------------------------------------
class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one model; built once per server.

    ``tokenizer``: a ``transformers`` fast tokenizer; ``vocab_size``: the model's (at least the
    tokenizer's length; the ids past it are never allowed); ``eos_token_ids``: every id that
    ends generation (:func:`~specserve.engine.loader.eos_token_ids`). The first compile reads
    the whole vocabulary (about 0.3 s for 49152 tokens), so a server that never sees a
    structured request never pays it. Thread-safe.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], *,
                 cache_size: int = 64) -> None:
        if LLMatcher is None:
            raise ConfigError("structured outputs need the llguidance package (pip install llguidance)")
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ConfigError("structured outputs need the model's EOS token ids")
        if vocab_size < len(tokenizer):
            raise ConfigError(f"the model's vocabulary ({vocab_size}) is smaller than its "
                              f"tokenizer's ({len(tokenizer)})")
        self._hf_tokenizer = tokenizer
        self._library_tokenizer = None  # llguidance's, built at the first compile
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self._eos_row = token_bitmask(eos, vocab_size)
        self._limits = LLParserLimits(**LIMITS)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _tokenizer(self):
        """llguidance's view of the vocabulary (built once; call under the lock)."""
        if self._library_tokenizer is None:
            import llguidance.hf  # imports transformers (where a tokenizer exists, it is loaded)

            try:
                self._library_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_token_ids))
            except ValueError as exc:  # a slow (Python) tokenizer
                raise ConfigError(f"structured outputs need a fast tokenizer: {exc}") from exc
        return self._library_tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached, least recently used out first).
        Raises :class:`~specserve.errors.InvalidRequestError` naming what the library refused."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            tokenizer = self._tokenizer()
        compiled = self._compile(spec, tokenizer)  # outside the lock: milliseconds; a duplicate is harmless
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec, tokenizer) -> CompiledGrammar:
        """Build the matcher every sequence of this grammar starts from, and its first mask
        (which builds the lexer: errors and the cost show up here, not in a decode step)."""
        prototype = LLMatcher(tokenizer, _grammar_text(spec), log_level=0,
                               limits=self._limits)
        if not prototype.is_error():
            _fill(prototype, allocate_bitmask(1, self.vocab_size)[0])
        if prototype.is_error():
            kind = "" if spec.kind == "grammar" else f"{spec.kind} "
            raise InvalidRequestError(f"the {kind}grammar cannot be used: "
                                      f"{_one_line(prototype.get_error())}")
        return CompiledGrammar(spec, prototype, self.vocab_size, self.eos_token_ids, self._eos_row)


def structured_outputs(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> GrammarCompiler | None:
    """A model's grammar compiler, or None where structured outputs cannot run here (no
    tokenizer, no EOS, no llguidance, a slow tokenizer: said in one log line; such requests
    are then refused)."""
    if tokenizer is None or not eos_token_ids:
        return None
    try:
        return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    except ConfigError as exc:
        log.warning("structured outputs are off: %s", exc)
        return None


def _grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec (its compile errors surface in the matcher)."""
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_OPTIONS)
    if spec.kind == "json_schema":  # a JSON object: GrammarSpec checked
        return LLMatcher.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "grammar":  # GBNF becomes Lark; Lark stays as it is
        try:
            return grammar_from("grammar", spec.value)
        except ValueError as exc:  # (Lark's errors surface in the matcher, as the others')
            raise InvalidRequestError(f"the grammar cannot be used: {_one_line(str(exc))}") from None
    # A Lark rule of string literals; JSON's string escapes are Lark's.
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))


def _fill(ll, row: torch.Tensor) -> None:
    """llguidance's mask of ``ll``'s state into ``row`` (``[W]`` int32, CPU, contiguous).
    ``llguidance.torch.fill_next_token_bitmask`` does the same, but importing that module
    loads torch's compiler stack for its ``torch.compile`` kernel (2 s here)."""
    assert row.dtype == torch.int32 and row.device.type == "cpu" and row.is_contiguous()
    ll.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _one_line(message: str) -> str:
    """A library message for a client: one line, without llguidance's ``<non-verbose/>`` tag."""
    return " ".join(message.replace("<non-verbose/>", "").split())[:ERROR_CHARS]


# -- matching ----------------------------------------------------------------------------------
class CompiledGrammar:
    """A grammar ready for sequences: :meth:`matcher` starts one at the beginning of the text.
    Lives where the masks are filled (it holds the library's objects: not picklable)."""

    def __init__(self, spec: GrammarSpec, prototype, vocab_size: int, eos_token_ids: frozenset[int],
                 eos_row: torch.Tensor) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.eos_row = eos_row        # [W] int32: only the EOS tokens
        self._prototype = prototype   # llguidance.LLMatcher at the start: only ever copied

    def matcher(self) -> Matcher:
        return Matcher(self._prototype.deep_copy(), self)


class Matcher:
    """One sequence's grammar state: which tokens may come next, given those emitted so far.

    Tokens are advanced one by one; an EOS (any of the grammar's ``eos_token_ids``) is allowed
    where the grammar is complete, and after it only EOS is. ``rollback(n)`` undoes the last n
    advances, EOS included.
    """

    def __init__(self, ll, grammar: CompiledGrammar) -> None:
        self._ll = ll              # llguidance.LLMatcher: the state before any EOS
        self._grammar = grammar
        self._num_ll_tokens = 0    # tokens advanced in the library (what it can roll back)
        self._num_eos = 0          # EOS tokens advanced after those (kept here, see the module)

    @property
    def vocab_size(self) -> int:
        return self._grammar.vocab_size

    @property
    def spec(self) -> GrammarSpec:
        return self._grammar.spec

    @property
    def num_tokens(self) -> int:
        """Tokens advanced so far (EOS included)."""
        return self._num_ll_tokens + self._num_eos

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and only EOS may come (or an EOS came)."""
        return self._num_eos > 0 or (self._ll.is_stopped() and not self._ll.is_error())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[n, ceil(V / 32)]`` int32, CPU).
        Raises :class:`~specserve.errors.InvalidRequestError` when the grammar is too complex to
        follow here (a step past :data:`LIMITS`)."""
        assert bitmask.ndim == 2 and bitmask.shape[1] == num_words(self.vocab_size)
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
        if self._num_eos:
            bitmask[row] = self._grammar.eos_row
            return
        _fill(self._ll, bitmask[row])
        if self._ll.is_error():
            raise InvalidRequestError("the output grammar cannot be followed: "
                                      f"{_one_line(self._ll.get_error())}")

    def accepts(self, token: int) -> bool:
        """Would ``token`` be allowed now (the state does not move)?"""
        if token in self._grammar.eos_token_ids:
            return self._num_eos > 0 or self._ll.is_accepting()
        if self._num_eos or not 0 <= token < self.vocab_size:
            return False
        return self._ll.validate_tokens([token]) == 1

    def advance(self, token: int) -> None:
        """Move past ``token``; a ``ValueError`` if the grammar does not allow it (a bug of the
        caller: a masked sampler never draws one)."""
        if not self.accepts(token):
            raise ValueError(f"token {token} is not allowed by the {self._grammar.spec.kind} grammar here")
        self._push(token)

    def _push(self, token: int) -> None:
        """:meth:`advance` past a token :meth:`accepts` just allowed."""
        if token in self._grammar.eos_token_ids:
            self._num_eos += 1
        elif self._ll.consume_token(token):
            self._num_ll_tokens += 1
        else:  # validated just before: the library disagrees with itself
            raise RuntimeError(f"llguidance refused token {token}: {self._ll.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        eos = min(num_tokens, self._num_eos)
        self._num_eos -= eos
        if num_tokens > eos:
            if not self._ll.rollback(num_tokens - eos):
                raise RuntimeError(f"llguidance could not roll back: {self._ll.get_error()}")
            self._num_ll_tokens -= num_tokens - eos

    def walk(self, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """The masks of a verify over drafts ``tokens``, and how many of them the grammar allows.

        Fills the mask at the current state, then per token: if allowed, advance and fill the
        next mask, else stop. Returns ``(masks, num_allowed)``: masks ``[num_allowed + 1, W]``
        int32, row j the mask after ``tokens[:j]`` (what position j of the verify uses; the
        positions after the first forbidden draft are never reached). The state is rolled back
        to where it started.

        Worked example: grammar ``choice ("yes", "no")``, drafts ``["ye", "s", "!"]`` as ids:
        row 0 allows ``y``, ``ye``, ``yes``, ``n``, ``no``; row 1 (after "ye") allows ``s``;
        row 2 (after "yes") allows only EOS; "!" is forbidden, so ``num_allowed = 2``.
        """
        masks = torch.zeros(len(tokens) + 1, num_words(self.vocab_size), dtype=torch.int32)
        self.fill_mask(masks, 0)
        num_allowed = 0
        for token in tokens:
            if not self.accepts(token):
                break
            self._push(token)
            num_allowed += 1
            self.fill_mask(masks, num_allowed)
        self.rollback(num_allowed)
        return masks[:num_allowed + 1], num_allowed

    def walk_tree(self, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, list[bool]]:
        """:meth:`walk` over a token tree (:mod:`~specserve.engine.runtime.token_tree`'s layout:
        ``parents[i] < i``, -1 for a child of the root).

        Returns ``(masks, allowed)``: masks ``[N + 1, W]`` int32, row 0 the mask at the root
        (the current state), row i + 1 the mask after the path root → node i, node i included
        (what the tree verify's row i + 1 uses: node i's children and its bonus token);
        ``allowed[i]``: node i's parent is allowed and the grammar allows ``tokens[i]`` after
        its ancestors. The rows of nodes not allowed are all zeros (never reached). The state is
        rolled back to where it started.
        """
        assert len(tokens) == len(parents) and all(-1 <= p < i for i, p in enumerate(parents))
        masks = torch.zeros(len(tokens) + 1, num_words(self.vocab_size), dtype=torch.int32)
        self.fill_mask(masks, 0)
        allowed = [False] * len(tokens)
        path: list[int] = []  # the nodes advanced, root first
        for i, parent in enumerate(parents):
            if parent >= 0 and not allowed[parent]:
                continue
            self._move_to(_ancestry(parents, parent), path, tokens)
            if self.accepts(tokens[i]):
                self._push(tokens[i])
                path.append(i)
                allowed[i] = True
                self.fill_mask(masks, i + 1)
        self.rollback(len(path))
        return masks, allowed

    def _move_to(self, target: list[int], path: list[int], tokens: list[int]) -> None:
        """Roll back to the common prefix of ``path`` and ``target`` (nodes, root first), then
        advance along the rest of ``target`` (all allowed nodes); ``path`` becomes ``target``."""
        common = 0
        while common < min(len(path), len(target)) and path[common] == target[common]:
            common += 1
        self.rollback(len(path) - common)
        del path[common:]
        for node in target[common:]:
            self.advance(tokens[node])
            path.append(node)


def _ancestry(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root, -1).

    >>> _ancestry([-1, 0, 0, 2], 3)
    [0, 2, 3]
    """
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


# -- drafts under a grammar -----------------------------------------------------------------------
def constrain(matcher: Matcher, params, proposal) -> tuple:
    """A structured output's row in a verify: its proposal less the drafts its grammar
    forbids, and the grammar's masks at its verified positions (``[drafts kept + 1, W]``);
    ``params``: its request's ``SamplingParams``.

    A chain keeps its drafts up to the first forbidden one. That one is dropped too,
    except where the rejection test reads the draft's q (:func:`keeps_forbidden`): there it
    stays, certain to be rejected (p = 0 under the mask), so the recovered token comes from
    the residual ``norm(max(0, p - q))`` as the test needs; the position after it is never
    reached (its mask allows everything). Greedy and seeded rows decide each position from p
    alone, and a one-hot q's residual is p itself, so dropping it there changes nothing. A
    tree loses its forbidden nodes and their subtrees (tree proposals are one-hot: same
    argument)."""
    if proposal.parents is not None:
        rows, allowed = matcher.walk_tree(proposal.token_ids, proposal.parents)
        kept = [j for j, ok in enumerate(allowed) if ok]
        return proposal.subtree(kept), rows[[0, *(j + 1 for j in kept)]]
    rows, num_allowed = matcher.walk(proposal.token_ids)
    keep = num_allowed
    if num_allowed < len(proposal.token_ids) and keeps_forbidden(params, proposal):
        keep += 1
        rows = torch.cat([rows, torch.full_like(rows[:1], -1)])  # (never reached)
    if keep < len(proposal.token_ids):
        proposal = proposal.prefix(keep)
    return proposal, rows


def keeps_forbidden(params, proposal) -> bool:
    """Whether a chain keeps its first draft a grammar forbids, as a certain rejection
    (:func:`constrain`): where the rejection test reads the draft's q (a model's
    probabilities, an unseeded sampled request)."""
    return proposal.probs is not None and not params.greedy and params.seed is None
