"""This machine in a few words, for benchmark reports and ``eval.json`` (no torch here)."""

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


def machine_label() -> str:
    """CPU model and core count, e.g. ``AMD EPYC, 2 cores``."""
    return f"{cpu_name()}, {os.cpu_count()} cores"
