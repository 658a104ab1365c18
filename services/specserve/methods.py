"""The speculation methods: every proposer the engine knows, in one table (the registry).

The configuration's ``speculative.method`` values, the API's ``speculation.method``, the
CLI's ``--method`` choices, the kinds ``specserve train-draft`` makes, and how a unit wires
a proposer (a draft group or not, the target's features sent or not) all read this table.
Adding a proposer is its module in ``specserve/engine/drafts/`` and one line in
:data:`PROPOSERS`; its settings, if it has any, are :class:`Option` rows on that line, from
which the configuration builds ``speculative.<method>`` (bounds, defaults and descriptions
included), so the configuration module is not edited either.

The table sits at the bottom of the package, beside ``errors.py``, and not among the
proposers: the configuration reads it, and the configuration is what the engine stands on.
Each row names its class by module and class name, imported only when an engine is built
(:func:`proposer_class`), the way vLLM's model registry names its model classes: reading
the table imports neither torch nor a proposer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One setting of a proposer: ``speculative.<method>.<name>`` in the configuration, a
    pydantic field of ``default``'s type with these bounds (``specserve.config``)."""

    name: str
    default: bool | int | float | str | None
    description: str
    ge: float | None = None    # lower bound (numbers)
    le: float | None = None    # upper bound (numbers)
    type: type | None = None   # default: the type of ``default``


@dataclass(frozen=True)
class ProposerSpec:
    """One proposer: its method name and what serving it takes."""

    method: str                # speculative.method in the config, speculation.method in the API
    module: str                # specserve.engine.drafts.<module>
    cls: str                   # the class in that module
    draft_model: bool          # needs a draft model (speculative.draft) and, in a unit, a draft group
    reads_features: bool       # reads the target's final hidden states, sent with each request
    draft_kind: str | None     # the `specserve train-draft --kind` that makes its draft
    plain_draft: bool = False  # a plain model of the target's tokenizer serves too
    summary: str = ""
    options: tuple[Option, ...] = ()  # its settings, speculative.<method>.<name>


# A model draft's sampled q, truncated: the rows a sampled draft sends per drafted token.
Q_TOP_K = Option("q_top_k", 16, "Sampled requests: the draft samples each token from its k "
                                "likeliest (renormalised) and sends only those k ids and "
                                "probabilities to the target (8 * k bytes, not 4 * vocab); "
                                "verification uses exactly that q, so output stays lossless. "
                                "Larger k: q closer to the draft's full distribution.",
                 ge=1, le=1024)

PROPOSERS: dict[str, ProposerSpec] = {spec.method: spec for spec in (
    ProposerSpec("ngram", "ngram", "NgramProposer", draft_model=False, reads_features=False,
                 draft_kind=None, summary="prompt lookup: the continuation of the sequence's "
                                          "last n-gram where it occurred before"),
    ProposerSpec("draft_model", "draft_model", "DraftModelProposer", draft_model=True,
                 reads_features=False, draft_kind="decoder", plain_draft=True,
                 summary="a smaller model of the target's tokenizer, or a decoder draft",
                 options=(Q_TOP_K,)),
    ProposerSpec("eagle", "eagle", "EagleProposer", draft_model=True, reads_features=True,
                 draft_kind="eagle", summary="an EAGLE head reading the target's features",
                 options=(
        Q_TOP_K,
        Option("tree", False, "Draft a token tree of up to K nodes instead of one chain "
                              "(EAGLE-2's dynamic tree: expand the likeliest nodes level by "
                              "level, keep the K likeliest); verified in one forward."),
        Option("tree_topk", 4, "tree: children per expanded node, and nodes expanded per level.",
               ge=1, le=8),
        Option("tree_depth", 6, "tree: levels grown (one forward of the head each): the "
                                "deepest path drafted.", ge=1, le=8),
    )),
    ProposerSpec("suffix", "suffix", "SuffixProposer", draft_model=False, reads_features=False,
                 draft_kind=None, summary="suffix decoding: the most frequent continuation of the "
                                          "sequence's suffix in itself and in earlier responses",
                 options=(
        Option("max_match_tokens", 32, "Longest suffix of the sequence matched.", ge=1, le=1024),
        Option("match_factor", 1.0, "Speculate at most match_factor x the match length + "
                                    "match_offset tokens (and K).", ge=0.0, le=64.0),
        Option("match_offset", 0, "See match_factor.", ge=-64, le=64),
        Option("min_token_prob", 0.1, "Stop drafting once the continuation's estimated "
                                      "probability (from counts) falls below this.", ge=0.0, le=1.0),
        Option("tree", False, "Draft a token tree of up to K nodes (the likeliest branches of "
                              "the match's continuations, best first) instead of one chain; "
                              "verified in one forward.", ),
        Option("max_cached_responses", 256, "Earlier responses kept in the unit's global cache "
                                            "(FIFO; 0: none, only the sequence itself).", ge=0,
               le=10_000_000),
        Option("max_cached_tokens", 1_000_000, "... and their tokens at most (the cache takes "
                                               "about 12 bytes per token, at most twice that).",
               ge=1, le=1_000_000_000),
        Option("cache_file", None, "Opt-in: start the global cache from this file of earlier "
                                   "responses (JSON lines {\"token_ids\": [...]}); responses are "
                                   "user data.", type=str | None),
    )),
)}

METHODS = tuple(PROPOSERS)  # ("ngram", "draft_model", "eagle", "suffix")
MODEL_METHODS = tuple(m for m, spec in PROPOSERS.items() if spec.draft_model)
# Model-free proposers: they draft in the coordinator, and may go in front of a model
# proposer (speculative.first).
FREE_METHODS = tuple(m for m, spec in PROPOSERS.items() if not spec.draft_model)
DRAFT_KINDS = tuple(spec.draft_kind for spec in PROPOSERS.values() if spec.draft_kind)


def proposer_class(method: str) -> type:
    """The :class:`~specserve.engine.drafts.base.Proposer` subclass of ``method``."""
    spec = PROPOSERS[method]
    return getattr(importlib.import_module(f"specserve.engine.drafts.{spec.module}"), spec.cls)
