"""Device discipline without a GPU (tests/device_double.py): the engine, with the target,
a draft model, an EAGLE head and EAGLE trees on a second device, computes with device tensors
only and hands back CPU tensors and plain data only; a planted CPU tensor in the sampler, or
a device tensor on its way out of a process, fails the check.

The double checks which device each tensor is on, as CUDA does, not CUDA itself: kernels,
streams and bf16 are the lent GPU machine's (docs/BENCHMARKS.md)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from specserve.config import SamplingParams
from specserve.engine import spec_decode
from specserve.engine.drafts.draft_model import DraftModelProposer
from specserve.engine.drafts.eagle import EagleOptions, EagleProposer
from specserve.engine.drafts.ngram import NgramProposer
from specserve.engine.runtime import block_attention
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step import sampling
from specserve.engine.step.penalties import history
from specserve.engine.step.proposal import DraftRequest, Proposal, TopK
from specserve.engine.worker import Launched, ModelWorker, Verified
from specserve.serve.wire import DeviceTensorCrossing, host_only, wire_bytes

from tests.device_double import DeviceDouble, DeviceMix, OnDevice, to_double
from tests.engine.rows import verify_batch
from tests.engine.test_spec_decode import EOS, prompts
from tests.models import eagle_head_of, perturbed, runtime_of
from tests.tiny import make_tiny_tokenizer

PARAMS = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
          SamplingParams(temperature=0.8, top_k=30, max_tokens=12, seed=7),   # drafter-invariant
          SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, logprobs=1),  # rejection test
          SamplingParams(temperature=0.7, max_tokens=12)]


def _worker(runtime, device: bool, slots: int = 8) -> ModelWorker:
    runtime.use_kernels("library")  # the C kernels read CPU pointers; a GPU runs the library's
    return ModelWorker(to_double(runtime) if device else runtime, num_slots=slots, max_seq_len=256)


def _engine(target_hf, method: str, device: bool) -> SpecDecodeEngine:
    if method == "draft_model":
        proposer = DraftModelProposer(_worker(runtime_of(perturbed(target_hf, scale=0.3)), device),
                                      q_top_k=8)
    else:
        proposer = EagleProposer(_worker(eagle_head_of(target_hf), device),
                                 EagleOptions(tree=method == "eagle-tree", tree_topk=3, tree_depth=3))
    return SpecDecodeEngine(_worker(runtime_of(target_hf), device), make_tiny_tokenizer(),
                            eos_token_ids=EOS, proposer=proposer, num_speculative_tokens=4)


def _checked_at_the_boundary(engine: SpecDecodeEngine) -> list[int]:
    """What the target's verify and the proposer return goes through ``host_only`` (as the
    actors' replies do); returns a list that counts the checks."""
    checks = []
    verify, propose = engine.target.verify, engine.draft.proposer.propose

    def checked(fn):
        def call(*args, **kwargs):
            checks.append(1)
            return host_only(fn(*args, **kwargs))
        return call

    engine.target.verify, engine.draft.proposer.propose = checked(verify), checked(propose)
    return checks


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle-tree"])
def test_the_engine_computes_on_its_device_and_returns_host_data(target_hf, method, monkeypatch):
    """Greedy, seeded and unseeded sampled rows in one batch, the models on the double's
    device: no op mixes devices, nothing off the host leaves verify or propose, and the
    output is the plain CPU engine's, token for token (same data, same seeds: the unseeded
    rows' seeds come from a counter here, not from the OS)."""
    batch = prompts(4, seed=3)
    monkeypatch.setattr(spec_decode, "random_seed", itertools.count(100).__next__)
    expected = _engine(target_hf, method, device=False).generate(batch, PARAMS)
    monkeypatch.setattr(spec_decode, "random_seed", itertools.count(100).__next__)
    with DeviceDouble() as double:
        engine = _engine(target_hf, method, device=True)
        assert engine.target.runtime.embed.weight.device.type == "cuda"
        checks = _checked_at_the_boundary(engine)
        done = engine.generate(batch, PARAMS)
    assert [c.finish_reason for c in done] == ["length"] * 4  # none failed on a mix
    assert [c.output_token_ids for c in done] == [c.output_token_ids for c in expected]
    assert [c.logprobs for c in done] == [c.logprobs for c in expected]
    assert engine.counters.spec.num_draft_tokens > 0 and len(checks) > 4 and double.calls > 1000
    if method == "eagle-tree":
        assert engine.counters.num_tree_drafts > 0


