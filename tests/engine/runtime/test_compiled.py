"""``kernels: compiled`` (the GPU path: bucketed static shapes under ``torch.compile``).

No GPU here: CUDA graphs (``mode="reduce-overhead"``) and bfloat16 speed are measured on a
lent GPU machine (``tests/gpu``), never in CI. What runs on a CPU is the rest: dynamo must
trace the layer stack as one graph per bucket (``backend="eager"``: dynamo's tracing without
inductor's code generation, so these tests stay quick; ``aot_eager`` adds the
functionalization inductor sees), with the GPU's attention too (``attention="flex"``, run
eagerly), inductor's CPU code must compute the same model, padding must never touch a
sequence's cache, decodes must share the verify's bucket, and a warm-up must leave nothing
to compile.
"""

from __future__ import annotations

import logging

import pytest
import torch
from specserve.config import SamplingParams
from specserve.engine.drafts.ngram import NgramProposer
from specserve.engine.runtime.compiled import BUCKET_TOKENS, bucket, token_bucket
from specserve.engine.runtime.forward_batch import ForwardBatch, Upload
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step.proposal import Proposal
from specserve.engine.worker import ModelWorker
from torch._dynamo.testing import CompileCounter

from tests.engine.rows import verify_batch
from tests.engine.runtime.test_model import ATOL, reference_logits
from tests.engine.test_spec_decode import EOS, prompts
from tests.models import TINY_CONFIGS, VOCAB, random_sequences, runtime_of, tiny_hf_model
from tests.tiny import make_tiny_tokenizer


def compiled(hf, backend="eager", max_len: int = 256, **options):
    return runtime_of(hf, max_len).use_kernels("compiled", backend=backend, **options)


