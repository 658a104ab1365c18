"""Tensor parallelism inside Ray actors: TP = 2 gives TP = 1's logits and greedy output.

Runs on CPU with gloo on 127.0.0.1; the ranks sit in ``{"GPU": 1}`` bundles of a STRICT_PACK
placement group on fake GPUs (torch sees none). NCCL on real GPUs is exercised on the lent
GPU machine, not in CI.
"""

from __future__ import annotations

import itertools
import random

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from specserve.config import SamplingParams, UnitConfig
from specserve.engine import spec_decode
from specserve.engine.drafts.eagle import EagleProposer
from specserve.engine.drafts.ngram import NgramProposer
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.worker import ModelWorker
from specserve.errors import TargetUnavailable
from specserve.serve.placement import unit_bundles
from specserve.serve.target_group import GroupStep, TargetGroup

from tests.engine.test_spec_decode import prompts
from tests.models import eagle_head_of
from tests.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def groups(local_ray, tiny_models):
    started = {}
    for tp in (1, 2):
        cfg = UnitConfig.model_validate({
            "engine": {"target": {"source": tiny_models[0], "device": "cpu"},  # fake GPUs
                       "max_model_len": 256, "max_num_seqs": 4},
            "tensor_parallel_size": tp, "accelerator": "gpu"})
        pg = placement_group(unit_bundles(cfg), strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        started[tp] = (TargetGroup(cfg, pg, first_bundle=1), pg)
    yield {tp: group for tp, (group, _) in started.items()}
    for group, pg in started.values():
        group.shutdown()
        remove_placement_group(pg)


def test_ranks_form_one_gloo_group_in_gpu_bundles(groups):
    info = ray.get([r.describe.remote() for r in groups[2].ranks])
    assert [i["rank"] for i in info] == [0, 1]
    assert all(i["world_size"] == 2 and i["backend"] == "gloo" and i["device"] == "cpu" for i in info)
    assert all(i["cuda_visible_devices"] not in (None, "") for i in info)  # each got a GPU bundle
    assert len({i["cuda_visible_devices"] for i in info}) == 2
    assert groups[2].warm_up_report["kernels"] == "invariant"  # every rank warmed up before serving


def test_a_warm_up_past_compile_timeout_fails_the_start_naming_it(local_ray, tiny_models):
    """Every batch shape is compiled before a group serves, bounded by its own
    ``compile_timeout_s``: a first compile inside a step would outlast
    ``target_step_timeout_s`` and start a restart loop. Past it, the start fails with a
    message naming the field (a timeout far below a Ray round trip: never met)."""
    cfg = UnitConfig.model_validate({
        "engine": {"target": {"source": tiny_models[0]}, "max_model_len": 256, "max_num_seqs": 2},
        "compile_timeout_s": 1e-6})
    pg = placement_group(unit_bundles(cfg), strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        with pytest.raises(TargetUnavailable, match="compile_timeout_s"):
            TargetGroup(cfg, pg, first_bundle=1)
    finally:
        remove_placement_group(pg)  # its ranks go with it


def test_tp2_logits_equal_tp1(groups):
    batch = [p[:n] for p, n in zip(prompts(3, seed=4), (5, 17, 11))]
    results = {}
    for tp, group in groups.items():
        slots = [group.allocate() for _ in batch]
        first = group.forward(ForwardBatch(slots, batch, [len(b) for b in batch])).logits
        group.rollback(slots[1], 9)  # a rejected draft: continue from an earlier position
        second = group.forward(ForwardBatch(slots[:2], [[7, 8], [9]], [2, 1])).logits
        results[tp] = torch.cat([first, second])
        for slot in slots:
            group.free(slot)
    assert (results[2] - results[1]).abs().max() <= 1e-4


@pytest.mark.parametrize("method", [None, "ngram"])
def test_tp2_greedy_generation_equals_tp1(groups, method):
    outputs = {}
    for tp, group in groups.items():
        engine = SpecDecodeEngine(group, make_tiny_tokenizer(), eos_token_ids=frozenset({2}),
                                  proposer=NgramProposer() if method else None,
                                  num_speculative_tokens=4)
        done = engine.generate(prompts(4, seed=9), SamplingParams(temperature=0, max_tokens=30))
        outputs[tp] = [c.output_token_ids for c in done]
        assert group.num_free_slots == 4
    assert outputs[2] == outputs[1]


def test_a_group_launches_each_decode_step_before_it_reads_the_last(groups, monkeypatch):
    """Issue 52's overlap on a unit's target group: rank 0 keeps a launched step, and the
    coordinator launches step N + 1 (its rows fed from step N's verdicts on rank 0's device,
    which under TP sends those tokens to the other rank first) before it asks for step N's
    result. The same tokens as one verify a step: greedy, seeded and unseeded rows (one seed
    stream per run), an end on ``max_tokens`` mid-run and an abort."""
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20),
              SamplingParams(temperature=0.8, max_tokens=20), SamplingParams(temperature=0, max_tokens=7)]
    sent, send = [], GroupStep.send
    monkeypatch.setattr(GroupStep, "send", lambda self, after=None: sent.append(after) or send(self, after))
    runs = {}
    for ahead in (False, True):
        stream = random.Random(7)
        monkeypatch.setattr(spec_decode, "random_seed", lambda s=stream: s.getrandbits(62))
        engine = SpecDecodeEngine(groups[2], make_tiny_tokenizer(), eos_token_ids=frozenset({2}),
                                  launch_ahead=ahead)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts(4, seed=9), params)]
        tokens = {i: [] for i in ids}
        for step in itertools.count():
            if step == 4:
                assert engine.abort(ids[2])
            for out in engine.step():
                tokens[out.seq_id] += out.new_token_ids
            if not engine.has_unfinished():
                break
        runs[ahead] = tokens
        assert groups[2].num_free_slots == 4
    assert runs[True] == runs[False]
    assert [len(t) for t in runs[True].values()] == [20, 20, 4, 7]
    assert sum(after is not None for after in sent) >= 15  # steps fed from the step before


