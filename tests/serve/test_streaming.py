"""A request's deadline over its unit stream (``streaming.until_deadline``), on a real event
loop and no Ray: the deadline ends a wait for a chunk with ``RequestTimeout`` and closes the
stream, never cancels the reader elsewhere, and leaves any other cancellation as it came."""

from __future__ import annotations

import asyncio
import time

import pytest
from specserve.serve.streaming import RequestTimeout, until_deadline

BOUND_S = 60  # generous: how long a test waits for what must happen at all
# A request's deadline: long enough that the chunks ready at once are read before it on a
# busy machine (what happens after it is timed from the deadline itself)
DEADLINE_S = 3.0


class Stream:
    """A unit stream: ``ready`` chunks at once, then a wait that only a cancellation ends."""

    def __init__(self, ready: int) -> None:
        self.ready, self.closed_by = ready, None

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        if self.ready:
            self.ready -= 1
            return self.ready
        try:
            await asyncio.Event().wait()
        except BaseException as exc:
            self.closed_by = type(exc)
            raise


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


def test_a_wait_past_the_deadline_is_a_timeout_and_the_task_is_not_left_cancelling():
    async def read():
        stream = Stream(ready=2)
        chunks = []
        with pytest.raises(RequestTimeout):
            async for chunk in until_deadline(stream, time.monotonic() + DEADLINE_S):
                chunks.append(chunk)
        assert chunks == [1, 0] and stream.closed_by is asyncio.CancelledError
        assert asyncio.current_task().cancelling() == 0  # taken back: nothing else is cancelled
        await asyncio.sleep(0)  # the task goes on as any other

    run(read())


def test_the_deadline_passing_while_the_reader_works_cancels_nothing_there():
    """The reader is busy with a chunk (a slow client's write, say) when the deadline passes:
    its own await goes on untouched, and the next chunk it asks for is the timeout."""
    async def read():
        deadline = time.monotonic() + DEADLINE_S
        chunks = until_deadline(Stream(ready=3), deadline)
        assert await chunks.__anext__() == 2
        await asyncio.sleep(deadline - time.monotonic() + 0.1)  # past the deadline, not cancelled
        with pytest.raises(RequestTimeout):
            await chunks.__anext__()

    run(read())


def test_another_cancellation_goes_on_as_it_came():
    """The client went away (the reader's task is cancelled) before the deadline: a
    cancellation, not a timeout."""
    async def main():
        stream = Stream(ready=0)

        async def read():
            async for _ in until_deadline(stream, time.monotonic() + BOUND_S):
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stream.closed_by is asyncio.CancelledError

    run(main())
