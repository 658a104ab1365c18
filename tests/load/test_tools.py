"""The pure parts of the load tools: aggregation, tables, plots, the truncated-draft builder.

No Ray and no SmolLM2: synthetic results and a tiny random Llama built from a config.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from load import bench_speculative as bs
from load import sweep
from load.common import rotated
from load.truncated_draft import truncate_model, truncated_draft
from tests.tiny import make_tiny_tokenizer


# -- sweep: aggregation ------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    assert sweep.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan():
    assert math.isnan(sweep.percentile([], 50))
    assert sweep.percentile([4.0], 99) == 4.0


def _result(start, chunks, end, tokens, drafts=0, draft_tokens=0, accepted=0, on=True, error=None):
    return sweep.RequestResult(start=start, chunk_times=list(chunks), end=end,
                               completion_tokens=tokens, num_drafts=drafts,
                               num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                               speculation_on=on, error=error)


def test_summarize_aggregates_a_level():
    results = [
        _result(0.0, [0.1, 0.3, 0.4], 0.4, tokens=5, drafts=2, draft_tokens=8, accepted=3),
        _result(0.0, [0.2, 0.5], 0.5, tokens=3, drafts=1, draft_tokens=4, accepted=1, on=False),
        _result(0.0, [], None, tokens=0, error="HTTP 429: full", on=None),
    ]
    row = sweep.summarize("on", 2, 4, results, wall_s=2.0)
    assert (row["finished"], row["failed"], row["requests"]) == (2, 1, 4)
    assert row["output_tokens_per_s"] == pytest.approx(8 / 2.0)
    assert row["ttft_p50_ms"] == pytest.approx(150.0)
    # inter-token gaps of the finished requests, pooled: 0.2, 0.1, 0.3
    assert row["itl_p50_ms"] == pytest.approx(200.0)
    assert row["itl_p99_ms"] == pytest.approx(1e3 * float(np.percentile([0.2, 0.1, 0.3], 99)))
    assert row["tpot_p50_ms"] == pytest.approx(1e3 * float(np.median([0.3 / 4, 0.3 / 2])))
    assert row["acceptance_rate"] == pytest.approx(4 / 12)
    assert row["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert row["spec_on_share"] == pytest.approx(0.5)  # the failed request has no header
    assert row["error"] == "HTTP 429: full"


def test_summarize_without_speculation_leaves_acceptance_empty():
    row = sweep.summarize("off", 1, 1, [_result(0.0, [0.1], 0.1, tokens=1, on=False)], wall_s=1.0)
    assert math.isnan(row["acceptance_rate"]) and math.isnan(row["itl_p50_ms"])
    assert row["spec_on_share"] == 0.0
    assert "nan" not in sweep.format_table([row], sweep.TABLE).lower()


def test_sse_events_fold_into_a_result():
    r = sweep.RequestResult(start=0.0)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    text = {"choices": [{"delta": {"content": "Hi"}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 7, "speculation": {
        "num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 5}}}
    assert not sweep.apply_event(r, json.dumps(role), 0.05)
    assert not sweep.apply_event(r, json.dumps(text), 0.1)
    assert not sweep.apply_event(r, json.dumps(usage), 0.3)
    assert sweep.apply_event(r, "[DONE]", 0.31)
    assert r.ok and r.chunk_times == [0.1] and r.end == 0.3
    assert (r.completion_tokens, r.num_draft_tokens, r.num_accepted_tokens) == (7, 8, 5)
    err = sweep.RequestResult(start=0.0)
    assert sweep.apply_event(err, json.dumps({"error": {"message": "boom"}}), 1.0)
    assert not err.ok and err.error == "boom"


def test_header_and_request_bodies():
    assert sweep.speculation_header_on("on; reason=default; method=ngram; k=4") is True
    assert sweep.speculation_header_on("off; reason=client_override") is False
    assert sweep.speculation_header_on(None) is None
    assert sweep.describe_speculation("on; reason=default; method=ngram; k=4") == "ngram, K=4"
    assert sweep.describe_speculation("off; reason=client_override") == ""
    assert sweep.describe_speculation(None) == ""
    bodies = {m: sweep.request_body("m", [{"role": "user", "content": "x"}], 9, m)
              for m in sweep.MODES}
    assert bodies["on"]["speculation"] == {"enabled": True}
    assert bodies["off"]["speculation"] == {"enabled": False}
    assert "speculation" not in bodies["router"]
    assert all(b["stream"] and b["stream_options"]["include_usage"] and b["temperature"] == 0
               for b in bodies.values())
    assert sweep.requests_per_level(1, None) == 24 and sweep.requests_per_level(32, None) == 192
    assert sweep.requests_per_level(32, 4) == 4


def test_local_app_args_validate():
    from specserve.app_config import AppConfig

    cfg = AppConfig.model_validate(sweep.local_app_args(32, 64, 2048, 4))
    assert cfg.unit.engine.max_num_seqs == 32 and cfg.unit.max_queue_len >= 32
    assert cfg.unit.engine.speculative.method == "ngram"
    hybrid = AppConfig.model_validate(sweep.local_app_args(8, 64, 2048, 8, "eagle", "suffix"))
    assert hybrid.unit.engine.speculative.first_method == "suffix"
    assert AppConfig.model_validate(sweep.local_app_args(8, 64, 2048, 8, "suffix")).unit.engine \
        .speculative.method == "suffix"


def test_bench_autoscale_apps_validate_and_its_summary_counts_what_it_says():
    from specserve.app_config import AppConfig

    from load import bench_autoscale as ba

    args = ba.parse_args(["--stages", "10x1,30x8"])
    assert args.stages == [(10, 1), (30, 8)]
    apps = {p: AppConfig.model_validate(ba.app_args(p, args)) for p in ba.POLICIES}
    assert apps["fixed"].autoscaling is None and apps["fixed"].num_units == 2
    assert apps["requests"].autoscaling.policy == "requests"
    assert (apps["speculation"].autoscaling.min_units, apps["speculation"].autoscaling.max_units) == (1, 2)
    samples = [{"t": 0.0, "RUNNING": 1, "load": 0.2}, {"t": 1.0, "RUNNING": 1, "load": 0.9},
               {"t": 2.0, "RUNNING": 1, "STARTING": 1, "load": 0.8},
               {"t": 3.0, "RUNNING": 2, "load": 0.5}, {"t": 4.0, "RUNNING": 2, "load": 2.0}]
    results = [{"status": 200, "complete": True, "ttft": 0.1 * i, "gaps": [0.05]} for i in range(5)]
    results += [{"status": 429, "complete": False}, {"status": 200, "complete": False, "gaps": []}]
    row = ba.summarize("speculation", args, samples, results, 0.0)
    assert (row["unit_seconds"], row["requests"], row["failed"], row["cut"]) == (7, 7, 1, 1)
    times = ("load_crossed_s", "second_unit_asked_s", "second_unit_running_s")
    assert tuple(row[k] for k in times) == (1.0, 2.0, 3.0)
    assert row["mean_crossed_s"] == 4.0  # the 5 s mean: 0.2, 0.55, 0.63, 0.6, then 0.88


def _fake_server(delay_s: float, hang: bool = False, peers: int = 1):
    """An httpx transport that streams a chat answer as SSE, counting requests in flight.
    With ``peers``, the first answer starts only once that many requests were in flight
    together (or after a minute): the test then sees the client's concurrency whatever the
    machine's speed, instead of relying on two requests happening to overlap."""
    import asyncio

    import httpx

    state = {"in_flight": 0, "most": 0}

    async def events():
        first = state["most"] == 0
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while first and state["most"] < peers and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.005)
            for piece in ("a", "b", "c"):
                await asyncio.sleep(3600 if hang else delay_s)
                yield f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode()
        except asyncio.CancelledError:  # the client gave up
            state["in_flight"] -= 1
            raise
        state["in_flight"] -= 1  # done: the client may start its next request now
        usage = {"choices": [], "usage": {"completion_tokens": 3, "speculation": {
            "num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 2}}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

    def handler(request):
        return httpx.Response(200, headers={"x-speculation": "on; reason=default"},
                              content=events())

    return httpx.MockTransport(handler), state


def test_run_level_keeps_exactly_concurrency_in_flight():
    import asyncio

    import httpx

    transport, state = _fake_server(0.01, peers=2)

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            # The limit only bounds a hang: six tiny answers take well under a second.
            return await sweep.run_level(client, "http://127.0.0.1:1/v1/chat/completions",
                                         [{}] * 6, concurrency=2, time_limit_s=600)

    results, wall = asyncio.run(go())
    assert len(results) == 6 and all(r.ok for r in results) and state["most"] == 2
    row = sweep.summarize("on", 2, 6, results, wall)
    assert row["completion_tokens"] == 18 and row["spec_on_share"] == 1.0
    assert row["acceptance_rate"] == 0.5 and row["itl_p50_ms"] > 0


def test_run_level_stops_at_its_time_limit():
    """Answers that would take an hour: the level ends at its limit (0.3 s), not theirs; the
    bound below only tells the two apart, it is no speed goal."""
    import asyncio
    import time

    import httpx

    transport, state = _fake_server(0.01, hang=True)

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await sweep.run_level(client, "http://127.0.0.1:1/v1/chat/completions",
                                         [{}] * 4, concurrency=2, time_limit_s=0.3)

    start = time.perf_counter()
    results, wall = asyncio.run(go())
    assert time.perf_counter() - start < 300 and wall < 300
    assert results == [] and state["in_flight"] == 0  # cancelled streams were closed


# -- plots ---------------------------------------------------------------------------------------
def _sweep_rows():
    rows = []
    for mode, speed in (("on", 1.5), ("off", 1.0), ("router", 1.4)):
        for c in (1, 2, 4, 8):
            rows.append({"mode": mode, "concurrency": c, "output_tokens_per_s": 20 * c * speed,
                         "itl_p99_ms": 40.0 * c / speed})
    return rows


def _legend_labels(ax):
    legend = ax.get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


def test_sweep_figure_and_png(tmp_path):
    fig = sweep.make_figure(_sweep_rows(), "SmolLM2 on a test machine")
    left, right = fig.axes
    assert left.get_ylabel() == "output throughput (tokens/s)"
    assert right.get_ylabel() == "p99 inter-token latency (ms)"
    for ax in (left, right):
        assert ax.get_xlabel() == "concurrency (requests in flight)"
        assert ax.get_xscale() == "log"
        assert _legend_labels(ax) == ["on", "off", "router"]
    assert "SmolLM2" in fig.get_suptitle()
    path = tmp_path / "sweep.png"
    sweep.save_plot(_sweep_rows(), "title", path)
    assert path.is_file() and path.stat().st_size > 1000


def test_sweep_csv(tmp_path):
    results = [_result(0.0, [0.1, 0.2], 0.2, tokens=2)]
    rows = [sweep.summarize("on", 1, 1, results, 1.0), sweep.summarize("off", 1, 1, [], 1.0)]
    path = tmp_path / "sweep.csv"
    sweep.write_csv(rows, path, sweep.CSV_COLUMNS)
    read = list(csv.DictReader(path.open()))
    assert [r["mode"] for r in read] == ["on", "off"]
    assert tuple(read[0]) == sweep.CSV_COLUMNS
    assert float(read[0]["output_tokens_per_s"]) == 2.0 and read[1]["ttft_p50_ms"] == ""


def test_sweep_same_text_compares_each_prompt_across_modes_and_repeats():
    def done(prompt, text):
        r = _result(0.0, [0.1], 0.1, tokens=1)
        r.prompt, r.text = prompt, text
        return r

    failed = done("c", "other")
    failed.error = "HTTP 500"
    results = [done("a", "x"), done("a", "x"), done("a", "x"), done("b", "y"), done("b", "z"),
               done("c", "w"), failed, done("d", "alone")]
    # a: one text; b: two; c: its failed request is left out, one finished: not compared.
    assert sweep.same_text(results) == (1, 2)


def _tally(tokens, seconds, steps, propose, verify, drafts=0, draft_tokens=0, accepted=0):
    """A run whose prefill step took 10% of its time and emitted one token."""
    return bs.Tally(runs=1, tokens=tokens, seconds=seconds, decode_tokens=tokens - 1,
                    decode_seconds=0.9 * seconds, steps=steps, propose_s=propose,
                    verify_s=verify, accept_s=0.01 * steps, drafts=drafts,
                    draft_tokens=draft_tokens, accepted_tokens=accepted)


def test_bench_speculative_rows_cost_model_and_best():
    tallies = {
        (bs.BASELINE, 1): _tally(100, 5.0, 100, 0.0, 4.0),
        (bs.BASELINE, 2): _tally(100, 5.0, 100, 0.0, 4.0),
        ("ngram", 1): _tally(100, 4.0, 60, 0.06, 3.0, drafts=50, draft_tokens=50, accepted=40),
        ("ngram", 2): _tally(100, 3.0, 40, 0.08, 2.4, drafts=40, draft_tokens=80, accepted=60),
        ("draft_model", 2): _tally(100, 8.0, 70, 4.0, 3.5, drafts=70, draft_tokens=140,
                                   accepted=30),
    }
    rows = bs.to_rows(tallies)
    base = rows[0]
    assert base["method"] == bs.BASELINE and base["tokens_per_s"] == pytest.approx(20.0)
    ngram2 = next(r for r in rows if r["method"] == "ngram" and r["k"] == 2)
    assert ngram2["speedup"] == pytest.approx((100 / 3.0) / 20.0)
    assert ngram2["acceptance_rate"] == pytest.approx(0.75)
    assert ngram2["mean_acceptance_length"] == pytest.approx(1 + 60 / 40)
    assert ngram2["decode_speedup"] == pytest.approx((99 / 2.7) / (99 / 4.5))
    per_token = 4.5 / 99  # the baseline's decode seconds per token
    c, v = 0.08 / 40 / 2 / per_token, 2.4 / 40 / per_token
    assert (ngram2["c"], ngram2["v"]) == (pytest.approx(c), pytest.approx(v))
    from specserve.engine.step.cost_model import expected_speedup

    assert ngram2["predicted_speedup"] == pytest.approx(expected_speedup(0.75, 2, c, v))
    # n-gram at K = 1 drafted in 50 of its 60 steps: the other 10 emit one token each
    ngram1 = next(r for r in rows if r["method"] == "ngram" and r["k"] == 1)
    c1, v1 = 0.06 / 60 / per_token, 3.0 / 60 / per_token
    assert ngram1["draft_share"] == pytest.approx(50 / 60)
    assert ngram1["predicted_tokens_per_step"] == pytest.approx(50 / 60 * 1.8 + 10 / 60)
    assert ngram1["predicted_speedup"] == pytest.approx((50 / 60 * 1.8 + 10 / 60) / (c1 + v1))
    # the best is the fastest, not the longest acceptance
    assert [r for r in rows if r["best"]] == [ngram2]


def test_bench_speculative_schedule_interleaves_the_baseline():
    order = bs.schedule(2, [1, 3], ["ngram", "draft_model"])
    assert len(order) == 2 * 2 * 3
    groups = [order[i:i + 3] for i in range(0, len(order), 3)]
    for group in groups:
        assert {m for _, _, m in group} == {bs.BASELINE, "ngram", "draft_model"}
        assert len({(p, k) for p, k, _ in group}) == 1
    assert len({g[0][2] for g in groups}) == 3  # the first runner rotates


def test_bench_speculative_figure_and_csv(tmp_path):
    tallies = {(bs.BASELINE, k): _tally(100, 5.0, 100, 0.0, 4.0) for k in (1, 2, 3)}
    for k in (1, 2, 3):
        tallies[("ngram", k)] = _tally(100, 5.0 - k, 100 // (k + 1), 0.01, 3.0, 30, 30 * k, 20 * k)
        tallies[("draft_model", k)] = _tally(100, 6.0 + k, 80, 2.0, 3.0, 80, 80 * k, 10 * k)
    rows = bs.to_rows(tallies)
    fig = bs.make_figure(rows, "SmolLM2 K sweep")
    speed, length = fig.axes
    assert speed.get_ylabel() == "output throughput (tokens/s, prefill included)"
    assert length.get_ylabel() == "mean acceptance length (tokens per step)"
    assert speed.get_xlabel() == length.get_xlabel() == "K (draft tokens per step)"
    labels = _legend_labels(speed)
    assert labels[:2] == ["ngram", "draft_model"]
    assert any(lbl.startswith(bs.BASELINE) for lbl in labels)
    assert "best: ngram K=3" in labels
    assert "ngram" in _legend_labels(length)
    path = tmp_path / "bench.png"
    bs.save_plot(rows, "title", path)
    assert path.is_file() and path.stat().st_size > 1000
    bs.write_csv(rows, tmp_path / "bench.csv", bs.CSV_COLUMNS, as_int=("best",))
    read = list(csv.DictReader((tmp_path / "bench.csv").open()))
    assert len(read) == 7 and sum(int(r["best"]) for r in read) == 1
    assert "ngram" in bs.format_table(rows, bs.TABLE)


# -- truncated draft ---------------------------------------------------------------------------
@pytest.fixture
def tiny_target(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path / "tiny-target"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def test_truncated_draft_keeps_first_layers_and_tokenizer(tiny_target, tmp_path):
    from specserve.config import ModelConfig
    from specserve.engine.builder import check_same_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, target = tiny_target
    cache = tmp_path / "cache"
    draft_path = truncated_draft(str(path), num_layers=1, cache_dir=cache)
    assert draft_path.parent == cache / "drafts"
    draft = AutoModelForCausalLM.from_pretrained(draft_path)
    assert draft.config.num_hidden_layers == 1 and len(draft.model.layers) == 1
    assert AutoTokenizer.from_pretrained(draft_path).get_vocab() == \
        AutoTokenizer.from_pretrained(path).get_vocab()
    check_same_tokenizer(ModelConfig(source=str(path)), ModelConfig(source=str(draft_path)))
    kept = target.state_dict()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, kept[name]), name
    assert (draft_path / "generation_config.json").is_file()
    assert truncated_draft(str(path), num_layers=1, cache_dir=cache) == draft_path  # reused


def test_truncate_model_refuses_bad_layer_counts(tiny_target):
    _, model = tiny_target
    with pytest.raises(ValueError, match="num_layers"):
        truncate_model(model, 4)
    with pytest.raises(ValueError, match="num_layers"):
        truncate_model(model, 0)


def test_measure_splits_prefill_from_decode_on_a_tiny_engine():
    from specserve.config import SamplingParams

    from tests.engine.test_spec_decode import make_engine, prompts
    from tests.models import tiny_hf_model

    engine = make_engine(tiny_hf_model(logit_scale=4.0), "ngram", k=3, slots=1)
    prompt = prompts(1)[0]
    [reference] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20),
                                  num_speculative_tokens=3)
    times = engine.counters.times
    before = dataclasses.replace(times)
    tally = bs.measure(engine, prompt, 20, num_speculative_tokens=3)
    assert tally.tokens == len(reference.output_token_ids) and tally.runs == 1
    assert tally.steps == times.steps - before.steps - 1  # the prefill step is left out
    # the engine's own count agrees: every step but the prefill decodes (verifies that kept
    # drafts included: told before the rows advance), and its forwards are part of the verify time
    assert times.decode_steps - before.decode_steps == tally.steps
    assert 0 < times.decode_verify_s - before.decode_verify_s < times.verify_s - before.verify_s
    assert 0 < tally.decode_tokens < tally.tokens and 0 < tally.decode_seconds < tally.seconds
    assert tally.draft_tokens == reference.stats.num_draft_tokens
    assert tally.accepted_tokens == reference.stats.num_accepted_tokens
    off = bs.measure(engine, prompt, 20, num_speculative_tokens=0)
    assert off.draft_tokens == 0 and off.decode_tokens == off.steps == off.tokens - 1


def test_sweep_rounds_split_and_rotate():
    """Each level runs in rounds with the modes' order rotated; the parts cover every request."""
    assert sweep.rounds_per_level(1, 24, None) == 24 and sweep.rounds_per_level(32, 192, None) == 6
    assert sweep.rounds_per_level(8, 32, 3) == 3
    parts = sweep.split_rounds(16, 3)
    assert [p.stop - p.start for p in parts] == [5, 6, 5] and parts[0].start == 0 and parts[-1].stop == 16
    assert sweep.split_rounds(2, 4) == [slice(0, 1), slice(1, 2)]  # never an empty round
    modes = ["on", "off", "router"]
    assert [rotated(modes, r)[0] for r in range(4)] == ["on", "off", "router", "on"]


def test_sweep_level_summary_ratios_and_round_spread():
    """router / best uses the better of on and off; the round spread is router / on per round."""
    rows = [{"mode": m, "concurrency": 4, "output_tokens_per_s": v}
            for m, v in (("on", 40.0), ("off", 20.0), ("router", 38.0))]
    rounds = [{"concurrency": 4, "round": r, "mode": m, "output_tokens_per_s": v}
              for r, vals in enumerate(((40.0, 20.0, 36.0), (40.0, 20.0, 44.0), (40.0, 20.0, 38.0)))
              for m, v in zip(("on", "off", "router"), vals)]
    [level] = sweep.level_summary(rows, rounds)
    assert level["router_over_best"] == pytest.approx(0.95)
    assert level["on_over_off"] == pytest.approx(2.0) and level["router_over_off"] == pytest.approx(1.9)
    assert level["rounds"] == 3
    assert (level["round_min"], level["round_median"], level["round_max"]) == pytest.approx((0.9, 0.95, 1.1))
    off_better = [dict(r, output_tokens_per_s=50.0) if r["mode"] == "off" else r for r in rows]
    assert sweep.level_summary(off_better, rounds)[0]["router_over_best"] == pytest.approx(38 / 50)
    assert sweep.level_summary(rows[:2], rounds) == []  # a mode missing: no criterion to show
    assert "nan" not in sweep.format_table([level], sweep.LEVEL_TABLE).lower()


# -- roofline ------------------------------------------------------------------------------------
def test_decode_bytes_counts_every_weight_once_and_a_tied_head_again():
    from load.roofline import decode_bytes, forward_costs
    from tests.models import runtime_of, tiny_hf_model

    untied = runtime_of(tiny_hf_model("llama-gqa"))
    tied = runtime_of(tiny_hf_model("llama-mha"))  # tie_word_embeddings
    for rt in (untied, tied):
        every = sum(p.numel() * 4 for p in rt.parameters())  # shared tensors once
        embed = rt.embed.weight.numel() * 4
        head_again = embed if rt.lm_head.weight is rt.embed.weight else 0
        assert decode_bytes(rt) == every - embed + rt.embed.weight.shape[1] * 4 + head_again
    costs = forward_costs(untied, list(range(3, 40)), ts=(1, 4), reps=1)
    assert set(costs) == {1, 4} and all(c > 0 for c in costs.values())


def test_bench_gpu_runs_its_tiny_shape_on_a_cpu(tmp_path, capsys):
    """The GPU benchmark's script, end to end at a tiny shape on the CPU with dynamo's eager
    backend (no GPU here: the figures themselves come from a lent GPU machine)."""
    from load import bench_gpu

    out = tmp_path / "gpu.json"
    bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--backend",
                    "eager", "--rows", "1,2", "--context", "40", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["kernels"], r["rows"]) for r in result["rows"]] == [
        ("library", 1), ("library", 2), ("compiled", 1), ("compiled", 2)]
    assert all(r["tokens_per_s"] > 0 and r["r8"] > 0 for r in result["rows"])
    assert "compiled" in capsys.readouterr().out


