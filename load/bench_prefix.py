"""The prompt (issue 34): what chunked prefill and prefix caching change where a user feels them.

A benchmark, not a test (``make bench-prefix``), on the embedded default, one app at a time
on a local Ray cluster and Serve on 127.0.0.1 (the capacity part needs neither):

1. **stall** (HTTP): a stream runs while a
   ~1,800-token prompt arrives; the stream's largest gap between chunks against its median,
   with chunked prefill (``chunked_prefill_size`` 256, the default) and without (None).
   Aim: the largest gap at most 2 x the median plus one chunk's forward (each chunk's forward
   is also timed in-process on the same model: the largest is the last one's).
2. **turns** (HTTP): a 6-turn conversation over a ~1,400-token document, time to first token
   per turn, on a unit of the slot layout (every turn prefills everything) and one of
   ``kv_cache.layout: paged`` with prefix caching (a turn prefills its new messages).
   Aim: the later turns' mean at most 0.25 x the first turn's.
3. **capacity** (in-process, a tiny random model: the count does not depend on the model): 96
   requests of 128 + 128 tokens through the engine with the KV memory of ``max_num_seqs`` 8 x
   ``max_model_len`` 2048: 8 slots, against a pool of blocks of 16 with 96 sequence slots
   (admission and preemption by blocks). The most tokens held in KV at once (in 256-token
   sequences' worth), the most sequences running, preemptions, and whether both runs gave
   the same tokens. Aim: 4x as many sequences' worth at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import specserve.serve.local  # noqa: F401  (before ray: loopback)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load.prompts import load_prompts  # noqa: E402

PORT = 18510
CHUNK = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="capacity,turns,stall", help="comma list of the parts to run")
    p.add_argument("--long-tokens", type=int, default=1800, help="the arriving prompt (stall)")
    p.add_argument("--doc-tokens", type=int, default=1400, help="the conversation's document (turns)")
    p.add_argument("--out", default="results/bench_prefix.json")
    return p.parse_args()


def document(tokenizer, n: int) -> str:
    """About ``n`` tokens of the prompt sets' own text (documents and chats), in file order."""
    parts, total = [], 0
    for name in ("doc_qa", "summarize", "chat", "code"):
        for prompt in load_prompts(name):
            for m in prompt["messages"]:
                text = m["content"] if isinstance(m["content"], str) else ""
                parts.append(text)
                total += len(tokenizer.encode(text))
                if total >= n:
                    return "\n\n".join(parts)
    return "\n\n".join(parts)