def test_bucket_is_the_next_power_of_two_up_to_the_slots():
    assert [bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert bucket(5, limit=6) == 6 and bucket(1, limit=6) == 1
    assert bucket(BUCKET_TOKENS[-1]) == BUCKET_TOKENS[-1]


def test_decodes_and_verifies_share_the_verify_bucket():
    assert [token_bucket(n, verify_tokens=4) for n in (1, 2, 4, 5, 9)] == [4, 4, 4, 8, 16]
    assert [token_bucket(n) for n in (1, 2, 3)] == [1, 2, 4]  # no verify width: as before
    assert token_bucket(1, verify_tokens=20) == 1  # verifies too wide to compile


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_static_forward_matches_transformers_through_rollbacks(kind):
    """Ragged prefills and continuations padded to buckets, a rejected draft rolled back:
    the logits are transformers' (the sliding window of mistral-window included)."""
    hf = tiny_hf_model(kind)
    rt = compiled(hf)
    cache = rt.make_cache(num_slots=3, max_seq_len=64)
    seqs = random_sequences((9, 30, 14))
    slots = [cache.allocate() for _ in seqs]
    got = [rt(cache, ForwardBatch(slots, [s[:3] for s in seqs], [3, 3, 3])).logits.split(3)]
    for start in range(3, 9, 3):  # verify-sized chunks, with garbage written and rolled back
        rt(cache, ForwardBatch(slots, [[(t + 5) % VOCAB for t in s[start:start + 3]] for s in seqs]))
        for slot in slots:
            cache.rollback(slot, start)
        got.append(rt(cache, ForwardBatch(slots, [s[start:start + 3] for s in seqs],
                                          [3, 3, 3])).logits.split(3))
    for row, seq in enumerate(seqs):
        ours = torch.cat([step[row] for step in got])
        assert (ours - reference_logits(hf, seq[:9])).abs().max() <= ATOL, row
    assert rt.static.buckets == {(3, 4)}  # rows: a power of two, but never more than the slots


def test_one_graph_per_bucket_and_long_prefills_stay_eager():
    """Dynamo traces the whole layer stack as one graph (fullgraph) per (rows, tokens)
    bucket; calls inside a bucket reuse it; a row of more than 16 new tokens runs eagerly."""
    counter = CompileCounter()
    rt = compiled(tiny_hf_model("llama-gqa"), backend=counter)
    cache = rt.make_cache(num_slots=4, max_seq_len=128)
    slots = [cache.allocate() for _ in range(3)]
    rt(cache, ForwardBatch(slots[:1], [list(range(3, 40))]))         # 37 tokens: eager, no graph
    assert counter.frame_count == 0
    for n in (1, 2, 3, 4):                                           # tokens 1, 2, 4, 4
        rt(cache, ForwardBatch(slots[:1], [[5] * n], [n]))
    assert counter.frame_count == 3
    rt(cache, ForwardBatch(slots, [[5], [6, 7, 8], [9]], [1, 3, 1]))  # 3 rows x 3 tokens -> (4, 4)
    rt(cache, ForwardBatch(slots[:2], [[5], [6]]))                   # (2, 1)
    rt(cache, ForwardBatch(slots[:2], [[5], [6]]))
    assert counter.frame_count == 5
    assert rt.static.buckets == {(1, 1), (1, 2), (1, 4), (4, 4), (2, 1)}


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_padding_writes_only_the_spare_slot(attention):
    """Padding rows and tokens land in the spare slot: no sequence's keys change, in a slot
    outside the forward or past a row's own length."""
    rt = compiled(tiny_hf_model("llama-gqa"), attention=attention)
    cache = rt.make_cache(num_slots=4, max_seq_len=64)
    a, b, idle = (cache.allocate() for _ in range(3))
    for slot, n in ((a, 20), (b, 7), (idle, 11)):
        rt(cache, ForwardBatch([slot], [list(range(3, 3 + n))]))
    before = [t.clone() for t in cache.k + cache.v]
    rt(cache, ForwardBatch([a, b], [[4], [5, 6, 7]], [1, 3]))  # bucket (2, 4): a's row has 3 padding tokens
    for old, new in zip(before, cache.k + cache.v):
        changed = (old != new).any(-1).any(1)  # [slots + 1, S]: positions that changed
        assert changed[a].nonzero().flatten().tolist() == [20]
        assert changed[b].nonzero().flatten().tolist() == [7, 8, 9]
        assert not changed[idle].any() and cache.spare_slot == 4


def test_inductor_computes_the_same_model_and_speculation_keeps_greedy_output():
    """Inductor's generated CPU code (the GPU path's compiler, minus CUDA graphs): logits
    equal the library runtime's up to rounding, and greedy n-gram speculation gives the
    target-only output. Not bit-identical by construction on this path (module docstring);
    the tiny model's sharpened logits keep its argmax margins far above rounding."""
    hf = tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0)
    library = runtime_of(hf).use_kernels("library")
    rt = compiled(hf, backend="inductor", verify_tokens=5)  # one token bucket, as serving runs it
    logits = {}
    for name, model in (("library", library), ("compiled", rt)):
        cache = model.make_cache(num_slots=2, max_seq_len=256)
        slots = [cache.allocate() for _ in range(2)]
        model(cache, ForwardBatch(slots, [list(range(3, 50)), list(range(7, 30))]))
        logits[name] = model(cache, ForwardBatch(slots, [[4, 5, 6, 7, 8], [9]], [5, 1])).logits
    assert torch.allclose(logits["compiled"], logits["library"], atol=ATOL)

    outputs = {}
    for method in (None, "ngram"):
        # Two slots: the verify runs the buckets of 2 rows (compiled above) and of 1 (a row
        # done first); a third row would compile a bucket of 4 more (issue 35: 10 s cold).
        engine = SpecDecodeEngine(ModelWorker(rt, num_slots=2, max_seq_len=256),
                                  make_tiny_tokenizer(), eos_token_ids=EOS,
                                  proposer=NgramProposer(min_n=1, max_n=3) if method else None,
                                  num_speculative_tokens=4)
        done = engine.generate(prompts(2, seed=2), SamplingParams(temperature=0, max_tokens=24))
        outputs[method] = [c.output_token_ids for c in done]
    assert outputs["ngram"] == outputs[None]
    assert all(len(o) > 0 for o in outputs[None])