def test_bench_suffix_runs_end_to_end_on_the_embedded_model(tmp_path):
    """`make bench-suffix` in miniature: one revision prompt, 8 tokens, target-only against
    suffix decoding with a warm cache made from 2 answers; exit 0 means the outputs were
    identical, and the report carries the cache and the proposer's own cost."""
    import json
    import subprocess
    import sys

    out, warm = tmp_path / "bench.json", tmp_path / "warm.jsonl"
    proc = subprocess.run([sys.executable, "load/bench_suffix.py", "--workloads", "revise",
                           "--prompts", "1", "--max-tokens", "8", "--modes", "suffix-warm",
                           "--warm-prompts", "2", "--warm-file", str(warm), "--out", str(out)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["results"]["revise"]) == {"target-only", "suffix-warm"}
    assert report["results"]["revise"]["suffix-warm"]["outputs_identical"]
    assert report["cache"]["suffix-warm"]["responses"] == 3  # 2 warm answers + the one served
    assert len(warm.read_text().splitlines()) == 2
    assert {r["responses"] for r in report["proposer_cost"]} == {0, 256, 4096}


def test_kernel_times_wraps_every_call_of_the_layer_and_refuses_a_layer_it_cannot_read():
    """``load/kernel_times.py``'s copy of kernels.c: each of decoder_layer's calls timed once,
    the rest of the source as it was; a call renamed in the kernels is one line, not a table
    of the calls it could still find."""
    from specserve.engine.runtime import native

    from load.kernel_times import CALLS, timed_source

    source = native.SOURCE.read_text()
    timed = timed_source(source)
    assert [timed.count(f"KT({i}, M == 1, ") for i in range(len(CALLS))] == [1] * len(CALLS)
    assert timed.count("decoder_layer_timed(") == 2  # defined, and called by decoder_layer
    head, tail = source.split("void decoder_layer(", 1)
    assert timed.startswith(head) and timed.endswith(tail.split("\n}\n", 1)[1])
    verify = timed_source(source, rows=9)  # --verify 9: the calls of a forward of 9 tokens
    assert [verify.count(f"KT({i}, M == 9, ") for i in range(len(CALLS))] == [1] * len(CALLS)
    assert "f->B * f->T == 9" in verify and "M == 1," not in verify
    with pytest.raises(SystemExit, match=r"no longer makes these calls: \['silu_mul'\]"):
        timed_source(source.replace("silu_mul_rows(gate_up", "swiglu_rows(gate_up"))


def test_bench_adaptive_times_the_default_controller_alone():
    """``load/bench_adaptive.py --controller-steps``: the shipped default's controller (K up to
    8) planned and told a step's costs, past its warm-up: calibrated, with a K it chose."""
    from load.bench_adaptive import controller_step_us

    for batch in (1, 3):
        us, ctl = controller_step_us(40, batch)
        assert math.isfinite(us) and us > 0
        assert ctl.steps == 80 and ctl.calibrated and ctl.max_k == 8 and 0 <= ctl.k <= 8
