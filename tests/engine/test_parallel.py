"""n samples of one prompt (issue 22, ``n > 1``): one prefill, n slots forked from it, each
sample with its own seed stream. Sample i of a request seeded s is the request seeded s + i
run alone, with every proposer and with speculation off; the prompt is computed once."""

from __future__ import annotations

import pytest
from specserve.config import SamplingParams
from specserve.errors import InvalidRequestError

from tests.engine.test_spec_decode import make_engine, prompts
from tests.models import perturbed

SEEDED = SamplingParams(temperature=0.9, top_k=40, max_tokens=20, seed=7, logprobs=2)
GREEDY = SamplingParams(temperature=0, max_tokens=20)
METHODS = [None, "ngram", "suffix", "draft_model", "eagle", "eagle-tree"]


def run(engine, prompt, params, n, **kw) -> list[dict]:
    """Step ``n`` samples of ``prompt`` to the end; per sample, in index order, what its
    outputs said (tokens, logprobs, finish reason, index)."""
    ids = engine.add_parallel(prompt, params, n, **kw)
    got = {i: {"tokens": [], "logprobs": [], "finish": None, "index": None} for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            g = got[out.seq_id]
            g["tokens"] += out.new_token_ids
            g["logprobs"] += out.logprobs or []
            g["finish"], g["index"] = out.finish_reason, out.index
            g["drafted"] = out.stats.num_draft_tokens
    return [got[i] for i in ids]


def alone(target_hf, prompt, params):
    engine = make_engine(target_hf, None)
    return run(engine, prompt, params, 1)[0]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m or "off")
def test_sample_i_is_seed_plus_i_alone_and_the_prompt_is_computed_once(target_hf, method):
    prompt = prompts(3, seed=5)[2]
    engine = make_engine(target_hf, method, 4, draft_hf=perturbed(target_hf, scale=0.3))
    samples = run(engine, prompt, SEEDED, 4)
    assert [s["index"] for s in samples] == [0, 1, 2, 3]
    for i, sample in enumerate(samples):
        want = alone(target_hf, prompt, SEEDED.model_copy(update={"seed": SEEDED.seed + i}))
        assert sample["tokens"] == want["tokens"], f"sample {i}"
        assert sample["logprobs"] == want["logprobs"]
        assert sample["finish"] == want["finish"]
    assert len({tuple(s["tokens"]) for s in samples}) > 1  # they are different samples
    assert engine.counters.num_prefill_tokens == len(prompt)
    assert engine.counters.num_forked_tokens == 3 * (len(prompt) - 1)
    assert engine.target.num_free_slots == engine.target.num_slots
    if method is not None:  # every sample drafts: a forked draft state works
        assert all(s["drafted"] > 0 for s in samples)
    if method in ("draft_model", "eagle", "eagle-tree"):
        assert engine.draft.proposer.num_slots_in_use == 0


def test_greedy_samples_are_all_the_greedy_output(target_hf):
    prompt = prompts(2, seed=3)[1]
    engine = make_engine(target_hf, "draft_model", 3, draft_hf=perturbed(target_hf, scale=0.3))
    want = alone(target_hf, prompt, GREEDY)["tokens"]
    assert [s["tokens"] for s in run(engine, prompt, GREEDY, 3)] == [want] * 3


def test_samples_run_beside_other_requests(target_hf):
    """A request of n takes n slots at once; requests queued behind it wait their turn, and
    everyone's output is what it would be alone."""
    batch = prompts(4, seed=9)
    engine = make_engine(target_hf, "ngram", 4, slots=4)
    singles = [engine.add_request(p, SEEDED) for p in batch[:2]]
    group = engine.add_parallel(batch[2], SEEDED, 3)
    late = engine.add_request(batch[3], SEEDED)
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
    for seq_id, prompt in zip(singles + [late], [batch[0], batch[1], batch[3]]):
        assert tokens[seq_id] == alone(target_hf, prompt, SEEDED)["tokens"]
    for i, seq_id in enumerate(group):
        params = SEEDED.model_copy(update={"seed": SEEDED.seed + i})
        assert tokens[seq_id] == alone(target_hf, batch[2], params)["tokens"]
    assert engine.target.num_free_slots == 4


def test_n_beyond_the_slots_is_refused(target_hf):
    engine = make_engine(target_hf, None, slots=4)
    with pytest.raises(InvalidRequestError, match="n: at most 4"):
        engine.add_parallel(prompts(1)[0], SEEDED, 5)
    top = SEEDED.model_copy(update={"seed": 2**63 - 1})  # sample 1 would need seed 2**63
    with pytest.raises(InvalidRequestError, match="seed: with n = 2, at most 9223372036854775806"):
        engine.add_parallel(prompts(1)[0], top, 2)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("order", [1, -1], ids=["first-first", "first-last"])
@pytest.mark.parametrize("when", ["waiting", "admitted", "forked"])
def test_aborting_the_samples_frees_every_slot(target_hf, when, order):
    """Whenever the API aborts a request's samples, in whatever order, every slot comes back
    (aborting the first before the fork takes the others with it)."""
    engine = make_engine(target_hf, "draft_model", 4, draft_hf=perturbed(target_hf, scale=0.3))
    ids = engine.add_parallel(prompts(1, seed=2)[0], SEEDED, 4)
    if when == "admitted":
        engine.scheduler.admit()
        assert engine.target.num_free_slots == engine.target.num_slots - 4
    if when == "forked":
        engine.step()
        assert len(engine.scheduler.running) == 4
    aborted = [engine.abort(i) for i in ids[::order]]
    assert aborted[0] and (all(aborted) or when != "forked")
    assert not engine.has_unfinished() and not engine.scheduler.forks
    assert engine.target.num_free_slots == engine.target.num_slots
    assert engine.draft.proposer.num_slots_in_use == 0


def test_a_failing_prompt_fails_all_its_samples_alone(target_hf):
    batch = prompts(2, seed=4)
    engine = make_engine(target_hf, "ngram", 4)
    other = engine.add_request(batch[0], SEEDED)
    bad = engine.add_parallel(batch[1], SEEDED, 3)
    engine.fault_token = batch[1][0]
    errors, tokens = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq_id == other:
                tokens += out.new_token_ids
            elif out.error is not None:
                errors[out.seq_id] = out.index
    assert errors == {seq_id: i for i, seq_id in enumerate(bad)}
    assert tokens == alone(target_hf, batch[0], SEEDED)["tokens"]
    assert engine.target.num_free_slots == engine.target.num_slots


def test_a_draft_model_forks_its_cache_too(target_hf):
    """After the first sample's prefill step the others hold a copy of the draft's cache over
    the shared prompt, so the draft computes the prompt once as well."""
    prompt = prompts(2, seed=8)[1]
    engine = make_engine(target_hf, "draft_model", 4, draft_hf=perturbed(target_hf, scale=0.3))
    first, *others = engine.add_parallel(prompt, SEEDED, 3)
    engine.step()
    draft = engine.draft.proposer
    for seq_id in others:
        assert draft.worker.length(draft.slots[seq_id]) == len(prompt) - 1
        assert engine.target.length(engine.scheduler.running[seq_id].slot) == len(prompt) - 1