# Host-device traffic of one engine step today, on the double (issue 52 brings each to 1:
# persistent device inputs filled by one copy, one read of the step's result). A ceiling, so
# that no change adds copies or syncs to the step unseen; lower it as the step improves.
# Library kernels, two rows, n-gram K = 4. Before issue 52's first changes: greedy 10 up and
# 7 down, sampled 15 and 10 (the inputs copied piece by piece, the acceptance read back row by
# row). Now the forward's inputs, its logit positions, the library attention's mask inputs,
# the drafts, the sampling settings, the noise keys and uniforms all go in one copy (a
# :class:`~specserve.engine.runtime.forward_batch.Upload` the worker fills before the forward),
# and the result comes back in one read: issue 52's one each way. The host waits for the
# device once a step (DeviceDouble.waits): for that read's copy, queued when the step launched.
TRAFFIC_CEILING = (1, 1, 1)
KINDS = {"greedy": SamplingParams(temperature=0, max_tokens=10),
         "seeded": SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=3),
         "unseeded": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10)}


@pytest.mark.parametrize(("kind", "kernels"), [(kind, "library") for kind in KINDS]
                         + [("seeded", "compiled"), ("greedy", "compiled")])
def test_host_device_traffic_per_step_is_counted_and_held(target_hf, kind, kernels):
    """Two rows decode with n-gram drafts, the target on the double's device: the largest
    number of host-to-device copies and of device-to-host reads in one step, against the
    ceiling above; the double counts what a GPU pays for (tests/device_double.py). The
    compiled path runs its graph's code eagerly here (``backend=None``: the double is no
    compiler's device): its bucket buffers take the step's one copy."""
    with DeviceDouble() as double:
        runtime = to_double(runtime_of(target_hf)).use_kernels(
            kernels, backend=None, attention="sdpa", verify_tokens=5)
        engine = SpecDecodeEngine(ModelWorker(runtime, num_slots=8, max_seq_len=256), make_tiny_tokenizer(),
                                  eos_token_ids=EOS, proposer=NgramProposer(), num_speculative_tokens=4)
        for prompt in prompts(2, seed=5):
            engine.add_request(prompt, KINDS[kind])
        engine.step()  # the prefill
        counts = []
        while engine.has_unfinished():
            before = (double.to_device, double.to_host, double.waits)
            engine.step()
            counts.append((double.to_device - before[0], double.to_host - before[1],
                           double.waits - before[2]))
    worst = tuple(max(c[i] for c in counts) for i in range(3))
    print(f"\n{kind}, {kernels}: per decode step, host-to-device {worst[0]}, device-to-host "
          f"{worst[1]}, waits {worst[2]}")
    assert len(counts) >= 2 and all(min(c[i] for c in counts) >= 1 for i in range(3))
    if kernels == "compiled":  # the decodes and verifies ran in the bucket's graph
        assert (2, 8) in runtime.static.buckets
    assert all(w <= ceiling for w, ceiling in zip(worst, TRAFFIC_CEILING)), worst


# A model-drafted step's waits: the proposal's read (and an unseeded row's q: ids and
# probabilities), one per sampler call, and an EAGLE head's kept features (one read a step).
# An EAGLE tree also reads each level's top-k (one read per tree and level; it was two per
# node) and its acceptance per row, and moves the kept path in the cache.
DRAFTED_WAITS = {("draft_model", "greedy"): 2, ("draft_model", "unseeded"): 4,
                 ("eagle", "greedy"): 3, ("eagle", "unseeded"): 5, ("eagle-tree", "greedy"): 9}


