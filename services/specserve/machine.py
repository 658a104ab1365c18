"""This machine in a few words, for benchmark reports and ``eval.json``, and where specserve
keeps its caches on it (no torch here)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags(prefixes: tuple[str, ...] = ("avx", "amx", "fma")) -> list[str]:
    """The CPU's vector-extension flags (``/proc/cpuinfo``): what decides which kernels the
    libraries pick, and so speed and rounding. Empty where unknown."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(prefixes))
    return []


def machine_label() -> str:
    """CPU model and core count, e.g. ``AMD EPYC, 2 cores``."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def default_cache_dir() -> Path:
    """Where dequantized GGUF models, built kernels and derived drafts are cached:
    ``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``."""
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
