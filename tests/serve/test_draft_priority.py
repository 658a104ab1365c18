"""A CPU draft loads under ``SCHED_IDLE`` and returns to normal scheduling once loaded, or
after a bound on a node with no idle time (``specserve.serve.draft_worker``). Real kernel
calls on this process's threads; skipped where the process may not leave ``SCHED_IDLE``."""

from __future__ import annotations

import os
import threading
import time

import pytest
from specserve.serve.draft_worker import _can_leave_idle, _IdleWhileLoading

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not _can_leave_idle(),
                                reason="this process may not leave SCHED_IDLE")


def policies() -> set[int]:
    """The scheduling policy of every thread of this process that is still alive (a thread
    listed may end before it is asked: the cancelled timer does, CI caught it)."""
    found = set()
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            found.add(os.sched_getscheduler(tid))
        except ProcessLookupError:
            pass
    return found


def run_in_thread(fn):
    """Run ``fn`` on a fresh thread (these tests change scheduling policies; the pytest thread
    and its peers must come out as they went in)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_idle_while_loading_then_normal_for_every_thread():
    def scenario():
        before = policies()
        with _IdleWhileLoading(max_s=600) as loading:
            inside = os.sched_getscheduler(0)
            # A thread started while loading (torch's pools are) inherits the idle policy.
            child = []
            t = threading.Thread(target=lambda: child.append(os.sched_getscheduler(0)))
            t.start()
            t.join()
            timer_policy = os.sched_getscheduler(loading.timer.native_id)
        return before, inside, child[0], timer_policy, policies()

    before, inside, child, timer_policy, after = run_in_thread(scenario)
    assert before == {os.SCHED_OTHER}
    assert inside == child == os.SCHED_IDLE
    assert timer_policy == os.SCHED_OTHER  # the bound's timer must run on a busy node
    assert after == {os.SCHED_OTHER}


def test_idle_ends_after_its_bound_while_still_loading():
    def scenario():
        with _IdleWhileLoading(max_s=0.2):
            deadline = time.monotonic() + 120  # generous: the timer thread must get a core
            while os.sched_getscheduler(0) == os.SCHED_IDLE and time.monotonic() < deadline:
                time.sleep(0.05)
            return os.sched_getscheduler(0)

    assert run_in_thread(scenario) == os.SCHED_OTHER
    assert policies() == {os.SCHED_OTHER}
