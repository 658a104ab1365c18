"""An HTTP golden: the same greedy and seeded requests, answered byte for byte the same.

A check for refactors of the engine, not a test (``make golden``): it starts a local Ray
cluster and the Serve app of ``deploy/serve_config.yaml`` on 127.0.0.1 (with a small
``chunked_prefill_size``, so one prompt arrives in chunks), sends a fixed list of requests over
real HTTP and writes every response, less what differs run to run (ids, ``created``, timings),
to one JSON file. Run it before and after a change on the same machine and compare the files:
``make golden GOLDEN_OUT=before.json`` ... ``cmp before.json after.json``. Floating point
differs between CPUs, so a file from another machine is no reference.

The requests: completions with logprobs, chat, n = 2 seeded, a json_schema response, a stream
with usage, the first request again (a prefix-cache hit), a prompt prefilled in chunks; once
per ``--methods`` entry (the default's suffix decoding at its K, not adaptive: the controller
picks K from measured times; and target-only). The responses' speculation counts are in the
file too: at a fixed K they are the same run to run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import specserve.serve.local  # noqa: F401  (before ray: loopback)

PORT = 18510
# Keys whose values differ between two runs of the same request.
VOLATILE = frozenset({"id", "created", "timing", "system_fingerprint"})
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
LONG = ("Write down, one after the other, the names of the planets, the days of the week and "
        "the months of the year, then explain why the year has twelve months. ") * 6


def requests(model: str) -> list[tuple[str, str, dict]]:
    """(name, route, body) of every request, in the order they are sent."""
    chat = [{"role": "user", "content": "Name three colours and one fruit of each colour."}]
    completion = {"model": model, "max_tokens": 24,  # a prompt of full blocks: the hit is one
                  "prompt": "Paris is the capital of France. Berlin is the capital of Germany. "
                            "Rome is the capital of Italy. Madrid is the capital of",
                  "temperature": 0, "logprobs": 3, "echo": False}
    return [
        ("completion_logprobs", "/v1/completions", completion),
        ("chat_greedy", "/v1/chat/completions",
         {"model": model, "messages": chat, "max_tokens": 40, "temperature": 0}),
        ("chat_n2_seeded", "/v1/chat/completions",
         {"model": model, "messages": chat, "max_tokens": 32, "temperature": 0.8, "top_p": 0.9,
          "n": 2, "seed": 1234}),
        ("json_schema", "/v1/chat/completions",
         {"model": model, "max_tokens": 48, "temperature": 0,
          "messages": [{"role": "user", "content": "Describe a pet as JSON."}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}}),
        ("stream_usage", "/v1/chat/completions",
         {"model": model, "messages": chat, "max_tokens": 32, "temperature": 0.7, "seed": 99,
          "stream": True, "stream_options": {"include_usage": True}}),
        ("prefix_hit", "/v1/completions", completion),
        ("chunked_prompt", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": LONG}], "max_tokens": 32,
          "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ]


def stable(value):
    """``value`` without the keys that differ run to run (``VOLATILE``)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def send(client, route: str, body: dict):
    if not body.get("stream"):
        r = client.post(f"http://127.0.0.1:{PORT}{route}", json=body)
        r.raise_for_status()
        return r.json()
    chunks = []
    with client.stream("POST", f"http://127.0.0.1:{PORT}{route}", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def app_args(method: str, chunk: int) -> dict:
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy/serve_config.yaml").read_text())
    [app] = config["applications"]
    args = app["args"]
    engine = args["unit"]["engine"]
    engine["chunked_prefill_size"] = chunk
    # K fixed: the adaptive controller picks K from measured times, so its speculation
    # counts (and only those) would differ run to run.
    engine["speculative"]["adaptive"] = {"enabled": False}
    args["unit"]["router"]["short_output_tokens"] = 0  # every request speculates
    if method == "off":
        engine["speculative"] = {"method": None}
    return args


def run(method: str, chunk: int) -> dict:
    import httpx
    from ray import serve
    from specserve.serve.local import start_local_ray, start_serve, stop_serve

    from deploy.app import build_app

    start_local_ray(metrics_export_port=None)
    start_serve("127.0.0.1", PORT)
    try:
        serve.run(build_app(app_args(method, chunk)), name="golden", route_prefix="/")
        with httpx.Client(timeout=600) as client:
            model = client.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
            return {name: stable(send(client, route, body)) for name, route, body in requests(model)}
    finally:
        stop_serve("golden")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="suffix,off", help="comma list: suffix (the default app), off")
    p.add_argument("--chunk", type=int, default=32, help="chunked_prefill_size")
    p.add_argument("--out", default="results/golden.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    out = {m: run(m, args.chunk) for m in args.methods.split(",")}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"golden: {sum(len(v) for v in out.values())} responses -> {path}")


if __name__ == "__main__":
    main()
