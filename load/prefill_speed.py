"""Prefill speed for ``make bench-engine`` (issue 36): a prompt's time to its first token.

At each prompt length, side by side and interleaved (``--prefill-reps`` rounds, the median):

- **ours**: the engine on the C kernels (``kernels: invariant``), from ``add_request`` to the
  first sampled token (``max_tokens`` 1, greedy, speculation off);
- **library**: the same engine on torch's kernels (``kernels: library``: MKL and SDPA);
- **transformers**: one forward of the ``transformers`` model over the prompt.

Float32, batch 1, the embedded model, prompts of seeded token ids (a forward's cost does not
depend on which tokens), the default KV layout with prefix caching off (each round computes
the whole prompt). ``same first token``: whether ours and the library's agree (their
kernels round differently, so a near tie may not).

With an interpreter that has ``llama-cpp-python`` (``bench_engine.py --llama-cpp``),
llama.cpp evaluates the same token ids on the same GGUF (its own 4-bit weights) with its
batched prompt evaluation (``n_batch`` 512), in a subprocess (``load/llama_cpp_run.py
--prefill-reps``): a crash is reported, not fatal (0.3.36's batched evaluation crashed on an
AVX512 machine before, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from specserve.config import EngineConfig, KVCacheConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specserve.engine.builder import build_engine
from specserve.engine.loader import embedded_gguf, load_hf_model, resolve

KINDS = ("ours", "library", "transformers")


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def engine_for(kernels: str, max_len: int):
    config = EngineConfig(target=ModelConfig(dtype="float32", device="cpu", kernels=kernels),
                          speculative=SpeculativeConfig(method=None), max_model_len=max_len,
                          max_num_seqs=1, chunked_prefill_size=None,
                          kv_cache=KVCacheConfig(prefix_caching=False))  # every round computes it all
    return build_engine(config)[0]


def first_token(engine, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    done = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t0, done[0].output_token_ids[0]


def hf_forward(model, ids: list[int]) -> tuple[float, int]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids])).logits[0, -1]
        return time.perf_counter() - t0, int(logits.argmax())


def measure(lengths: list[int], reps: int = 3, llama_python: str | None = None
            ) -> tuple[list[dict], dict | None]:
    """One row per prompt length: each kind's median seconds and tokens/s, ours / library;
    and llama.cpp's seconds (:func:`llama_cpp`) with ``llama_python``."""
    engines = {"ours": engine_for("invariant", max(lengths) + 8),
               "library": engine_for("library", max(lengths) + 8)}
    model = load_hf_model(resolve("embedded")).float().eval()
    vocab = model.config.vocab_size
    runs = {"ours": lambda ids: first_token(engines["ours"], ids),
            "library": lambda ids: first_token(engines["library"], ids),
            "transformers": lambda ids: hf_forward(model, ids)}
    for run in runs.values():  # warm-up: the kernels' build, the allocator
        run(prompt_ids(64, vocab))
    rows = []
    for n in lengths:
        ids = prompt_ids(n, vocab, seed=n)
        seconds: dict[str, list[float]] = {k: [] for k in KINDS}
        tokens: dict[str, int] = {}
        for r in range(reps):
            for kind in KINDS[r % 3:] + KINDS[:r % 3]:  # the order rotated per round
                s, tokens[kind] = runs[kind](ids)
                seconds[kind].append(s)
        med = {k: statistics.median(v) for k, v in seconds.items()}
        rows.append({"tokens": n, **{f"{k}_s": round(med[k], 4) for k in KINDS},
                     **{f"{k}_tokens_per_s": round(n / med[k], 1) for k in KINDS},
                     "ours_over_library": round(med["library"] / med["ours"], 3),
                     "same_first_token": tokens["ours"] == tokens["library"]})
    llama = None
    if llama_python:
        llama = llama_cpp(llama_python, str(embedded_gguf()), lengths, vocab, reps,
                          torch.get_num_threads())
    return rows, llama


def llama_cpp(python: str, gguf: str, lengths: list[int], vocab: int, reps: int,
              threads: int, n_batch: int = 512) -> dict:
    """llama.cpp's seconds per prompt length (the same ids as :func:`measure`), or why not."""
    script = Path(__file__).resolve().parent / "llama_cpp_run.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({str(n): prompt_ids(n, vocab, seed=n) for n in lengths}, f)
        f.flush()
        done = subprocess.run([python, str(script), "--gguf", gguf, "--prompts", f.name,
                               "--threads", str(threads), "--n-batch", str(n_batch),
                               "--prefill-reps", str(reps)], capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}", "n_batch": n_batch}
    return json.loads(done.stdout)


def print_rows(rows: list[dict], llama: dict | None = None) -> None:
    print("\nprefill (float32, batch 1; seconds to the first token, median; tokens/s):")
    print(f"{'tokens':>7} | {'ours':>16} | {'library':>16} | {'transformers':>16} | "
          f"{'ours speed / library':>20} | same first token")
    for r in rows:
        cells = [f"{r[f'{k}_s']:.3f}s ({r[f'{k}_tokens_per_s']:.0f}/s)" for k in KINDS]
        print(f"{r['tokens']:>7} | {cells[0]:>16} | {cells[1]:>16} | {cells[2]:>16} | "
              f"{r['ours_over_library']:>19.2f}x | {'yes' if r['same_first_token'] else 'no'}")
    if llama is None:
        return
    if "error" in llama:
        print(f"llama.cpp (n_batch {llama['n_batch']}): failed, {llama['error']}")
        return
    cells = [f"{n} tokens {s:.3f}s ({int(n) / s:.0f}/s, ours {s / r['ours_s']:.2f}x its speed)"
             for (n, s), r in zip(llama["prefill_s"].items(), rows)]
    print(f"llama.cpp {llama['version']} (its 4-bit GGUF, n_batch {llama['n_batch']}): " + "; ".join(cells))
