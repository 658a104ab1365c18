"""Engine tokens/s at batch 1 on CPU: transformers ``generate()`` vs ours vs ours + ngram.

For each dtype (``--dtypes``, default float32 and bfloat16) on the embedded default
(SmolLM2-135M-Instruct), greedy, EOS on, at most ``--max-tokens`` new tokens:

1. ``generate()``: the ``transformers`` model, cast to the dtype, ``do_sample=False``;
2. ``target-only``: our engine with speculation off (``num_speculative_tokens=0``), on the
   GGUF's own blocks (issue 54), and ``target-only (float32)`` on its dequantized weights
   (``weights: float32``, the same bits) and ``target-only (library)`` on torch's kernels;
3. ``ngram K=k``: our engine with prompt-lookup drafts of up to k tokens (``--k``),

on an input-repeating workload (``load/prompts/rewrite.jsonl``) and on open chat
(``chat.jsonl``), ``--prompts`` prompts each. Throughput is sum(tokens) / sum(seconds) over
the same prompts in every mode (seconds include the prefill, as a client would see); modes
are interleaved per prompt (their order rotated) so machine noise hits them alike. One
warm-up run per mode comes first.

Greedy outputs should be identical token for token; the ``same ids`` column counts the
prompts where they are. float32: always. bfloat16: rounding depends on the batch shape
(a verify forward over K + 1 tokens vs one token) and on the kernels (ours fuses q/k/v),
so some outputs diverge after a near tie; that is reported, not an error.

The ``others`` column is the share of the CPU that other processes took while a mode ran
(from /proc/stat). On 2 cores a busy neighbour slows a 2-thread run several-fold, so a run
during which others took more than 5% is measured again once the machine is quiet (up to
4 tries; the JSON counts the retries); if noise remains the script says so under the table.

    make bench-engine                     # or: python load/bench_engine.py --help

With ``--llama-cpp PYTHON`` (an interpreter with ``llama-cpp-python``, which compiles
llama.cpp and so lives in its own virtualenv; ``auto`` = this one, if it has it), llama.cpp
also runs the same prompts as token ids on the same GGUF (its own 4-bit weights), greedy,
through ``load/llama_cpp_run.py``, after ours: its tokens/s and ours over it per workload.

Then the prefill (``--prefill``, ``load/prefill_speed.py``): a prompt's time to its first
token at 128, 512, 1,400 and 2,048 tokens, ours against torch's kernels and ``transformers``
(``--only-prefill``: that table alone).

Prints a table and writes the same numbers to ``results/bench_engine.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from specserve.config import EngineConfig, KVCacheConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specserve.engine.builder import build_engine
from specserve.engine.loader import embedded_gguf, load_hf_model, load_tokenizer, resolve
from specserve.engine.step.stats import SpecStats
from specserve.engine.tokenizer import encode_chat
from specserve.machine import cpu_flags, cpu_name
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/ is not a package
from common import cpu_seconds, rotated  # noqa: E402
from prefill_speed import measure as measure_prefill  # noqa: E402
from prefill_speed import print_rows as print_prefill  # noqa: E402
from prompts import load_prompts  # noqa: E402
from roofline import decode_bytes, forward_costs, read_bandwidth  # noqa: E402

WORKLOADS = ("rewrite", "chat")
# Every mode runs the same prompts: a prefix cache would serve the later modes' prefills.
NO_PREFIX_CACHE = KVCacheConfig(prefix_caching=False)
GENERATE, TARGET, TARGET_LIBRARY = "generate()", "target-only", "target-only (library)"
TARGET_FLOAT32 = "target-only (float32)"  # ours on dequantized weights (issue 54's before)
OURS, LIBRARY = "invariant", "library"  # ModelConfig.kernels
OURS_FLOAT32 = "invariant, float32 weights"  # ModelConfig.weights: float32
ROOFLINE_NAMES = {LIBRARY: "library", OURS_FLOAT32: "ours f32", OURS: "ours"}  # its rows
WARMUP_TOKENS = 16
ROOFLINE_CONTEXT = 100  # tokens of context before the measured forwards
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "bench_engine.json"
NOISY = 0.05  # a run during which other processes took more of the CPU is measured again
MAX_TRIES = 4  # measurements of one run at most; the last one counts
QUIET_WAIT_S = 60.0  # before a retry, wait at most this long for the machine to be quiet
# A run: (prompt token ids, max new tokens) -> (output token ids, seconds, spec stats or None)
Runner = Callable[[list[int], int], tuple[list[int], float, SpecStats | None]]


@dataclass
class Tally:
    """One mode on one workload: tokens and seconds summed over its prompts."""

    tokens: int = 0
    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)
    outputs: list[list[int]] = field(default_factory=list)
    other_cpu_seconds: float = 0.0  # CPU time other processes used while this mode ran
    retries: int = 0                # runs measured again because other processes were busy

    def add(self, output: list[int], seconds: float, stats: SpecStats | None,
            other_cpu_seconds: float) -> None:
        self.tokens += len(output)
        self.seconds += seconds
        self.other_cpu_seconds += other_cpu_seconds
        self.outputs.append(output)
        if stats is not None:
            self.stats.merge(stats)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def other_load(self) -> float:
        """Share of the machine's CPU that other processes took meanwhile (0..1): noise."""
        return self.other_cpu_seconds / (self.seconds * (os.cpu_count() or 1)) if self.seconds else 0.0


