"""Bounded soak: a steady mixed load for a few minutes, then what it left behind.

``--concurrency`` workers (default 6) send requests back to back for ``--duration`` seconds
(default 180) or until ``--max-requests`` (default 5000) have been sent, whichever comes
first: chat and completions, streamed and not, greedy and sampled, speculation forced on,
off or left to the router, some streams dropped by the client half way (the server must free
their slots), and a share of bad requests (which must get a clean 4xx). It reports

- requests sent, by outcome; **failures** (anything but the expected status, a 5xx, a stream
  without ``[DONE]``, a timeout) must be 0;
- resident memory (RSS) of every Ray process of the app (proxy, ingress, unit, target ranks,
  draft) after a warm-up and at the end, and its growth;
- free KV slots at the end (must equal the slots: nothing leaked), and requests still running.

    python load/soak.py --start-local                  # its own local Ray + Serve (127.0.0.1)
    python load/soak.py --host http://127.0.0.1:8000   # against a running `make serve`

Writes ``results/soak.json`` and prints a table. Exit status 1 when a failure happened or a
slot was left taken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "results"
PROMPTS = ["Summarize: the cat sat on the mat, and then the cat sat on the mat again.",
           "def fibonacci(n):\n    ", "Translate to French: good morning, how are you?",
           "List three primary colors.", "Repeat exactly: one two three one two three one two",
           "Write a haiku about latency."]
APP_PROCESSES = ("ProxyActor", "OpenAIIngress", "SpeculationUnit", "TargetRank", "DraftWorker")


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    expected_4xx: int = 0
    dropped: int = 0          # streams the client cut on purpose
    failures: list[str] = field(default_factory=list)
    completion_tokens: int = 0

    def fail(self, what: str) -> None:
        self.failures.append(what[:300])


# -- the requests ---------------------------------------------------------------------------------
def pick(rng: random.Random, model: str) -> tuple[str, dict, str]:
    """(path, body, kind): kind is 'ok', 'drop' (read a little, then hang up) or 'bad'."""
    roll = rng.random()
    prompt = rng.choice(PROMPTS)
    spec = rng.choice([None, {"enabled": True}, {"enabled": False}])
    common = {"model": model, "max_tokens": rng.choice([16, 48, 96]),
              "temperature": rng.choice([0.0, 0.0, 0.7]), "seed": rng.randrange(1 << 30),
              "stream": rng.random() < 0.6, **({"speculation": spec} if spec else {})}
    if roll < 0.08:
        return "/v1/chat/completions", {**common, "messages": [], "stream": False}, "bad"
    if roll < 0.12:
        return "/v1/completions", {**common, "prompt": "x", "max_tokens": -1, "stream": False}, "bad"
    kind = "drop" if common["stream"] and roll > 0.94 else "ok"
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}, kind
    return "/v1/completions", {**common, "prompt": prompt}, kind


async def one(client, base: str, path: str, body: dict, kind: str, tally: Tally) -> None:
    tally.sent += 1
    try:
        if kind == "bad":
            r = await client.post(base + path, json=body)
            if 400 <= r.status_code < 500 and "error" in r.json():
                tally.expected_4xx += 1
            else:
                tally.fail(f"bad request got {r.status_code}: {r.text[:120]}")
            return
        if not body["stream"]:
            r = await client.post(base + path, json=body)
            if r.status_code != 200:
                tally.fail(f"{r.status_code} {path}: {r.text[:200]}")
                return
            tally.ok += 1
            tally.completion_tokens += r.json()["usage"]["completion_tokens"]
            return
        async with client.stream("POST", base + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.fail(f"{r.status_code} {path} (stream): {r.text[:200]}")
                return
            lines, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                lines += 1
                if kind == "drop" and lines >= 3:
                    tally.dropped += 1
                    return  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    done = True
                elif '"error"' in line:
                    tally.fail(f"in-band error: {line[:200]}")
                    return
            if not done:
                tally.fail(f"stream without [DONE] after {lines} events")
                return
            tally.ok += 1
    except Exception as exc:  # noqa: BLE001  a transport error is a failure to report
        tally.fail(f"{type(exc).__name__}: {exc}")


async def run_load(base: str, model: str, concurrency: int, duration_s: float, max_requests: int,
                   seed: int = 0, request_timeout_s: float = 120.0, sample_every_s: float = 0,
                   samples: list | None = None) -> Tally:
    """The load; with ``sample_every_s``, ``(seconds, app_rss())`` pairs go to ``samples``."""
    import httpx

    tally = Tally()
    rng = random.Random(seed)
    start = time.monotonic()
    end = start + duration_s
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as client:
        async def worker() -> None:
            while time.monotonic() < end and tally.sent < max_requests:
                await one(client, base, *pick(rng, model), tally)

        async def sampler() -> None:
            while sample_every_s and time.monotonic() + sample_every_s < end:
                await asyncio.sleep(sample_every_s)
                samples.append((time.monotonic() - start, await asyncio.to_thread(app_rss)))

        await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    return tally


# -- what it left behind ----------------------------------------------------------------------------
def app_rss() -> dict[str, int]:
    """RSS in bytes of the app's Ray processes on this machine, by process title (summed
    where a title repeats: ``TargetRank`` over its ranks)."""
    import psutil

    out: dict[str, int] = {}
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if not cmd.startswith("ray::") or proc.info["memory_info"] is None:
            continue
        name = next((n for n in APP_PROCESSES if n in cmd.split()[0]), None)
        if name:
            out[name] = out.get(name, 0) + proc.info["memory_info"].rss
    return out


def unit_state(base: str) -> dict:
    import httpx

    return httpx.get(base + "/v1/units/stats", timeout=30).json()


def settle(base: str, timeout_s: float = 30.0) -> dict:
    """Unit stats once nothing runs or waits (dropped streams take a step to abort)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = unit_state(base)
        idle = stats["running"] == 0 and stats["waiting"] == 0
        if (idle and stats["free_slots"] == stats["num_slots"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.3)


def soak(base: str, *, concurrency: int, duration_s: float, max_requests: int,
         warmup_s: float = 15.0, seed: int = 0) -> dict:
    """Warm up, take RSS, run the load, settle, take RSS again; the report as a dict."""
    import httpx

    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    asyncio.run(run_load(base, model, concurrency, warmup_s, max_requests, seed=seed + 1))
    settle(base)
    rss_before = app_rss()
    samples: list = [(0.0, rss_before)]
    t0 = time.monotonic()
    tally = asyncio.run(run_load(base, model, concurrency, duration_s, max_requests, seed=seed,
                                 sample_every_s=duration_s / 6, samples=samples))
    wall = time.monotonic() - t0
    stats = settle(base)
    rss_after = app_rss()
    samples.append((wall, rss_after))
    return {
        "duration_s": round(wall, 1), "concurrency": concurrency, "requests": tally.sent,
        "ok": tally.ok, "expected_4xx": tally.expected_4xx, "dropped_by_client": tally.dropped,
        "failures": len(tally.failures), "failure_examples": tally.failures[:5],
        "completion_tokens": tally.completion_tokens,
        "free_slots": stats["free_slots"], "num_slots": stats["num_slots"],
        "running_at_end": stats["running"], "waiting_at_end": stats["waiting"],
        "requests_aborted": stats["requests_aborted"],
        "rss_mb": {name: {"before": round(rss_before.get(name, 0) / 2**20, 1),
                          "after": round(rss_after.get(name, 0) / 2**20, 1),
                          "growth": round((rss_after.get(name, 0) - rss_before.get(name, 0)) / 2**20, 1)}
                   for name in sorted(set(rss_before) | set(rss_after))},
        "rss_mb_over_time": [{"t_s": round(t, 1), **{n: round(v / 2**20, 1) for n, v in sorted(rss.items())}}
                             for t, rss in samples],
    }


def print_report(report: dict) -> None:
    print(f"soak: {report['requests']} requests in {report['duration_s']} s at concurrency "
          f"{report['concurrency']}: {report['ok']} ok, {report['expected_4xx']} bad requests "
          f"answered 4xx, {report['dropped_by_client']} streams dropped by the client, "
          f"**{report['failures']} failures**")
    for example in report["failure_examples"]:
        print(f"  failure: {example}")
    print(f"free slots at the end: {report['free_slots']} / {report['num_slots']} "
          f"(running {report['running_at_end']}, waiting {report['waiting_at_end']}; "
          f"{report['requests_aborted']} aborted since start)")
    print(f"{'process':>16}  {'RSS before':>10}  {'after':>8}  {'growth':>8}  (MiB)")
    for name, rss in report["rss_mb"].items():
        print(f"{name:>16}  {rss['before']:>10.1f}  {rss['after']:>8.1f}  {rss['growth']:>+8.1f}")
    names = list(report["rss_mb"])
    print("RSS over the run (MiB): t_s  " + "  ".join(names))
    for row in report["rss_mb_over_time"]:
        print(f"  {row['t_s']:>7.1f}  " + "  ".join(f"{row.get(n, 0):.1f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="http://127.0.0.1:8000", help="base URL of a running server")
    p.add_argument("--start-local", action="store_true", help="start local Ray + Serve itself")
    p.add_argument("--local-port", type=int, default=18700)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (bounded)")
    p.add_argument("--max-requests", type=int, default=5000, help="stop after this many")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the first RSS")
    p.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args(argv)
    if not (1 <= args.concurrency <= 256 and 0 < args.duration <= 3600 and args.max_requests >= 1):
        p.error("--concurrency in [1, 256], --duration in (0, 3600], --max-requests >= 1")
    base = args.host.rstrip("/")
    if args.start_local:
        from load.sweep import local_app_args, start_local

        base = start_local(args.local_port, local_app_args(8, 64, 2048, 4), name="soak")
    try:
        report = soak(base, concurrency=args.concurrency, duration_s=args.duration,
                      max_requests=args.max_requests, warmup_s=args.warmup)
    finally:
        if args.start_local:
            from load.sweep import stop_local

            stop_local()
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if report["failures"] or report["free_slots"] != report["num_slots"] else 0


if __name__ == "__main__":
    sys.exit(main())
