"""The draft group killed, hung past its timeout, and slower than its timeout, each while a
load streams through the unit (real Ray actors, real HTTP):

- no request fails, and every output is the target's own (greedy);
- meanwhile the unit keeps stepping target-only: while the draft is lost, the engine's own
  clock (``/v1/units/stats``' step times) shows its steps taking most of the wall time and
  almost none of it waiting on a proposal (the draft's timeout is paid once, when the fault is
  found, not per step);
- speculation resumes once the draft answers again, and the draft actor holds no slot once
  the unit is idle (the slots of sequences that ended while it was away included).

The unit's draft shares target rank 0's (fake) GPU (``draft_placement: shared``, the
default): its placement group has no draft bundle, the draft asks for its fraction of rank 0's
bundle (``draft_gpu_fraction``), and Ray restarts it there after each kill.

Times are compared within one window of one unit, never with a number or with another
moment's rate: the test holds on a slow machine and on one whose load changes under it (a
target-only rate measured a minute earlier, on a machine then quieter, failed it; issue 50).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import ray
from specserve.config import UnitConfig
from specserve.serve.placement import ACTOR_NAMESPACE

from tests.serve.conftest import deployed_one, target_only_texts, unit_args, unit_handle
from tests.serve.test_http import PROMPTS, read_sse

APP = "draftfaults"
DRAFT_TIMEOUT_S = 2.0  # a tiny draft step takes milliseconds: only an injected fault reaches it
FAULT_WINDOW_S = 4 * DRAFT_TIMEOUT_S  # long beside the one timeout a fault may cost
MAX_TOKENS = 100
WORKERS = 4
DRAFT_GPU_FRACTION = 0.25
DEADLINE_S = 180.0


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_models):
    args = unit_args(tiny_models[0], speculative={
        "method": "draft_model", "num_speculative_tokens": 3, "draft": {"source": tiny_models[1]},
        "adaptive": {"enabled": False}})  # draft every step: the faults must be met
    args["unit"].update({"draft_timeout_s": DRAFT_TIMEOUT_S, "draft_retry_s": 0.2,
                         "draft_retry_max_s": 2.0})
    # Placed like the session's draft app, on fake GPU bundles with CPU tensors, so its draft
    # is not niced: a niced draft restarts under SCHED_IDLE, which a busy machine (`make
    # test`'s other worker) starves for up to 30 s before each kill's draft is back.
    # test_draft_priority.py tests that loading.
    args["unit"]["accelerator"] = "gpu"
    args["unit"]["engine"]["target"]["device"] = "cpu"
    args["unit"]["draft_gpu_fraction"] = DRAFT_GPU_FRACTION
    yield from deployed_one(APP, args)


@pytest.fixture(scope="module")
def expected(tiny_models) -> dict[str, str]:
    return target_only_texts(tiny_models[2], PROMPTS, MAX_TOKENS)


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/units/stats", timeout=60).json()


def draft_actor():
    unit = unit_handle(APP)
    return ray.get_actor(unit.draft_actor_name.remote().result(), namespace=ACTOR_NAMESPACE)


class Load:
    """``WORKERS`` threads streaming greedy completions back to back until stopped; every
    output is checked against the target's own."""

    def __init__(self, url: str, model: str, expected: dict[str, str], speculation: dict | None):
        self.url, self.model, self.expected, self.speculation = url, model, expected, speculation
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.pool = ThreadPoolExecutor(WORKERS)
        self.futures = [self.pool.submit(self._worker, i) for i in range(WORKERS)]

    def _worker(self, i: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        n = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            prompt = PROMPTS[(i + n * WORKERS) % len(PROMPTS)]
            n += 1
            body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": True}
            if self.speculation is not None:
                body["speculation"] = self.speculation
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                    events = read_sse(r) if r.status_code == 200 else []
                    if r.status_code != 200:
                        r.read()
                        self.failures.append(f"{r.status_code}: {r.text}")
                        continue
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
                continue
            if any("error" in e for e in events):
                self.failures.append(str(events[-1]))
                continue
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            if text != self.expected[prompt]:
                self.failures.append(f"wrong output for {prompt!r}: {text!r}")
            self.done += 1

    def finish(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result()
        self.pool.shutdown()


def wait_for(condition, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Sample(NamedTuple):
    time: float           # time.monotonic() here
    times: dict           # the engine's step times: steps, propose_s, verify_s, accept_s
    draft_available: bool


def sample_steps(url: str, load: Load, done, start=None) -> list[Sample]:
    """The unit's :class:`Sample` every 0.1 s while ``load`` runs (after ``start()``), until
    ``done(samples)``."""
    wait_for(lambda: stats(url)["running"] >= WORKERS - 1, "the load to be running")
    samples = []
    if start is not None:
        start()
    deadline = time.monotonic() + DEADLINE_S
    while not done(samples):
        assert time.monotonic() < deadline, "the samples never showed what they wait for"
        s = stats(url)
        samples.append(Sample(time.monotonic(), s["times"], s["draft_available"]))
        time.sleep(0.1)
    return samples


def lost_and_back(samples: list[Sample]) -> bool:
    """A ``done`` for :func:`sample_steps`: once the draft was lost and answers again."""
    flags = [s.draft_available for s in samples]
    return False in flags and flags[-1]


def clock(first: Sample, last: Sample) -> dict[str, float]:
    """Between two samples: wall seconds, and the engine's steps, seconds stepping (its
    three phases) and, of those, seconds waiting on proposals."""
    d = {k: last.times[k] - first.times[k] for k in ("steps", "propose_s", "verify_s", "accept_s")}
    return {"wall_s": last.time - first.time, "steps": d["steps"], "propose_s": d["propose_s"],
            "stepping_s": d["propose_s"] + d["verify_s"] + d["accept_s"]}


def kill(actor) -> None:
    ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1)


def hang(actor) -> None:
    actor.hang.remote(4 * DRAFT_TIMEOUT_S)  # its next step hangs for 4 timeouts


def slow(actor) -> None:
    actor.slow_down.remote(1.5 * DRAFT_TIMEOUT_S, FAULT_WINDOW_S)  # every step, for the window


@pytest.mark.parametrize("fault", [kill, hang, slow],
                         ids=lambda f: f.__name__)
def test_a_draft_fault_under_load_fails_nothing_and_costs_one_timeout(app, tiny_models, expected, fault):
    model = Path(tiny_models[0]).name
    before = wait_for(lambda: (s := stats(app))["draft_available"] and s, "the draft to be attached")
    load = Load(app, model, expected, None)
    try:
        samples = sample_steps(app, load, lost_and_back, start=lambda: fault(draft_actor()))
        back = stats(app)
        assert back["draft_fallbacks"] > before["draft_fallbacks"]
        # Speculation comes back (the draft answers probes again) while the load goes on.
        wait_for(lambda: stats(app)["spec"]["num_drafts"] > back["spec"]["num_drafts"],
                 "drafts after the draft came back")
    finally:
        load.finish()
    assert not load.failures, load.failures[:3]
    assert load.done > 0
    # While the draft is lost, the unit steps target-only: its steps fill the time (measured:
    # 91-97% of it; a step loop stalled between steps, by a probe of the draft say, would
    # not) and wait on no proposal (measured: under 1% of the stepping; a step that called
    # the lost draft would wait its whole timeout). The draft's one timeout is not in the
    # window: the step that found the fault waited it and dropped the flag inside its
    # propose, and its times count when it ends, which a sample can fall between (it did
    # under load: 2.1 s of proposing); the window starts once the step count moved on.
    lost = [s for s in samples if not s.draft_available]
    lost = [s for s in lost if s.times["steps"] > lost[0].times["steps"]]
    assert len(lost) >= 5, "the draft was lost too briefly to measure"
    seen = clock(lost[0], lost[-1])
    print(f"{fault.__name__}: lost for {seen['wall_s']:.1f} s of {samples[-1].time - samples[0].time:.1f}: "
          f"{seen['steps']} steps, stepping {seen['stepping_s']:.2f} s, proposing {seen['propose_s']:.3f} s")
    assert seen["steps"] > 0 and seen["stepping_s"] >= 0.5 * seen["wall_s"], seen
    assert seen["propose_s"] <= 0.25 * seen["stepping_s"], seen
    after = wait_for(lambda: (s := stats(app))["running"] == 0 and s, "the unit to be idle")
    assert after["free_slots"] == after["num_slots"] and after["target_restarts"] == 0
    wait_for(lambda: ray.get(draft_actor().slots_in_use.remote(), timeout=60) == 0,
             "the draft to hold no slot", timeout_s=60)


def test_a_step_waiting_on_a_local_draft_that_dies_fails_at_once(app):
    """The step stops waiting when the draft's process is gone, not when Ray reports the actor
    dead (about 1.7 s later): the error names the exited process, which Ray's does not."""
    import os
    import signal

    from specserve.errors import ProposerUnavailable
    from specserve.serve.draft_group import DraftGroup

    wait_for(lambda: stats(app)["draft_available"], "the draft to be attached")
    actor = draft_actor()
    proposer = DraftGroup(actor, method="draft_model", timeout_s=DEADLINE_S)
    proposer._identify()
    assert proposer._local is not None, "the test's draft runs on this node"
    pid = proposer._local[0]
    ray.get(actor.hang.remote(DEADLINE_S))  # the next step hangs: it can only end by the kill
    threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL)).start()
    with pytest.raises(ProposerUnavailable, match=f"process {pid} has exited"):
        proposer.propose([])
    wait_for(lambda: proposer.ping(timeout_s=10), "Ray to restart the draft")


