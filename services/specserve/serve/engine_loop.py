"""The engine loop of a unit: in the unit's coordinator process, one thread owns the engine;
requests are asyncio streams.

The engine is not thread-safe, so a single background thread does everything to it: it takes
new requests and aborts from an inbox at the top of each iteration (continuous batching at
the step level: a request joins at the next step, a finished or cancelled one leaves and frees
its slots), runs one :meth:`SpecDecodeEngine.step`, and hands each :class:`StepOutput` to the
request's ``asyncio.Queue`` on the replica's event loop: one hand-over (one wake-up of the
loop) a step for all the step's sequences.

While the draft group is lost, a second thread (:class:`DraftWatch`) probes it, off the engine
thread and with exponential backoff, through the same call a step makes: a dead, hung or
slow draft therefore costs the engine one ``draft_timeout_s`` when it is found out, never
again while it stays bad. Once a probe answers in time, the engine thread re-attaches it,
after telling it to drop everything it held (its slots of sequences that ended meanwhile).

A request that cannot get a slot waits in the engine's queue; beyond ``max_queue_len`` waiting
requests, :class:`~specserve.errors.CapacityError` (429) is raised before anything is queued.

A request's own failure ends that request alone (the engine steps the rows of a failed step
one by one, see ``spec_decode``). When the target group fails (a rank died, or a step ran
past its timeout: :class:`~specserve.errors.TargetUnavailable`), every request in the unit
ends with :class:`EngineFailed` (503, retry), which frees every slot; the thread then
restarts the target group (``restart_target``) while new requests are refused
with :class:`~specserve.errors.TargetUnavailable` (503, retry) instead of waiting. After
``max_restarts`` restarts without a successful step in between, the unit gives up
(:attr:`EngineLoop.broken`): its health check fails and Serve replaces the whole unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from specserve.engine.grammar import CompiledGrammar
from specserve.engine.request import EngineRequest
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step.sequence import StepOutput
from specserve.errors import CapacityError, SpecServeError, TargetUnavailable

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


# The engine thread's inbox: what the asyncio side asks of it.
@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    grammar: CompiledGrammar | None  # the request's, compiled
    num_speculative_tokens: int | None
    adaptive: bool
    stream: _Stream
    accepted: asyncio.Future  # resolves, on the caller's loop, to the sequence ids or the error


@dataclass(frozen=True)
class _Abort:
    seq_ids: list[int]


@dataclass(frozen=True)
class _Stall:
    seconds: float  # fault injection
    release: str | None = None  # ... ended early once this file exists


class EngineFailed(SpecServeError):
    """The target group failed mid-step; every in-flight request ends with this (503)."""

    type = "service_unavailable"
    code = "engine_failed"
    status_code = 503


class UnitError(SpecServeError):
    """The unit failed outside any one request (a bug, logged with its traceback); the
    requests in flight end with this (500). The target group is not restarted."""

    code = "unit_error"
    status_code = 500


class DraftWatch:
    """Probes a lost draft group off the engine thread: after ``retry_s``, then twice as long
    after each probe that fails, up to ``max_retry_s``. A draft lost again soon after it came
    back (within ``max_retry_s``) resumes the backoff where it stopped, so a draft that
    answers a probe but then times out on real steps is asked ever more rarely."""

    def __init__(self, probe: Callable[[], bool], *, retry_s: float, max_retry_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.probe, self.retry_s, self.max_retry_s, self.clock = probe, retry_s, max_retry_s, clock
        self.failures = 0              # failed probes (and quick relapses) in a row
        self.num_probes = 0
        self._back_at: float | None = None  # when the draft last came back
        self._lost = threading.Event()
        self._back = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="draft-watch", daemon=True)
        self._thread.start()

    def lost(self) -> None:
        """The engine thread found the draft gone: start probing."""
        if self._back_at is not None and self.clock() - self._back_at >= self.max_retry_s:
            self.failures = 0  # it had been well for a while: a fresh loss
        self._back.clear()
        self._lost.set()

    def take_back(self) -> bool:
        """True once (per recovery) when a probe found the draft answering."""
        if not self._back.is_set():
            return False
        self._back.clear()
        return True

    def delay(self) -> float:
        return min(self.max_retry_s, self.retry_s * 2.0 ** self.failures)

    def _run(self) -> None:
        while not self._stopped:
            self._lost.wait()
            if self._stopped:
                return
            time.sleep(self.delay())
            self.num_probes += 1
            if self._probe():
                self._lost.clear()
                self._back_at = self.clock()
                self.failures += 1  # a relapse soon after waits longer (see lost())
                self._back.set()
            else:
                self.failures += 1

    def _probe(self) -> bool:
        try:
            return bool(self.probe())
        except Exception:  # noqa: BLE001  a probe that raises is a probe that failed
            log.warning("draft probe raised", exc_info=True)
            return False

    def stop(self) -> None:
        self._stopped = True
        self._lost.set()


class EngineLoop:
    """The engine thread and the asyncio side that feeds it (module docstring)."""

    def __init__(self, engine: SpecDecodeEngine, *, max_queue_len: int,
                 draft_probe: Callable[[], bool] | None = None, draft_retry_s: float = 1.0,
                 draft_max_retry_s: float = 30.0,
                 restart_target: Callable[[], None] | None = None, max_restarts: int = 3) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        # In-process proposers have nothing to probe: they are back at the next turn.
        self.draft_watch = DraftWatch(draft_probe, retry_s=draft_retry_s,
                                      max_retry_s=max(draft_retry_s, draft_max_retry_s)) \
            if draft_probe is not None else None
        self.restart_target = restart_target
        self.max_restarts = max_restarts
        self.recovering = False       # the target group is being restarted
        self.broken = False           # gave up restarting it: the health check fails
        self.num_target_restarts = 0  # since start
        self._restarts_in_a_row = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._wake = threading.Event()
        self._stall_ended = threading.Event()  # end_stall: a stall ends before its time
        self._stopped = False
        self._draft_was_available = engine.draft.available
        self.num_running = 0
        self.num_waiting = 0
        self.num_streams = 0  # sequences of the requests admitted and not ended (asyncio side)
        self.num_admitted = 0  # sequences the engine accepted since start (n per request)
        self.num_aborted = 0   # sequences cancelled before they finished (client went away)
        self.capacity = engine.target.num_free_slots + max_queue_len
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- the asyncio side ---------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Sequences running or waiting: what the router balances on."""
        return self.num_running + self.num_waiting

    @contextlib.contextmanager
    def admission(self, n: int = 1) -> Iterator[None]:
        """A new request of ``n`` sequences: refused with what it would get now (503 while the
        target group restarts, 429 when the unit is full), else it holds ``n`` of the unit's
        capacity until the block ends. The unit enters it before it answers anything, so the
        client gets a status code rather than an error inside a stream that already said 200."""
        if not self.target_available:
            raise TargetUnavailable("the target group is restarting after a failure; retry shortly")
        if self.num_streams + n > self.capacity:
            raise CapacityError(f"the unit is full ({self.capacity} sequences running or queued); "
                                "retry shortly")
        self.num_streams += n
        try:
            yield
        finally:
            self.num_streams -= n

    @property
    def target_available(self) -> bool:
        """False while the target group restarts after a failure, or once the unit gave up."""
        return not (self.recovering or self.broken)

    async def generate(self, request: EngineRequest, grammar: CompiledGrammar | None = None, *,
                       num_speculative_tokens: int | None, adaptive: bool = False
                       ) -> AsyncIterator[StepOutput]:
        """Stream the outputs of one request's ``n`` sequences (:attr:`StepOutput.index` says
        whose), admitted by :meth:`admission`, until every one has finished; cancelling the
        iteration aborts them all."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        self._submit(_Add(request, grammar, num_speculative_tokens, adaptive, stream, accepted))
        try:
            seq_ids = await accepted  # raises the engine's validation error, if any
        except asyncio.CancelledError:
            # Cancelled after the engine thread accepted it but before this task resumed:
            # the future holds sequences nobody will read. Abort them.
            if accepted.done() and not accepted.cancelled() and accepted.exception() is None:
                self._submit(_Abort(accepted.result()))
            raise
        running = set(seq_ids)
        try:
            while running:
                out = await stream.queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finish_reason is not None:
                    running.discard(out.seq_id)
                yield out
        finally:
            if running:
                self._submit(_Abort(sorted(running)))

    def _submit(self, item: _Add | _Abort | _Stall) -> None:
        self._inbox.put(item)
        self._wake.set()

    def stall(self, seconds: float, release: str | None = None) -> None:
        """Fault injection: the engine thread sleeps ``seconds`` at its next turn, as a hung
        target step would (tests of timeouts and of what waits behind a stuck unit), or
        until :meth:`end_stall`, or until the file ``release`` exists (a test that must end
        the stall of a unit it can no longer call: one being drained)."""
        self._stall_ended.clear()
        self._submit(_Stall(seconds, release))

    def end_stall(self) -> None:
        """End the stall now (a test that has seen what it waited for); if the engine thread
        has not begun it yet, it does not sleep at all."""
        self._stall_ended.set()

    def _sleep(self, seconds: float, release: str | None) -> None:
        if release is None:
            self._stall_ended.wait(seconds)
            return
        deadline = time.monotonic() + seconds
        while not os.path.exists(release) and time.monotonic() < deadline:
            if self._stall_ended.wait(0.05):
                return

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self.draft_watch is not None:
            self.draft_watch.stop()
        self._thread.join(timeout=10)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            self._watch_draft()
            if not self.engine.has_unfinished():
                self._flush_draft()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except TargetUnavailable:  # the target group failed: end every request clearly
                log.exception("the target group failed")
                self._fail_all(EngineFailed("the target group failed; the request was cancelled, "
                                            "retry shortly"))
                self._recover()
                continue
            except Exception:  # noqa: BLE001  a bug outside any one request: no restart
                log.exception("the engine failed outside any one request")
                self._fail_all(UnitError("the server failed while processing this request"))
                continue
            self._restarts_in_a_row = 0
            self._count()
            self._deliver([(out.seq_id, out if out.error is None else out.error,
                            out.finish_reason is not None) for out in outputs])

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            match item:
                case _Add():
                    self._add(item)
                case _Stall(seconds, release):
                    self._sleep(seconds, release)
                case _Abort(seq_ids):
                    for seq_id in seq_ids:
                        self.num_aborted += self.engine.abort(seq_id)
                        self._streams.pop(seq_id, None)
            self._count()

    def _add(self, add: _Add) -> None:
        loop = add.stream.loop
        try:
            seq_ids = self.engine.submit(add.request, add.grammar,
                                         num_speculative_tokens=add.num_speculative_tokens,
                                         adaptive=add.adaptive)
        except Exception as exc:
            loop.call_soon_threadsafe(_resolve, add.accepted, None, exc)
            return
        for seq_id in seq_ids:
            self._streams[seq_id] = add.stream
        self.num_admitted += len(seq_ids)
        loop.call_soon_threadsafe(self._accepted, add.accepted, seq_ids)

    def _accepted(self, future: asyncio.Future, seq_ids: list[int]) -> None:
        """On the caller's loop: hand over the sequence ids, or abort the sequences if the
        caller was cancelled (client gone, request timed out) while it waited in the inbox."""
        if future.cancelled():
            self._submit(_Abort(seq_ids))
        elif not future.done():
            future.set_result(seq_ids)

    def _deliver(self, items: list[tuple[int, StepOutput | Exception, bool]]) -> None:
        """A step's ``(seq_id, output or error, last)`` to their streams: one hand-over to
        each event loop (one wake-up of it) a step, however many sequences the step ran."""
        puts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for seq_id, item, last in items:
            stream = self._streams.pop(seq_id, None) if last else self._streams.get(seq_id)
            if stream is not None:
                puts.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in puts.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, exc: Exception) -> None:
        seq_ids = list(self._streams)
        for seq_id in seq_ids:
            self.engine.abort(seq_id)
        self._deliver([(seq_id, exc, True) for seq_id in seq_ids])
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
        self.num_running = len(self.engine.scheduler.running)
        self.num_waiting = len(self.engine.scheduler.waiting)

    def _watch_draft(self) -> None:
        """Tell the watch when the draft is lost; re-attach it when the watch found it back."""
        engine = self.engine
        if engine.draft.proposer is None:
            return
        if not engine.draft.available:
            if self.draft_watch is None:  # in-process: nothing to wait for
                engine.reattach_proposer()
            elif self._draft_was_available:
                self.draft_watch.lost()
            elif self.draft_watch.take_back():
                log.info("draft group is back; resuming speculation")
                engine.reattach_proposer()
        self._draft_was_available = engine.draft.available

    def _flush_draft(self) -> None:
        """Idle: send the draft's buffered bookkeeping (the ``finish`` of the last requests),
        so an idle draft holds no slots."""
        try:
            self.engine.draft.flush()
        except Exception:  # noqa: BLE001  a lost draft is found out by the next step
            log.warning("flushing the draft's bookkeeping failed", exc_info=True)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: one step's items into their streams' queues."""
    for stream_queue, item in batch:
        stream_queue.put_nowait(item)


def _resolve(future: asyncio.Future, value, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
