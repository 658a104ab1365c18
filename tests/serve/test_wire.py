"""What crosses the process boundaries of a unit (issue 21): target rank 0 samples next to its
logits and sends back only the tokens each row keeps; a model draft sends token ids and, for
sampled rows, its top-k q. Measured here on the real groups (Ray actors, the target at
TP = 2 over gloo, the draft in its own actor), through the engine a unit runs:

- bytes the coordinator receives per row and step, at batch 8 with sampled rows: under 1 KB
  from the target and under 1 KB from the draft (before: the target's float32 logits, rows
  x (K + 1) x V x 4 bytes, and the draft's full q, K x V x 4);
- sampled output through the groups has the target-only distribution (the chi-square test
  of test_spec_decode, 8000 samples) with a model draft and with an EAGLE head, seeded and
  unseeded; greedy output stays target-only's.

The GPUs of the bundles are Ray's fake ones (tests/serve/conftest.py): torch sees a CPU.
"""

from __future__ import annotations

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from specserve.config import SamplingParams, UnitConfig
from specserve.engine.builder import assemble_engine
from specserve.engine.draft_head import save_draft
from specserve.serve.draft_group import DraftGroup
from specserve.serve.placement import unit_bundles
from specserve.serve.target_group import TargetGroup

from tests.engine.test_spec_decode import (
    SAMPLED,
    chi_square_pvalue,
    exact_joint,
    far_draft,
    prompts,
    sampling_prompt,
)
from tests.models import eagle_head_of
from tests.serve.conftest import save_tiny
from tests.tiny import make_tiny_tokenizer

NUM_SAMPLES = 8000
K = 3


class Unit:
    """A unit's target and draft groups in a placement group, and the engine over them."""

    def __init__(self, target_dir: str, draft: dict, *, tp: int, slots: int,
                 eos: frozenset[int] | None = None) -> None:
        """``eos``: the stop ids (default the target's; the distribution tests stop on none,
        so every sample has its two tokens)."""
        self.cfg = UnitConfig.model_validate({
            "engine": {"target": {"source": target_dir, "device": "cpu"},  # fake GPUs
                       "max_model_len": 256,
                       "max_num_seqs": slots,
                       "speculative": {"num_speculative_tokens": K, "adaptive": {"enabled": False},
                                       **draft}},
            "tensor_parallel_size": tp, "accelerator": "gpu", "draft_timeout_s": 300})
        self.pg = placement_group(unit_bundles(self.cfg), strategy="STRICT_PACK")
        ray.get(self.pg.ready(), timeout=120)
        self.target = TargetGroup(self.cfg, self.pg, 2)
        self.draft = DraftGroup.launch(self.cfg, self.pg, 1, target_vocab_size=self.target.vocab_size)
        eos = frozenset(self.target.info["eos_token_ids"]) if eos is None else eos
        self.engine = assemble_engine(self.target, make_tiny_tokenizer(), eos,
                                      self.cfg.engine.speculative, draft=self.draft)

    def close(self) -> None:
        self.draft.shutdown()
        self.target.shutdown()
        remove_placement_group(self.pg)


@pytest.fixture(scope="module")
def draft_dirs(tiny_models, tmp_path_factory):
    """A model draft far enough from the target that drafts are rejected often (about 0.45
    acceptance), and an EAGLE head of the target (``train-draft``'s format)."""
    far = save_tiny(tmp_path_factory.mktemp("far-draft"), far_draft(tiny_models[2]))
    eagle = tmp_path_factory.mktemp("eagle-wire") / "draft"
    save_draft(eagle_head_of(tiny_models[2]), eagle, target_name="tiny",
               tokenizer=make_tiny_tokenizer(), extra={})
    return {"draft_model": {"method": "draft_model", "draft": {"source": far}},
            "eagle": {"method": "eagle", "draft": {"source": str(eagle)}}}


