"""Trained-draft machinery: the draft head (both kinds), its files, and the EAGLE proposer's
bookkeeping. Losslessness of both proposers is in ``test_spec_decode.py`` (parametrized
``eagle`` / ``decoder_head``); this file checks what those tests cannot see: that the head
serves what it was trained to compute, that a saved draft loads back to the same drafts, and
that a lost EAGLE proposer degrades to target-only without changing a token."""

from __future__ import annotations

import pytest
import torch
from specserve.config import AdaptiveConfig, EngineConfig, ModelConfig
from specserve.engine.builder import build_engine, check_draft_files, load_draft_proposer
from specserve.engine.drafts.draft_head import (
    is_draft_dir,
    load_draft_head,
    new_draft_head,
    read_draft_meta,
    save_draft,
)
from specserve.engine.drafts.draft_model import DraftModelProposer
from specserve.engine.drafts.eagle import EagleProposer
from specserve.engine.loader import load_target_parts
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.model import default_kernels
from specserve.engine.step.adaptive import Row, SpecLengthController
from specserve.engine.step.proposal import DraftRequest
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError, ProposerUnavailable

from tests.engine.test_spec_decode import GREEDY, make_engine, prompts
from tests.models import eagle_head_of, runtime_of, worker_of
from tests.serve.conftest import save_tiny
from tests.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("target"), target_hf)


def _target_features(target_hf, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden state at every position of ``tokens``: ``[len, hidden]``."""
    worker = worker_of(target_hf, 1)
    slot = worker.allocate()
    return worker.forward(ForwardBatch([slot], [tokens], [1], hidden=True)).hidden


def test_the_hidden_states_are_what_the_lm_head_reads(target_hf):
    """The features a target returns give back its own logits through its LM head."""
    worker = worker_of(target_hf, 2)
    a, b = worker.allocate(), worker.allocate()
    rows = [prompts(2)[0], prompts(2)[1][:5]]
    out = worker.forward(ForwardBatch([a, b], rows, [2, 1], hidden=True))
    logits, hidden = out.logits, out.hidden
    assert hidden.shape == (sum(map(len, rows)), target_hf.config.hidden_size)
    wanted = torch.cat([hidden[len(rows[0]) - 2:len(rows[0])], hidden[-1:]])
    torch.testing.assert_close(worker.runtime.logits(wanted), logits)


def test_eagle_proposer_drafts_what_the_head_was_trained_to_compute(target_hf):
    """At every position, the proposer's first draft (cache, catch-up, features as the engine
    sends them) equals the argmax of the head's training forward over the whole sequence, so
    what training optimises is what serving drafts."""
    head = eagle_head_of(target_hf, feature_mix=0.2)
    seq = prompts(3)[2] + prompts(3)[1]
    feats = _target_features(target_hf, seq)
    t = len(seq) - 2
    with torch.no_grad():  # position i reads (x_{i+1}, f_i) and drafts x_{i+2}
        trained = head.logits(head.train_forward(torch.tensor([seq[1:t + 1]]), feats[None, :t])[0])
    proposer = EagleProposer(ModelWorker(head, num_slots=1, max_seq_len=256))
    proposer.start(0, 0)
    sent, first = 0, 4
    for n in range(first, len(seq) - 1):
        (prop,) = proposer.propose([DraftRequest(0, seq[:n + 1], 2, hidden=feats[sent:n])])
        sent = n
        assert prop.token_ids[0] == int(trained[n - 1].argmax())
        proposer.commit(0, n + 1)
    proposer.finish(0)
    assert proposer.worker.num_free_slots == 1 and not proposer.pending


@pytest.mark.parametrize("kernels", ["invariant", "library"])
def test_drafts_warm_up_before_their_first_request_and_leave_no_trace(target_hf, kernels):
    """Issue 52: a draft model and an EAGLE head run a forward in every shape drafting will
    use before the first request (a head with zero features of its width), as the target does;
    the draft actor calls it at start. Their slots stay free, and the drafts after it are a
    fresh proposer's."""
    attention = {"attention": "flex"} if kernels == "library" else {}
    seq = prompts(2)[0]
    feats = _target_features(target_hf, seq)
    drafted = []
    for warm in (False, True):
        head = eagle_head_of(target_hf).use_kernels(kernels, **attention)
        eagle = EagleProposer(ModelWorker(head, num_slots=2, max_seq_len=128))
        draft = DraftModelProposer(ModelWorker(runtime_of(target_hf).use_kernels(kernels, **attention),
                                               num_slots=2, max_seq_len=128))
        for proposer in (eagle, draft):
            if warm:
                assert proposer.warm_up()["kernels"] == kernels
                assert proposer.worker.num_free_slots == 2
            proposer.start(0, 0)
        drafted.append([eagle.propose([DraftRequest(0, seq, 3, hidden=feats[:len(seq) - 1])]),
                        draft.propose([DraftRequest(0, seq, 3)])])
    assert drafted[1] == drafted[0]


