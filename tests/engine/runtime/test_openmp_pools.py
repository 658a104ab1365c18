"""One OpenMP pool in a unit's process (issue 71). libgomp keeps a pool of threads for every
thread that ran a parallel region, for as long as that thread lives, and while a process has
more pooled threads than cores it hardly spins at its barriers: each of the forward's parallel
regions then waits for its threads to wake. A unit whose target loaded on the replica's own
thread and then ran on the engine thread had two pools, and a one-stream token took 23 ms
against 15-17 with one (docs/BENCHMARKS.md, "The target in the unit"). So the target loads in
a thread that ends with its load (``target_group.in_own_thread``); this holds that the pool of
such a thread goes with it, and that running the same load on a thread that lives on (the
planted mistake) leaves its pool behind."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from specserve.serve.target_group import in_own_thread

BOUND_S = 60.0  # generous: a pool's threads exit as soon as they are scheduled


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_region() -> int:
    """Run one parallel region on two threads in the calling thread; the threads then."""
    torch.set_num_threads(2)
    torch.ones(1 << 21).mul_(2)  # far above torch's grain: it runs in parallel
    return threads()


def settled(expected: int) -> int:
    deadline = time.monotonic() + BOUND_S
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads()


@pytest.fixture
def torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_a_load_in_its_own_thread_leaves_no_pool_and_one_on_a_living_thread_does(torch_threads):
    before = threads()
    during = in_own_thread(parallel_region)
    assert during > before, "the region ran without a pool: nothing here tests pools"
    assert settled(before) == before

    # The planted mistake: the same load on a thread that lives on keeps its pool.
    done, stop = threading.Event(), threading.Event()

    def living() -> None:
        parallel_region()
        done.set()
        stop.wait()

    keeper = threading.Thread(target=living, daemon=True)
    keeper.start()
    try:
        assert done.wait(BOUND_S)
        assert threads() >= before + 2  # the keeper and its pool's thread, for as long as it lives
    finally:
        stop.set()
        keeper.join(BOUND_S)


def test_in_own_thread_returns_the_value_raises_the_error_and_times_out():
    assert in_own_thread(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad"):
        in_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="took over 0.01 s"):
            in_own_thread(lambda: release.wait(BOUND_S), timeout_s=0.01)
    finally:
        release.set()