@pytest.mark.parametrize(("kind", "backend"), [("llama-gqa", "aot_eager"), ("mistral-window", "eager")])
def test_flex_attention_matches_transformers_through_rollbacks(kind, backend):
    """The GPU's attention (FlexAttention reading each row's own key blocks) traced in the
    layer stack: after ragged prefills, verify-sized chunks with rejected drafts rolled back
    give transformers' logits, one row crossing a 64-key block, the padding row of bucket
    (4, 4) included; ``aot_eager`` functionalizes the in-place cache writes and the storage
    view as inductor would."""
    hf = tiny_hf_model(kind)
    rt = compiled(hf, backend=backend, attention="flex")
    cache = rt.make_cache(num_slots=4, max_seq_len=128)
    seqs, starts = random_sequences((66, 26, 23)), [60, 20, 17]
    slots = [cache.allocate() for _ in seqs][::-1]
    rt(cache, ForwardBatch(slots, [s[:c] for s, c in zip(seqs, starts)]))  # prefills: the library path
    got = []
    for at in (0, 3):
        chunks = [s[c + at:c + at + 3] for s, c in zip(seqs, starts)]
        rt(cache, ForwardBatch(slots, [[(t + 5) % VOCAB for t in chunk] for chunk in chunks]))
        for slot, c in zip(slots, starts):
            cache.rollback(slot, c + at)
        got.append(rt(cache, ForwardBatch(slots, chunks, [3, 3, 3])).logits.split(3))
    for row, (seq, c) in enumerate(zip(seqs, starts)):
        ours = torch.cat([step[row] for step in got])
        assert (ours - reference_logits(hf, seq[:c + 6])[c:]).abs().max() <= ATOL, row
    assert rt.static.buckets == {(4, 4)}


def test_a_decode_runs_in_the_verify_bucket():
    """verify_tokens=5: a decode (T = 1) and a verify (T = 5) run in one bucket, (rows, 8),
    one graph, and the decode's padding changes none of its logits."""
    counter = CompileCounter()
    hf = tiny_hf_model("llama-gqa")
    rt = compiled(hf, backend=counter, attention="flex", verify_tokens=5)
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    seq = random_sequences((12,))[0]
    slot = cache.allocate()
    logits = [rt(cache, ForwardBatch([slot], [seq[:6]], [6])).logits,
              rt(cache, ForwardBatch([slot], [seq[6:7]])).logits,
              rt(cache, ForwardBatch([slot], [seq[7:12]], [5])).logits]
    assert rt.static.buckets == {(1, 8)} and counter.frame_count == 1
    assert (torch.cat(logits) - reference_logits(hf, seq)).abs().max() <= ATOL


@pytest.mark.parametrize("kernels", ["compiled", "library"])
def test_decodes_and_verifies_run_the_lm_head_at_one_shape(kernels):
    """The final norm and LM head of a decode (one logit per row) and of a verify (K + 1)
    run over the same rows as the layers did: a GEMM's kernel follows its M on a GPU, so a
    token's logits would otherwise round by how many others asked for theirs. ``library``
    pads to its width on CUDA only (``decode_width``), set here as CUDA sets it. A prefill
    past the buckets runs the asked rows only. Logits and EAGLE's hidden states unchanged."""
    hf = tiny_hf_model("llama-gqa")
    rt = runtime_of(hf, 256).use_kernels(kernels, backend="eager", verify_tokens=5)
    if kernels == "library":
        rt.decode_width = 5
    head_rows = []
    rt.lm_head.register_forward_pre_hook(lambda _, args: head_rows.append(args[0].shape[0]))
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    seq = random_sequences((27,))[0]
    slot = cache.allocate()
    logits = [rt(cache, ForwardBatch([slot], [seq[:20]], [20])).logits,
              rt(cache, ForwardBatch([slot], [seq[20:21]])).logits]
    out = rt(cache, ForwardBatch([slot], [seq[21:26]], [5], hidden=True))
    verified, hidden = out.logits, out.hidden
    width = 8 if kernels == "compiled" else 5
    assert head_rows == [20, width, width]
    assert (torch.cat([*logits, verified]) - reference_logits(hf, seq[:26])).abs().max() <= ATOL
    assert hidden.shape == (5, hf.config.hidden_size)
    assert (rt.logits(hidden) - verified).abs().max() <= ATOL


