"""A request's stream from its unit, as the ingress reads it: under the request's deadline
(:class:`RequestTimeout`), cancelled when the request ends early (which frees its slot), and
answered either as one response (:meth:`UnitReply.collect`) or as an SSE body
(:meth:`UnitReply.sse`), whose errors, the headers being gone, are sent in-band.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from specserve.app_config import LimitsConfig
from specserve.serve.api_errors import from_unit_error, server_error, timeout_error
from specserve.serve.guard import Lease
from specserve.serve.metrics import record_finish
from specserve.serve.openai_shapes import chunk_body, echoed, joined, logprobs_object, sse_line
from specserve.serve.tools import ToolPlan
from specserve.serve.unit_messages import StreamDelta, StreamStart

log = logging.getLogger(__name__)


class RequestTimeout(Exception):
    """The request ran past ``limits.request_timeout_s``."""


async def until_deadline(stream, deadline: float) -> AsyncIterator[StreamStart | StreamDelta]:
    """``stream``'s chunks, raising :class:`RequestTimeout` once ``deadline`` (monotonic)
    passes while a chunk is awaited, or at the next chunk asked for after it passed.

    One timer for the whole request, not ``asyncio.wait_for`` a chunk: that wraps each
    chunk's wait in a task of its own (a task, a future, a timer and an extra turn of the
    event loop for every token, on the thread that shares the forward's cores). The timer
    cancels the task reading the stream only while it waits here for a chunk; the
    cancellation is then taken back and raised as :class:`RequestTimeout`. Any other
    cancellation (the client went away) goes on as it came."""
    loop = asyncio.get_running_loop()
    waiting: asyncio.Task | None = None  # the task awaiting a chunk here, while it does
    expired = cancelled = False

    def expire() -> None:
        nonlocal expired, cancelled
        expired = True
        if waiting is not None:
            cancelled = waiting.cancel()

    timer = loop.call_at(loop.time() + (deadline - time.monotonic()), expire)
    try:
        while True:
            if expired or time.monotonic() >= deadline:
                raise RequestTimeout
            waiting = asyncio.current_task()
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if cancelled and waiting.uncancel() == 0:  # ours alone: the deadline
                    raise RequestTimeout from None
                raise
            finally:
                waiting = None
            yield chunk
    finally:
        timer.cancel()


def cancel_stream(stream) -> None:
    """Cancel a unit stream: a no-op once it finished, and it frees the slot of one that has
    not. Serve re-raises a request's routing error (e.g. BackPressureError) from ``cancel``
    when the request never reached a unit; that error is being answered already."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001
        pass


def end_request(stream, lease: Lease) -> None:
    """End a request: cancel its unit stream and give back its lease."""
    cancel_stream(stream)
    lease.release()