def test_the_draft_shares_target_rank_0s_gpu(app):
    """The unit's placement group holds a coordinator bundle and one GPU bundle per target
    rank, none for the draft; rank 0 and the draft (restarted there after the faults above)
    together use all of rank 0's bundle's GPU: its 0.75 and the draft's 0.25, and Ray gives
    both processes the same GPU (``CUDA_VISIBLE_DEVICES``; the cluster declares 8 GPUs and
    has no CUDA, so the tensors are on the CPU). (Ray's state API, which would name each
    actor's resources, needs the dashboard these clusters run without; the bundle's own
    resource says it.)"""
    cpus = 2 * UnitConfig().cpus_per_actor  # rank 0's bundle holds both actors' CPUs
    tables = {pg: t for pg, t in ray.util.placement_group_table().items()
              if t["state"] == "CREATED" and any(b.get("GPU") for b in t["bundles"].values())
              and any(b.get("CPU") == cpus for b in t["bundles"].values())}
    [(pg, table)] = tables.items()  # this module's unit (other modules' may still be here)
    assert [b.get("GPU", 0) for b in table["bundles"].values()] == [0, 1], table["bundles"]
    rank0 = f"GPU_group_1_{pg}"
    assert ray.cluster_resources()[rank0] == 1
    deadline = time.monotonic() + 120  # a draft killed by the tests above may still restart
    while ray.available_resources().get(rank0, 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get(rank0, 0) == 0, ray.available_resources().get(rank0)
    names = unit_handle(APP).target_actor_names.remote().result()
    rank = ray.get(ray.get_actor(names[0], namespace=ACTOR_NAMESPACE).describe.remote(), timeout=60)
    draft = ray.get(draft_actor().describe.remote(), timeout=60)
    assert rank["cuda_visible_devices"] not in (None, "")
    assert draft["cuda_visible_devices"] == rank["cuda_visible_devices"], (draft, rank)
    assert draft["gpu_ids"] == [rank["cuda_visible_devices"]]
