"""Tokens/s through HTTP vs the in-process engine, batch 1, on the embedded default.

A benchmark, not a test (``make bench-http``). It starts a local Ray cluster and the Serve app
on 127.0.0.1, builds the same engine in this process, and runs the same greedy requests both
ways, interleaved per prompt so machine noise hits both sides alike. The ratio shows what the
serving path costs: Ray hops, the coordinator thread, SSE/JSON, the HTTP proxy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import specserve.serve.local  # noqa: F401  (before ray: loopback)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load.prompts import load_prompts  # noqa: E402

PORT = 18500


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4, help="chat prompts to run")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--methods", default="off,ngram", help="comma list: off, ngram")
    p.add_argument("--out", default="results/bench_http.json")
    return p.parse_args()


def app_args(method: str) -> dict:
    spec = {"method": None} if method == "off" else {"method": method, "num_speculative_tokens": 4}
    engine = {"speculative": spec, "max_num_seqs": 2,
              "kv_cache": {"prefix_caching": False}}  # each prompt prefilled by both paths
    return {"unit": {"engine": engine}, "max_tokens_cap": 4096,
            "auth": {"enabled": False}}  # loopback benchmark


def start(method: str):
    """Local Ray + the Serve app, and the same engine in-process."""
    from ray import serve
    from specserve.app_config import AppConfig
    from specserve.engine.builder import build_engine
    from specserve.serve.local import start_local_ray, start_serve

    from deploy.app import build_app

    start_local_ray(metrics_export_port=None)
    start_serve("127.0.0.1", PORT)
    args = app_args(method)
    serve.run(build_app(args), name="bench", route_prefix="/")
    engine, target = build_engine(AppConfig.model_validate(args).unit.engine)
    return engine, target


def http_run(messages: list[dict], max_tokens: int, model: str) -> tuple[int, float, str]:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], seconds, r.json()["choices"][0]["message"]["content"]


def engine_run(engine, tokenizer, messages: list[dict], max_tokens: int) -> tuple[int, float, str]:
    from specserve.config import SamplingParams
    from specserve.engine.tokenizer import encode_chat

    ids = encode_chat(tokenizer, messages)
    t0 = time.perf_counter()
    [done] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))
    return len(done.output_token_ids), time.perf_counter() - t0, done.text


def measure(method: str, prompts: list[dict], max_tokens: int) -> dict:
    from tqdm import tqdm

    engine, target = start(method)
    http_run(prompts[0]["messages"], 8, target.name)  # warm-up both paths
    engine_run(engine, target.tokenizer, prompts[0]["messages"], 8)
    sums = {"http": [0, 0.0], "engine": [0, 0.0]}
    same = 0
    for p in tqdm(prompts, desc=f"{method}: http vs engine", file=sys.stderr):
        h = http_run(p["messages"], max_tokens, target.name)
        e = engine_run(engine, target.tokenizer, p["messages"], max_tokens)
        for key, (n, s, _) in (("http", h), ("engine", e)):
            sums[key][0] += n
            sums[key][1] += s
        same += h[2] == e[2]
    stop()
    tps = {k: n / s for k, (n, s) in sums.items()}
    return {"method": method, "http_tokens_per_s": round(tps["http"], 2),
            "engine_tokens_per_s": round(tps["engine"], 2),
            "ratio": round(tps["http"] / tps["engine"], 3), "same_text": f"{same}/{len(prompts)}"}


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def main() -> None:
    args = parse_args()
    prompts = load_prompts("chat")[: args.prompts]
    rows = [measure(m, prompts, args.max_tokens) for m in args.methods.split(",")]
    print(f"{'method':8} {'http tok/s':>11} {'engine tok/s':>13} {'http/engine':>12} {'same text':>10}")
    for r in rows:
        print(f"{r['method']:8} {r['http_tokens_per_s']:>11} {r['engine_tokens_per_s']:>13} "
              f"{r['ratio']:>12} {r['same_text']:>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