class UnitReply:
    """One request's chunks from its unit (``stream``: the Serve response generator of the
    unit's ``generate``), read until ``deadline`` (monotonic)."""

    def __init__(self, stream, deadline: float, limits: LimitsConfig, *, rid: str, chat: bool,
                 n: int) -> None:
        self.stream, self.rid, self.chat, self.n = stream, rid, chat, n
        self.chunks = until_deadline(stream, deadline)
        self.route = "/v1/chat/completions" if chat else "/v1/completions"
        self.timeout_s, self.log_content = limits.request_timeout_s, limits.log_request_content

    async def start(self) -> StreamStart:
        """The unit's first chunk: its decision, before any text. A timeout or the unit's error
        (capacity, say) is raised as an :class:`~specserve.serve.api_errors.APIError`, the
        stream cancelled."""
        try:
            return await self.chunks.__anext__()
        except RequestTimeout:
            cancel_stream(self.stream)
            raise timeout_error(self.timeout_s) from None
        except Exception as exc:
            cancel_stream(self.stream)
            raise from_unit_error(exc, self.rid) from exc

    async def collect(self) -> tuple[list[StreamDelta], dict]:
        """Every choice's chunk, until all ``n`` finished, and the usage (on the last). A unit
        answers a request that does not stream with one chunk per choice, when it finishes: its
        whole text, all its logprobs items and, for an echo, the prompt's scores."""
        finals: list[StreamDelta | None] = [None] * self.n
        unfinished = self.n
        try:
            async for chunk in self.chunks:
                finals[chunk.index] = chunk
                unfinished -= chunk.finish_reason is not None
                if unfinished == 0:
                    record_finish(self.route, chunk)
                    self._log_output("".join(c.text for c in finals))
                    return finals, chunk.usage
        except RequestTimeout:
            raise timeout_error(self.timeout_s) from None
        except Exception as exc:
            raise from_unit_error(exc, self.rid) from exc
        finally:
            cancel_stream(self.stream)  # no-op when finished; frees the slot when the client went away
        raise server_error(RuntimeError("the unit ended the stream without finishing"), self.rid)

    async def sse(self, names, model: str, lease: Lease, include_usage: bool,
                  echo: tuple[str, list[int]] | None = None, tools: ToolPlan | None = None,
                  usage_so_far: int | None = None, prompt_ids: list[int] | None = None
                  ) -> AsyncIterator[str]:
        """The SSE body; it owns ``lease``; ``names`` names the logprobs' tokens (the tokenizer,
        or :class:`~specserve.serve.openai_shapes.TokenIdNames`). With ``tools``, a choice's
        text is held until it finishes and then sent as its content or its ``tool_calls`` (a
        call is parsed whole).
        ``usage_so_far``: the prompt's tokens, where every chunk carries its choice's usage so
        far (vLLM's ``continuous_usage_stats``). ``prompt_ids``: the prompt's token ids, where
        the chunks carry token ids (vLLM's ``return_token_ids``): the prompt's on a choice's
        first chunk, each sent chunk the output ids since the last one sent."""

        def sent(body: dict, tokens: int = 0) -> str:
            if usage_so_far is not None:
                body["usage"] = {"prompt_tokens": usage_so_far, "completion_tokens": tokens,
                                 "total_tokens": usage_so_far + tokens}
            return sse_line(body)

        rid, chat, n = self.rid, self.chat, self.n
        created = int(time.time())
        held: list[tuple[str, list | None]] = [("", None)] * n  # with tools: text, logprobs so far
        parts: list[str] = []  # kept only to log the output (limits.log_request_content)
        offsets = [0] * n  # per choice, completions' text_offset of its next token
        echoes = [echo] * n  # per choice, the prompt still to send before its text
        prompts = [prompt_ids] * n  # per choice, the prompt's ids still to send (return_token_ids)
        ids: list[list[int] | None] = [None if prompt_ids is None else []] * n  # not sent yet
        unfinished = n
        try:
            if chat:
                for i in range(n):
                    yield sent(chunk_body(rid, model, created, chat, {"role": "assistant", "content": ""},
                                          None, index=i, prompt_ids=prompts[i]))
                    prompts[i] = None
            async for chunk in self.chunks:
                i, text, items = chunk.index, chunk.text, chunk.logprobs
                if ids[i] is not None:
                    ids[i] = ids[i] + (chunk.token_ids or [])
                if echoes[i] is not None:  # the prompt goes out with the choice's first chunk
                    prefix, items = echoed(echoes[i], chunk.prompt_logprobs, items)
                    text, echoes[i] = prefix + text, None
                finish = chunk.finish_reason
                delta = {"content": text} if chat else text
                if tools is not None:
                    text, items = held[i][0] + text, joined(held[i][1], items)
                    held[i] = (text, items)
                    if finish is None:
                        continue
                    content, calls = tools.parse(text)
                    delta = {"content": content}
                    if calls:
                        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                        finish = "tool_calls"
                if text or finish or items:
                    logprobs = logprobs_object(names, items, chat, offsets[i])
                    if logprobs is not None and not chat:
                        offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    yield sent(chunk_body(rid, model, created, chat, delta, finish, logprobs, index=i,
                                          token_ids=ids[i], prompt_ids=prompts[i]), chunk.num_tokens)
                    prompts[i], ids[i] = None, None if ids[i] is None else []
                    if self.log_content:
                        parts.append(text)
                unfinished -= chunk.finish_reason is not None
                if unfinished == 0:
                    record_finish(self.route, chunk)
                    self._log_output("".join(parts))
                    if include_usage:
                        body = chunk_body(rid, model, created, chat, None, None)
                        body["choices"], body["usage"] = [], chunk.usage
                        yield sse_line(body)
        except RequestTimeout:
            yield sse_line(timeout_error(self.timeout_s).body)
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            yield sse_line(from_unit_error(exc, rid).body)
        finally:
            end_request(self.stream, lease)  # a client that disconnects mid-stream frees its slot
        yield "data: [DONE]\n\n"

    def _log_output(self, text: str) -> None:
        if self.log_content:
            log.info("request %s: output %r", self.rid, text)
