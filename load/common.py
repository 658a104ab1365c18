"""Helpers the load tools share: table and CSV output, run order, how busy the machine was, and
one streamed request's SSE lines."""

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


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for any other line (comments, events, blanks)."""
    return line[5:].strip() if line.startswith("data:") else None


async def post_sse(client, url: str, body: dict, on_data, on_response=None) -> str | None:
    """POST ``body`` (an ``httpx.AsyncClient``'s streamed request) and hand each SSE ``data:``
    payload to ``on_data(payload, perf_counter_now)`` until it returns True. ``on_response``
    sees the response first (its headers). Returns what went wrong, or None: a status other
    than 200 (``HTTP 429: ...``) or the exception, a failed request being a data point of a
    load tool, not its crash."""
    import time

    try:
        async with client.stream("POST", url, json=body) as response:
            if on_response is not None:
                on_response(response)
            if response.status_code != 200:
                await response.aread()
                return f"HTTP {response.status_code}: {response.text[:200]}"
            async for line in response.aiter_lines():
                if (data := sse_data(line)) is not None and on_data(data, time.perf_counter()):
                    break
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


async def client_pool(jobs, concurrency: int, time_limit_s: float, send) -> float:
    """``concurrency`` clients take ``jobs`` from one shared iterator (each job sent once), each
    awaiting ``send(job)`` for one after another; none starts a job past ``time_limit_s``, and
    what still runs then is cancelled. Returns the wall time."""
    import asyncio
    import time

    queue, t0 = iter(jobs), time.perf_counter()

    async def client() -> None:
        for job in queue:
            if time.perf_counter() - t0 >= time_limit_s:
                return
            await send(job)

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    _, late = await asyncio.wait(tasks, timeout=time_limit_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    return time.perf_counter() - t0
