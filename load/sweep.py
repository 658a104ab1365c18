"""Concurrency sweep over HTTP: speculation forced on vs forced off vs the router's choice.

For every concurrency level (``--concurrency``, default 1,2,4,8,16,32) and every mode

- ``on``:     ``{"speculation": {"enabled": true}}`` (speculation forced on),
- ``off``:    ``{"speculation": {"enabled": false}}`` (target-only),
- ``router``: no extension (the server decides),

it sends ``--requests-per-level`` streaming, greedy chat requests (default 6 x concurrency,
at least 24) with exactly ``concurrency`` of them in flight, and stops a level early at
``--level-timeout`` seconds (in-flight requests are cancelled and counted as unfinished).
Modes are interleaved per level, in rounds: a level's requests are split into ``--rounds``
parts (default: one part per ``concurrency`` requests, so at c = 1 the modes take turns
request by request) and each part runs under every mode, the modes' order rotated from round
to round (on, off, router; then off, router, on; ...), so machine drift and position in the
order hit every mode alike; every mode gets the same prompts in the same order (greedy and
lossless: the same tokens). A mode's throughput is its tokens over the sum of its rounds'
wall times.

The per-level summary puts the router against the better of on and off (issue 5's
criterion) next to the measurement's own resolution: the spread, over the level's rounds, of
the per-round ratio router / on. Where the router chose what forced-on does, that ratio is
an A/A comparison and its spread is the noise of one round on this machine.

Per (mode, concurrency): output tokens/s (completion tokens of the finished requests / wall
time of the level), p50 / p99 time to first token, p50 / p99 inter-token latency (gaps
between SSE chunks that carry text: with speculation on, one chunk can hold several tokens),
p50 time per output token ((end - first token) / (tokens - 1)), the acceptance rate (sum of
accepted / sum of draft tokens from each request's final ``usage.speculation``) and the
share of requests that ran with speculation on (``x-speculation`` header). Per level, ``same
text``: the prompts whose completions were one text across every mode and repeat (greedy
and lossless, so all of them).

    python load/sweep.py --host http://127.0.0.1:8000        # against a running `make serve`
    python load/sweep.py --start-local                       # starts Ray + Serve itself

``--start-local`` starts a local Ray cluster and the Serve app on 127.0.0.1:``--local-port``
(embedded default, ``--method``, n-gram by default, ``max_num_seqs`` = the largest
concurrency) and stops it at the end. Writes ``results/sweep.csv`` and
``results/sweep.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `load` as a namespace package, run as a script or imported

from specserve.machine import machine_label  # noqa: E402

from load.common import client_pool, format_table, post_sse, rotated, write_csv  # noqa: E402

MODES: dict[str, dict] = {
    "on": {"speculation": {"enabled": True}},
    "off": {"speculation": {"enabled": False}},
    "router": {},
}
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
RESULTS = ROOT / "results"
CSV_COLUMNS = (
    "mode", "concurrency", "requests", "finished", "failed", "wall_s", "completion_tokens",
    "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
    "tpot_p50_ms", "acceptance_rate", "mean_acceptance_length", "spec_on_share", "mean_k",
    "same_text", "error",
)
ROUND_COLUMNS = ("concurrency", "round", "mode", "requests", "finished", "completion_tokens",
                 "wall_s", "output_tokens_per_s")


# -- one request ---------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """What one streamed request saw. Times are ``time.perf_counter()`` seconds."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    end: float | None = None
    completion_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_k: float | None = None              # usage.speculation.mean_speculation_length
    speculation_on: bool | None = None      # from the x-speculation header
    header: str | None = None
    error: str | None = None
    prompt: str = ""                         # the request's messages, as JSON
    text: str = ""                           # the streamed completion


    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.chunk_times or self.end is None or self.completion_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.completion_tokens - 1)


def speculation_header_on(value: str | None) -> bool | None:
    """``on; reason=default; method=ngram; k=4`` -> True, ``off; ...`` -> False, absent -> None."""
    if not value:
        return None
    return value.split(";", 1)[0].strip().lower() == "on"


def describe_speculation(header: str | None) -> str:
    """``on; reason=default; method=ngram; k=4`` -> ``ngram, K=4``; '' when it says nothing."""
    fields = dict(part.strip().split("=", 1) for part in (header or "").split(";") if "=" in part)
    if "method" not in fields:
        return ""
    return f"{fields['method']}, K={fields['k']}" if "k" in fields else fields["method"]


