"""``logit_bias``, ``min_tokens``, ``min_p``, the presence, frequency and repetition
penalties, ``allowed_token_ids`` and ``bad_words`` with speculation: each changes the
target's distribution (the bias and the allowed tokens at every position, ``min_tokens`` at
the positions before it, ``min_p`` for sampled rows, a penalty and a bad word by the tokens
before the position, drafts included), so the verification must decide every verified
position on the changed logits. Greedy and seeded outputs identical to target-only's with
the same settings, for every proposer; each setting does what it says; unseeded samples
distributed as the target's under all of them; planted bugs (the stop tokens banned only at
a verify's first position, penalties or bad words blind to the drafts) are caught."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from specserve.config import SamplingParams
from specserve.engine.grammar import GrammarCompiler, GrammarSpec
from specserve.engine.step.bans import narrowed, word_bans, word_token_ids
from specserve.engine.step.sampling import compute_probs
from specserve.engine.step.sequence import Sequence
from specserve.engine.tokenizer import IncrementalDetokenizer
from specserve.errors import InvalidRequestError

from tests.engine.test_spec_decode import (
    EOS,
    chi_square_pvalue,
    chi_square_pvalue_or_zero,
    far_draft,
    make_engine,
    prompts,
)
from tests.models import VOCAB
from tests.tiny import make_tiny_tokenizer

[EOS_ID] = EOS
METHODS = ["ngram", "suffix", "draft_model", "eagle", "suffix-tree"]
MIN_TOKENS = 6
# EOS all but forced (+100), and banned until MIN_TOKENS: every output is MIN_TOKENS tokens,
# then EOS; a second, smaller bias shifts the rest of the distribution.
STOP_AT_MIN = dict(logit_bias=((EOS_ID, 100.0), (7, 2.5)), min_tokens=MIN_TOKENS, max_tokens=40)


@pytest.fixture(scope="module")
def reference(target_hf):
    """Target-only's outputs of the cases below, once for the module."""
    engine = make_engine(target_hf, None)
    return {name: [c.output_token_ids for c in engine.generate(prompts(4, seed=31), params)]
            for name, params in CASES.items()}


WORDS = ("in in", "the sys", "oran", " namem")
CASES = {
    "greedy": SamplingParams(temperature=0.0, **STOP_AT_MIN),
    "seeded": SamplingParams(temperature=0.9, seed=5, min_p=0.05, **STOP_AT_MIN),
    "seeded-long": SamplingParams(temperature=0.9, seed=5, min_p=0.2, top_k=40, max_tokens=30,
                                  logit_bias=((11, -100.0), (12, 3.0))),
    "greedy-penalized": SamplingParams(temperature=0.0, max_tokens=30, presence_penalty=0.15,
                                       frequency_penalty=0.3, repetition_penalty=1.2),
    "seeded-penalized": SamplingParams(temperature=0.9, seed=6, max_tokens=30, presence_penalty=-0.3,
                                       frequency_penalty=0.7, repetition_penalty=0.8, min_p=0.05),
    # " in in" (and "in in") is a repeat the free output makes; the others, pairs it makes
    "greedy-words": SamplingParams(temperature=0.0, max_tokens=30,
                                   bad_words=WORDS),
    "seeded-allowed": SamplingParams(temperature=0.9, seed=8, max_tokens=30, bad_words=("in in",),
                                     allowed_token_ids=(*range(100, 400), EOS_ID)),
}


def reference_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    """vLLM's penalties written out token by token, for one logits row (``[V]``)."""
    x = logits.clone()
    counts = Counter(output)
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, c in counts.items():
        x[token] -= params.frequency_penalty * c + params.presence_penalty
    return x