@pytest.mark.parametrize(("method", "kind"), list(DRAFTED_WAITS))
def test_a_model_drafted_step_waits_only_for_what_it_reads(target_hf, method, kind):
    """Two rows drafted by a draft model or an EAGLE head, everything on the double's
    device: the most waits in one step (every one of them a read the step needs). A Python
    list as an index, a factory from host data, a pageable ``.to`` each waited too: 4 to 26
    waits a proposal, once per draft token and sampled row (issue 52)."""
    with DeviceDouble() as double:
        engine = _engine(target_hf, method, device=True)
        for prompt in prompts(2, seed=5):
            engine.add_request(prompt, KINDS[kind])
        engine.step()  # the prefill
        worst = 0
        while engine.has_unfinished():
            waits = double.waits
            engine.step()
            worst = max(worst, double.waits - waits)
    assert engine.counters.spec.num_draft_tokens > 0
    assert worst == DRAFTED_WAITS[method, kind], worst


@pytest.mark.parametrize("kernels", ["library", "compiled"])
def test_a_draft_chain_stays_on_the_device_until_its_proposal_is_read(target_hf, kernels):
    """A draft model drafts K = 4 tokens a row, each drawn token fed to the next forward where
    it was drawn (``ForwardBatch.fed``; the compiled path writes it into its bucket's
    buffer): a proposal reads the device once for greedy and seeded rows (it was once per
    draft token), three times with an unseeded row (its q's ids and probabilities too).
    The greedy row's drafts are the draft model's own greedy chain, decoded a token at a
    time by a second worker that reads each one back."""
    draft_hf = perturbed(target_hf, scale=0.3)
    prompt = prompts(1, seed=9)[0]
    with DeviceDouble() as double:
        runtime = to_double(runtime_of(draft_hf)).use_kernels(
            kernels, backend=None, attention="sdpa", verify_tokens=5)
        proposer = DraftModelProposer(ModelWorker(runtime, num_slots=4, max_seq_len=256), q_top_k=8)
        reads = {}
        for seq_id, kind in enumerate(KINDS):
            proposer.start(seq_id, seed=11)
            request = DraftRequest(seq_id, prompt, k=4, params=KINDS[kind])
            before = double.to_host
            proposal = host_only(proposer.propose([request]))[0]
            reads[kind] = double.to_host - before
            assert len(proposal.token_ids) == 4 and (proposal.probs is not None) == (kind == "unseeded")
            if kind == "greedy":
                drafted = proposal.token_ids
    assert reads == {"greedy": 1, "seeded": 1, "unseeded": 3}, reads
    chain = ModelWorker(runtime_of(draft_hf).use_kernels(kernels, backend=None, attention="sdpa",
                                                         verify_tokens=5), num_slots=1, max_seq_len=256)
    slot, feed, expected = chain.allocate(), prompt, []
    for _ in range(4):
        expected.append(int(chain.forward(ForwardBatch([slot], [feed])).logits[0].argmax()))
        feed = expected[-1:]
    assert drafted == expected