def request_body(model: str, messages: list[dict], max_tokens: int, mode: str) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **MODES[mode]}


def apply_event(result: RequestResult, data: str, now: float) -> bool:
    """Fold one SSE ``data:`` payload into ``result``; True when the stream is over."""
    if data.strip() == "[DONE]":
        result.end = result.end or now
        return True
    obj = json.loads(data)
    if "error" in obj:
        result.error = str(obj["error"].get("message", obj["error"]))
        return True
    for choice in obj.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            result.chunk_times.append(now)
            result.text += content
    usage = obj.get("usage")
    if usage:
        result.end = now
        result.completion_tokens = int(usage.get("completion_tokens", 0))
        spec = usage.get("speculation") or {}
        result.num_drafts = int(spec.get("num_drafts", 0))
        result.num_draft_tokens = int(spec.get("num_draft_tokens", 0))
        result.num_accepted_tokens = int(spec.get("num_accepted_tokens", 0))
        if spec.get("mean_speculation_length") is not None:
            result.mean_k = float(spec["mean_speculation_length"])
    return False


async def stream_request(client, url: str, body: dict) -> RequestResult:
    """POST one streaming chat request and time its SSE chunks; errors land in ``error``."""
    result = RequestResult(start=time.perf_counter(), prompt=json.dumps(body.get("messages")))

    def headers(response) -> None:
        result.header = response.headers.get("x-speculation")
        result.speculation_on = speculation_header_on(result.header)

    result.error = await post_sse(client, url, body, lambda data, now: apply_event(result, data, now),
                                  headers)
    if result.end is None and result.error is None:
        result.error = "the stream ended without usage"
    return result


