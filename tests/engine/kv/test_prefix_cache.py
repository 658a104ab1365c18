"""The prompt through the engine (issue 34): prefix caching (the in-process engine on
``kv_cache.layout: paged``) and chunked prefill (``chunked_prefill_size``, any layout).

A conversation's second turn finds its first turn's blocks and prefills only the rest; a
long prompt is prefilled a chunk per step while the running streams keep decoding. Every
output, greedy and seeded, is the target-only engine's (slot cache, prompts whole) token for
token, for each proposer: seeded draws depend on (seed, position) only, so neither a cached
prefix nor a chunk boundary can move them, and the kernels are row-invariant, so a cached
block or a chunk's keys hold a whole fresh prefill's bits. EAGLE reads the target's
features, which the prefix cache does not keep yet: its requests do not look prefixes up
(no hit), and stay exact; chunks pass it their features."""

from __future__ import annotations

import pytest
from specserve.config import EngineConfig, KVCacheConfig, SamplingParams

from tests.engine.test_spec_decode import make_engine, prompts
from tests.models import random_sequences

METHODS = [None, "ngram", "draft_model", "suffix", "eagle"]
MODEL_DRAFTS = ("draft_model", "eagle")

PAGED = KVCacheConfig(layout="paged", block_size=16)
DRAFT_PAGED = KVCacheConfig(layout="paged", block_size=16, prefix_caching=False)  # a draft's
PARAMS = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=20),
          SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=11)]


def turns(engine) -> list[list[int]]:
    """Two turns of three conversations: turn 2 is turn 1's prompt, its answer and 9 more
    tokens. Every output, in order."""
    first = prompts(3, seed=7)
    done = engine.generate(first, PARAMS)
    second = [p + c.output_token_ids + list(range(40, 49)) for p, c in zip(first, done)]
    return [c.output_token_ids for c in done] + \
        [c.output_token_ids for c in engine.generate(second, PARAMS)]


@pytest.fixture(scope="module")
def reference(target_hf):
    return turns(make_engine(target_hf, None))


@pytest.mark.parametrize("method", METHODS)
def test_second_turns_hit_the_cache_and_keep_target_onlys_output(target_hf, close_draft_hf,
                                                                  reference, method):
    engine = make_engine(target_hf, method, draft_hf=close_draft_hf, kv=PAGED, draft_kv=DRAFT_PAGED)
    assert turns(engine) == reference
    stats = engine.target.cache.manager.stats
    if method == "eagle":
        assert stats.hits == 0
    else:
        assert stats.hits >= 3 * 16, stats  # each second turn found at least a block
    engine.target.cache.manager.check()
    assert engine.target.num_free_slots == engine.target.num_slots


LONG = random_sequences((70, 45, 9), seed=8)  # 70 and 45 tokens: chunked under a budget of 16


@pytest.fixture(scope="module")
def whole(target_hf):
    """Target-only, slot cache, every prompt whole."""
    return [c.output_token_ids for c in make_engine(target_hf, None).generate(LONG, PARAMS)]


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefill_keeps_target_onlys_output(target_hf, close_draft_hf, whole, method, layout):
    engine = make_engine(target_hf, method, draft_hf=close_draft_hf,
                         kv=PAGED if layout == "paged" else None)
    engine.scheduler.chunked_prefill_size = 16
    assert [c.output_token_ids for c in engine.generate(LONG, PARAMS)] == whole
    assert engine.counters.num_prefill_chunks >= 6
    assert engine.counters.num_prefill_tokens == sum(map(len, LONG))


def test_a_long_prompt_never_stops_a_running_stream(target_hf):
    """While a 150-token prompt is prefilled a chunk per step, the running stream gets a
    token every step, and the chunk rides in the stream's own forward: one target forward a
    step, so the stream waits for one chunk's forward, not a chunk's and then its own. (Without
    a budget the prompt takes one step, which no chunk spares.)"""
    engine = make_engine(target_hf, "ngram")
    engine.scheduler.chunked_prefill_size = 32
    forwards = []
    forward = engine.target.forward
    engine.target.forward = lambda batch: forwards.append(len(batch.slots)) or forward(batch)
    running = engine.add_request(prompts(1, seed=9)[0], SamplingParams(temperature=0, max_tokens=60))
    for _ in range(3):
        engine.step()
    long = engine.add_request(random_sequences((150,), seed=10)[0],
                              SamplingParams(temperature=0, max_tokens=4))
    steps = 0
    del forwards[:]
    while True:
        outputs = {o.seq_id: o for o in engine.step()}
        steps += 1
        assert outputs[running].new_token_ids, f"step {steps}: the running stream got no token"
        if long in outputs and outputs[long].new_token_ids:
            break
    assert steps >= 150 // 32 and engine.counters.num_prefill_chunks == steps - 1
    assert forwards == [2] * steps, forwards  # the stream and the prompt, in one forward a step


