"""Where a decode's layers spend their time, call by call: a target-only greedy decode at batch
1 on the embedded model (2 threads), with the C kernels built from a copy of ``kernels.c`` that
times each call of ``decoder_layer`` (the monotonic clock around it; a few tens of
nanoseconds a call). Prints, in microseconds a decode token, each call's share: the two
norms, the four linears, RoPE and the cache store, the attention, the residual adds and SiLU,
and the layers in all; and the attention's microseconds a layer. ::

    python load/kernel_times.py [--prompt-words N] [--tokens 128] [--rounds 3]

``--prompt-words N``: a prompt of N plain words (about 3.7 tokens each), for the attention at a
longer context; by default the chat prompt of ``load/decode_ms.py`` (39 tokens). Only decode
calls (one row) are counted: a prefill's calls are left out. ``--verify 9 [--context 100]``:
instead, ``load.roofline``'s forward of 9 new tokens (a verify of 8 drafts) after a context,
its calls at 9 rows timed, and the forward and a decode beside them (in decodes). The patched
copy times; it changes no arithmetic, and the runtime's own source is untouched.

On a 2-core Zen 3 at 40-170 keys (docs/BENCHMARKS.md, "A decode's layers, call by call"): the
linears 3.9-4.2 of the layers' 4.6-4.9 ms, the attention 0.45-0.47 ms (15 us a layer), the
norms, RoPE, adds and SiLU about 0.2; at 1,490 keys the attention 4.7-5.1 of 8.6-9.5 ms."""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from specserve.config import SamplingParams
from specserve.engine.runtime import native
from specserve.engine.tokenizer import encode_chat

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `load` as a namespace package, run as a script or imported

from load.decode_ms import PROMPT, decode_engine  # noqa: E402

# decoder_layer's calls in its order: how each statement begins -> its name here.
CALLS = [("rms_norm_rows(x,", "input_norm"), ("linear_any(normed, &l->qkv,", "qkv"),
         ("rope_and_store(", "rope_and_store"), ("attention_rows(", "attention"),
         ("linear_any(attn, &l->o,", "o"), ("add_into(out, x,", "add_attention"),
         ("rms_norm_rows(out,", "post_norm"), ("linear_any(normed, &l->gate_up,", "gate_up"),
         ("silu_mul_rows(", "silu_mul"), ("linear_any(act, &l->down,", "down"),
         ("add_into(out, mlp_out,", "add_mlp")]
TIMERS = """
#include <time.h>
double kt_ns[16]; long kt_calls[16];
void kt_reset(void) { for (int i = 0; i < 16; i++) { kt_ns[i] = 0; kt_calls[i] = 0; } }
void kt_read(double *ns, long *calls) {
  for (int i = 0; i < 16; i++) { ns[i] = kt_ns[i]; calls[i] = kt_calls[i]; }
}
static inline double kt_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}
#define KT(i, on, call) do { double _t = kt_now(); call; \\
  if (on) { kt_ns[i] += kt_now() - _t; kt_calls[i]++; } } while (0)
"""
LAYER = len(CALLS)  # the whole layer's timer


def timed_source(source: str, rows: int = 1) -> str:
    """``source`` with each of decoder_layer's calls in :data:`CALLS` wrapped in a timer that
    counts the calls of ``rows`` tokens only (1: a decode's); SystemExit where the function no
    longer reads so."""
    head = "void decoder_layer(const float *x, float *out, const layer_ref *l, const forward_ref *f) {"
    start = source.find(head)
    end = source.find("\n}\n", start)
    if start < 0 or end < 0:
        raise SystemExit("kernel_times: kernels.c has no decoder_layer of the expected signature")
    body = source[start + len(head):end]
    found = []
    for i, (opening, _) in enumerate(CALLS):
        pattern = re.compile(r"^(\s*)(" + re.escape(opening) + r"[^;]*);", re.M)
        body, count = pattern.subn(lambda m, i=i: f"{m[1]}KT({i}, M == {rows}, {m[2]});", body, count=1)
        found.append(count)
    if not all(found):
        missing = [name for (_, name), n in zip(CALLS, found) if not n]
        raise SystemExit(f"kernel_times: decoder_layer no longer makes these calls: {missing}")
    body = body.rstrip() + "\n"
    layer = (f"{head}\n  double kt_layer = kt_now();\n  decoder_layer_timed(x, out, l, f);\n"
             f"  if (f->B * f->T == {rows}) {{\n    kt_ns[{LAYER}] += kt_now() - kt_layer;\n"
             f"    kt_calls[{LAYER}]++;\n  }}\n}}\n")
    timed = head.replace("decoder_layer(", "decoder_layer_timed(").replace("void ", "static void ", 1)
    return source[:start] + TIMERS + timed + body + "}\n" + layer + source[end + 3:]