def test_tp2_returns_tp1_hidden_states_and_feeds_eagle(groups, tiny_models):
    """The final hidden states come back from rank 0 under TP (what an EAGLE head reads),
    equal to TP = 1's, and EAGLE speculation over the TP group keeps greedy output."""
    batch = [p[:n] for p, n in zip(prompts(2, seed=5), (6, 13))]
    hidden = {}
    for tp, group in groups.items():
        slots = [group.allocate() for _ in batch]
        out = group.forward(ForwardBatch(slots, batch, [1, 2], hidden=True))
        hidden[tp] = out.hidden
        assert out.logits.shape[0] == 3 and hidden[tp].shape[0] == sum(map(len, batch))
        for slot in slots:
            group.free(slot)
    assert (hidden[2] - hidden[1]).abs().max() <= 1e-4
    head = eagle_head_of(tiny_models[2])
    params = SamplingParams(temperature=0, max_tokens=30)
    reference = SpecDecodeEngine(groups[1], make_tiny_tokenizer(), eos_token_ids=frozenset({2}))
    expected = [c.output_token_ids for c in reference.generate(prompts(4, seed=9), params)]
    engine = SpecDecodeEngine(groups[2], make_tiny_tokenizer(), eos_token_ids=frozenset({2}),
                              proposer=EagleProposer(ModelWorker(head, num_slots=4, max_seq_len=256)),
                              num_speculative_tokens=3)
    assert [c.output_token_ids for c in engine.generate(prompts(4, seed=9), params)] == expected
    assert engine.counters.spec.num_accepted_tokens > 0 and groups[2].num_free_slots == 4


@pytest.fixture(scope="module")
def paged_group(local_ray, tiny_models):
    """TP = 2 on ``kv_cache.layout: paged``: the coordinator owns the block tables and the
    prefix cache, and both ranks follow them."""
    cfg = UnitConfig.model_validate({
        "engine": {"target": {"source": tiny_models[0], "device": "cpu"},  # fake GPUs
                   "max_model_len": 256, "max_num_seqs": 4,
                   "kv_cache": {"layout": "paged", "block_size": 16}},
        "tensor_parallel_size": 2, "accelerator": "gpu"})
    pg = placement_group(unit_bundles(cfg), strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    group = TargetGroup(cfg, pg, first_bundle=1)
    yield group
    group.shutdown()
    remove_placement_group(pg)


def _conversation(group) -> list[list[int]]:
    """Two turns of two conversations (greedy, and seeded sampled) and a request of n = 2
    (its samples fork the prompt's blocks), chunked prefill on: every output, in order."""
    engine = SpecDecodeEngine(group, make_tiny_tokenizer(), eos_token_ids=frozenset({2}),
                              proposer=NgramProposer(), num_speculative_tokens=4,
                              chunked_prefill_size=16)
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=5)]
    first = prompts(2, seed=7)
    done = engine.generate(first, params)
    second = [p + c.output_token_ids + list(range(40, 49)) for p, c in zip(first, done)]
    out = [c.output_token_ids for c in done] + \
        [c.output_token_ids for c in engine.generate(second, params)]
    ids = engine.add_parallel(second[0] + [50, 51, 52], params[1], 2)
    samples = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            samples[o.seq_id] += o.new_token_ids
    return out + [samples[i] for i in ids]


def test_paged_tp2_follows_the_coordinators_tables_and_prefix_cache(groups, paged_group):
    assert _conversation(paged_group) == _conversation(groups[2])
    stats = paged_group.table.stats
    assert stats.hits >= 2 * 16 and stats.forks == 1, stats
    assert paged_group.num_free_slots == 4
    paged_group.table.check()


def test_a_rank_freezes_what_it_loaded_out_of_the_collector(tiny_models):
    """After warm-up a rank's model objects are frozen (``gc.freeze``): a full collection no
    longer walks them (167 ms for the embedded model's process), and later objects are
    collected as before. A rank in this process, as a CPU unit's target at TP = 1 is."""
    import gc

    from specserve.serve.target_group import TargetRank

    threads = torch.get_num_threads()
    gc.unfreeze()
    try:
        rank = TargetRank(0, 1)
        rank.setup({"target": {"source": tiny_models[0]}, "max_model_len": 64, "max_num_seqs": 1},
                   "", 0, "gloo")
        assert gc.get_freeze_count() == 0
        rank.warm_up()
        assert gc.get_freeze_count() > 1000  # the model's modules, tensors, the libraries' own
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