def test_the_coordinator_receives_under_1_kb_per_sampled_row_and_step(ray_cluster, tiny_models,
                                                                      draft_dirs):
    """Batch 8, every row sampled and unseeded (the rows whose q crosses), TP = 2."""
    unit = Unit(tiny_models[0], draft_dirs["draft_model"], tp=2, slots=8)
    try:
        engine = unit.engine
        for prompt in prompts(8, seed=2):
            engine.add_request(prompt, SamplingParams(temperature=0.8, max_tokens=40))
        engine.step()  # the prefill step: prompts in, hidden states none
        target0, draft0 = (unit.target.received.bytes, unit.target.received.calls), \
            (unit.draft.received.bytes, unit.draft.received.calls)
        rows = 0
        while engine.has_unfinished():
            rows += len(engine.running)
            engine.step()
        target_bytes = unit.target.received.bytes - target0[0]
        draft_bytes = unit.draft.received.bytes - draft0[0]
        assert engine.stats.num_draft_tokens > 0 and rows >= 8
        vocab = unit.target.vocab_size
        print(f"\nper row and step at batch 8: target -> coordinator {target_bytes / rows:.0f} B "
              f"(logits would be {(K + 1) * vocab * 4} B), draft -> coordinator "
              f"{draft_bytes / rows:.0f} B (its full q {K * vocab * 4} B)")
        assert target_bytes / rows < 1024
        assert draft_bytes / rows < 1024
    finally:
        unit.close()


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_sampled_output_through_the_groups_has_the_target_distribution(
        ray_cluster, tiny_models, draft_dirs, method, seeded):
    """8000 samples of the first two tokens (T 0.7, top-k 20), chi-square against the exact
    target-only joint distribution; p > 1e-3 (test_spec_decode's power test shows the same
    test rejects the far draft's own distribution). TP = 1: the sampler is rank 0's either way."""
    torch.manual_seed(20261125)
    target_hf = tiny_models[2]
    unit = Unit(tiny_models[0], draft_dirs[method], tp=1, slots=256, eos=frozenset())
    try:
        params = SAMPLED[1].model_copy(update={"max_tokens": 5 if method == "eagle" else 3})
        prompt = list(sampling_prompt(target_hf))
        done = unit.engine.generate([prompt] * NUM_SAMPLES,
                                    [params.model_copy(update={"seed": i if seeded else None})
                                     for i in range(NUM_SAMPLES)])
        stats = unit.engine.stats
        assert stats.num_draft_tokens > 0 and 0.0 < stats.acceptance_rate < 0.95
        pvalue = chi_square_pvalue([tuple(c.output_token_ids[:2]) for c in done],
                                   exact_joint(target_hf, prompt, SAMPLED[1]))
        assert pvalue > 1e-3
    finally:
        unit.close()


def test_greedy_output_through_the_groups_is_target_only(ray_cluster, tiny_models, draft_dirs):
    from tests.engine.test_spec_decode import make_engine

    batch = prompts(6, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    expected = make_engine(tiny_models[2], None, slots=8).generate(batch, greedy)
    for method in ("draft_model", "eagle"):
        unit = Unit(tiny_models[0], draft_dirs[method], tp=2, slots=8)
        try:
            done = unit.engine.generate(batch, greedy)
            assert unit.engine.stats.num_draft_tokens > 0
            assert [c.output_token_ids for c in done] == [c.output_token_ids for c in expected]
            _n_samples_are_their_seeds_alone(unit.engine, batch[3])
        finally:
            unit.close()


def _n_samples_are_their_seeds_alone(engine, prompt: list[int]) -> None:
    """n = 3 through the groups: the slots fork on every rank and in the draft actor, and
    sample i is the single request of seed 21 + i."""
    seeded = SamplingParams(temperature=0.9, max_tokens=16, seed=21)
    ids = engine.add_parallel(prompt, seeded, 3)
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.seq_id] += out.new_token_ids
    assert engine.num_forked_tokens == 2 * (len(prompt) - 1)
    for i, seq_id in enumerate(ids):
        alone = engine.generate([prompt], seeded.model_copy(update={"seed": 21 + i}))[0]
        assert tokens[seq_id] == alone.output_token_ids, f"sample {i}"
    assert engine.target.num_free_slots == engine.target.num_slots