def test_warm_up_compiles_every_bucket_and_leaves_the_cache_as_it_was(caplog):
    """warm_up runs every (rows, tokens) bucket serving uses (rows 1, 2 and the 3 slots;
    tokens the verify's 4) on free slots: afterwards a serving forward compiles nothing, the
    cache's free slots and lengths are unchanged, and a bucket it did not cover warns."""
    counter = CompileCounter()
    rt = compiled(tiny_hf_model("llama-gqa"), backend=counter, attention="flex", verify_tokens=3)
    cache = rt.make_cache(num_slots=3, max_seq_len=64)
    busy = cache.allocate()
    rt(cache, ForwardBatch([busy], [list(range(3, 23))]))  # a sequence in flight keeps its slot and keys
    keys = cache.k[0][busy, :, :20].clone()
    lengths, free = list(cache.lengths), cache.num_free_slots
    with caplog.at_level(logging.INFO, logger="specserve.engine.runtime.compiled"):
        report = rt.warm_up(cache)
    assert [(b["rows"], b["tokens"]) for b in report["buckets"]] == [(1, 4), (2, 4), (3, 4)]
    assert report["graphs"] >= counter.frame_count == 3 and report["cudagraph_skips"] == 0
    assert report["kernels"] == "compiled" and report["prefills"] == []  # prefills: CUDA only
    assert "compiled 3 rows x 4 tokens in" in caplog.text
    assert cache.lengths == lengths and cache.num_free_slots == free
    assert torch.equal(cache.k[0][busy, :, :20], keys)
    slots = [busy, cache.allocate(), cache.allocate()]
    rt(cache, ForwardBatch(slots[:1], [[7]]))
    rt(cache, ForwardBatch(slots[:2], [[7, 8], [9]], [2, 1]))
    rt(cache, ForwardBatch(slots, [[7]] * 3))
    assert counter.frame_count == 3
    with caplog.at_level(logging.WARNING, logger="specserve.engine.runtime.compiled"):
        rt(cache, ForwardBatch(slots[:1], [list(range(3, 12))], [9]))  # 9 tokens: bucket (1, 16)
    assert "while serving" in caplog.text and counter.frame_count == 4


@pytest.mark.parametrize(("kernels", "buckets"), [("invariant", []), ("library", [1, 2])])
def test_warm_up_of_the_other_kernels(kernels, buckets):
    """Nothing compiles per shape on the C kernels: one small forward, no buckets. The
    library's FlexAttention pads rows to powers of two: one forward per row count."""
    rt = runtime_of(tiny_hf_model("llama-gqa")).use_kernels(kernels, attention="flex")
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    report = rt.warm_up(cache)
    assert [b["rows"] for b in report["buckets"]] == buckets and report["kernels"] == kernels
    assert cache.num_free_slots == 2 and cache.lengths == [0, 0]


