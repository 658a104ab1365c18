"""Where a token's time goes at one stream over HTTP: ``make profile-stream`` (issue 71).

A profile, not a test. It starts ``specserve serve`` as a user does (the shipped config with
speculation off, auth off, 127.0.0.1), streams ``--requests`` greedy chat completions of
``--tokens`` tokens (``ignore_eos``) one after another, and measures, over that window:

- at the client: the mean gap between tokens (a stream's first-to-last content chunk over its
  tokens - 1), the median over requests;
- in every process of the server's two sessions (the supervisor's and the server's: Ray's
  daemons and workers among them), the CPU time it took (``utime + stime`` in
  ``/proc/PID/stat``), in milliseconds a token, by role: the unit's replica (the coordinator,
  and at TP = 1 on a CPU the forward), a target rank actor where there is one, the ingress
  replica, Serve's proxy and controller, Ray's daemons, the server; and in the ingress
  replica, thread by thread (``/proc/PID/task``: the forward's two threads, the event loop's);
- then, with the server stopped, the same model's decode in this process
  (``load/decode_ms.py``: batch 1, 2 threads, 128 tokens), the forward's own time.

The gap over HTTP minus the in-process decode is what serving adds to a token (issue 71's aim:
at most 1 ms). Beside it, the forward calls of those very steps (timed where the engine makes
them): the decode less them is the engine's step outside the forward (aim: at most 0.5 ms),
and the gap less them what a token costs beyond the forward, step and serving together (issue
71's done-when: at most 1 ms); and the bare forward of one token after the prompt, measured
apart (it drifted 1-2 ms against the decode on a shared VM). ``--rounds N`` (3) measures the
server and the in-process decode in turn N times and reports the median of the rounds'
differences: on a shared VM the decode's own speed drifts by more than the aim within
minutes. CPU time shows where: on a 2-core machine every millisecond another process spends
beside the forward delays it. ``--py-spy DIR`` (needs ``py-spy``) also records each Python
role's flame graph over the window (speedscope JSON, one file a role). ``--unit JSON`` merges
fields into the unit's config (an experiment: ``'{"target_in_unit": false}'`` puts the target
back in a rank actor). Prints a table with the CPU flags; writes ``results/profile_stream.json``.

    make profile-stream
    make profile-stream PROFILE_ARGS="--requests 12 --py-spy results/profile_stream"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "services"))

from specserve.machine import cpu_flags, machine_label  # noqa: E402
from specserve.serve.ports import cmdline, proc_stat  # noqa: E402
from specserve.serve.ray_watch import children, session_pids  # noqa: E402

from load import bench_vs_llama_server as vs  # noqa: E402
from load import decode_ms  # noqa: E402

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
# Roles by what a process's command line holds (Ray's workers carry their actor's title).
ROLES = (("TargetRank", "target rank (the forward)"),
         ("SpeculationUnit", "unit replica (and an in-unit target)"),
         ("OpenAIIngress", "ingress replica (and a unit in it)"), ("ProxyActor", "Serve proxy"),
         ("ServeController", "Serve controller"), ("gcs_server", "Ray GCS"),
         ("raylet", "raylet"), ("dashboard", "Ray dashboard and agents"),
         ("DashboardAgent", "Ray dashboard and agents"), ("RuntimeEnvAgent", "Ray dashboard and agents"),
         ("MetricsHub", "metrics hub (an actor)"), ("log_monitor", "Ray log monitor"),
         ("autoscaler", "Ray autoscaler monitor"), ("ray_watch", "guardian"),
         ("specserve", "server and supervisor"))
PY_SPY_ROLES = ("TargetRank", "SpeculationUnit", "OpenAIIngress", "ProxyActor")


def cpu_s(pid: int) -> float:
    """The CPU seconds ``pid`` has used (user + system); 0 once it is gone."""
    stat = proc_stat(pid)
    return stat.cpu_ticks * TICK_S if stat is not None else 0.0


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: its name and the CPU seconds it has used (``/proc/PID/task``)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        stat = proc_stat(pid, int(task.name))
        if stat is not None:
            out[int(task.name)] = (stat.comm, stat.cpu_ticks * TICK_S)
    return out


def role(pid: int) -> str:
    line = cmdline(pid)
    return next((name for key, name in ROLES if key in line), "other Ray processes")


def server_pids(supervisor: int) -> list[int]:
    """Every live process of the supervisor's session and of its server's."""
    sessions = {supervisor} | {pid for pid, _ in children(supervisor)}
    return sorted({pid for sid in sessions for pid in session_pids(sid)})


def find(pids: list[int], key: str) -> int | None:
    return next((pid for pid in pids if key in cmdline(pid)), None)


async def stream_all(url: str, bodies: list[dict]) -> list:
    import httpx

    async with httpx.AsyncClient(timeout=vs.REQUEST_TIMEOUT_S, trust_env=False) as client:
        return [await vs.stream_chat(client, url, "chat", body) for body in bodies]


def bodies(model: str, count: int, tokens: int) -> list[dict]:
    """Fresh chat requests (a nonce in each: nothing cached), greedy, ``tokens`` each."""
    return [{"model": model, "stream": True, "temperature": 0, "max_tokens": tokens,
             "ignore_eos": True, "stream_options": {"include_usage": True},
             "messages": [{"role": "user", "content": f"({i}-{time.time_ns()}) Write a long story "
                           "about a lighthouse keeper and the ships she watches."}]}
            for i in range(count)]


def py_spy(pids: list[int], seconds: float, out: Path) -> list[subprocess.Popen]:
    beside = Path(sys.executable).parent / "py-spy"  # the .venv's, where `make` does not put it on PATH
    exe = str(beside) if beside.is_file() else shutil.which("py-spy")
    if exe is None:
        raise SystemExit("profile-stream: --py-spy needs py-spy (pip install py-spy)")
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for key in PY_SPY_ROLES:
        pid = find(pids, key)
        if pid is not None:
            spies.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--duration", str(int(seconds) + 1), "--rate", "250",
                 "--format", "speedscope", "--output", str(out / f"{key}.json"), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def measure_server(args, log: Path) -> dict:
    """The server's side: the gaps at the client and each role's CPU per token."""
    config = vs.specserve_configs()[args.config] | json.loads(args.app)
    config["unit"] = config["unit"] | json.loads(args.unit)
    with tempfile.TemporaryDirectory(prefix="profile-stream-") as tmp:
        path = Path(tmp) / "specserve-off.json"
        path.write_text(json.dumps(config))
        [port] = vs.free_ports(1)
        env = (os.environ | vs.parse_env(args.env)) if args.env else None
        argv = vs.specserve_argv(path, port) + (["--proxy-only"] if args.proxy_only else [])
        spec = vs.ServerSpec("specserve", "off", argv, env, port)
        proc = vs.start(spec, log)
        try:
            vs.wait_ready(spec, proc, log)
            url = f"http://{vs.HOST}:{port}/v1/chat/completions"
            model = vs.model_id(port)
            asyncio.run(stream_all(url, bodies(model, 2, 16)))  # warm-up
            pids = server_pids(proc.pid)
            spies = py_spy(pids, args.requests * args.tokens * 0.05, Path(args.py_spy)) if args.py_spy else []
            replica = find(pids, "OpenAIIngress")
            before = {pid: cpu_s(pid) for pid in pids}
            threads_before = thread_cpu_s(replica) if replica else {}
            t0 = time.perf_counter()
            streams = asyncio.run(stream_all(url, bodies(model, args.requests, args.tokens)))
            wall = time.perf_counter() - t0
            threads_after = thread_cpu_s(replica) if replica else {}
            after = {pid: cpu_s(pid) for pid in server_pids(proc.pid)}
            roles = {pid: role(pid) for pid in after}  # while they run: their titles go with them
            for spy in spies:
                spy.wait(timeout=120)
        finally:
            vs.stop(proc)
    failed = [s.error or 'no [DONE]' for s in streams if not s.ok]
    if failed:
        raise SystemExit(f"profile-stream: {len(failed)} requests failed: {failed[:3]}")
    tokens = sum(s.tokens for s in streams)
    threads = sorted(((name, tid == replica, end - threads_before.get(tid, (name, 0.0))[1])
                      for tid, (name, end) in threads_after.items()), key=lambda t: -t[2])
    by_role: dict[str, float] = {}
    for pid, end in after.items():
        by_role[roles[pid]] = by_role.get(roles[pid], 0.0) + end - before.get(pid, 0.0)
    return {"tokens": tokens, "wall_s": round(wall, 3),
            "gap_ms": round(statistics.median(s.token_gap for s in streams) * 1000, 2),
            "wall_ms_per_token": round(wall / tokens * 1000, 2),
            "cpu_ms_per_token": {name: round(sec / tokens * 1000, 3)
                                 for name, sec in sorted(by_role.items(), key=lambda kv: -kv[1])},
            "replica_threads_cpu_ms_per_token": [
                {"thread": name + (" (main)" if main else ""), "ms": round(sec / tokens * 1000, 3)}
                for name, main, sec in threads if sec > 0]}


def report(result: dict) -> None:
    http, forward = result["server"]["gap_ms"], result["in_process_ms"]
    print(f"\n{result['machine']}; CPU flags: {' '.join(result['cpu_flags'])}")
    print(f"one stream, speculation off, {result['server']['tokens']} tokens in "
          f"{result['requests']} requests of {result['tokens_per_request']} a round"
          + (f"; server env: {result['env']}" if result["env"] else "")
          + (f"; unit: {json.dumps(result['unit'])}" if result.get("unit") else ""))
    for i, r in enumerate(result["rounds"], 1):
        print(f"  round {i}: gap {r['gap_ms']:6.2f} ms, in-process decode {r['in_process_ms']:6.2f} ms, "
              f"its forward {r['forward_ms']:6.2f} ms (bare {r['bare_forward_ms']:5.2f}), "
              f"serving adds {r['adds_ms']:5.2f} ms")
    print(f"  gap between tokens over HTTP   {http:7.2f} ms (median over requests, then rounds)")
    print(f"  decode in-process              {forward:7.2f} ms (load/decode_ms.py, median over rounds)")
    print(f"  what serving adds              {result['adds_ms']:7.2f} ms a token (median of the rounds'; "
          "aim: at most 1)")
    print(f"  the step outside the forward   {result['step_ms']:7.2f} ms (the decode less its forwards, "
          "median of the rounds'; aim: at most 0.5)")
    print(f"  the gap beyond the forward     {result['beyond_forward_ms']:7.2f} ms (the gap less the "
          "decode's forwards: the step and serving; median of the rounds')")
    print("CPU time a token, by process role, the last round (2 cores: 2 ms of CPU a ms of wall at most):")
    for name, ms in result["server"]["cpu_ms_per_token"].items():
        print(f"  {name:32s} {ms:7.3f} ms")
    if threads := result["server"].get("replica_threads_cpu_ms_per_token"):
        print("the ingress replica's threads, CPU time a token (the forward's OpenMP workers are "
              "unnamed copies of the process's name; the engine thread is one of them):")
        for t in threads[:8]:
            print(f"  {t['thread']:32s} {t['ms']:7.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--decode-runs", type=int, default=3, help="in-process decodes a round")
    p.add_argument("--rounds", type=int, default=3,
                   help="server then in-process, this many times in turn; the median difference")
    p.add_argument("--py-spy", default=None, help="a folder for each Python role's flame graph")
    p.add_argument("--env", default="", help="'K=V ...' for the server (an experiment's settings)")
    p.add_argument("--config", default="off", choices=("off", "off-invariant"),
                   help="the server's configuration (bench-vs-llama-server's; off-invariant: the "
                        "target's kernels: invariant, the float32-identical arithmetic)")
    p.add_argument("--app", default="{}", help="JSON fields merged into the app's config")
    p.add_argument("--unit", default="{}", help="JSON fields merged into the unit's config")
    p.add_argument("--proxy-only", action="store_true",
                   help="the server's --proxy-only: through Serve's proxy, for comparison")
    p.add_argument("--out", default=str(ROOT / "results" / "profile_stream.json"))
    args = p.parse_args()
    out = Path(args.out)
    kernels = "invariant" if args.config == "off-invariant" else "auto"
    rounds = []
    for _ in range(args.rounds):  # in turn: this machine's speed drifts by more than the aim
        server = measure_server(args, out.with_suffix(".log"))
        in_process = decode_ms.main(args.decode_runs, kernels)  # the same kernels as the server's
        ms = statistics.median(in_process["ms_per_token"])
        forward = statistics.median(in_process["forward_in_step_ms"])  # those steps' own forwards
        rounds.append({"gap_ms": server["gap_ms"], "in_process_ms": ms, "in_process_runs":
                       in_process["ms_per_token"], "adds_ms": round(server["gap_ms"] - ms, 2),
                       "forward_ms": forward, "bare_forward_ms": in_process["forward_ms"],
                       "step_ms": round(ms - forward, 2),
                       "beyond_forward_ms": round(server["gap_ms"] - forward, 2),
                       "server": server})
    result = {"machine": machine_label(), "cpu_flags": cpu_flags(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "env": args.env, "config": args.config, "app": json.loads(args.app),
              "unit": json.loads(args.unit), "proxy_only": args.proxy_only, "requests": args.requests,
              "tokens_per_request": args.tokens,
              "gap_ms_median": statistics.median(r["gap_ms"] for r in rounds),
              "in_process_ms": statistics.median(r["in_process_ms"] for r in rounds),
              "adds_ms": statistics.median(r["adds_ms"] for r in rounds),
              "step_ms": statistics.median(r["step_ms"] for r in rounds),
              "beyond_forward_ms": statistics.median(r["beyond_forward_ms"] for r in rounds),
              "rounds": [{k: v for k, v in r.items() if k != "server"} for r in rounds]}
    result["server"] = server | {"gap_ms": result["gap_ms_median"]}
    report(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
