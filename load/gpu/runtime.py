"""What the steps do to a runtime, written once: choose its kernels, warm it up, count the
graphs CUDA-graph capture skipped.

``LlamaRuntime.use_kernels`` is gaining keyword arguments (``verify_tokens``: the one token
shape decodes and verifies share on the compiled path) and the runtime a ``warm_up(cache)``
that compiles every shape serving uses. The steps run on code before and after that change,
so they pass what the signature takes and warm up where the method exists.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

log = logging.getLogger(__name__)


def use_kernels(runtime, kernels: str, *, backend: str | None, verify_tokens: int | None = None) -> dict:
    """``runtime.use_kernels(kernels, ...)`` with the keywords it accepts; returns them (for
    the report). ``verify_tokens`` (the engine's K + 1, which decodes then share as their
    token shape) where the signature takes it; None leaves the kernels' default."""
    accepted = inspect.signature(runtime.use_kernels).parameters
    kwargs: dict = {"backend": backend}
    if verify_tokens is not None and "verify_tokens" in accepted:
        kwargs["verify_tokens"] = verify_tokens
    runtime.use_kernels(kernels, **kwargs)
    return {"kernels": kernels, **kwargs}


def warm_up(runtime, cache) -> dict | None:
    """``runtime.warm_up(cache)``'s report and its wall time, or None where the runtime has
    no warm-up (before that change: shapes compile at their first forward instead)."""
    if not hasattr(runtime, "warm_up"):
        return None
    start = time.perf_counter()
    report = runtime.warm_up(cache)
    seconds = time.perf_counter() - start
    log.info("warm-up: %.1f s", seconds)
    return {"seconds": seconds, "report": report}


def cudagraph_skips() -> int:
    """Compiled graphs inductor ran without CUDA graphs in this process (a CPU tensor, a
    mutated input...): each is a shape that pays kernel launches again. 0 is the pass."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (timings, memory peaks)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_cuda() -> None:
    """Give cached blocks back between measurements, so one's peak is not the last one's."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