def test_eagle_waits_for_features_and_drops_drafted_pairs(target_hf):
    """No features yet (the prefill step): no drafts. After a commit, the head's cache holds
    only pairs built from real features."""
    proposer = EagleProposer(ModelWorker(eagle_head_of(target_hf), num_slots=1, max_seq_len=256))
    seq = prompts(1)[0]
    proposer.start(7, 0)
    assert proposer.propose([DraftRequest(7, seq, 3)])[0].token_ids == []
    feats = _target_features(target_hf, seq[:-1])
    (prop,) = proposer.propose([DraftRequest(7, seq, 3, hidden=feats)])
    assert len(prop.token_ids) == 3
    slot = proposer.slots[7]
    assert proposer.worker.length(slot) == len(seq) - 1 + 2  # catch-up + 2 fed drafts
    proposer.commit(7, len(seq) + 1)
    assert proposer.worker.length(slot) == len(seq) - 1


def test_reduced_vocabulary_drafts_only_its_tokens(target_hf):
    vocab = torch.arange(3, 512, 5)
    head = new_draft_head(runtime_of(target_hf), kind="decoder", num_layers=1, draft_vocab=vocab)
    worker = ModelWorker(head.requires_grad_(False), num_slots=1, max_seq_len=256)
    logits = worker.forward(ForwardBatch([worker.allocate()], [prompts(1)[0]], [3])).logits
    outside = torch.ones(512, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, vocab]).all()


@pytest.mark.parametrize("kind", ["eagle", "decoder"])
def test_saved_draft_loads_back_and_serves_through_the_config(target_hf, target_dir, tmp_path, kind):
    """save -> load (embeddings read from the target's files alone) -> the same drafts; and an
    EngineConfig naming the directory serves greedy output identical to target-only."""
    head = (eagle_head_of(target_hf) if kind == "eagle" else
            new_draft_head(runtime_of(target_hf), kind="decoder", num_layers=2,
                           draft_vocab=torch.arange(512)).requires_grad_(False))
    out = tmp_path / "draft"
    save_draft(head, out, target_name="tiny", tokenizer=make_tiny_tokenizer(), extra={"note": 1})
    assert is_draft_dir(out) and read_draft_meta(out)["kind"] == kind
    embed, cos, _ = load_target_parts(EngineConfig(target={"source": target_dir}).target, max_model_len=256)
    torch.testing.assert_close(embed, runtime_of(target_hf).embed.weight)
    loaded = load_draft_head(out, target_cfg=EngineConfig(target={"source": target_dir}).target,
                             max_model_len=256)
    for name, value in head.state_dict().items():  # bfloat16 on disk
        torch.testing.assert_close(loaded.state_dict()[name], value, atol=0.02, rtol=0.02)
    method = "eagle" if kind == "eagle" else "draft_model"
    cfg = EngineConfig.model_validate({"target": {"source": target_dir}, "max_model_len": 256,
                                       "speculative": {"method": method, "num_speculative_tokens": 3,
                                                       "draft": {"source": str(out)}}})
    engine, _ = build_engine(cfg)
    expected = EagleProposer if kind == "eagle" else DraftModelProposer
    assert type(engine.draft.proposer) is expected
    batch = prompts(4, seed=3)
    reference = make_engine(target_hf, None).generate(batch, GREEDY)
    got = engine.generate(batch, GREEDY)
    assert [c.output_token_ids for c in got] == [c.output_token_ids for c in reference]
    assert engine.counters.spec.num_accepted_tokens > 0


def test_method_and_draft_kind_must_agree(target_hf, target_dir, tmp_path):
    out = tmp_path / "eagle"
    save_draft(eagle_head_of(target_hf), out, target_name="tiny", tokenizer=make_tiny_tokenizer(),
               extra={})
    spec = lambda method, source: {"target": {"source": target_dir},  # noqa: E731
                                   "speculative": {"method": method, "draft": {"source": source}}}
    # The config's shape is valid either way; the builder reads the draft and refuses it.
    with pytest.raises(ConfigError, match="needs a 'decoder' draft"):
        check_draft_files(EngineConfig.model_validate(spec("draft_model", str(out))))
    with pytest.raises(ConfigError, match="needs a 'eagle' draft"):
        check_draft_files(EngineConfig.model_validate(spec("eagle", target_dir)))
    (out / "draft.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable specserve draft"):
        check_draft_files(EngineConfig.model_validate(spec("eagle", str(out))))


class FlakyEagle(EagleProposer):
    down = False

    def propose(self, requests):
        if self.down:
            raise ProposerUnavailable("draft actor is dead")
        return super().propose(requests)


