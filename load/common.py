"""Helpers the load tools share: table and CSV output, run order, and how busy the machine was."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

# A printed table: (header, row key, column width, decimals) per column.
TableSpec = tuple[tuple[str, str, int, int], ...]


def fmt(value, digits: int = 1) -> str:
    """A cell: floats to ``digits`` decimals (NaN as empty), True as ``*``, False as empty."""
    if isinstance(value, bool):
        return "*" if value else ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def rotated(items: list, i: int) -> list:
    """``items`` starting at the i-th (modulo its length): run i uses this order, so no item
    always runs first or last and machine drift hits them alike."""
    i %= len(items)
    return items[i:] + items[:i]


def format_table(rows: list[dict], spec: TableSpec) -> str:
    lines = ["  ".join(h.rjust(w) for h, _, w, _ in spec)]
    for row in rows:
        lines.append("  ".join(fmt(row[key], d).rjust(w) for _, key, w, d in spec))
    return "\n".join(lines)


def print_end_to_end(results: dict[str, dict[str, dict]], mode_width: int) -> None:
    """``end_to_end``'s reports (``specserve.training.evaluate``) per workload and mode, one line
    each: seconds, speedup, acceptance rate, mean acceptance length, identical to baseline."""
    print(f"{'workload':10} {'mode':{mode_width}} {'seconds':>8} {'speedup':>8} {'accept':>7} "
          f"{'mean len':>9} {'identical':>9}")
    for workload, runs in results.items():
        for name, r in runs.items():
            print(f"{workload:10} {name:{mode_width}} {r['seconds']:8.1f} {r['speedup']:8.2f} "
                  f"{r['acceptance_rate']:7.3f} {r['mean_acceptance_length']:9.2f} "
                  f"{str(r['outputs_identical']):>9}")


def write_csv(rows: list[dict], path: Path, columns: list[str], *, as_int: tuple[str, ...] = ()) -> None:
    """Rows to CSV, floats to 4 decimals; ``as_int`` columns (flags) as 0 / 1."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: int(row[k]) if k in as_int else fmt(row[k], 4) for k in columns})


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) so far; the
    difference over a run is what other processes took. Without /proc/stat (not Linux) the
    machine's figure is this process's own."""
    times = os.times()
    mine = times.user + times.system
    stat = Path("/proc/stat")
    if not stat.is_file():
        return mine, mine
    ticks = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), mine