@pytest.mark.parametrize("method", METHODS)
def test_speculation_keeps_target_onlys_output_under_each_setting(target_hf, close_draft_hf, reference,
                                                                  method):
    engine = make_engine(target_hf, method, 4, draft_hf=close_draft_hf)
    batch = prompts(4, seed=31)
    drafted = 0
    for name, params in CASES.items():
        got = engine.generate(batch, params)
        assert [c.output_token_ids for c in got] == reference[name], (method, name)
        drafted += sum(c.stats.num_draft_tokens for c in got)
    assert drafted > 0, method  # a comparison with drafts in it


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle-tree"])
def test_model_drafts_draw_with_the_bias(target_hf, close_draft_hf, method):
    """A bias of 100, or allowed_token_ids of one token, makes the target emit that token; a
    model draft that applies the request's bias and allowed tokens drafts it too, so its
    drafts are accepted (without them in the drafts: almost none)."""
    engine = make_engine(target_hf, method, 4, draft_hf=close_draft_hf)
    for forced in (SamplingParams(temperature=0.0, max_tokens=24, logit_bias=((9, 100.0),)),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=24, allowed_token_ids=(9,))):
        done = engine.generate(prompts(2, seed=34), forced)
        assert all(c.output_token_ids == [9] * 24 for c in done)
    assert engine.counters.spec.acceptance_rate > 0.9, engine.counters.spec


def test_model_drafts_draw_with_the_penalties(target_hf, close_draft_hf, monkeypatch):
    """An EAGLE chain drafting under the request's penalties (each draft counted for the next)
    is accepted more often than one blind to them; the tokens are the target's either way
    (test_speculation_keeps_target_onlys_output_under_each_setting)."""
    from specserve.engine.drafts.draft_model import DraftModelProposer

    def acceptance() -> float:
        engine = make_engine(target_hf, "eagle", 4, draft_hf=close_draft_hf)
        engine.generate(prompts(8, seed=35), CASES["seeded-penalized"])
        return engine.counters.spec.acceptance_rate

    aware = acceptance()
    monkeypatch.setattr(DraftModelProposer, "_penalties", lambda self, requests, feeds, silent: {})
    assert aware > acceptance() + 0.05


def test_each_setting_does_what_it_says(target_hf, reference):
    for name in ("greedy", "seeded"):  # EOS banned until MIN_TOKENS, then taken at once
        for out in reference[name]:
            assert EOS_ID not in out[:MIN_TOKENS] and out[MIN_TOKENS:] == [EOS_ID], (name, out)
    assert all(11 not in out for out in reference["seeded-long"])  # banned by its bias
    engine = make_engine(target_hf, None)
    batch = prompts(4, seed=31)
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    free = [c.output_token_ids for c in engine.generate(batch, plain)]
    common, _ = Counter(t for out in free for t in out).most_common(1)[0]
    banned = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=((common, -100.0),))
    assert all(common not in c.output_token_ids for c in engine.generate(batch, banned))
    # min_p 1 keeps only the likeliest token: a seeded sample at any temperature is greedy.
    sharp = SamplingParams(temperature=1.5, seed=9, min_p=1.0, max_tokens=20)
    assert [c.output_token_ids for c in engine.generate(batch, sharp)] == free
    # the penalties: greedy decoding with the model itself and vLLM's formulas written out
    params = CASES["greedy-penalized"]
    for prompt, got in zip(batch, reference["greedy-penalized"]):
        want: list[int] = []
        with torch.no_grad():
            while len(want) < params.max_tokens:
                x = target_hf(torch.tensor([prompt + want])).logits[0, -1]
                want.append(int(reference_penalties(x, params, prompt, want).argmax()))
        assert got == want
    assert reference["greedy-penalized"] != free  # (and they changed something)
    # bad words: greedy decoding with each word's last token banned where the output ends
    # with its other tokens, written out; no output holds a word; the allowed tokens only
    words = word_token_ids(make_tiny_tokenizer(), WORDS)
    for prompt, got in zip(batch, reference["greedy-words"]):
        want = []
        with torch.no_grad():
            while len(want) < 30:
                x = target_hf(torch.tensor([prompt + want])).logits[0, -1]
                for w in words:
                    if len(want) >= len(w) - 1 and tuple(want[len(want) - len(w) + 1:]) == w[:-1]:
                        x[w[-1]] = -torch.inf
                want.append(int(x.argmax()))
        assert got == want
        assert not any(tuple(got[i:i + len(w)]) == w for w in words for i in range(len(got)))
    assert any((282, 282) == tuple(out[i:i + 2]) for out in free for i in range(19))  # " in in"
    allowed = set(CASES["seeded-allowed"].allowed_token_ids)
    assert all(set(out) <= allowed for out in reference["seeded-allowed"])