@pytest.mark.parametrize("kernels", ["library", "compiled"])
def test_a_verify_launched_before_the_last_is_read_emits_what_it_would_after(target_hf, kernels):
    """Issue 52's overlap, at the worker: step N + 1 is launched before step N is read, each
    row's pending token taken on the device from its verdict of step N
    (``VerifyRow.follows``); launching waits for nothing (on a GPU a wait would hold the
    host until the device is idle) and queues its own result's read, so that reading step N
    waits for that copy alone, not for step N + 1 queued after it: reading makes no copy of
    its own and waits once per sampler call. Greedy, seeded and unseeded rows emit what
    verifies read one at a time emit (their draws are a function of seed and position: the
    rows sit in other slots)."""
    sampling = [(params, 5 + i) for i, params in enumerate(KINDS.values())]
    first = prompts(3, seed=4)
    with DeviceDouble() as double:
        runtime = to_double(runtime_of(target_hf)).use_kernels(
            kernels, backend=None, attention="sdpa", verify_tokens=5)
        worker = ModelWorker(runtime, num_slots=6, max_seq_len=256)
        outputs = {}
        for way in ("one at a time", "launched ahead"):
            slots = [worker.allocate() for _ in sampling]
            start = worker.verify(verify_batch(worker, slots, first, [Proposal([])] * 3, sampling))
            emitted = [v.emitted for v in start.verdicts]
            if way == "one at a time":
                for _ in range(5):
                    done = worker.verify(verify_batch(worker, slots, [e[-1:] for e in emitted],
                                                     [Proposal([])] * 3, sampling))
                    emitted = [e + v.emitted for e, v in zip(emitted, done.verdicts)]
            else:
                launched = worker.launch(verify_batch(worker, slots, [e[-1:] for e in emitted],
                                                     [Proposal([])] * 3, sampling))
                for step in range(5):
                    waits, reads = double.waits, double.to_host
                    ahead = None if step == 4 else worker.launch(
                        verify_batch(worker, slots, [[0]] * 3, [Proposal([])] * 3, sampling,
                                     follows=[0, 1, 2]),
                        after=launched)
                    assert double.waits == waits  # launched without waiting
                    queued = double.to_host - reads  # its reads, one per sampler call
                    assert queued >= (ahead is not None), queued
                    waits, reads = double.waits, double.to_host
                    emitted = [e + v.emitted for e, v in zip(emitted, launched.result().verdicts)]
                    assert double.to_host == reads and 1 <= double.waits - waits <= 3, (
                        double.to_host - reads, double.waits - waits)
                    launched = ahead
            outputs[way] = emitted
    assert outputs["launched ahead"] == outputs["one at a time"]
    assert all(len(e) == 6 for e in outputs["one at a time"])


def test_the_engine_launches_each_decode_step_before_it_reads_the_last(target_hf, monkeypatch):
    """``launch_ahead`` (the default where the target runs on CUDA: ``TargetCalls``): a step
    of plain decodes launches the next step, its tokens taken on the device, before it reads
    its own. The output is the same, token for token, as without it: greedy, seeded and
    unseeded rows (the unseeded ones' seeds from one stream per run), rows that end on EOS
    and on ``max_tokens`` mid-run, a request aborted between steps and one that arrives
    mid-run (it waits a step to be scheduled). On a CPU it runs for this test alone (a
    forward there runs as it is called: nothing to hide)."""
    reference = SpecDecodeEngine(ModelWorker(runtime_of(target_hf), num_slots=1, max_seq_len=256),
                                 make_tiny_tokenizer(), eos_token_ids=frozenset())
    first = prompts(4, seed=6)
    eos = frozenset({reference.generate(first[:1], KINDS["greedy"])[0].output_token_ids[4]})
    params = [SamplingParams(temperature=0, max_tokens=14), KINDS["seeded"], KINDS["unseeded"],
              SamplingParams(temperature=0, max_tokens=6)]
    runs, result = {}, Launched.result
    for ahead in (False, True):
        stream = random.Random(7)
        monkeypatch.setattr(spec_decode, "random_seed", lambda s=stream: s.getrandbits(62))
        engine = SpecDecodeEngine(ModelWorker(runtime_of(target_hf), num_slots=6, max_seq_len=256),
                                  make_tiny_tokenizer(), eos_token_ids=eos, launch_ahead=ahead)
        events, launch = [], engine.target.launch
        engine.target.launch = lambda batch, after=None, e=events, go=launch: (
            e.append("ahead" if batch.followers else "launch") or go(batch, after))
        monkeypatch.setattr(Launched, "result", lambda self, e=events: e.append("read") or result(self))
        ids = [engine.add_request(p, sp) for p, sp in zip(first, params)]
        tokens, ends = {i: [] for i in ids}, {}
        for step in itertools.count():
            if step == 3:
                assert engine.abort(ids[2])
            if step == 5:
                tokens[engine.add_request(first[0], KINDS["greedy"])] = []
            for out in engine.step():
                tokens[out.seq_id] += out.new_token_ids
                ends[out.seq_id] = out.finish_reason
            if not engine.has_unfinished():
                break
        runs[ahead] = tokens, ends
        if ahead:
            assert " ".join(events).count("ahead read") >= 5, events  # launched, then read
        else:
            assert "ahead" not in events
    assert runs[True] == runs[False]
    tokens, ends = runs[True]
    assert ends[ids[0]] == "stop" and tokens[ids[0]][-1] in eos and ends[ids[2]] is None  # aborted
    assert "length" in ends.values() and len(tokens) == 5 and all(tokens.values())


