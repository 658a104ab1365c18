"""Results that survive a kill: files written whole, log lines with timestamps.

A step's subprocess may be killed at its timeout at any moment, so a result file is never
written in place: it goes to ``<name>.tmp`` and is renamed over the old one (a rename is
atomic), and a step rewrites its file after every measurement, not once at the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(message)s"
DATE_FORMAT = "%H:%M:%S"


def write_text(path: Path, text: str) -> None:
    """``text`` to ``path``, all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data) -> None:
    """``data`` as indented JSON, all or nothing; what JSON lacks (dtypes, paths) as text."""
    write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def setup_logging(log_file: Path | None = None) -> logging.Logger:
    """Root logging at INFO with a timestamp on every line, to stdout (flushed per line,
    which the harness reads as it comes) and, given, appended to ``log_file``. A no-op where
    logging is set up already (a script's ``main`` called by a test under pytest)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file, mode="a"))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=DATE_FORMAT,
                        handlers=handlers)
    return logging.getLogger("gpu-check")
