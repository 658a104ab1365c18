"""The speculation coordinator's loop: one thread owns the engine; requests are asyncio streams.

The engine is not thread-safe, so a single background thread does everything to it: it takes
new requests and aborts from an inbox at the top of each iteration (continuous batching at
the step level: a request joins at the next step, a finished or cancelled one leaves and frees
its slots), runs one :meth:`SpecDecodeEngine.step`, and hands each :class:`StepOutput` to the
request's ``asyncio.Queue`` on the replica's event loop. While the draft group is lost, the
thread also asks it every ``draft_retry_s`` whether it is back, and re-attaches it.

A request that cannot get a slot waits in the engine's queue; beyond ``max_queue_len`` waiting
requests, :class:`~specserve.errors.CapacityError` (429) is raised before anything is queued.

When a step fails (the target group lost a rank, or a step ran past its timeout), every
request in the unit ends with :class:`EngineFailed` (503, retry), which frees every slot; the
thread then restarts the target group (``restart_target``) while new requests are refused
with :class:`~specserve.errors.TargetUnavailable` (503, retry) instead of waiting. After
``max_restarts`` restarts without a successful step in between, the unit gives up
(:attr:`AsyncEngine.broken`): its health check fails and Serve replaces the whole unit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specserve.config import SamplingParams
from specserve.engine.spec_decode import SpecDecodeEngine, StepOutput
from specserve.errors import CapacityError, SpecServeError, TargetUnavailable

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineFailed(SpecServeError):
    """The target group failed mid-step; every in-flight request ends with this (503)."""

    type = "service_unavailable"
    code = "engine_failed"
    status_code = 503


class AsyncEngine:
    def __init__(self, engine: SpecDecodeEngine, *, max_queue_len: int,
                 draft_probe: Callable[[], bool] | None = None, draft_retry_s: float = 1.0,
                 restart_target: Callable[[], None] | None = None, max_restarts: int = 3) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.draft_probe = draft_probe
        self.draft_retry_s = draft_retry_s
        self.restart_target = restart_target
        self.max_restarts = max_restarts
        self.recovering = False       # the target group is being restarted
        self.broken = False           # gave up restarting it: the health check fails
        self.num_target_restarts = 0  # since start
        self._restarts_in_a_row = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._last_probe = 0.0
        self.num_running = 0
        self.num_waiting = 0
        self.num_streams = 0  # generate() calls in progress (asyncio side)
        self.num_admitted = 0  # requests the engine accepted since start
        self.num_aborted = 0   # requests cancelled before they finished (client went away)
        self.capacity = engine.target.num_free_slots + max_queue_len
        self._thread = threading.Thread(target=self._run, name="spec-coordinator", daemon=True)
        self._thread.start()

    # -- the asyncio side ---------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Sequences running or waiting: what the router balances on."""
        return self.num_running + self.num_waiting

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       spec_len: int | None, adaptive: bool = False) -> AsyncIterator[StepOutput]:
        """Stream the outputs of one request; cancelling the iteration aborts it."""
        self.check_admission()
        self.num_streams += 1
        try:
            async for out in self._stream(prompt_token_ids, params, spec_len, adaptive):
                yield out
        finally:
            self.num_streams -= 1

    @property
    def target_available(self) -> bool:
        """False while the target group restarts after a failure, or once the unit gave up."""
        return not (self.recovering or self.broken)

    def check_admission(self) -> None:
        """Raise what a new request would get now: 503 while the target group restarts, 429
        when the unit is full. The unit asks before it answers anything, so the client gets a
        status code rather than an error inside a stream that already said 200."""
        if not self.target_available:
            raise TargetUnavailable("the target group is restarting after a failure; retry shortly")
        if self.num_streams >= self.capacity:
            raise CapacityError(f"the unit is full ({self.capacity} requests running or queued); "
                                "retry shortly")

    async def _stream(self, prompt_token_ids, params, spec_len, adaptive) -> AsyncIterator[StepOutput]:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        self._submit(("add", prompt_token_ids, params, spec_len, adaptive, stream, accepted))
        seq_id = await accepted  # raises the engine's validation error, if any
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self._submit(("abort", seq_id))

    def _submit(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    def stall(self, seconds: float) -> None:
        """Fault injection: the engine thread sleeps ``seconds`` at its next turn, as a hung
        target step would (tests of timeouts and of what waits behind a stuck unit)."""
        self._submit(("stall", seconds))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            self._maybe_reattach_draft()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=self.draft_retry_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the target group failed: end every request clearly
                log.exception("engine step failed")
                self._fail_all(EngineFailed(f"the target group failed ({exc}); the request was "
                                            "cancelled, retry shortly"))
                self._recover()
                continue
            self._restarts_in_a_row = 0
            self._count()
            for out in outputs:
                self._deliver(out.seq_id, out, last=out.finish_reason is not None)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._add(*item[1:])
            elif item[0] == "stall":
                time.sleep(item[1])
            else:
                self.num_aborted += self.engine.abort(item[1])
                self._streams.pop(item[1], None)
            self._count()

    def _add(self, prompt, params, spec_len, adaptive, stream: _Stream,
             accepted: asyncio.Future) -> None:
        try:
            seq_id = self.engine.add_request(prompt, params, spec_len=spec_len, adaptive=adaptive)
        except Exception as exc:
            stream.loop.call_soon_threadsafe(_resolve, accepted, None, exc)
            return
        self._streams[seq_id] = stream
        self.num_admitted += 1
        stream.loop.call_soon_threadsafe(self._accepted, accepted, seq_id)

    def _accepted(self, future: asyncio.Future, seq_id: int) -> None:
        """On the caller's loop: hand over the sequence id, or abort the sequence if the caller
        was cancelled (client gone, request timed out) while it waited in the inbox."""
        if future.cancelled():
            self._submit(("abort", seq_id))
        elif not future.done():
            future.set_result(seq_id)

    def _deliver(self, seq_id: int, item, *, last: bool) -> None:
        stream = self._streams.pop(seq_id, None) if last else self._streams.get(seq_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for seq_id in list(self._streams):
            self.engine.abort(seq_id)
            self._deliver(seq_id, exc, last=True)
        self._count()

    def _recover(self) -> None:
        """Restart the target group (the engine thread waits; new requests get 503)."""
        if self.restart_target is None:
            return
        self.recovering = True
        while not self._stopped:
            if self._restarts_in_a_row >= self.max_restarts:
                log.error("the target group failed %d times in a row; giving up (Serve will "
                          "replace this unit)", self._restarts_in_a_row)
                self.broken = True
                return
            self._restarts_in_a_row += 1
            self.num_target_restarts += 1
            try:
                self.restart_target()
            except Exception:
                log.exception("restarting the target group failed (attempt %d)",
                              self._restarts_in_a_row)
                time.sleep(min(30.0, 2.0 ** self._restarts_in_a_row))
                continue
            log.info("target group restarted (restart %d)", self.num_target_restarts)
            self.recovering = False
            return

    def _count(self) -> None:
        self.num_running = len(self.engine.running)
        self.num_waiting = len(self.engine.waiting)

    def _maybe_reattach_draft(self) -> None:
        if self.engine.draft_available or self.draft_probe is None or self.engine.proposer is None:
            return
        now = time.monotonic()
        if now - self._last_probe < self.draft_retry_s:
            return
        self._last_probe = now
        if self.draft_probe():
            log.info("draft group is back; resuming speculation")
            self.engine.reattach_proposer()


def _resolve(future: asyncio.Future, value, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