def test_a_step_launched_ahead_is_observed_as_the_forward_it_ran(target_hf):
    """An engine with a proposer and the K controller serving requests that do not speculate
    (the router's high-concurrency gate) launches their decodes ahead: each such step is
    never arranged, yet the cost fit and the step times must read it as the forward it ran,
    one token a row (it was read as a forward of no rows, whose time then priced nothing)."""
    from specserve.config import AdaptiveConfig
    from specserve.engine.step.adaptive import SpecLengthController

    engine = SpecDecodeEngine(ModelWorker(runtime_of(target_hf), num_slots=4, max_seq_len=256),
                              make_tiny_tokenizer(), eos_token_ids=frozenset(), proposer=NgramProposer(),
                              controller=SpecLengthController(4, AdaptiveConfig()), launch_ahead=True)
    seen, observe = [], engine.k.controller.observe_forward
    engine.k.controller.observe_forward = lambda rows, tokens, *rest: (
        seen.append((rows, tokens)) or observe(rows, tokens, *rest))
    ahead, launch = [], engine.target.launch
    engine.target.launch = lambda batch, after=None: (
        ahead.append(bool(batch.followers)) or launch(batch, after))
    outs = engine.generate(prompts(2, seed=3), SamplingParams(temperature=0, max_tokens=12),
                           num_speculative_tokens=0)
    assert sum(ahead) >= 5 and all(len(o.output_token_ids) == 12 for o in outs)
    assert all(rows >= 1 and tokens >= rows for rows, tokens in seen), seen
    times = engine.counters.times
    assert times.decode_steps == times.steps - 1 == len(seen) - 1  # all but the prefill (both prompts)


def test_penalties_and_a_drafts_q_go_to_the_device_without_a_wait(target_hf):
    """A verify of an unseeded row with a model draft's q (its top-k ids and probabilities)
    and a seeded one, both under penalties: their token ids, prompt and q go up queued, and
    the verify waits for the device only for its result (one ``.to`` each was a pageable
    copy: a wait apiece, once per row and step). It waits twice, once per sampler call (the
    seeded kind's and the unseeded one's), as every verify does (test_host_device_traffic_*)."""
    penalized = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.1)
    unseeded = SamplingParams(temperature=0.8, **penalized)
    seeded = SamplingParams(temperature=0.8, seed=5, **penalized)
    q = TopK(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0.6, 0.4], [0.5, 0.5]]))
    with DeviceDouble() as double:
        worker = _worker(runtime_of(target_hf), device=True)
        slots = [worker.allocate(), worker.allocate()]
        batch = verify_batch(worker, slots, [[3, 4, 5, 7], [3, 4, 9]], [Proposal([5, 7], q), Proposal([9])],
                             [(unseeded, 1), (seeded, 2)],
                             histories=[history(unseeded, [3, 4], [4]), history(seeded, [3], [4])])
        waits, copies = double.waits, double.to_device
        verified = worker.verify(batch)
        assert double.waits - waits == 2 and double.to_device - copies >= 3
    assert [1 <= len(v.emitted) <= 3 for v in verified.verdicts] == [True, True]


def test_flex_attentions_key_blocks_go_up_in_one_queued_copy():
    """The library path's FlexAttention inputs (``ForwardContext.key_blocks``, made on the
    host once a forward): one copy, no wait (a ``.to`` per tensor was six pageable copies, a
    wait each, in every forward of a draft model on a GPU)."""
    blocks = block_attention.key_blocks(torch.tensor([[70, 71], [5, 6]]), torch.tensor([70, 6]),
                                        torch.tensor([[3], [0]]), num_kv_heads=2, block_len=128)
    with DeviceDouble() as double:
        moved = blocks.to(torch.device("cuda", 0))
        assert (double.to_device, double.waits) == (1, 0)
        assert isinstance(moved.indices, OnDevice) and moved.indices.dtype == torch.int32
        assert torch.equal(moved.indices.cpu(), blocks.indices) and torch.equal(moved.last.cpu(), blocks.last)