@pytest.mark.parametrize("kernels", ["invariant", "library"])
def test_a_prefill_verifies_drafts_only_on_row_invariant_kernels(kernels):
    """A prompt and drafts in one forward round the prompt's keys and values as the target-only
    prefill does only where the kernels are row-invariant; elsewhere (every GPU) the prefill
    runs alone and drafting starts at the next step (``KPlanner.plan``). On an H200
    that took greedy speculation's divergences from target-only from 6 of 16 outputs (from
    their first tokens) to 1 (docs/BENCHMARKS.md, "The GPU path")."""
    worker = ModelWorker(runtime_of(tiny_hf_model("llama-gqa")).use_kernels(kernels),
                         num_slots=1, max_seq_len=128)
    assert worker.row_invariant == (kernels == "invariant")
    widths = []
    forward = worker.forward

    def recording(batch):
        widths.append(len(batch.token_ids[0]))
        return forward(batch)

    worker.forward = recording
    engine = SpecDecodeEngine(worker, make_tiny_tokenizer(), eos_token_ids=EOS,
                              proposer=NgramProposer(min_n=1, max_n=3), num_speculative_tokens=4)
    prompt = [5, 6, 7, 8] * 3  # n-gram lookup drafts 5, 6, 7, 8 after it
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert widths[0] == len(prompt) + (4 if kernels == "invariant" else 0)


def test_an_eagle3_target_keeps_the_compiled_path():
    """A target serving an EAGLE-3 head (``feature_layers``) returns those layers' inputs as
    outputs of its bucket's graph: a decode and a verify asking for them run the bucket's
    one graph, with the logits of a target that returns none, bit for bit, and the library
    path's features up to rounding."""
    counter = CompileCounter()
    hf = tiny_hf_model("llama-gqa")
    seq = random_sequences((30,))[0]
    runs = {}
    for name, rt in (("plain", compiled(hf, verify_tokens=5)),
                     ("eagle3", compiled(hf, backend=counter, verify_tokens=5)),
                     ("library", runtime_of(hf, 256).use_kernels("library"))):
        if name != "plain":
            rt.feature_layers = (0, 1)
        cache = rt.make_cache(num_slots=2, max_seq_len=64)
        slot = cache.allocate()
        rt(cache, ForwardBatch([slot], [seq[:20]]))  # a prefill: past the buckets
        runs[name] = [rt(cache, ForwardBatch([slot], [ids], [len(ids)], hidden=True))
                      for ids in (seq[20:21], seq[21:26])]
    assert counter.frame_count == 1
    for plain, eagle3, library in zip(runs["plain"], runs["eagle3"], runs["library"]):
        assert torch.equal(plain.logits, eagle3.logits)
        width = 2 * hf.config.hidden_size  # two layers' inputs
        assert eagle3.hidden.shape == library.hidden.shape == (library.logits.shape[0], width)
        assert (eagle3.hidden - library.hidden).abs().max() <= ATOL


def test_a_bucket_reads_its_inputs_from_one_buffer_its_step_fills():
    """Every forward of a bucket reads one persistent buffer, at one address (what a CUDA
    graph replays from); the step's other uploads arrive with it, and a tail larger than
    the spare still arrives, sent apart, with the same logits."""
    rt = compiled(tiny_hf_model("llama-gqa"), verify_tokens=5)
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    slot = cache.allocate()
    seq = random_sequences((30,))[0]
    rt(cache, ForwardBatch([slot], [seq[:20]]))  # a prefill: past the buckets

    def decode(upload: Upload) -> torch.Tensor:
        logits = rt(cache, ForwardBatch([slot], [seq[20:21]], upload=upload)).logits
        cache.lengths[slot] -= 1  # the same decode again next time
        return logits

    small, large = Upload(), Upload()
    ids, floats = small.add(torch.tensor([7, 8])), small.add(torch.tensor([1.5, -2.0]))
    first = decode(small)
    (buffer,) = rt.static._buffers.values()
    start = buffer.device.data_ptr()
    assert small[ids].tolist() == [7, 8] and small[floats].tolist() == [1.5, -2.0]
    spare = buffer.device.numel() - buffer.layout.size
    many = large.add(torch.arange(spare + 1))
    assert torch.equal(decode(large), first) and torch.equal(large[many], torch.arange(spare + 1))
    assert list(rt.static._buffers.values()) == [buffer] and buffer.device.data_ptr() == start


