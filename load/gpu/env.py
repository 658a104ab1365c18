"""``env.json``: the machine every other number came from.

The GPU and its driver, the CUDA / torch / triton / transformers / Python versions, the SM
count, the memory CUDA reports (``mem_get_info``: free is what a model can still have) and
the device-to-device read bandwidth torch reaches (``roofline.read_bandwidth``), which
``bench.json``'s GB/s are a share of.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from load.gpu.output import write_json
from load.roofline import read_bandwidth

log = logging.getLogger(__name__)

FILE = "env.json"
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pydantic",
            "pydantic_core", "llguidance", "pytest", "pytest-timeout")


def run(out: Path, dry_run: bool) -> None:
    device = "cpu" if dry_run else "cuda"
    env = {"dry_run": dry_run, "python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "torch_cuda": torch.version.cuda,
           "packages": {name: _version(name) for name in PACKAGES}, **gpu(device)}
    write_json(out / FILE, env)  # before the bandwidth: a hang there leaves the rest
    gib = 0.125 if dry_run else 2.0
    env["read_bandwidth_bytes_per_s"] = read_bandwidth(gib=gib, device=device)
    env["read_bandwidth_gib"] = gib
    log.info("read bandwidth %.0f GB/s over %.3f GiB", env["read_bandwidth_bytes_per_s"] / 1e9, gib)
    write_json(out / FILE, env)


def gpu(device: str) -> dict:
    """The device's name, driver, SMs and memory (None on a CPU)."""
    if device == "cpu":
        return {"device": "cpu", "gpu_name": None, "driver_version": None, "sm_count": None,
                "capability": None, "total_memory_bytes": None, "free_memory_bytes": None}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    info = {"device": "cuda", "gpu_name": props.name, "driver_version": driver_version(),
            "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
            "total_memory_bytes": total, "free_memory_bytes": free,
            "nvidia_smi": nvidia_smi("name,driver_version,memory.total,clocks.max.sm,power.limit")}
    log.info("%s, driver %s, %d SMs, %.1f of %.1f GiB free", props.name, info["driver_version"],
             props.multi_processor_count, free / 2**30, total / 2**30)
    return info


def driver_version() -> str | None:
    """From nvidia-smi where it is installed, else torch's driver query."""
    smi = nvidia_smi("driver_version")
    if smi:
        return smi
    try:
        v = torch._C._cuda_getDriverVersion()  # e.g. 13000 for 13.0
        return f"{v // 1000}.{v % 1000 // 10} (CUDA driver API)"
    except Exception:  # a private API: absent from some builds
        return None


def nvidia_smi(fields: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