def test_a_planted_host_tensor_in_the_sampler_is_caught(target_hf, monkeypatch):
    """The sampler's per-row temperatures on the host (as before issue 21) next to logits on
    the device: the double raises, as CUDA would."""
    sampled = (SamplingParams(temperature=0.7), 1)
    with DeviceDouble():
        worker = _worker(runtime_of(target_hf), device=True)
        slot = worker.allocate()
        worker.verify(verify_batch(worker, [slot], [[5, 6, 7]], [Proposal([])], [sampled]))  # fine as built
        worker.rollback(slot, 0)
        compute_probs = sampling.compute_probs
        monkeypatch.setattr(sampling, "compute_probs", lambda logits, temperature, *rest, **kw:
                            compute_probs(logits, temperature.cpu(), *rest, **kw))
        with pytest.raises(DeviceMix, match="same device"):
            worker.verify(verify_batch(worker, [slot], [[5, 6, 7]], [Proposal([])], [sampled]))


def test_the_double_catches_mixes_and_allows_what_cuda_allows():
    with DeviceDouble():
        x = torch.randn(3, 4).to("cuda")
        with pytest.raises(DeviceMix):
            _ = x * torch.ones(3, 4)
        with pytest.raises(DeviceMix):
            torch.cat([x, torch.zeros(1, 4)])
        with pytest.raises(TypeError):
            x.numpy()
        assert isinstance(x * torch.tensor(2.0), OnDevice)     # a 0-d host scalar is fine
        assert isinstance(x[torch.tensor([0, 2])], OnDevice)   # host indices, as CUDA allows
        assert x.cpu().device.type == "cpu" and not isinstance(x.cpu(), OnDevice)
        assert isinstance(torch.zeros(2, device=x.device), OnDevice)


def test_the_double_counts_copies_and_reads_each_way():
    with DeviceDouble() as double:
        x = torch.randn(3, 4).to("cuda")                      # a copy up
        torch.zeros(2, device=x.device)                       # allocated there: no copy
        ids = torch.tensor([0, 2], device=x.device)           # host data: a copy up
        _ = x[torch.tensor([0, 2])]                            # host indices: a copy up
        _ = x[ids] * 2                                         # all on the device: none
        assert (double.to_device, double.to_host) == (3, 0)
        x.cpu(), x.tolist(), int(x[0, 0]), bool(x[0, 0] > 0)   # four reads
        torch.empty(3, 4).copy_(x)                             # a copy down
        assert (double.to_device, double.to_host) == (3, 5)
        # an output sized by a device tensor's values: its count read back first (a wait)
        waits, mask = double.waits, x > 0
        _ = x[mask], mask.nonzero(), torch.where(mask), ids.repeat_interleave(ids)
        x[mask] = 0.0
        assert double.waits - waits == 5
        _ = x.flatten()[ids], torch.where(mask, x, 1.0), ids.repeat_interleave(ids, output_size=2)
        x.view(-1)[ids] = 1.0                                  # an index, a select: no wait
        assert double.waits - waits == 5


def test_a_device_tensor_cannot_cross_a_process_boundary():
    """``host_only`` (what the target rank and the draft actor return through) refuses a
    device tensor anywhere in the reply, and counts host data by its size."""
    with DeviceDouble():
        hidden = torch.randn(2, 8).to("cuda")
        crossing = Verified([], [hidden], 0.0, 0.0)
        with pytest.raises(DeviceTensorCrossing, match="cuda:0"):
            host_only(crossing)
        assert host_only(Verified([], [hidden.cpu()], 0.0, 0.0)).hidden[0].device.type == "cpu"
    q = TopK(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16))
    assert 4 * 16 * 8 <= wire_bytes(Proposal([1, 2, 3, 4], q)) < 4 * 16 * 8 + 400
