"""Unit autoscaling under a ramp (issue 55): this project's policy against Serve's and a fixed
maximum, side by side in one run, on the embedded default (``make bench-autoscale``).

A benchmark, not a test. It starts a local Ray cluster and, for each policy in turn, the Serve
app on 127.0.0.1 with units of ``--slots`` sequences (at most 2 units: what 2 cores hold),
then runs a Locust-style ramp of streaming chat users (``--stages``: seconds x users; by
default 1 user, then enough to saturate one unit, then 1 again) and records, once a second,
the units Serve runs (and starts and stops) and each unit's load by the rule
(``specserve:autoscaling_load`` on ``/metrics``), and its mean over Serve's look-back window
(what the policy sees: a scale-up is due ``--up-delay`` after that crosses the target). Per
request: status, time to first token, the gaps between chunks, whether the stream ended with
its finish reason and ``[DONE]``.

    speculation  autoscaling.policy speculation (serve/autoscaling.py), 1..2 units
    requests     Serve's own policy, target_ongoing_requests = max_num_seqs x target, 1..2 units
    fixed        num_units 2, no autoscaling

Prints per policy: unit-seconds used, p50 / p95 TTFT, p95 inter-token gap, requests, failed
requests, cut streams, when the load crossed the target and when the second unit was asked
for (``STARTING``) and was running; writes ``results/bench_autoscale.json`` and a plot of
units and load over time (``.png`` beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # two units share 2 cores (tests/conftest.py)

import specserve.serve.local  # noqa: E402,F401  (before ray: loopback)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load.prompts import load_prompts  # noqa: E402

PORT = 18520
LOOK_BACK_S = 5.0  # autoscaling.look_back_s: Serve averages the units' reports over it
POLICIES = ("speculation", "requests", "fixed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--stages", default="20x1,70x8,80x1", help="seconds x users, comma-separated")
    p.add_argument("--slots", type=int, default=4, help="max_num_seqs of a unit")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--target", type=float, default=0.7, help="autoscaling.target_utilization")
    p.add_argument("--up-delay", type=float, default=5.0)
    p.add_argument("--down-delay", type=float, default=20.0)
    p.add_argument("--out", default="results/bench_autoscale.json")
    args = p.parse_args(argv)
    args.stages = [tuple(int(x) for x in s.split("x")) for s in args.stages.split(",")]
    return args


def app_args(policy: str, args) -> dict:
    engine = {"speculative": {"method": "ngram", "num_speculative_tokens": 4},
              "max_num_seqs": args.slots}
    out = {"unit": {"engine": engine, "max_queue_len": 64}, "max_tokens_cap": 4096,
           "auth": {"enabled": False}, "drain_timeout_s": 120}
    if policy == "fixed":
        return {**out, "num_units": 2}
    return {**out, "num_units": 1, "autoscaling": {
        "policy": policy, "min_units": 1, "max_units": 2, "target_utilization": args.target,
        "upscale_delay_s": args.up_delay, "downscale_delay_s": args.down_delay,
        "look_back_s": LOOK_BACK_S, "metrics_interval_s": 1}}


def one_request(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request, timed by the client."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start, first, last, gaps, done, finish = time.monotonic(), None, None, [], False, None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return {"start": start, "status": r.status_code, "complete": False}
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    choice = (chunk.get("choices") or [{}])[0]
                    finish = choice.get("finish_reason") or finish
                    if (choice.get("delta") or {}).get("content"):
                        now = time.monotonic()
                        first = first or now
                        if last is not None:
                            gaps.append(now - last)
                        last = now
    except httpx.HTTPError as exc:
        return {"start": start, "status": type(exc).__name__, "complete": False}
    return {"start": start, "status": 200, "complete": done and finish is not None,
            "ttft": None if first is None else first - start, "gaps": gaps}


def replica_states(app: str) -> dict[str, int]:
    from ray import serve

    deployment = serve.status().applications[app].deployments["SpeculationUnit"]
    return {str(state).split(".")[-1]: n for state, n in deployment.replica_states.items()}


def unit_loads(url: str) -> list[float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return [s.value for f in text_string_to_metric_families(text) if f.name == "specserve:autoscaling_load"
            for s in f.samples]


def run_policy(policy: str, args, prompts: list[dict]) -> dict:
    import httpx
    from ray import serve

    from deploy.app import build_app

    app, url = f"scale-{policy}", f"http://127.0.0.1:{PORT}/scale-{policy}"
    serve.run(build_app(app_args(policy, args)), name=app, route_prefix=f"/{app}")
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    one_request(url, model, prompts[0]["messages"], 8)  # warm-up
    t0, stop, samples, results = time.monotonic(), threading.Event(), [], []
    ends, users = [], max(n for _, n in args.stages)
    at = 0
    for seconds, n in args.stages:
        at += seconds
        ends.append((at, n))

    def users_now() -> int:
        elapsed = time.monotonic() - t0
        return next((n for end, n in ends if elapsed < end), 0)

    def user(i: int) -> None:
        turn = i
        while time.monotonic() - t0 < ends[-1][0]:
            if i >= users_now():
                time.sleep(0.2)
                continue
            results.append(one_request(url, model, prompts[turn % len(prompts)]["messages"],
                                       args.max_tokens))
            turn += users

    def sample() -> None:
        while not stop.is_set():
            try:
                states, loads = replica_states(app), unit_loads(url)
            except Exception as exc:  # noqa: BLE001  (a sample missed is reported, not fatal)
                states, loads = {"error": str(exc)}, []
            samples.append({"t": round(time.monotonic() - t0, 2), **states,
                            "load": round(statistics.fmean(loads), 4) if loads else None})
            stop.wait(1.0)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    sampler = threading.Thread(target=sample)
    for th in [sampler, *threads]:
        th.start()
    for th in threads:
        th.join()
    time.sleep(args.down_delay + 10)  # the way down, with one user gone too
    stop.set()
    sampler.join()
    serve.delete(app)
    return summarize(policy, args, samples, results, t0)


def summarize(policy: str, args, samples: list[dict], results: list[dict], t0: float) -> dict:
    def pct(values: list[float], q: float) -> float | None:
        return round(statistics.quantiles(values, n=100)[q - 1], 3) if len(values) >= 2 else None

    ttft = [r["ttft"] for r in results if r.get("ttft") is not None]
    gaps = [g for r in results for g in r.get("gaps", [])]
    up_at = next((s["t"] for s in samples if s.get("RUNNING", 0) + s.get("STARTING", 0) > 1
                  and policy != "fixed"), None)
    running_two = next((s["t"] for s in samples if s.get("RUNNING", 0) > 1 and policy != "fixed"), None)
    crossed = next((s["t"] for s in samples if (s["load"] or 0) > args.target), None)
    # What the policy sees: the reports' mean over the look-back window (Serve's aggregation)
    seen = [(s["t"], statistics.fmean([(o["load"] or 0) for o in samples
                                       if s["t"] - LOOK_BACK_S < o["t"] <= s["t"]])) for s in samples]
    crossed_seen = next((t for t, load in seen if load > args.target), None)
    times = [s["t"] for s in samples]
    steps = [b - a for a, b in zip(times, times[1:])] + [1.0]  # a sample holds until the next
    unit_seconds = round(sum(s.get("RUNNING", 0) * dt for s, dt in zip(samples, steps)), 1)
    return {"policy": policy, "unit_seconds": unit_seconds, "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95), "itl_p95": pct(gaps, 95), "requests": len(results),
            "failed": sum(r["status"] != 200 for r in results),
            "cut": sum(r["status"] == 200 and not r["complete"] for r in results),
            "load_crossed_s": crossed, "mean_crossed_s": crossed_seen, "second_unit_asked_s": up_at,
            "second_unit_running_s": running_two, "samples": samples}


def plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.6 * len(rows)), sharex=True)
    for ax, row in zip(axes if len(rows) > 1 else [axes], rows):
        t = [s["t"] for s in row["samples"]]
        ax.step(t, [s.get("RUNNING", 0) for s in row["samples"]], where="post", label="units running")
        ax.plot(t, [s["load"] or 0 for s in row["samples"]], label="mean unit load (rule)")
        ax.axhline(args.target, color="grey", linestyle=":", label="target")
        ax.set_title(f"{row['policy']}: {row['unit_seconds']} unit-s, p95 TTFT {row['ttft_p95']} s")
        ax.legend(loc="upper right", fontsize=7)
    axes_list = axes if len(rows) > 1 else [axes]
    axes_list[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from specserve.serve.local import start_local_ray, start_serve

    start_local_ray(metrics_export_port=None)
    start_serve("127.0.0.1", PORT)
    prompts = load_prompts("chat")
    rows = [run_policy(p, args, prompts) for p in args.policies.split(",")]
    flags = sorted({f for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags") for f in line.split() if f.startswith(("avx", "fma"))})
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"cpu flags: {' '.join(flags)}; stages {args.stages} (seconds, users); units of "
          f"{args.slots} slots; up / down delay {args.up_delay} / {args.down_delay} s")
    print(f"{'policy':12} {'unit-s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p95':>8} {'requests':>9} "
          f"{'failed':>7} {'cut':>4} {'crossed':>8} {'mean crossed':>13} {'asked':>6} {'running':>8}")
    for r in rows:
        print(f"{r['policy']:12} {r['unit_seconds']:>7} {r['ttft_p50']!s:>9} {r['ttft_p95']!s:>9} "
              f"{r['itl_p95']!s:>8} {r['requests']:>9} {r['failed']:>7} {r['cut']:>4} "
              f"{r['load_crossed_s']!s:>8} {r['mean_crossed_s']!s:>13} {r['second_unit_asked_s']!s:>6} "
              f"{r['second_unit_running_s']!s:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, indent=1))
    plot(rows, args, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    from ray import serve

    serve.shutdown()


if __name__ == "__main__":
    main()