def test_lost_eagle_leaves_running_sequences_target_only(target_hf):
    """An EAGLE proposer that comes back has lost every sequence's features: the sequences
    that were running finish target-only, a new one speculates, and no output changes."""
    batch = prompts(4, seed=21)
    reference = make_engine(target_hf, None).generate(batch, GREEDY)
    flaky = FlakyEagle(ModelWorker(eagle_head_of(target_hf), num_slots=8, max_seq_len=256))
    engine = make_engine(target_hf, None)
    engine.draft.proposer, engine.draft.needs_hidden, engine.draft.available = flaky, True, True
    ids = [engine.add_request(p, GREEDY) for p in batch[:3]]
    outputs: dict[int, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        flaky.down = 2 <= step < 4
        if step == 4:
            engine.reattach_proposer()
            assert not any(s.draft_attached for s in engine.scheduler.running.values())
            ids.append(engine.add_request(batch[3], GREEDY))
        for out in engine.step():
            outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
        if step == 6:
            assert [s.seq_id for s in engine.scheduler.running.values() if s.draft_attached] == [ids[3]]
        step += 1
    assert [outputs[i] for i in ids] == [c.output_token_ids for c in reference]
    assert engine.counters.num_draft_fallbacks == 1
    # Re-attaching reset the proposer: the lost sequences' slots are free again, none leak.
    assert flaky.worker.num_free_slots == 8 and not flaky.slots


class ZeroThenK(SpecLengthController):
    """K = 0 for every row for the first ``zero_steps`` steps, then the cap."""

    def __init__(self, max_k: int, zero_steps: int) -> None:
        super().__init__(max_k, AdaptiveConfig())
        self.steps, self.zero_steps = 0, zero_steps

    def plan(self, rows: list[Row]) -> list[int]:
        self.steps += 1
        return [0 if self.steps <= self.zero_steps else r.cap for r in rows]


def test_features_do_not_pile_up_while_nothing_is_drafted(target_hf):
    """Rows the controller keeps at K = 0 still hand their features over each step, and the
    head folds them into its cache once 16 wait: neither side's queue grows with the
    sequence. Drafting resumes afterwards, and the output is target-only's."""
    batch = prompts(3, seed=31)
    reference = make_engine(target_hf, None).generate(batch, GREEDY)
    proposer = EagleProposer(ModelWorker(eagle_head_of(target_hf), num_slots=8, max_seq_len=256))
    engine = make_engine(target_hf, None, controller=None)
    engine.draft.proposer, engine.draft.needs_hidden, engine.draft.available = proposer, True, True
    engine.k.controller = ZeroThenK(3, zero_steps=30)
    ids = [engine.add_request(p, GREEDY, adaptive=True) for p in batch]
    outputs: dict[int, list[int]] = {}
    most_waiting = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
        assert all(len(s.hidden) <= 1 for s in engine.scheduler.running.values())  # only this step's
        most_waiting = max([most_waiting, *(sum(map(len, q)) for q in proposer.pending.values())])
    assert [outputs[i] for i in ids] == [c.output_token_ids for c in reference]
    assert most_waiting < EagleProposer.CATCH_UP_BACKLOG + 8
    assert engine.counters.spec.num_accepted_tokens > 0  # drafting resumed after step 30


def test_a_head_on_the_gpus_attention_drafts_as_the_default(target_hf):
    """A head with the GPU's kernels (``library`` with FlexAttention, what it gets on CUDA)
    computes the default's logits: a catch-up with the target's features, then a fed draft."""
    seq = prompts(2)[0]
    feats = _target_features(target_hf, seq)
    outs = []
    for head in (eagle_head_of(target_hf), eagle_head_of(target_hf).use_kernels("library", attention="flex")):
        cache = head.make_cache(num_slots=2, max_seq_len=128)
        slot = cache.allocate()
        n = len(seq) - 2  # position t reads (x_{t+1}, f_t)
        catch_up = head(cache, ForwardBatch([slot], [seq[1:n + 1]], [3], features=feats[:n])).logits
        fed = head(cache, ForwardBatch([slot], [seq[n + 1:n + 2]], features=feats[n:n + 1])).logits
        outs.append(torch.cat([catch_up, fed]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_a_loaded_head_takes_the_kernels_of_its_config(target_hf, tmp_path):
    """``kernels: auto`` gives a head what a draft on its device gets (the C kernels on a
    CPU; library with FlexAttention on CUDA, where a target's are compiled), and the draft's
    config can name them."""
    out = tmp_path / "eagle"
    save_draft(eagle_head_of(target_hf), out, target_name="tiny", tokenizer=make_tiny_tokenizer(),
               extra={})
    target = runtime_of(target_hf)
    head = load_draft_head(out, target, max_model_len=256)
    assert head.kernels == "invariant" and all(layer.attn.invariant for layer in head.layers)
    assert default_kernels("cpu", draft=True) == default_kernels("cpu") == "integer"
    assert default_kernels("cuda:1", draft=True) == "library" and default_kernels("cuda") == "compiled"
    proposer = load_draft_proposer("eagle", ModelConfig(source=str(out), kernels="library"),
                                   num_slots=2, max_model_len=256, target_runtime=target)
    runtime = proposer.worker.runtime
    assert runtime.kernels == "library" and runtime.attention == "sdpa"  # sdpa: a CPU
    assert not any(layer.attn.invariant for layer in runtime.layers)
