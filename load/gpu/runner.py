"""A phase's steps, each a subprocess under its own timeout, the summary rewritten after each.

Why a subprocess per step: a step that hangs (a compile, a wedged kernel) or dies (CUDA out
of memory, a segfault) takes nothing else with it. At its timeout the step's whole process
group is killed (inductor's compile workers too), whatever it has written so far stays, and
the phase goes on to the next step. Every line the step prints comes into the harness's log
as it comes, prefixed with the step's name.

``summary.json`` lists every step of the phase from the start (``pending``) and is rewritten
after each one, so a phase cut short still says how far it got.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from load.gpu.output import write_json

log = logging.getLogger("gpu-check")

STATUSES = ("pending", "ok", "failed", "timeout", "skipped")


@dataclass(frozen=True)
class Step:
    """One command of a phase and what it needs."""

    name: str
    argv: list[str]          # run in the repository root
    timeout_s: float
    needs: tuple[str, ...]   # modules it imports (preflight checks them)
    output: str | None       # the file it writes into the output folder
    env: dict[str, str] = field(default_factory=dict)  # on top of the harness's environment


@dataclass
class Outcome:
    """A step's line in ``summary.json``."""

    step: str
    status: str = "pending"   # one of STATUSES
    seconds: float = 0.0
    reason: str = ""          # one line: why not ok, or what ok found
    file: str | None = None


class Summary:
    """``summary.json``: the phase, its preflight and one :class:`Outcome` per step."""

    def __init__(self, path: Path, header: dict, steps: list[Step]) -> None:
        self.path, self.header = path, header
        self.outcomes = {s.name: Outcome(s.name, file=s.output) for s in steps}

    def record(self, outcome: Outcome) -> None:
        self.outcomes[outcome.step] = outcome
        log.info("step %s: %s (%.1f s)%s", outcome.step, outcome.status, outcome.seconds,
                 f": {outcome.reason}" if outcome.reason else "")
        self.write()

    def write(self) -> None:
        write_json(self.path, {**self.header, "steps": [asdict(o) for o in self.outcomes.values()]})


def run_step(step: Step, *, cwd: Path, out: Path, env: dict[str, str], timeout_s: float,
             describe=None) -> Outcome:
    """Run ``step`` to its end or its timeout. ``describe(step, out, rc)`` may name what an
    ended step found (a test count) in one line; by default a failure's last output line."""
    log.info("step %s: start (timeout %.0f s): %s", step.name, timeout_s, " ".join(step.argv))
    start = time.monotonic()
    proc = subprocess.Popen(step.argv, cwd=cwd, env={**env, **step.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)  # its own process group, killed whole
    lines: list[str] = []
    reader = threading.Thread(target=_relay, args=(proc, step.name, lines), daemon=True)
    reader.start()
    try:
        rc, timed_out = proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        _kill(proc)
        rc, timed_out = proc.wait(), True
    finally:
        # Also after a normal exit (inductor's compile workers outlive a step that skips its
        # teardown) and on Ctrl-C: nothing of a step outlives it.
        _kill(proc)
    reader.join(timeout=10)
    _remove_partial_writes(out)
    seconds = time.monotonic() - start
    return _outcome(step, out, rc, timed_out, seconds, lines, describe)


def _relay(proc: subprocess.Popen, name: str, lines: list[str]) -> None:
    """Each line of the step's output into the log as it arrives; the last lines kept."""
    for line in proc.stdout:
        line = line.rstrip()
        log.info("  %s | %s", name, line)
        lines.append(line)
        del lines[:-50]


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_partial_writes(out: Path) -> None:
    """A step killed between writing ``x.tmp`` and renaming it leaves the temporary file:
    it must not count against the folder's file limit."""
    for tmp in out.glob("*.tmp"):
        tmp.unlink(missing_ok=True)


def _outcome(step: Step, out: Path, rc: int, timed_out: bool, seconds: float,
             lines: list[str], describe) -> Outcome:
    written = step.output is None or (out / step.output).exists()
    found = describe(step, out, rc) if describe is not None else ""
    if timed_out:
        kept = f"; partial {step.output} kept" if step.output and written else ""
        status, reason = "timeout", f"killed after {seconds:.0f} s{kept}"
    elif rc != 0:
        status, reason = "failed", found or f"exit {rc}: {_last_line(lines)}"
    elif not written:
        status, reason = "failed", f"exit 0 but no {step.output}"
    else:
        status, reason = "ok", found
    return Outcome(step.name, status, round(seconds, 1), reason[:300], step.output)


def _last_line(lines: list[str]) -> str:
    """The line that says what went wrong: the last one naming an error, else the last."""
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line.strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "no output")