def test_a_bad_word_is_banned_after_its_other_tokens_drafts_included():
    """Row j of a chain reads the output and the first j drafts, a tree node's row its path;
    a word is banned as tokenized alone and after a space."""
    words = ((5, 6), (9,), (7, 5, 6))
    chain = word_bans(words, [1, 7, 5], [6, 5, 7], None, VOCAB)
    banned = [[t for t in (5, 6, 7, 9) if not int(row[t // 32]) >> (t % 32) & 1] for row in chain]
    assert banned == [[6, 9], [9], [6, 9], [9]]
    tree = word_bans(words, [1], [5, 7, 5], [-1, -1, 1], VOCAB)  # nodes: 5 | 7 -> 5
    banned = [[t for t in (5, 6, 7, 9) if not int(row[t // 32]) >> (t % 32) & 1] for row in tree]
    assert banned == [[9], [6, 9], [9], [6, 9]]
    assert word_bans((), [5], [6], None, VOCAB) is None
    tokenizer = make_tiny_tokenizer()
    spellings = {tuple(tokenizer.encode(t, add_special_tokens=False)) for t in ("in in", " in in")}
    assert set(word_token_ids(tokenizer, ("  in in",))) == spellings and len(spellings) == 2


def test_a_suffix_draft_of_an_early_eos_is_rejected(target_hf, monkeypatch):
    """Suffix decoding drafts an earlier response, EOS at MIN_TOKENS included; asked for more
    tokens now, that EOS comes before min_tokens and must be rejected at its draft position.
    Planted: bans at a verify's first position only; the output then stops early."""
    batch = prompts(4, seed=32)
    more = SamplingParams(temperature=0.0, **{**STOP_AT_MIN, "min_tokens": MIN_TOKENS + 5})

    def outputs(engine) -> list[list[int]]:
        engine.generate(batch, SamplingParams(temperature=0.0, **STOP_AT_MIN))  # the suffix cache
        return [c.output_token_ids for c in engine.generate(batch, more)]

    want = outputs(make_engine(target_hf, None))
    assert all(len(out) == MIN_TOKENS + 6 for out in want)
    assert outputs(make_engine(target_hf, "suffix", 8)) == want
    first_row_only = Sequence.stop_bans

    def planted(self, parents, num_drafts, vocab_size, eos_token_ids):
        masks = first_row_only(self, parents, num_drafts, vocab_size, eos_token_ids)
        if masks is not None:
            masks[1:] = -1
        return masks

    monkeypatch.setattr(Sequence, "stop_bans", planted)
    assert outputs(make_engine(target_hf, "suffix", 8)) != want


def test_penalties_blind_to_the_drafts_are_caught(target_hf, close_draft_hf, reference, monkeypatch):
    """Planted: each verified position penalized for the output alone, not for the drafts
    before it; a draft's repeat then goes unpenalized and the greedy output changes. (EAGLE:
    its drafts are accepted most here; n-gram's are repeats, which the penalties reject.)"""
    from specserve.engine.step import penalties

    monkeypatch.setattr(penalties, "prefixes", lambda token_ids, parents: [[]] * (len(token_ids) + 1))
    engine = make_engine(target_hf, "eagle", 4, draft_hf=close_draft_hf)
    got = engine.generate(prompts(4, seed=31), CASES["greedy-penalized"])
    assert [c.output_token_ids for c in got] != reference["greedy-penalized"]


def test_bad_words_blind_to_the_drafts_are_caught(target_hf, close_draft_hf, reference, monkeypatch):
    """Planted: each verified position's bad words read the output alone, not the drafts
    before it; a drafted word's first token then lets its last through."""
    from specserve.engine.step import bans

    monkeypatch.setattr(bans, "prefixes", lambda token_ids, parents: [[]] * (len(token_ids) + 1))
    engine = make_engine(target_hf, "eagle", 4, draft_hf=close_draft_hf)
    got = engine.generate(prompts(4, seed=31), CASES["greedy-words"])
    assert [c.output_token_ids for c in got] != reference["greedy-words"]


def test_a_grammar_complete_before_min_tokens_ends_its_output(target_hf):
    """A structured output whose grammar is complete before ``min_tokens`` ends there
    ("stop"), with and without speculation: min_tokens does not keep it going. Within a verify,
    a drafted position after the grammar's completion allows only a stop, which min_tokens
    bans: there the grammar's mask stays (``narrowed``), so no row is left with nothing
    allowed (its token is dropped after the stop anyway)."""
    compiled = GrammarCompiler(make_tiny_tokenizer(), VOCAB, EOS).compile(GrammarSpec("regex", "[a-m]{2,3}"))
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12)
    batch = prompts(3, seed=33)
    want = make_engine(target_hf, None).generate(batch, params, grammar=compiled)
    got = make_engine(target_hf, "ngram", 4).generate(batch, params, grammar=compiled)
    assert [c.output_token_ids for c in got] == [c.output_token_ids for c in want]
    for c in want:
        assert c.finish_reason == "stop" and 2 <= len(c.text) <= 3 and len(c.output_token_ids) < 12, c
    grammar = torch.tensor([[0b1100, -1], [0b0100, 0]], dtype=torch.int32)  # row 1: EOS (2) only
    bans = torch.tensor([[~0b0100, -1], [~0b0100, -1]], dtype=torch.int32)
    assert narrowed(grammar, bans).tolist() == [[0b1000, -1], [0b0100, 0]]


def test_stop_bans_follow_each_drafts_output_position():
    """Row j of a chain decides output token L + j, a tree node's row L + its depth; the rows
    at or past min_tokens allow everything; ignore_eos leaves EOS allowed, stop ids not."""
    params = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(40,))
    seq = Sequence(0, 2, [5, 6, 9, 9], params, 4, False, None, 0)  # two output tokens: L = 2
    chain = seq.stop_bans(None, 4, VOCAB, EOS)
    banned = [[bool(~int(row[t // 32]) >> (t % 32) & 1) for t in (EOS_ID, 40, 41)] for row in chain]
    assert banned == [[True, True, False]] * 2 + [[False, False, False]] * 3
    tree = seq.stop_bans([-1, -1, 0, 2], 4, VOCAB, EOS)  # depths 1, 1, 2, 3: rows L, L+1, L+1, L+2, L+3
    assert [bool(int(row[0]) != -1) for row in tree] == [True, True, True, False, False]
    relaxed = Sequence(0, 2, [5, 6, 9], params.model_copy(update={"ignore_eos": True}), 4, False, None, 0)
    row = relaxed.stop_bans(None, 0, VOCAB, EOS)[0]
    assert int(row[0]) >> EOS_ID & 1 and not int(row[1]) >> (40 - 32) & 1
    done = Sequence(0, 2, [5, 6, 9, 9, 9, 9], params, 4, False, None, 0)
    assert done.stop_bans(None, 4, VOCAB, EOS) is None


def test_stop_strings_are_looked_for_from_min_tokens_on():
    """vLLM's rule: a stop string completed before the min_tokens-th output token does not
    stop the output, then or later; one completed after does."""
    tokenizer = make_tiny_tokenizer()
    ids = tokenizer.encode("ab ab ab", add_special_tokens=False)
    stop = tokenizer.decode(ids[:1])
    for min_tokens, stops in ((0, True), (len(ids) + 1, False)):
        detok = IncrementalDetokenizer(tokenizer, [1], stop=[stop], min_tokens=min_tokens)
        for t in ids:
            detok.add(t)
        assert (detok.stop_reason is not None) is stops, (min_tokens, detok.text)


def test_bad_settings_are_refused_by_name(target_hf):
    engine = make_engine(target_hf, None)
    for params, param in ((SamplingParams(max_tokens=3, min_tokens=4), "min_tokens"),
                          (SamplingParams(max_tokens=3, logit_bias=((VOCAB, 1.0),)), "logit_bias"),
                          (SamplingParams(max_tokens=3, allowed_token_ids=(5, VOCAB)), "allowed_token_ids")):
        with pytest.raises(InvalidRequestError) as err:
            engine.generate([[5, 6]], params)
        assert err.value.param == param
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 1.0), (3, 2.0)))
    for bad in (dict(bad_words=(" ",)), dict(bad_words=("",)), dict(allowed_token_ids=())):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


# -- the distribution: unseeded rows, where the rejection test reads the draft's q ------------
UNSEEDED = SamplingParams(temperature=1.0, min_p=0.02, max_tokens=3,
                          logit_bias=((7, 3.0), (11, 3.0), (13, 2.0), (301, -100.0)),
                          presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3,
                          allowed_token_ids=tuple(t for t in range(VOCAB) if t != 11),
                          bad_words=("youib",))  # 312 after 400 (or 405): P(400, 312) ~ 0.1
PROMPT = [5, 301, 45, 17, 5, 301]


def joint(target_hf, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of target-only sampling under ``params``: the target's logits, its bias
    added, its penalties for the output before each token, the tokens not allowed and the
    bad words' banned, then temperature and min-p."""
    bias = torch.zeros(VOCAB)
    for token, value in params.logit_bias:
        bias[token] = value
    if params.allowed_token_ids is not None:
        bias[[t for t in range(VOCAB) if t not in params.allowed_token_ids]] = -torch.inf
    words = word_token_ids(make_tiny_tokenizer(), params.bad_words)
    assert all(len(w) <= 2 for w in words)  # (the output before t2 is t1)

    def banned(out: list[int]) -> list[int]:
        return [w[-1] for w in words if list(w[:-1]) == out[len(out) - len(w) + 1:]]

    def probs(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        n = logits.shape[0]
        logits = torch.stack([reference_penalties(x + bias, params, PROMPT, out).index_fill(
            0, torch.tensor(banned(out), dtype=torch.long), -torch.inf)
            for x, out in zip(logits, outputs)])
        return compute_probs(logits, torch.full((n,), params.temperature), torch.zeros(n),
                             torch.ones(n), min_p=torch.full((n,), params.min_p)).double()

    with torch.no_grad():
        p1 = probs(target_hf(torch.tensor([PROMPT])).logits[0, -1:], [[]])[0]
        support = p1.nonzero()[:, 0].tolist()
        p2 = probs(target_hf(torch.tensor([PROMPT + [t] for t in support])).logits[:, -1],
                   [[t] for t in support])
    out = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    out[support] = p1[support, None] * p2
    return (out / out.sum()).numpy()


def test_unseeded_samples_have_the_biased_distribution(target_hf):
    """6000 unseeded samples of the first two tokens from a mismatched draft model, whose q
    knows nothing of min-p, the allowed tokens or the bad words (any q keeps the rejection
    test exact): chi-square against the exact joint distribution of the constrained target
    fails below p = 1e-3; the same samples against the unbiased target's joint, and against
    the joint without the bad word, must fail it (the test has power)."""
    engine = make_engine(target_hf, "draft_model", 3, draft_hf=far_draft(target_hf), slots=256)
    done = engine.generate([PROMPT] * 6000, UNSEEDED)
    rate = engine.counters.spec.acceptance_rate
    assert engine.counters.spec.num_draft_tokens > 0 and 0.0 < rate < 0.95, rate
    samples = [tuple(c.output_token_ids[:2]) for c in done]
    assert chi_square_pvalue(samples, joint(target_hf, UNSEEDED)) > 1e-3
    plain = SamplingParams(temperature=1.0, max_tokens=3)
    assert chi_square_pvalue_or_zero(samples, joint(target_hf, plain)) < 1e-3
    unbanned = UNSEEDED.model_copy(update={"bad_words": ()})
    assert chi_square_pvalue_or_zero(samples, joint(target_hf, unbanned)) < 1e-3
