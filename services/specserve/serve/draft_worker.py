"""The draft group's actor: a draft model with its own KV cache, behind the proposer API
(its coordinator-side client is :class:`specserve.serve.draft_group.DraftGroup`).

On a CPU node the draft shares cores with the target, and the draft is optional while the
target is not. A draft that Ray restarts spends seconds of CPU importing torch and
transformers and loading its model (about 4.6 s for a tiny model on this project's machines),
and at an equal or merely lower priority that CPU comes out of the target's steps: measured,
a restart at niceness +10 still cost the target about half its steps per second. So a
``niced`` draft:

- is ``DRAFT_NICENESS`` nicer than the worker Ray started, for good;
- loads under ``SCHED_IDLE`` (the kernel runs it only on a core no other task wants) and goes
  back to normal scheduling once loaded, or after ``IDLE_LOAD_MAX_S`` on a node so busy that
  idle time never comes. Leaving ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE``
  that allows it; where the process has neither it loads at its niceness only.

This module imports nothing heavy at the top: Ray imports it in the new worker before it
constructs the actor, and the heavy imports happen in ``__init__``, after the priority is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from specserve.engine.step.proposal import DraftRequest, Proposal

log = logging.getLogger(__name__)

DRAFT_NICENESS = 10  # added to the niceness Ray starts its workers with (15 unless configured)
IDLE_LOAD_MAX_S = 30.0  # a niced draft loads under SCHED_IDLE for at most this long


def _set_policy(policy: int, skip: frozenset[int] = frozenset()) -> None:
    """``policy`` for every thread of this process but ``skip`` (threads keep the policy of
    the thread that created them, so torch's pools follow the loading thread's)."""
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid in skip:
            continue
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when it is gone: with the
    pid, an identity that a reused pid does not fake."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _can_leave_idle() -> bool:
    """Whether this process may go from ``SCHED_IDLE`` back to ``SCHED_OTHER`` (tried on a
    throwaway thread)."""
    result = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except (OSError, AttributeError):  # AttributeError: not Linux
            result.append(False)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return result[0]


class _IdleWhileLoading:
    """Context manager: the process runs ``SCHED_IDLE`` inside it, for at most ``max_s``."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.lock = threading.Lock()
        self.idle = False

    def __enter__(self) -> _IdleWhileLoading:
        # The timer thread exists before the process turns idle and stays normal: on a node
        # with no idle time an idle thread might wait very long to run.
        self.timer = threading.Timer(self.max_s, self._leave, args=("still loading after "
                                                                    f"{self.max_s:.0f} s",))
        self.timer.daemon = True
        self.timer.start()
        with self.lock:
            _set_policy(os.SCHED_IDLE, skip=frozenset({self.timer.native_id}))
            self.idle = True
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        self._leave("loaded")

    def _leave(self, why: str) -> None:
        with self.lock:
            if self.idle:
                _set_policy(os.SCHED_OTHER)
                self.idle = False
                log.info("draft: normal scheduling again (%s)", why)


@ray.remote
class DraftWorker:
    """The draft group: a draft-model proposer in its own process."""

    OPS = frozenset({"start", "fork", "commit", "finish", "reset"})

    def __init__(self, method: str, draft: dict, target: dict, max_model_len: int,
                 num_slots: int, target_vocab_size: int | None = None, *,
                 options: dict | None = None, niced: bool = False,
                 eos_token_ids: list[int] | None = None, kv: dict | None = None) -> None:
        loading = contextlib.nullcontext()
        if niced:  # before the heavy imports below: they are most of a restart's CPU
            os.nice(DRAFT_NICENESS)
            if _can_leave_idle():
                loading = _IdleWhileLoading(IDLE_LOAD_MAX_S)
        with loading:
            import torch

            from specserve.config import KVCacheConfig, ModelConfig
            from specserve.engine.builder import load_draft_proposer

            torch.set_num_threads(os.cpu_count() or 1)  # the loop runs draft and target in turn
            self.proposer = load_draft_proposer(
                method, ModelConfig.model_validate(draft),
                target_cfg=ModelConfig.model_validate(target), num_slots=num_slots,
                max_model_len=max_model_len, target_vocab_size=target_vocab_size,
                options=options, kv=KVCacheConfig.model_validate(kv) if kv else None)
            if eos_token_ids and target_vocab_size:  # drafts follow structured outputs' grammars
                from specserve.engine.grammar import GrammarCompiler
                from specserve.engine.loader import load_tokenizer, resolve

                target_model = ModelConfig.model_validate(target)
                tokenizer = load_tokenizer(resolve(target_model.source, target_model.cache_dir))
                self.proposer.use_grammars(GrammarCompiler(tokenizer, target_vocab_size, eos_token_ids))
            # Its compiles and captures here, before the unit reports ready, not in a step.
            self.warm_up_report = self.proposer.warm_up()
            log.info("draft: warmed up: %s", self.warm_up_report)
        self._slow: tuple[float, float] = (0.0, 0.0)  # fault injection: (seconds per call, until)
        self._hang = 0.0                               # fault injection: the next step sleeps this

    def step(self, ops: list[tuple], requests: list[DraftRequest]) -> list[Proposal]:
        self._maybe_slow()
        self.apply(ops)
        from specserve.serve.wire import host_only  # (light: torch is loaded by now)

        return host_only(self.proposer.propose(requests)) if requests else []

    def apply(self, ops: list[tuple]) -> None:
        """Every op is applied, whatever the one before did: one sequence's failed ``commit``
        must not keep the ``finish`` of another from freeing its slot."""
        for name, args in ops:
            if name not in self.OPS:
                log.error("draft: unknown bookkeeping op %r", name)
                continue
            try:
                getattr(self.proposer, name)(*args)
            except Exception:  # noqa: BLE001
                log.exception("draft: %s%r failed", name, args)

    def identity(self) -> tuple[str, int, int | None]:
        """``(node id, pid, process start)``: a caller on this node can see the process die at
        once (Ray fails a call to a dead actor only after about 1.7 s)."""
        pid = os.getpid()
        return ray.get_runtime_context().get_node_id(), pid, process_start(pid)

    def ping(self) -> bool:
        return True

    def describe(self) -> dict:
        """Where this draft runs (tests check the placement): the GPU Ray assigned it, as its
        process sees it (``CUDA_VISIBLE_DEVICES``) and as Ray names it (``gpu_ids``)."""
        return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    def slots_in_use(self) -> int:
        """Sequences the draft holds a cache slot for (tests: zero once the unit is idle)."""
        model = getattr(self.proposer, "model", self.proposer)  # behind speculative.first
        return model.num_slots_in_use

    def slow_down(self, seconds: float, for_s: float) -> None:
        """Fault injection: every ``step`` in the next ``for_s`` seconds first sleeps
        ``seconds`` (a draft slower than its timeout)."""
        self._slow = (seconds, time.monotonic() + for_s)

    def hang(self, seconds: float) -> None:
        """Fault injection: the next ``step`` hangs for ``seconds`` (calls behind it wait)."""
        self._hang = seconds

    def _maybe_slow(self) -> None:
        hang, self._hang = self._hang, 0.0
        seconds, until = self._slow
        if seconds > 0 and time.monotonic() < until:
            hang = max(hang, seconds)
        if hang > 0:
            time.sleep(hang)
