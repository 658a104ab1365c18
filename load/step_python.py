"""The engine's Python a decode token, alone: a target-only greedy decode at batch 1 on the
embedded model (2 threads) with the forward's two C calls, the layer stack and the LM head,
replaced by stubs that return zeros of their shapes (the head's largest logit on a plain text
token, so the detokenizer sees text), so that only Python runs. ``--read-mb N`` reads N MB a
token inside the stub, as a decode streams its weights through the caches (the embedded
model's: about 110). Prints, in microseconds a token, the step outside ``runtime.forward`` and
the forward's own Python (with the read, where there is one), each round's. ::

    python load/step_python.py [--read-mb 110] [--tokens 512] [--rounds 3]

On a 2-core Zen 3 the step outside the forward took 0.29 ms warm and 0.61-0.76 ms after a
110 MB read, as much as in a real decode (docs/BENCHMARKS.md, "Why the step's Python is
slow after a forward")."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from specserve.config import SamplingParams
from specserve.engine.runtime import native
from specserve.engine.tokenizer import encode_chat

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `load` as a namespace package, run as a script or imported

from load.decode_ms import PROMPT, decode_engine, timed_forwards  # noqa: E402


def stub_kernels(read_mb: int, token: int) -> list[int]:
    """Put the stubs in ``native``'s place (where the layers and the head call them); the
    returned list's one item counts the layer stack's calls."""
    stream = np.ones(read_mb * 2**18 + 1, dtype=np.float32)  # read_mb MB of float32
    calls = [0]

    def decoder_layers(x, stack, forward):
        calls[0] += 1
        stream.sum()  # every byte read, as the layers' weights are
        return torch.zeros_like(x)

    def linear_quantized(x, weight, bias):
        out = torch.zeros(*x.shape[:-1], weight.out_features)
        out[..., token] = 1.0
        return out

    for name in ("decoder_layers", "linear_quantized"):  # a renamed kernel: an error, not a real forward
        if not callable(getattr(native, name, None)):
            raise SystemExit(f"step_python: native.{name} is gone; stub what the forward calls now")
    native.decoder_layers, native.linear_quantized = decoder_layers, linear_quantized
    return calls


def main(read_mb: int, tokens: int, rounds: int) -> dict:
    engine, target = decode_engine()
    ids = encode_chat(target.tokenizer, PROMPT)
    calls = stub_kernels(read_mb, target.tokenizer.encode(" the", add_special_tokens=False)[0])
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    spent = timed_forwards(target.runtime)
    outside, forward = [], []
    for _ in range(rounds):  # the prefill and the first token taken off, as decode_ms does
        start, spent[0] = time.perf_counter(), 0.0
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        first, first_forwards, spent[0] = time.perf_counter(), spent[0], 0.0
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        whole = time.perf_counter() - first - (first - start)
        in_forward = spent[0] - first_forwards
        outside.append(round((whole - in_forward) / (tokens - 1) * 1e6, 1))
        forward.append(round(in_forward / (tokens - 1) * 1e6, 1))
    if calls[0] < rounds * tokens:  # the forward went around the stubs: these are not its Python
        raise SystemExit(f"step_python: the stubs ran {calls[0]} times for {rounds * tokens} tokens")
    return {"read_mb": read_mb, "tokens": tokens, "step_outside_forward_us": outside,
            "forward_us": forward}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--read-mb", type=int, default=0, help="MB read a token inside the stub")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(main(a.read_mb, a.tokens, a.rounds)))