# -- 3. capacity --------------------------------------------------------------------------------
def capacity() -> dict:
    import torch
    from specserve.config import KVCacheConfig, SamplingParams, SpeculativeConfig
    from specserve.engine.builder import assemble_engine
    from specserve.engine.worker import ModelWorker

    from load.bench_gpu import random_runtime
    from load.gpu.identity import IdText

    slots, max_len, block, prompt_len, output_len, requests = 8, 2048, 16, 128, 128, 96
    torch.manual_seed(0)
    runtime = random_runtime("tiny", torch.float32, "cpu", max_len)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (prompt_len,), generator=gen).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    runs = {}
    for name, num_slots, kv in (
            ("slots", slots, None),
            ("paged", requests, KVCacheConfig(layout="paged", block_size=block,
                                              num_blocks=slots * max_len // block))):
        worker = ModelWorker(runtime, num_slots=num_slots, max_seq_len=max_len, kv=kv)
        engine = assemble_engine(worker, IdText(), frozenset(), SpeculativeConfig(method=None),
                                 chunked_prefill_size=CHUNK)
        ids = [engine.add_request(p, params) for p in prompts]
        out, peak, full, start = {}, 0, 0, time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.seq_id, []).extend(o.new_token_ids)
            peak = max(peak, len(engine.scheduler.running))
            full = max(full, sum(worker.length(s.slot) for s in engine.scheduler.running.values()))
        runs[name] = {"most_running": peak, "most_kv_tokens": full,
                      "sequences_worth": round(full / (prompt_len + output_len), 1),
                      "preemptions": engine.counters.num_preemptions,
                      "seconds": round(time.perf_counter() - start, 2),
                      "tokens": [out[i] for i in ids]}
    same = runs["slots"].pop("tokens") == runs["paged"].pop("tokens")
    return {"memory_positions": slots * max_len, "block_size": block, "requests": requests,
            "sequence_tokens": prompt_len + output_len, **runs, "same_tokens": same,
            "ratio": round(runs["paged"]["most_kv_tokens"] / runs["slots"]["most_kv_tokens"], 2)}


# -- 2. turns -----------------------------------------------------------------------------------
QUESTIONS = ["Summarize the text above in two sentences.", "Which names appear in it?",
             "What is the main request in it?", "List three keywords.",
             "Is anything in it a question?", "Give it a title."]


def turns(tokenizer, doc_tokens: int) -> dict:
    """The conversation over HTTP, on an app of each layout (one at a time)."""
    from ray import serve

    from deploy.app import build_app

    doc = document(tokenizer, doc_tokens)
    out = {}
    for layout in ("slots", "paged"):
        serve.run(build_app(app_args(layout=layout)), name="prefix", route_prefix="/")
        url, model = endpoint()
        messages = [{"role": "system", "content": doc}]
        ttft, prompt_tokens = [], []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            first, text, usage = stream(url, model, messages, max_tokens=32)
            ttft.append(first)
            prompt_tokens.append(usage["prompt_tokens"])
            messages.append({"role": "assistant", "content": text})
            print(f"turns {layout}: turn {len(ttft)}, {usage['prompt_tokens']} prompt tokens, "
                  f"first token after {first:.2f} s", file=sys.stderr)
        serve.delete("prefix")
        out[layout] = {"ttft_s": [round(t, 3) for t in ttft], "prompt_tokens": prompt_tokens,
                       "later_over_first": round(statistics.mean(ttft[1:]) / ttft[0], 3)}
    return out


def app_args(*, layout: str = "slots", budget: int | None = CHUNK) -> dict:
    engine = {"speculative": {"method": "ngram"}, "max_num_seqs": 2, "max_model_len": 2048,
              "chunked_prefill_size": budget, "kv_cache": {"layout": layout}}
    return {"unit": {"engine": engine}, "max_tokens_cap": 4096,
            "auth": {"enabled": False}}  # a loopback benchmark


def endpoint() -> tuple[str, str]:
    import httpx

    model = httpx.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
    url = f"http://127.0.0.1:{PORT}/v1/chat/completions"
    httpx.post(url, json={"model": model, "max_tokens": 4,  # warm-up
                          "messages": [{"role": "user", "content": "Hi"}]}, timeout=600)
    return url, model


def stream(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """A greedy streamed chat: seconds to its first content, its text, its usage."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first if first is not None else time.perf_counter() - t0
                    text += choice["delta"]["content"]
    return first, text, usage


# -- 1. stall -----------------------------------------------------------------------------------
def stall(tokenizer, long_tokens: int) -> dict:
    """The stream's gaps on an app with chunked prefill, then on one without."""
    from ray import serve

    from deploy.app import build_app

    long_text = document(tokenizer, long_tokens)
    out = {}
    for budget in (CHUNK, None):
        serve.run(build_app(app_args(budget=budget)), name="prefix", route_prefix="/")
        out["chunked" if budget else "whole"] = one_stall(long_text)
        serve.delete("prefix")
    forwards = chunk_forwards(long_text)
    chunked = out["chunked"]
    chunked["chunk_forwards_s"] = [round(t, 3) for t in forwards]
    chunked["aim_largest_chunk_s"] = round(2 * chunked["median_gap_s"] + max(forwards), 3)
    chunked["within_aim_largest_chunk"] = chunked["largest_gap_s"] <= chunked["aim_largest_chunk_s"]
    return out


def chunk_forwards(long_text: str) -> list[float]:
    """Each chunk's forward of the long prompt, timed in this process on the same model and
    cache as the unit's (no Ray, no serving): later chunks attend to more keys and cost more,
    so the largest gap, around the last chunk, is held to that chunk's forward."""
    from specserve.config import EngineConfig
    from specserve.engine.builder import build_engine
    from specserve.engine.runtime.forward_batch import ForwardBatch
    from specserve.engine.tokenizer import encode_chat

    engine, loaded = build_engine(EngineConfig.model_validate(app_args()["unit"]["engine"]))
    ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": long_text}])
    target, times = engine.target, []
    slot = target.allocate()
    for start in range(0, len(ids) - 1, CHUNK):
        t0 = time.perf_counter()
        target.forward(ForwardBatch([slot], [ids[start:min(start + CHUNK, len(ids) - 1)]], [1],
                                    argmax=True))
        times.append(time.perf_counter() - t0)
    target.free(slot)
    return times


def one_stall(long_text: str) -> dict:
    """A greedy stream of 400 tokens; after its 30th chunk the long prompt arrives (1 token
    asked). Gaps between the stream's chunks: the median over the run, the largest while the
    long prompt was in the unit; the long request's latency over its chunk count estimates
    one chunk's forward."""
    import httpx

    url, model = endpoint()
    times: list[float] = []
    window: dict[str, float] = {}

    def long_request() -> None:
        window["start"] = time.perf_counter()
        r = httpx.post(url, json={"model": model, "max_tokens": 1, "temperature": 0,
                                  "messages": [{"role": "user", "content": long_text}]}, timeout=600)
        window["end"] = time.perf_counter()
        window["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]

    body = {"model": model, "max_tokens": 400, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}]}
    thread = threading.Thread(target=long_request)
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            times.append(time.perf_counter())
            if len(times) == 30:
                thread.start()
    thread.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    inside = [b - a for a, b in zip(times, times[1:]) if window["start"] <= b and a <= window["end"]]
    median = statistics.median(gaps)
    chunks = -(-window["prompt_tokens"] // CHUNK)
    chunk_s = (window["end"] - window["start"]) / chunks
    largest = max(inside) if inside else max(gaps)
    return {"median_gap_s": round(median, 4), "largest_gap_s": round(largest, 3),
            "long_prompt_tokens": window["prompt_tokens"],
            "long_latency_s": round(window["end"] - window["start"], 3),
            "chunk_forward_s": round(chunk_s, 3),
            "aim_s": round(2 * median + chunk_s, 3), "within_aim": largest <= 2 * median + chunk_s}


def main() -> None:
    args = parse_args()
    parts = args.parts.split(",")
    from specserve.machine import cpu_flags, machine_label

    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_label(),
              "cpu_flags": " ".join(cpu_flags())}
    print(report["machine"], report["cpu_flags"])
    if "capacity" in parts:
        report["capacity"] = capacity()
        print(json.dumps({"capacity": report["capacity"]}))
    if "turns" in parts or "stall" in parts:
        from ray import serve
        from specserve.engine.loader import load_tokenizer, resolve
        from specserve.serve.local import start_local_ray, start_serve

        start_local_ray(metrics_export_port=None)
        start_serve("127.0.0.1", PORT)
        tokenizer = load_tokenizer(resolve("embedded"))
        try:
            if "turns" in parts:
                report["turns"] = turns(tokenizer, args.doc_tokens)
                print(json.dumps({"turns": report["turns"]}))
            if "stall" in parts:
                report["stall"] = stall(tokenizer, args.long_tokens)
                print(json.dumps({"stall": report["stall"]}))
        finally:
            import ray

            serve.shutdown()
            ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