# -- one level ------------------------------------------------------------------------------------
async def run_level(client, url: str, bodies: list[dict], concurrency: int, time_limit_s: float,
                    on_done=None) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` with exactly ``concurrency`` in flight; at ``time_limit_s`` cancel what
    is still running. Returns the finished requests' results and the level's wall time."""
    results: list[RequestResult] = []

    async def send(body: dict) -> None:
        results.append(await stream_request(client, url, body))
        if on_done:
            on_done()

    wall = await client_pool(bodies, concurrency, time_limit_s, send)
    return results, wall


# -- aggregation (pure) --------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def same_text(results: list[RequestResult]) -> tuple[int, int]:
    """(prompts whose finished completions are all the same text, prompts finished at least
    twice) over a level's requests of every mode: greedy and lossless, a prompt gets one text
    whatever the mode, the batch it shared and the K it was verified with."""
    texts: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for r in results:
        if r.ok:
            texts.setdefault(r.prompt, set()).add(r.text)
            counts[r.prompt] = counts.get(r.prompt, 0) + 1
    compared = [p for p, n in counts.items() if n >= 2]
    return sum(len(texts[p]) == 1 for p in compared), len(compared)


def summarize(mode: str, concurrency: int, requested: int, results: list[RequestResult],
              wall_s: float) -> dict:
    """One row of the sweep table from a level's request results (times in ms)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    headers = [r.speculation_on for r in results if r.speculation_on is not None]
    tokens = sum(r.completion_tokens for r in ok)
    errors = [r.error for r in results if r.error]
    return {
        "mode": mode, "concurrency": concurrency, "requests": requested, "finished": len(ok),
        "failed": len(results) - len(ok), "wall_s": wall_s, "completion_tokens": tokens,
        "output_tokens_per_s": _ratio(tokens, wall_s),
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50), "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "itl_p50_ms": 1e3 * percentile(itls, 50), "itl_p99_ms": 1e3 * percentile(itls, 99),
        "tpot_p50_ms": 1e3 * percentile(tpots, 50),
        "acceptance_rate": _ratio(sum(r.num_accepted_tokens for r in ok),
                                  sum(r.num_draft_tokens for r in ok)),
        "mean_acceptance_length": 1 + _ratio(sum(r.num_accepted_tokens for r in ok),
                                             sum(r.num_drafts for r in ok)),
        "spec_on_share": _ratio(sum(headers), len(headers)),
        "mean_k": _mean([r.mean_k for r in ok if r.mean_k is not None]),
        "same_text": "",  # per level, across modes: see same_text() and run_sweep()
        "error": errors[0] if errors else "",
    }


# -- output ---------------------------------------------------------------------------------------
TABLE = (("mode", "mode", 7, 0), ("c", "concurrency", 4, 0), ("done", "finished", 5, 0),
         ("fail", "failed", 5, 0), ("tok/s", "output_tokens_per_s", 8, 1),
         ("TTFT p50", "ttft_p50_ms", 9, 0), ("TTFT p99", "ttft_p99_ms", 9, 0),
         ("ITL p50", "itl_p50_ms", 8, 0), ("ITL p99", "itl_p99_ms", 8, 0),
         ("TPOT p50", "tpot_p50_ms", 9, 0), ("accept", "acceptance_rate", 7, 2),
         ("spec on", "spec_on_share", 7, 2), ("mean K", "mean_k", 6, 2))


def make_figure(rows: list[dict], title: str):
    """Two panels vs concurrency (log2 x): throughput, and p99 inter-token latency; one line
    per mode. Returns a matplotlib Figure (no pyplot state; save with ``fig.savefig``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    panels = fig.subplots(1, 2)
    levels = sorted({r["concurrency"] for r in rows})
    specs = (("output_tokens_per_s", "output throughput (tokens/s)"),
             ("itl_p99_ms", "p99 inter-token latency (ms)"))
    for ax, (key, label) in zip(panels, specs):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["concurrency"], r[key]) for r in rows if r["mode"] == mode)
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(title="speculation")
    fig.suptitle(title)
    return fig


def save_plot(rows: list[dict], title: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_figure(rows, title).savefig(path, dpi=120)


# -- server ---------------------------------------------------------------------------------------
def local_app_args(max_num_seqs: int, max_queue_len: int, max_model_len: int, k: int,
                   method: str = "ngram", first: str | None = None) -> dict:
    """The AppConfig of the local server: embedded default, ``method`` (n-gram by default; a
    model method drafts with the shipped EAGLE draft, behind ``first`` if given), enough slots
    and queue."""
    spec = {"method": method, "num_speculative_tokens": k}
    if method in ("eagle", "draft_model"):
        spec["draft"] = {"source": "embedded-eagle"}
        if first:
            spec["first"] = first
    return {"unit": {"engine": {"target": {"source": "embedded"}, "speculative": spec,
                                "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                                # the prompt set repeats across levels and modes: no cache hits
                                "kv_cache": {"prefix_caching": False}},
                     "max_queue_len": max_queue_len},
            "max_tokens_cap": 4096, "auth": {"enabled": False}}  # loopback benchmark


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_local(port: int, app_args: dict, name: str = "sweep") -> str:
    """Local Ray + the Serve app on 127.0.0.1:port (blocks until it is up); its base URL."""
    from specserve.serve.local import start_local_ray, start_serve  # before ray: loopback

    if not port_is_free(port):
        raise SystemExit(f"sweep: port {port} on 127.0.0.1 is taken; pass --local-port")
    from ray import serve

    from deploy.app import build_app

    start_local_ray(metrics_export_port=None)
    start_serve("127.0.0.1", port)
    serve.run(build_app(app_args), name=name, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_local() -> None:
    """Stop what :func:`start_local` started (nothing if Ray never came up)."""
    if "ray" not in sys.modules:
        return
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


# -- the sweep ------------------------------------------------------------------------------------
def requests_per_level(concurrency: int, flag: int | None) -> int:
    return flag if flag else max(24, 6 * concurrency)


def build_bodies(model: str, prompts: list[dict], n: int, max_tokens: int, mode: str) -> list[dict]:
    """The level's requests: prompts in file order, cycled; the same for every mode."""
    return [request_body(model, prompts[i % len(prompts)]["messages"], max_tokens, mode)
            for i in range(n)]


async def served_model(client, base: str) -> str:
    r = await client.get(f"{base}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_sweep(args, base: str, prompts: list[dict]) -> tuple[str, str, list[dict], list[dict]]:
    """Every (level, mode) in order; returns the model id, the server's speculation method
    (from a warm-up's header), the table rows and one row per (level, round, mode)."""
    import httpx
    from tqdm import tqdm

    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    total = len(args.modes) * sum(requests_per_level(c, args.requests_per_level)
                                  for c in args.concurrency)
    rows, round_rows, spec = [], [], ""
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await served_model(client, base)
        for mode in args.modes:  # warm-up, not measured
            r = await stream_request(client, url, request_body(model, prompts[0]["messages"], 8,
                                                               mode))
            spec = spec or describe_speculation(r.header)
        with tqdm(total=total, unit="req", file=sys.stderr) as bar:
            for c in args.concurrency:
                n = requests_per_level(c, args.requests_per_level)
                results = {mode: [] for mode in args.modes}
                walls = dict.fromkeys(args.modes, 0.0)
                level = {mode: build_bodies(model, prompts, n, args.max_tokens, mode)
                         for mode in args.modes}
                for r, part in enumerate(split_rounds(n, rounds_per_level(c, n, args.rounds))):
                    for mode in rotated(args.modes, r):
                        bar.set_description(f"c={c} round {r + 1} {mode}")
                        bodies = level[mode][part]
                        got, wall = await run_level(client, url, bodies, c, args.level_timeout,
                                                    on_done=bar.update)
                        results[mode] += got
                        walls[mode] += wall
                        round_rows.append(round_row(c, r, mode, bodies, got, wall))
                same, compared = same_text([r for got in results.values() for r in got])
                rows += [{**summarize(mode, c, n, results[mode], walls[mode]),
                          "same_text": f"{same}/{compared}"} for mode in args.modes]
    return model, spec, rows, round_rows


def round_row(concurrency: int, r: int, mode: str, bodies: list, got: list[RequestResult],
              wall: float) -> dict:
    ok = [x for x in got if x.ok]
    tokens = sum(x.completion_tokens for x in ok)
    return {"concurrency": concurrency, "round": r, "mode": mode, "requests": len(bodies),
            "finished": len(ok), "completion_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": _ratio(tokens, wall)}


def rounds_per_level(concurrency: int, n: int, flag: int | None) -> int:
    return flag if flag else max(1, n // concurrency)


def split_rounds(n: int, rounds: int) -> list[slice]:
    """A level's ``n`` requests in ``rounds`` consecutive parts (sizes differ by at most 1)."""
    bounds = [round(i * n / rounds) for i in range(rounds + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def parse_list(text: str, cast=int) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="http://127.0.0.1:8000", help="base URL of a running server")
    p.add_argument("--start-local", action="store_true",
                   help="start local Ray + Serve on 127.0.0.1:--local-port, stop it at the end")
    p.add_argument("--local-port", type=int, default=18600, help="port for --start-local")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_LEVELS)),
                   help="comma-separated concurrency levels")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of: on, off, router")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per (mode, level); default max(24, 6 x concurrency)")
    p.add_argument("--rounds", type=int, default=None,
                   help="split each level into this many rounds, the modes' order rotated per round "
                        "(drift and ordering hit every mode alike); default: one round per "
                        "concurrency requests")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--prompts", default="rewrite", help="prompt set (load/prompts/<name>.jsonl)")
    p.add_argument("--level-timeout", type=float, default=300.0,
                   help="seconds per (mode, level); requests still running then are cancelled")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--k", type=int, default=4, help="--start-local: the server's default K")
    p.add_argument("--method", default="ngram", choices=("ngram", "suffix", "eagle"),
                   help="--start-local: the proposer (eagle: the shipped EAGLE draft)")
    p.add_argument("--first", default=None, choices=("ngram", "suffix"),
                   help="--start-local, with --method eagle: the model-free proposer in front")
    p.add_argument("--max-model-len", type=int, default=2048, help="--start-local: context length")
    p.add_argument("--machine", default=None, help="machine name for the plot title")
    p.add_argument("--csv", type=Path, default=RESULTS / "sweep.csv")
    p.add_argument("--png", type=Path, default=RESULTS / "sweep.png")
    p.add_argument("--rounds-csv", type=Path, default=RESULTS / "sweep-rounds.csv",
                   help="one row per (level, round, mode)")
    args = p.parse_args(argv)
    args.concurrency = sorted(set(parse_list(args.concurrency)))
    args.modes = parse_list(args.modes, str)
    if not args.concurrency or min(args.concurrency) < 1 or max(args.concurrency) > 1024:
        p.error("--concurrency: levels in [1, 1024]")
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: a comma list of {', '.join(MODES)}")
    if args.max_tokens < 1 or any(v is not None and v < 1
                                  for v in (args.requests_per_level, args.rounds)):
        p.error("--max-tokens, --requests-per-level and --rounds must be >= 1")
    host = urlparse(args.host)
    if host.scheme not in ("http", "https") or not host.hostname:
        p.error("--host: a base URL such as http://127.0.0.1:8000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from load.prompts import load_prompts

    prompts = load_prompts(args.prompts)
    base = args.host.rstrip("/")
    try:
        if args.start_local:
            top = max(args.concurrency)
            base = start_local(args.local_port, local_app_args(
                top, max(64, top), args.max_model_len, args.k, args.method, args.first))
        model, spec, rows, round_rows = asyncio.run(run_sweep(args, base, prompts))
    finally:
        if args.start_local:
            stop_local()
    report(args, base, model, spec, rows, round_rows)
    return 0


def report(args, base: str, model: str, spec: str, rows: list[dict], round_rows: list[dict]) -> None:
    """Print the tables; write the CSVs and the plot."""
    local = args.start_local or urlparse(base).hostname in ("127.0.0.1", "localhost")
    machine = args.machine or (machine_label() if local else base)
    title = (f"{model} on {machine}: speculation {' / '.join(args.modes)}\n"
             + (f"{spec}, " if spec else "") + f"{args.prompts} prompts, greedy, "
             f"max_tokens={args.max_tokens}, streaming chat, {datetime.date.today()}")
    print(f"model: {model}   server: {base}   machine: {machine}   speculation: {spec or '?'}\n")
    print(format_table(rows, TABLE))
    print("\nlatencies in ms; ITL = gap between SSE chunks (a speculative chunk can carry several "
          "tokens); TPOT = (last - first token) / (tokens - 1)")
    levels = level_summary(rows, round_rows)
    if levels:
        print("\n" + format_table(levels, LEVEL_TABLE))
        print("\nrouter / best: router tok/s over the better of on and off (issue 5 wants >= 0.95); "
              "router / on per round: min, median, max over the level's rounds (the noise of one "
              "round where the router chose what on does); same text: prompts whose completions "
              "were one text in every mode and repeat / prompts compared")
    write_csv(rows, args.csv, CSV_COLUMNS)
    write_csv(round_rows, args.rounds_csv, ROUND_COLUMNS)
    save_plot(rows, title, args.png)
    print(f"wrote {args.csv}, {args.rounds_csv} and {args.png}")


LEVEL_TABLE = (("c", "concurrency", 4, 0), ("on tok/s", "on", 9, 1), ("off tok/s", "off", 9, 1),
               ("router tok/s", "router", 12, 1), ("router/best", "router_over_best", 11, 3),
               ("on/off", "on_over_off", 7, 2), ("router/off", "router_over_off", 10, 2),
               ("rounds", "rounds", 6, 0), ("r/on min", "round_min", 8, 2),
               ("r/on med", "round_median", 8, 2), ("r/on max", "round_max", 8, 2),
               ("same text", "same_text", 9, 0))


def level_summary(rows: list[dict], round_rows: list[dict]) -> list[dict]:
    """Per level with all three modes: their tok/s, router over the better of on and off,
    the speedups over off, and min / median / max over the rounds of the per-round ratio
    router / on (tok/s). Empty when a mode is missing."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        tps = {r["mode"]: r["output_tokens_per_s"] for r in rows if r["concurrency"] == c}
        if not all(m in tps for m in MODES):
            return []
        per_round: dict[int, dict[str, float]] = {}
        for r in round_rows:
            if r["concurrency"] == c:
                per_round.setdefault(r["round"], {})[r["mode"]] = r["output_tokens_per_s"]
        ratios = [_ratio(v["router"], v["on"]) for v in per_round.values() if "router" in v and "on" in v]
        ratios = [x for x in ratios if not math.isnan(x)]
        same = next((r.get("same_text", "") for r in rows if r["concurrency"] == c), "")
        out.append({"concurrency": c, **{m: tps[m] for m in MODES}, "same_text": same,
                    "router_over_best": _ratio(tps["router"], max(tps["on"], tps["off"])),
                    "on_over_off": _ratio(tps["on"], tps["off"]),
                    "router_over_off": _ratio(tps["router"], tps["off"]),
                    "rounds": len(ratios), "round_min": min(ratios, default=math.nan),
                    "round_median": percentile(ratios, 50), "round_max": max(ratios, default=math.nan)})
    return out


if __name__ == "__main__":
    sys.exit(main())
