"""The unit in the ingress's own process (``AppConfig.unit_in_ingress``), called as its Serve
handle would be.

With one unit whose target runs in it (a CPU at TP 1), a second replica buys nothing but a
hop: each step's chunk would be a Ray message from the unit's replica to the ingress's, and
on a small machine that CPU is taken from the forward. Here the ingress builds the
:class:`~specserve.serve.unit.SpeculationUnit` itself, and reads its stream as a local
async generator. The ingress keeps one way of calling its unit: these give a local unit the
calls it makes of a handle, ``generate.remote`` (a stream read with ``__anext__`` and ended
with ``cancel``) and ``stats.remote`` (awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from specserve.serve.direct_http import DirectHTTP
from specserve.serve.unit_messages import UnitSnapshot


class LocalStream:
    """One request's chunks from a unit in this process: what the ingress reads of a Serve
    response generator (``__anext__``, and ``cancel``, which frees the request's slot)."""

    def __init__(self, chunks: AsyncIterator) -> None:
        self._chunks = chunks
        self._loop = asyncio.get_running_loop()

    def __aiter__(self) -> LocalStream:
        return self

    def __anext__(self):
        return self._chunks.__anext__()

    def cancel(self) -> None:
        """Close the stream (its ``finally`` aborts the request's sequences); a no-op once it
        ended. The reader's own cancellation (a client gone, a deadline) ends it from inside."""
        if self._chunks.ag_frame is not None:
            self._loop.call_soon_threadsafe(self._loop.create_task, self._close())

    async def _close(self) -> None:
        with contextlib.suppress(RuntimeError):  # being read right now: its reader ends it
            await self._chunks.aclose()


class _Call:
    def __init__(self, method) -> None:
        self._method = method

    def remote(self, *args):
        return self._method(*args)


class LocalUnit:
    """A :class:`~specserve.serve.unit.SpeculationUnit` built in this process, with the calls
    the ingress makes of a unit's handle."""

    def __init__(self, config: dict) -> None:
        from specserve.serve.unit import SpeculationUnit

        self.unit = SpeculationUnit(config, in_ingress=True)
        self.generate = _Call(lambda asked: LocalStream(self.unit.generate(asked)))
        self.stats = _Call(self._stats)

    async def _stats(self) -> dict:
        return self.unit.stats()

    def metrics(self) -> dict[str, UnitSnapshot]:
        """The unit's numbers now, by its id, as a metrics hub answers for its units."""
        return {self.unit.unit_id: self.unit.metrics_snapshot()}

    def check_health(self) -> None:
        self.unit.check_health()

    def close(self) -> None:
        self.unit.close()


class HostsUnit:
    """What the ingress's replica answers for the unit it holds (``local``; None where the
    units have replicas of their own): Serve's health check and replica stop, and the unit's
    handle-only fault injection (SpeculationUnit's), so a test reaches a unit the same way
    in either shape."""

    local: LocalUnit | None = None
    direct: DirectHTTP | None = None  # its own HTTP server (AppConfig.direct_http)

    def check_health(self) -> None:
        if self.local is not None:
            self.local.check_health()
        if self.direct is not None:
            self.direct.check_health()

    def __del__(self) -> None:
        if self.direct is not None:
            self.direct.close()
        if self.local is not None:
            self.local.close()

    def stall(self, seconds: float, release: str | None = None) -> str:
        return self.local.unit.stall(seconds, release)

    def end_stall(self) -> None:
        self.local.unit.end_stall()

    def inject_fault_token(self, token_id: int | None) -> None:
        self.local.unit.inject_fault_token(token_id)

    def draft_actor_name(self) -> str | None:
        return self.local.unit.draft_actor_name()

    def target_actor_names(self) -> list[str]:
        return self.local.unit.target_actor_names()
