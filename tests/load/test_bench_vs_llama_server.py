"""The pure parts of ``load/bench_vs_llama_server.py``: SSE parsing, the statistics, the
workload's freshness, and the command lines both servers are started with.

No server, no network, no build: synthetic streams and the prompt file.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from load import bench_vs_llama_server as vs
from load.common import sse_data
from load.prompts import load_prompts


# -- SSE -------------------------------------------------------------------------------------------
def _chunk(content=None, usage=None) -> str:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return json.dumps({"object": "chat.completion.chunk", "choices": choices, "usage": usage})


@pytest.mark.parametrize(("line", "payload"), [
    ('data: {"a": 1}', '{"a": 1}'), ("data:[DONE]", "[DONE]"), ("data: [DONE]  ", "[DONE]"),
    (": keep-alive", None), ("event: message", None), ("", None)])
def test_sse_data_takes_only_data_lines(line, payload):
    assert sse_data(line) == payload


def test_a_stream_counts_tokens_from_usage_where_the_server_sends_it():
    s = vs.Stream(kind="chat", start=0.0)
    assert not vs.apply_chunk(s, json.dumps({"choices": [{"delta": {"role": "assistant"}}]}), 0.05)
    for t, text in ((0.1, "Hel"), (0.2, "lo wor"), (0.4, "ld")):
        assert not vs.apply_chunk(s, _chunk(text), t)
    assert not vs.apply_chunk(s, _chunk(usage={"prompt_tokens": 9, "completion_tokens": 5}), 0.41)
    assert vs.apply_chunk(s, "[DONE]", 0.42)
    assert s.ok and s.text == "Hello world" and s.chunk_times == [0.1, 0.2, 0.4]
    assert s.tokens == 5                                   # usage, not the 3 chunks
    assert s.ttft == pytest.approx(0.1)
    assert s.token_gap == pytest.approx((0.4 - 0.1) / 4)  # per token, not per chunk


def test_without_usage_each_content_chunk_counts_as_one_token():
    s = vs.Stream(kind="chat", start=0.0)
    for t in (0.1, 0.3, 0.6):
        vs.apply_chunk(s, _chunk("x", usage=None), t)
    vs.apply_chunk(s, "[DONE]", 0.6)
    assert (s.usage_tokens, s.tokens) == (None, 3)
    assert s.token_gap == pytest.approx(0.25)


def test_llama_servers_own_time_a_token_comes_from_its_timings():
    s = vs.Stream(kind="chat", start=0.0)
    vs.apply_chunk(s, _chunk("x"), 0.1)
    assert s.server_decode_ms is None                   # specserve sends no timings
    last = json.loads(_chunk(usage={"completion_tokens": 2})) | {
        "timings": {"predicted_n": 2, "predicted_per_token_ms": 9.25}}
    vs.apply_chunk(s, json.dumps(last), 0.2)
    assert s.server_decode_ms == 9.25


def test_an_error_event_ends_the_stream_as_failed():
    s = vs.Stream(kind="chat", start=0.0)
    assert vs.apply_chunk(s, json.dumps({"error": {"message": "slot busy", "code": 503}}), 0.1)
    assert not s.ok and s.error == "slot busy"


# -- statistics ------------------------------------------------------------------------------------
def _stream(kind, ttft, gaps, tokens=None, start=0.0, error=None):
    times = list(np.cumsum([start + ttft, *gaps]))
    return vs.Stream(kind=kind, start=start, chunk_times=times, end=None if error else times[-1],
                     usage_tokens=tokens, error=error)


def test_summarize_a_level():
    streams = [_stream("chat", 0.1, [0.05] * 9, tokens=10), _stream("agent", 0.3, [0.1] * 4),
               _stream("quote", 0.2, [0.1], error="HTTP 429: full")]
    row = vs.summarize(streams, wall_s=2.0, requested=4)
    assert (row["requests"], row["ok"], row["tokens"]) == (4, 2, 15)
    assert row["tokens_per_s"] == pytest.approx(7.5)
    assert row["ttft_p50_ms"] == pytest.approx(200.0)
    assert row["ttft_p95_ms"] == pytest.approx(1e3 * float(np.percentile([0.1, 0.3], 95)))
    assert row["gap_ms"] == pytest.approx(1e3 * (0.05 + 0.1) / 2)
    assert row["usage_share"] == pytest.approx(0.5)
    assert row["error"] == "HTTP 429: full"


def test_summarize_nothing_is_nan_not_a_crash():
    row = vs.summarize([], wall_s=0.0, requested=3)
    assert row["ok"] == 0 and math.isnan(row["tokens_per_s"]) and math.isnan(row["gap_ms"])


def test_kind_rows_put_the_repeating_kinds_against_chat():
    streams = [_stream("chat", 0.1, [0.1] * 3), _stream("code_edit", 0.1, [0.05] * 7),
               _stream("agent", 0.1, [0.05] * 3)]
    rows = {r["group"]: r for r in vs.kind_rows(streams)}
    assert set(rows) == {*vs.KINDS, "repeating"}
    assert rows["repeating"]["ok"] == 2 and rows["chat"]["ok"] == 1
    assert rows["repeating"]["tokens_per_s"] == pytest.approx(12 / (0.45 + 0.25))
    assert rows["chat"]["tokens_per_s"] == pytest.approx(4 / 0.4)


def test_ratio_rows_are_specserve_over_llama_server_per_level():
    rows = [{"server": "llama-server", "config": "default", "concurrency": 1, "tokens_per_s": 100.0,
             "ttft_p50_ms": 50.0, "gap_ms": 10.0},
            {"server": "specserve", "config": "router", "concurrency": 1, "tokens_per_s": 150.0,
             "ttft_p50_ms": 100.0, "gap_ms": 5.0},
            {"server": "specserve", "config": "off", "concurrency": 4, "tokens_per_s": 1.0,
             "ttft_p50_ms": 1.0, "gap_ms": 1.0}]  # no llama-server row at c = 4: no ratio
    [ratio] = vs.ratio_rows(rows)
    assert ratio == {"config": "router", "concurrency": 1, "tokens_per_s": 1.5, "ttft_p50": 2.0,
                     "gap": 0.5}


def test_the_served_forward_is_the_decode_steps_verify_time_between_two_readings():
    before = {"steps": 10, "verify_s": 1.0, "decode_steps": 8, "decode_verify_s": 0.04}
    after = {"steps": 140, "verify_s": 2.5, "decode_steps": 135, "decode_verify_s": 0.675}
    assert vs.served_forward_ms(before, after) == pytest.approx(5.0)  # 0.635 s over 127 steps
    assert math.isnan(vs.served_forward_ms(None, after))  # llama-server: nothing to read
    assert math.isnan(vs.served_forward_ms({"steps": 1, "verify_s": 0.1}, after))  # an older unit
    assert math.isnan(vs.served_forward_ms(after, after))  # no step between them


def test_kernel_rows_put_a_decode_against_the_bandwidth_and_a_verify_in_decodes():
    figures = {"read_bandwidth_gbs": 40.0, "decode_bytes": 100_000_000,
               "forward_ms": {"1": 5.0, "8": 10.0, "9": 12.5}}
    rows = [{"server": "llama-server", "concurrency": 1, "server_decode_ms": 8.0},
            {"server": "llama-server", "concurrency": 4, "server_decode_ms": 30.0}]
    ours, theirs = vs.kernel_rows(figures, rows, gguf_bytes=96_000_000)
    assert ours["gbs"] == pytest.approx(20.0) and ours["bandwidth_share"] == pytest.approx(0.5)
    assert (ours["verify_7"], ours["verify_8"]) == (pytest.approx(2.0), pytest.approx(2.5))
    assert theirs["decode_ms"] == 8.0 and theirs["gbs"] == pytest.approx(12.0)  # its c = 1 row
    assert theirs["bandwidth_share"] == pytest.approx(0.3) and math.isnan(theirs["verify_8"])
    # a llama-server that sent no timings: specserve's row alone
    assert len(vs.kernel_rows(figures, [{"server": "llama-server", "concurrency": 1,
                                         "server_decode_ms": math.nan}], 1)) == 1


def test_cpu_flags_shown():
    assert vs.shown_flags(["avx", "avx2", "avx512f"]) == {
        "avx2": True, "avx512f": True, "avx512_vnni": False, "avx_vnni": False}


# -- the workload ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def templates():
    return load_prompts(vs.PROMPT_SET)


def test_the_prompt_set_covers_every_kind(templates):
    kinds = [t["category"] for t in templates]
    assert len(templates) >= 22 and set(kinds) == set(vs.KINDS)
    assert all(kinds.count(k) >= 3 for k in vs.KINDS)  # a kind's c = 1 row is not one request


def test_requests_are_filled_and_fresh_within_a_run(templates):
    work = vs.build_workload(templates, seed=7, levels=[1, 4, 16])
    assert [len(work[k]) for k in ("warmup", "1", "4", "16")] == [len(vs.KINDS), 26, 26, 48]
    requests = [r for level in work.values() for r in level]
    texts = [json.dumps(r.messages) for r in requests]
    assert not any("{{" in t for t in texts)
    assert len(set(texts)) == len(texts)                          # no request sent twice
    assert len({r.messages[0]["content"] for r in requests}) == len(requests)  # nor any prefix


def test_two_runs_get_different_prompts_and_one_seed_the_same(templates):
    a, b = (vs.build_workload(templates, seed, [1, 8]) for seed in (1, 2))
    again = vs.build_workload(templates, 1, [1, 8])
    for level in a:
        assert [r.messages for r in a[level]] == [r.messages for r in again[level]]
        assert all(x.messages != y.messages for x, y in zip(a[level], b[level]))


def test_a_slot_has_one_value_per_request():
    template = {"category": "chat", "messages": [
        {"role": "user", "content": "{{NAME1}} and {{NAME2}} met in {{CITY1}} on {{DATE1}}."},
        {"role": "assistant", "content": "{{NAME1}} liked {{CITY1}}."}]}
    r = vs.fill(template, random.Random(3))
    first, second = r.messages[0]["content"], r.messages[1]["content"]
    assert first.startswith("Ref ") and "{{" not in first + second
    name1, city = second.removesuffix(".").split(" liked ")
    assert name1 in first and city in first


def test_unknown_slot_kinds_are_refused():
    with pytest.raises(ValueError, match="FOO"):
        vs.draw("FOO", 1, random.Random(0))


# -- the servers' command lines -------------------------------------------------------------------
def test_llama_server_binds_loopback_with_two_threads_and_eight_slots(tmp_path):
    argv = vs.llama_server_argv(tmp_path / "llama-server", tmp_path / "m.gguf", 18600, 2)
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert flags == {"-m": str(tmp_path / "m.gguf"), "-t": "2", "-np": "8", "-c": "16384",
                     "--host": "127.0.0.1", "--port": "18600"}


def test_specserve_binds_loopback(tmp_path):
    argv = vs.specserve_argv(tmp_path / "c.json", 18601)
    assert argv[0].endswith("specserve") and argv[1] == "serve"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "18601"


def test_server_specs_write_both_configs_and_bind_loopback(tmp_path, monkeypatch):
    monkeypatch.setattr(vs, "free_ports", lambda n: list(range(18600, 18600 + n)))
    args = vs.parse_args(["--avx2", "--avx2-env", "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"])
    specs = vs.server_specs(tmp_path / "llama-server", tmp_path / "m.gguf", args, tmp_path)
    assert [s.label for s in specs] == ["llama-server-default", "specserve-off", "specserve-router"]
    assert all(s.argv[s.argv.index("--host") + 1] == "127.0.0.1" for s in specs)
    assert len({s.port for s in specs}) == 3
    assert specs[0].env is None and specs[1].env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    off = json.loads((tmp_path / "specserve-off.json").read_text())
    assert off["unit"]["engine"]["speculative"] == {"method": None}


def test_specserve_configs_are_the_shipped_default_and_it_without_speculation():
    configs = vs.specserve_configs()
    router, off = configs["router"], configs["off"]
    assert router["auth"]["enabled"] is False
    assert router["unit"]["engine"]["speculative"]["method"] == "suffix"
    assert off["unit"]["engine"]["speculative"] == {"method": None}
    assert off["unit"]["engine"]["max_num_seqs"] == router["unit"]["engine"]["max_num_seqs"] == vs.SLOTS
    for name, plain in (("off-invariant", off), ("router-invariant", router)):  # float32-identical
        engine = configs[name]["unit"]["engine"]
        assert engine["target"] == plain["unit"]["engine"]["target"] | {"kernels": "invariant"}
        assert engine | {"target": plain["unit"]["engine"]["target"]} == plain["unit"]["engine"]
    assert "kernels" not in router["unit"]["engine"]["target"]
    with pytest.raises(SystemExit):
        vs.parse_args(["--configs", "off,fast"])


def test_avx2_needs_its_environment():
    with pytest.raises(SystemExit):
        vs.parse_args(["--avx2"])
    assert vs.parse_env("A=1 B=x=y") == {"A": "1", "B": "x=y"}


def test_the_cmake_flavours(tmp_path):
    """``host`` sets each instruction set as this CPU lists it and never AMX (llama.cpp's AMX
    kernels die with SIGILL here); ``avx2`` is the same on every machine."""
    avx512 = frozenset({"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx512f", "avx512_vnni",
                        "avx512vbmi", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8"})
    host = vs.configure_argv(tmp_path / "src", tmp_path / "b", "host", avx512)
    host_avx2 = vs.configure_argv(tmp_path / "src", tmp_path / "b", "host", vs.AVX2_FLAGS)
    avx2 = vs.configure_argv(tmp_path / "src", tmp_path / "b", "avx2", avx512)
    for argv in (host, avx2):
        assert {"-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"} <= set(argv)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX_VNNI=ON",
            "-DGGML_AVX2=ON", "-DGGML_FMA=ON"} <= set(host)
    assert avx2 == host_avx2
    assert {"-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF",
            "-DGGML_AVX_VNNI=OFF"} <= set(avx2)
    assert vs.build_argv(tmp_path / "b") == ["cmake", "--build", str(tmp_path / "b"), "--target",
                                             "llama-server", "-j", "2"]
    assert vs.binary_path("avx2", tmp_path) == tmp_path / "avx2" / "bin" / "llama-server"