# -- runners ------------------------------------------------------------------------------------
def hf_runner(model, eos_ids: list[int]) -> Runner:
    def run(prompt: list[int], max_tokens: int):
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos_ids,
                                 pad_token_id=eos_ids[0])
        return out[0, len(prompt):].tolist(), time.perf_counter() - start, None
    return run


def engine_runner(engine, num_speculative_tokens: int) -> Runner:
    def run(prompt: list[int], max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        start = time.perf_counter()
        [done] = engine.generate([prompt], params, num_speculative_tokens=num_speculative_tokens)
        return done.output_token_ids, time.perf_counter() - start, done.stats
    return run


def build_engines(dtype: str, ks: list[int]) -> dict[str, tuple]:
    """``kernels -> (engine, target)``: ours (``invariant``, the GGUF's blocks where it has
    them), ours on float32 weights (``weights: float32``, issue 54's before) and torch's
    (``library``)."""
    engines = {}
    for kernels, weights in ((LIBRARY, "auto"), (OURS, "auto"), (OURS_FLOAT32, "float32")):
        config = EngineConfig(target=ModelConfig(dtype=dtype, device="cpu", weights=weights,
                                                 kernels=OURS if kernels == OURS_FLOAT32 else kernels),
                              speculative=SpeculativeConfig(method="ngram",
                                                            num_speculative_tokens=max(ks)),
                              max_model_len=1024, max_num_seqs=1,
                              kv_cache=NO_PREFIX_CACHE)  # modes run the same prompts
        engines[kernels] = build_engine(config)
    return engines


def build_runners(dtype: str, ks: list[int], engines: dict[str, tuple]) -> dict[str, Runner]:
    """generate(), target-only on torch's kernels and on ours, and one ngram mode per K (ours),
    all in ``dtype``."""
    engine, target = engines[OURS]
    hf = load_hf_model(resolve("embedded")).to(getattr(torch, dtype))
    runners = {GENERATE: hf_runner(hf, sorted(target.eos_token_ids)),
               TARGET_LIBRARY: engine_runner(engines[LIBRARY][0], 0),
               TARGET_FLOAT32: engine_runner(engines[OURS_FLOAT32][0], 0),
               TARGET: engine_runner(engine, 0)}
    runners.update({f"ngram K={k}": engine_runner(engine, k) for k in ks})
    return runners


# -- measuring ----------------------------------------------------------------------------------
def measure(run: Runner, prompt: list[int], max_tokens: int):
    """One run, plus the CPU seconds other processes used meanwhile."""
    busy, mine = cpu_seconds()
    output, seconds, stats = run(prompt, max_tokens)
    busy_after, mine_after = cpu_seconds()
    return output, seconds, stats, max(0.0, (busy_after - busy) - (mine_after - mine))


def wait_until_quiet(timeout_s: float) -> None:
    """Sleep until other processes use at most NOISY of the CPU over a 2 s window."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy, mine = cpu_seconds()
        time.sleep(2.0)
        busy_after, mine_after = cpu_seconds()
        if (busy_after - busy) - (mine_after - mine) <= NOISY * 2.0 * (os.cpu_count() or 1):
            return


def measure_quietly(run: Runner, prompt: list[int], max_tokens: int, tally: Tally) -> None:
    """Measure; while other processes took more than NOISY of the CPU meanwhile, wait for a
    quiet machine and measure again (MAX_TRIES in all; the last measurement counts)."""
    for attempt in range(1, MAX_TRIES + 1):
        result = measure(run, prompt, max_tokens)
        if result[3] <= NOISY * result[1] * (os.cpu_count() or 1) or attempt == MAX_TRIES:
            break
        tally.retries += 1
        wait_until_quiet(QUIET_WAIT_S)
    tally.add(*result)


def run_workload(runners: dict[str, Runner], prompts: list[list[int]], max_tokens: int,
                 bar: tqdm) -> dict[str, Tally]:
    tallies = {mode: Tally() for mode in runners}
    for i, prompt in enumerate(prompts):
        for mode in rotated(list(runners), i):
            measure_quietly(runners[mode], prompt, max_tokens, tallies[mode])
            bar.update()
    return tallies


def bench_dtype(dtype: str, args, workloads: dict[str, list[list[int]]], bar: tqdm,
                roofline: dict) -> dict[str, dict[str, Tally]]:
    bar.set_description(f"{dtype}: loading")
    engines = build_engines(dtype, args.k)
    bar.set_description(f"{dtype}: roofline")
    context = next(iter(workloads.values()))[0][:ROOFLINE_CONTEXT]
    roofline[dtype] = {kernels: forward_costs(target.runtime, context)
                       for kernels, (_, target) in engines.items()}
    roofline[dtype]["decode_bytes"] = {kernels: decode_bytes(target.runtime)
                                       for kernels, (_, target) in engines.items()}
    runners = build_runners(dtype, args.k, engines)
    bar.set_description(f"{dtype}: warm-up")
    first = next(iter(workloads.values()))[0]
    for run in runners.values():
        run(first, WARMUP_TOKENS)
    results = {}
    for name, prompts in workloads.items():
        bar.set_description(f"{dtype}: {name}")
        results[name] = run_workload(runners, prompts, args.max_tokens, bar)
    del runners, engines
    gc.collect()
    return results


# -- reporting ----------------------------------------------------------------------------------
def same_ids(a: Tally, b: Tally) -> str:
    return f"{sum(x == y for x, y in zip(a.outputs, b.outputs))}/{len(a.outputs)}"


def first_divergence(a: Tally, b: Tally) -> list[int | None]:
    """Per prompt, the index of the first output token where a and b differ (None: equal)."""
    return [None if x == y else next((i for i, (p, q) in enumerate(zip(x, y)) if p != q),
                                     min(len(x), len(y)))
            for x, y in zip(a.outputs, b.outputs)]


def mode_row(dtype: str, workload: str, mode: str, tallies: dict[str, Tally]) -> dict:
    """One table row; ``baseline`` is what the speedup and same-ids columns compare with."""
    tally = tallies[mode]
    baseline = {GENERATE: None, TARGET: TARGET_FLOAT32, TARGET_FLOAT32: TARGET_LIBRARY,
                TARGET_LIBRARY: GENERATE}.get(mode, TARGET)
    row = {"dtype": dtype, "workload": workload, "mode": mode, "tokens": tally.tokens,
           "seconds": round(tally.seconds, 3), "tokens_per_second": round(tally.tokens_per_second, 2),
           "baseline": baseline, "other_load": round(tally.other_load, 3), "retries": tally.retries}
    if baseline:
        ref = tallies[baseline]
        row["speedup"] = round(tally.tokens_per_second / ref.tokens_per_second, 3)
        row["same_ids"] = same_ids(tally, ref)
        row["first_divergence"] = first_divergence(tally, ref)
    if mode.startswith("ngram"):
        row.update(acceptance_rate=round(tally.stats.acceptance_rate, 4),
                   mean_acceptance_length=round(tally.stats.mean_acceptance_length, 3))
    return row


def to_rows(results: dict[str, dict[str, dict[str, Tally]]]) -> list[dict]:
    return [mode_row(dtype, workload, mode, tallies)
            for dtype, by_workload in results.items()
            for workload, tallies in by_workload.items()
            for mode in tallies]


COLUMNS = (("dtype", 9), ("workload", 9), ("mode", 21), ("tokens", 7), ("seconds", 8),
           ("tok/s", 7), ("speedup", 21), ("accept", 7), ("mean len", 9), ("same ids", 9), ("others", 6))


def format_row(row: dict) -> list[str]:
    base = row["baseline"] or ""
    label = base.split("(")[-1].rstrip(")") if "(" in base else base.split(" ")[0]
    speedup = f"{row['speedup']:.2f}x vs {label}" if base else ""
    return [row["dtype"], row["workload"], row["mode"], str(row["tokens"]),
            f"{row['seconds']:.1f}", f"{row['tokens_per_second']:.1f}", speedup,
            f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "",
            f"{row['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in row else "",
            row.get("same_ids", ""), f"{row['other_load']:.0%}"]


def print_table(rows: list[dict]) -> None:
    print("  ".join(name.ljust(width) for name, width in COLUMNS))
    previous = None
    for row in rows:
        if previous and (row["dtype"], row["workload"]) != previous:
            print()
        previous = (row["dtype"], row["workload"])
        print("  ".join(cell.ljust(width) for cell, (_, width) in zip(format_row(row), COLUMNS)))
    print("\nspeedup / same ids: target-only (library) vs generate(); target-only (float32: "
          "ours on dequantized weights) vs library; target-only (ours, the GGUF's blocks) vs "
          "float32; ngram vs target-only (same ids = prompts whose greedy output token ids are "
          "identical)")
    print(f"others: share of the CPU other processes used during the runs that count; a run "
          f"during which they used more than {NOISY:.0%} was measured again "
          f"({sum(row['retries'] for row in rows)} times in all, at most {MAX_TRIES} tries a run)")
    worst = max(row["other_load"] for row in rows)
    if worst > NOISY:
        print(f"WARNING: other processes took up to {worst:.0%} of the CPU during the runs; "
              "these numbers are noisy. Rerun on a quiet machine.")


def roofline_rows(roofline: dict, bandwidth: float) -> list[dict]:
    """Per dtype and kernels: the forward cost at T = 1..8 and how near T = 1 is the roofline."""
    rows = []
    for dtype, by_kernels in roofline.items():
        for kernels in (LIBRARY, OURS_FLOAT32, OURS):
            costs, nbytes = by_kernels[kernels], by_kernels["decode_bytes"][kernels]
            rows.append({"dtype": dtype, "kernels": ROOFLINE_NAMES[kernels],
                         "decode_mb": round(nbytes / 1e6, 1),
                         "forward_ms": {t: round(c * 1e3, 2) for t, c in costs.items()},
                         "verify_over_decode": {t: round(c / costs[1], 3) for t, c in costs.items()},
                         "achieved_gbs": round(nbytes / costs[1] / 1e9, 2),
                         "roofline_share": round(nbytes / costs[1] / bandwidth, 3)})
    return rows


def print_roofline(rows: list[dict], bandwidth: float) -> None:
    ts = list(rows[0]["forward_ms"])
    print(f"forward of T new tokens after a {ROOFLINE_CONTEXT}-token context (median ms); "
          f"machine read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum over 1 GiB)")
    print("  ".join(["dtype".ljust(9), "kernels".ljust(9)] + [f"T={t}".rjust(7) for t in ts]
                    + ["T8/T1".rjust(6), "decode MB".rjust(9), "GB/s".rjust(6), "roofline".rjust(8)]))
    for row in rows:
        cells = [row["dtype"].ljust(9), row["kernels"].ljust(9)]
        cells += [f"{row['forward_ms'][t]:.1f}".rjust(7) for t in ts]
        cells += [f"{row['verify_over_decode'][ts[-1]]:.2f}".rjust(6), f"{row['decode_mb']:.0f}".rjust(9),
                  f"{row['achieved_gbs']:.1f}".rjust(6), f"{row['roofline_share']:.0%}".rjust(8)]
        print("  ".join(cells))
    print()


def machine_info() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": cpu_flags(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def print_header(machine: dict, config: dict) -> None:
    print(f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['torch_threads']} "
          f"torch threads, {machine['cpu_capability']}), torch {machine['torch']}, "
          f"transformers {machine['transformers']}, {machine['date']}")
    print(f"cpu flags: {' '.join(machine['cpu_flags'])}")
    print(f"model: SmolLM2-135M-Instruct (embedded), batch 1, greedy, EOS on, "
          f"max_tokens={config['max_tokens']}, {config['prompts']} prompts per workload\n")


# -- llama.cpp (optional) -----------------------------------------------------------------------
def llama_cpp_python(flag: str | None) -> str | None:
    """The interpreter to run llama.cpp under, or None (not asked for, or ``auto`` without it)."""
    if flag != "auto":
        return flag
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: llama_cpp is not importable here; pass --llama-cpp PYTHON", file=sys.stderr)
        return None
    return sys.executable


def run_llama_cpp(args, workloads: dict[str, list[list[int]]]) -> dict | None:
    """llama.cpp's tokens and seconds per workload (``load/llama_cpp_run.py``), or None."""
    python = llama_cpp_python(args.llama_cpp)
    if python is None:
        return None
    script = Path(__file__).resolve().parent / "llama_cpp_run.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(workloads, f)
        f.flush()
        done = subprocess.run([python, str(script), "--gguf", str(embedded_gguf()), "--prompts",
                               f.name, "--max-tokens", str(args.max_tokens),
                               "--threads", str(torch.get_num_threads()),
                               "--n-batch", str(args.llama_cpp_n_batch)],
                              capture_output=True, text=True)
    if done.returncode != 0:
        print(f"llama.cpp failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
        return None
    return json.loads(done.stdout)


def print_llama_cpp(llama: dict, rows: list[dict]) -> None:
    """llama.cpp's tokens/s per workload, and each of our float32 modes over it."""
    print(f"\nllama.cpp (llama-cpp-python {llama['version']}, the same GGUF with its 4-bit weights, "
          f"n_batch={llama['n_batch']}, greedy, the same prompts as token ids, run after ours):")
    for name, got in llama["workloads"].items():
        tps = got["tokens"] / got["seconds"]
        ours = [f"{row['mode']} {row['tokens_per_second'] / tps:.2f}x" for row in rows
                if row["workload"] == name and row["dtype"] == "float32"
                and row["mode"] != GENERATE]
        print(f"  {name}: {tps:.1f} tok/s ({got['tokens']} tokens); ours over it: {', '.join(ours)}")


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated dtypes (float32, bfloat16, float16)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt, at most")
    p.add_argument("--k", default="4", help="ngram K, comma-separated to compare several")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    p.add_argument("--prefill", default="128,512,1400,2048",
                   help="prompt lengths whose prefill is timed (load/prefill_speed.py); '' for none")
    p.add_argument("--prefill-reps", type=int, default=3, help="rounds per prefill length (median)")
    p.add_argument("--only-prefill", action="store_true", help="the prefill table alone")
    p.add_argument("--llama-cpp", default=None, metavar="PYTHON",
                   help="also run llama.cpp under this interpreter (one with llama-cpp-python; "
                        "'auto': this one if it has it)")
    p.add_argument("--llama-cpp-n-batch", type=int, default=1,
                   help="llama.cpp's n_batch (1: its batched prompt evaluation crashed here)")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.k = [int(k) for k in args.k.split(",")]
    if args.prompts < 1 or args.max_tokens < 1 or min(args.k) < 1:
        p.error("--prompts, --max-tokens and every --k must be >= 1")
    return args


def encode_workloads(n: int) -> dict[str, list[list[int]]]:
    tokenizer = load_tokenizer(resolve("embedded"))
    return {name: [encode_chat(tokenizer, p["messages"]) for p in load_prompts(name)[:n]]
            for name in WORKLOADS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()  # one bar on stderr: ours
    lengths = [int(n) for n in args.prefill.split(",") if n]
    if args.only_prefill:
        machine = machine_info()
        print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['date']}\n"
              f"cpu flags: {' '.join(machine['cpu_flags'])}")
        prefill, llama = measure_prefill(lengths, args.prefill_reps, llama_cpp_python(args.llama_cpp))
        print_prefill(prefill, llama)
        write_json(Path(args.out), {"machine": machine, "prefill": prefill, "llama_cpp_prefill": llama})
        return 0
    workloads = encode_workloads(args.prompts)
    runs = sum(map(len, workloads.values())) * (3 + len(args.k)) * len(args.dtypes)
    roofline: dict = {}
    with tqdm(total=runs, unit="run", file=sys.stderr) as bar:
        results = {dtype: bench_dtype(dtype, args, workloads, bar, roofline)
                   for dtype in args.dtypes}
    bandwidth = read_bandwidth()
    config = {"model": "SmolLM2-135M-Instruct", "batch_size": 1, "greedy": True,
              "max_tokens": args.max_tokens, "prompts": args.prompts, "k": args.k,
              "workloads": list(WORKLOADS), "dtypes": args.dtypes}
    machine, rows = machine_info(), to_rows(results)
    machine["read_bandwidth_gbs"] = round(bandwidth / 1e9, 2)
    costs = roofline_rows(roofline, bandwidth)
    print_header(machine, config)
    print_roofline(costs, bandwidth)
    print_table(rows)
    llama = run_llama_cpp(args, workloads)
    if llama:
        print_llama_cpp(llama, rows)
    prefill, llama_prefill = (measure_prefill(lengths, args.prefill_reps, llama_cpp_python(args.llama_cpp))
                              if lengths else ([], None))
    if prefill:
        print_prefill(prefill, llama_prefill)
    write_json(Path(args.out), {"machine": machine, "config": config, "roofline": costs,
                                "results": rows, "llama_cpp": llama, "prefill": prefill,
                                "llama_cpp_prefill": llama_prefill})
    return 0


def write_json(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())