def test_two_forwards_of_one_bucket_in_a_step_keep_the_first_ones_uploads():
    """A step whose row groups run as two forwards of one bucket (decode rows beside a short
    prompt chunk): the second refills the bucket's buffer, and what the first carried for
    the verification after it (the caller's upload) must still read as it was sent."""
    rt = compiled(tiny_hf_model("llama-gqa"), verify_tokens=5)
    cache = rt.make_cache(num_slots=2, max_seq_len=64)
    a, b = cache.allocate(), cache.allocate()
    seq = random_sequences((30,))[0]
    rt(cache, ForwardBatch([a], [seq[:20]]))
    upload = Upload()
    drafts = upload.add(torch.tensor([[11, 12, 13, 14, 4]]))
    rt(cache, ForwardBatch([a, b], [seq[20:25], seq[:6]], [5, 0], groups=[1, 1], upload=upload))
    assert rt.static.buckets == {(1, 8)}  # both groups in one bucket: one buffer
    assert upload[drafts].tolist() == [[11, 12, 13, 14, 4]]


def test_a_greedy_verify_is_judged_inside_the_graph_as_the_sampler_judges_it():
    """On the compiled path a greedy verify's result is a graph output (issue 52): the
    worker installs ``acceptance.greedy_in_bucket`` as the graph's verdict, which judges
    each row's drafts against the argmax inside the graph. Its verdicts equal the sampler's
    on the same logits (the verdict removed: ``verify_greedy`` after the forward) for rows
    that keep all, some or none of their drafts and a decode row beside them; a planted
    off-by-one (each row's asked columns read one late) is caught."""
    worker = ModelWorker(compiled(tiny_hf_model("llama-gqa"), verify_tokens=5), num_slots=4,
                         max_seq_len=128)
    greedy = (SamplingParams(temperature=0), 0)
    slots = [worker.allocate() for _ in range(4)]
    seqs = random_sequences((20, 24, 18, 22))
    worker.forward(ForwardBatch(slots, [s[:-1] for s in seqs], [0] * 4, groups=[1] * 4))
    starts = [worker.length(slot) for slot in slots]

    def verify(drafts: list[list[int]]) -> tuple[list[tuple[list[int], int]], bool]:
        seen = []
        forward = worker.forward
        worker.forward = lambda batch: seen.append(forward(batch)) or seen[-1]
        try:
            done = worker.verify(verify_batch(
                worker, slots, [[s[-1], *d] for s, d in zip(seqs, drafts)], [Proposal(d) for d in drafts],
                [greedy] * 4))
        finally:
            worker.forward = forward
            for slot, start in zip(slots, starts):
                worker.rollback(slot, start)
        return [(v.emitted, v.num_accepted) for v in done.verdicts], seen[0].verdict is not None

    follow = [[] for _ in slots]  # each row's greedy continuation, a decode at a time
    for _ in range(4):
        out = worker.verify(verify_batch(
            worker, slots, [[f[-1] if f else s[-1]] for s, f in zip(seqs, follow)], [Proposal([])] * 4,
            [greedy] * 4))
        for f, v in zip(follow, out.verdicts):
            f += v.emitted
    for slot, start in zip(slots, starts):
        worker.rollback(slot, start)
    wrong = [(t + 1) % VOCAB for t in (f[0] for f in follow)]
    drafts = [follow[0][:4], [*follow[1][:2], (follow[1][2] + 1) % VOCAB, 3], [wrong[2], 7], []]

    judged, in_graph = verify(drafts)
    assert in_graph and [n for _, n in judged] == [4, 2, 0, 0]
    static = worker.runtime.static
    installed, static.verdict = static.verdict, None
    try:
        assert verify(drafts) == (judged, False)  # the sampler after the forward
        static.verdict = lambda tokens, argmax, first, count: installed(tokens, argmax, first + 1, count)
        assert verify(drafts)[0] != judged  # the planted off-by-one
    finally:
        static.verdict = installed