def main(prompt_words: int | None, tokens: int, rounds: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        patched = Path(tmp) / "kernels.c"
        patched.write_text(timed_source(native.SOURCE.read_text()))
        native.SOURCE = patched  # built (and cached) apart from the runtime's own
        engine, target = decode_engine()
        lib = native.library()
    if lib is None or not hasattr(lib, "kt_read"):
        raise SystemExit("kernel_times: the native kernels did not build here")
    ids = (target.tokenizer.encode(" ".join(f"word{i}" for i in range(prompt_words)))
           if prompt_words else encode_chat(target.tokenizer, PROMPT))
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    names = [name for _, name in CALLS] + ["layers"]
    results = []
    for _ in range(rounds):
        lib.kt_reset()
        started = time.perf_counter()
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        wall_ms = (time.perf_counter() - started) * 1e3
        ns, calls = (ctypes.c_double * 16)(), (ctypes.c_long * 16)()
        lib.kt_read(ns, calls)
        decodes = calls[LAYER] / len(target.runtime.layers)  # decode tokens timed
        row = {"prompt_tokens": len(ids), "decode_tokens": decodes,
               "ms_per_token_with_prefill": round(wall_ms / tokens, 2),
               "us_per_token": {n: round(ns[i] / 1e3 / decodes, 1) for i, n in enumerate(names)},
               "attention_us_per_layer": round(ns[3] / 1e3 / max(calls[3], 1), 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def verify(rows: int, context: int, rounds: int, reps: int = 30) -> list[dict]:
    """``--verify T``: forwards of T new tokens after ``context`` (``load.roofline``'s, a
    verify of T - 1 drafts), each call of ``decoder_layer`` at T rows timed, beside the whole
    forward and a decode's (T = 1) measured in turn in the same process."""
    import torch

    from load.roofline import context_ids, forward_cost, prefilled_cache, target_runtime

    with tempfile.TemporaryDirectory() as tmp:
        patched = Path(tmp) / "kernels.c"
        patched.write_text(timed_source(native.SOURCE.read_text(), rows))
        native.SOURCE = patched
        torch.set_num_threads(2)
        runtime = target_runtime()
        lib = native.library()
    if lib is None or not hasattr(lib, "kt_read"):
        raise SystemExit("kernel_times: the native kernels did not build here")
    ids = context_ids(context)
    cache, slots = prefilled_cache(runtime, ids, 1, rows)
    names = [name for _, name in CALLS] + ["layers"]
    results = []
    for _ in range(rounds):
        forward_cost(runtime, cache, slots, ids, rows, 3, 1)  # warm
        lib.kt_reset()
        forward_s, _ = forward_cost(runtime, cache, slots, ids, rows, reps, 0)
        ns, calls = (ctypes.c_double * 16)(), (ctypes.c_long * 16)()
        lib.kt_read(ns, calls)
        decode_s, _ = forward_cost(runtime, cache, slots, ids, 1, reps, 3)
        forwards = calls[LAYER] / len(runtime.layers)
        row = {"rows": rows, "context": context, "forward_ms": round(forward_s * 1e3, 2),
               "decode_ms": round(decode_s * 1e3, 2), "in_decodes": round(forward_s / decode_s, 2),
               "us_per_forward": {n: round(ns[i] / 1e3 / forwards, 1) for i, n in enumerate(names)}}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-words", type=int, default=None)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--verify", type=int, default=None, metavar="T",
                   help="time a forward of T new tokens (a verify of T - 1 drafts) instead")
    p.add_argument("--context", type=int, default=100, help="with --verify: the tokens before")
    a = p.parse_args()
    if a.verify:
        verify(a.verify, a.context, a.rounds)
    else:
        main(a.prompt_words, a.tokens, a.rounds)