def test_a_failed_step_with_a_chunk_steps_every_row_alone_the_chunk_too(target_hf, whole):
    """A step whose one forward (verifying rows and a prompt's chunk) fails: each of its
    rows is stepped alone, the chunk prefilled alone (not its whole prompt at once), and
    nothing is lost: the outputs are still target-only's."""
    engine = make_engine(target_hf, "ngram")
    engine.scheduler.chunked_prefill_size = 16
    events = []  # ("failed", [chunk sizes]), ("verify", rows, chunks), ("forward", [tokens per row])
    verify, forward = engine.target.verify, engine.target.forward

    def failing_verify(batch):
        if batch.chunks and not any(e[0] == "failed" for e in events):
            events.append(("failed", [len(ids) for _, ids in batch.chunks]))
            raise RuntimeError("planted: a step with a chunk fails once")
        events.append(("verify", len(batch.rows), len(batch.chunks)))
        return verify(batch)

    def logged_forward(batch):
        events.append(("forward", [len(x) for x in batch.token_ids]))
        return forward(batch)

    engine.target.verify, engine.target.forward = failing_verify, logged_forward
    assert [c.output_token_ids for c in engine.generate(LONG, PARAMS)] == whole
    at, failed = next((i, e) for i, e in enumerate(events) if e[0] == "failed")
    # the failed step's rows alone: its verifying row (whose verify logs its forward too),
    # then its chunk; a prompt the budget held back waits (it was in no forward)
    alone = events[at + 1:at + 4]
    assert len(failed[1]) == 1 and ("forward", failed[1]) in alone, (failed, alone)
    assert all(e[0] != "verify" or e[1:] == (1, 0) for e in alone), alone
    assert engine.counters.num_prefill_tokens == sum(map(len, LONG))


def test_a_prompt_to_score_is_never_chunked(target_hf):
    """``prompt_logprobs`` scores every prompt position in the prefill's forward: such a
    prompt is prefilled whole whatever the budget, and scores as without one."""
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    prompt = random_sequences((70,), seed=11)[0]
    runs = []
    for budget in (None, 16):
        engine = make_engine(target_hf, "ngram")
        engine.scheduler.chunked_prefill_size = budget
        [done] = engine.generate([prompt], params)
        runs.append((done.prompt_logprobs, done.output_token_ids, engine.counters.num_prefill_chunks))
    assert runs[0] == runs[1] and len(runs[1][0]) == len(prompt) - 1 and runs[1][2] == 0


# Preemption (scheduler.py): 12 blocks of 8 positions hold one sequence of max_len 96, while
# four sequences grow to about 70 positions each (9 blocks): the newest wait and recompute.
TIGHT = KVCacheConfig(layout="paged", block_size=8, num_blocks=12)
# A model draft's pool as a unit sizes it: the target's blocks and each slot's drafts ahead.
DRAFT_TIGHT = EngineConfig.model_validate({"max_model_len": 96, "max_num_seqs": 8,
                                           "kv_cache": TIGHT.model_dump(),
                                           "speculative": {"num_speculative_tokens": 4}}).draft_kv_cache
CROWD = random_sequences((20, 14, 26, 9), seed=12)
CROWD_PARAMS = [SamplingParams(temperature=0, max_tokens=48),
                SamplingParams(temperature=0.8, top_k=20, max_tokens=52, seed=5),
                SamplingParams(temperature=0, max_tokens=40),
                SamplingParams(temperature=0.9, max_tokens=56, seed=6)]


def crowd(engine, chunk: int | None = 16) -> list[list[int]]:
    engine.scheduler.chunked_prefill_size = chunk
    return [c.output_token_ids for c in engine.generate(CROWD, CROWD_PARAMS)]


@pytest.fixture(scope="module")
def uncrowded(target_hf):
    """Target-only, a slot per sequence: nothing preempted."""
    return crowd(make_engine(target_hf, None, max_len=96, eos=frozenset()))


@pytest.mark.parametrize("method", METHODS)
def test_preempted_sequences_recompute_and_keep_target_onlys_output(target_hf, close_draft_hf,
                                                                    uncrowded, method):
    engine = make_engine(target_hf, method, draft_hf=close_draft_hf, max_len=96, eos=frozenset(),
                         kv=TIGHT, draft_kv=DRAFT_TIGHT)
    assert crowd(engine) == uncrowded
    assert engine.counters.num_preemptions >= 2
    proposer = engine.draft.proposer
    workers = [engine.target] + ([proposer.worker] if hasattr(proposer, "worker") else [])
    assert DRAFT_TIGHT.num_blocks == 12 + 8 * 2 and len(workers) == 1 + (method in MODEL_DRAFTS)
    for worker in workers:  # the target's pool, and a model draft's (paged too), all given back
        manager = worker.cache.manager
        manager.check()
        assert worker.num_free_slots == worker.num_slots
        assert manager.pool.num_free == manager.pool.num_blocks


def test_the_preemption_test_catches_a_sequence_that_resumes_without_recomputing(
        target_hf, uncrowded, monkeypatch):
    """Planted bug: a preempted sequence admitted again takes fresh blocks as if they held its
    tokens' keys and values (resumed, not recomputed); the test above fails on it. (Prompts
    whole: admission then leaves room for the whole sequence, which the bug takes.)"""
    engine = make_engine(target_hf, None, max_len=96, eos=frozenset(), kv=TIGHT)
    match = engine.scheduler._match

    def resume(seq):
        if not seq.num_preemptions:
            return match(seq)
        cache = engine.target.cache
        cache.reserve([seq.slot], [len(seq.token_ids) - 1])
        cache.lengths[seq.slot] = len(seq.token_ids) - 1
        return len(seq.token_ids) - 1

    monkeypatch.setattr(engine.scheduler, "_match", resume)
    assert crowd(engine, None) != uncrowded and engine.counters.num_preemptions >= 2


def test_the_scheduler_doctests_hold():
    """The step's plan, its forward's row groups and the preemption choice, as documented."""
    import doctest

    from specserve.engine.step import scheduler, step_batch

    plan, layout = doctest.testmod(scheduler), doctest.testmod(step_batch)
    assert plan.attempted >= 5 and layout.attempted >= 3 and plan.failed == layout.failed == 0
