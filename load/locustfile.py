"""Locust load test for specserve's OpenAI-compatible API, streamed (SSE).

Every request is ``POST /v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``; the SSE stream is parsed here so that the numbers are the
client's own (time to first token, gaps between chunks), not the server's.

    locust -f load/locustfile.py --headless -u 4 -r 4 -t 60s --host http://127.0.0.1:8000 \
        --csv results/load/locust --html results/load/locust.html [UserClass ...]

User classes: pick them by name on the command line, with ``--class-picker`` in the web UI,
or by the tag in brackets (``-T chat code``, ``-E long``: whole classes, see
``_select_classes_by_tag``); with none picked, all run in proportion to their weights. The
prompts are the shipped sets in ``load/prompts/``, sent in turn from a random start per user:

    ShortOutputUser      [short]   chat + code prompts, max_tokens 16       weight 1
    LongOutputUser       [long]    chat + code prompts, max_tokens 256      weight 1
    ChatUser             [chat]    chat prompts, max_tokens 128             weight 2
    CodeUser             [code]    code prompts, max_tokens 128             weight 2
    InputRepeatingUser   [repeat]  rewrite + summarize prompts, max 256     weight 2
    EditUser             [edit]    code_edit + revise prompts, max 256      weight 1
    AgentUser            [agent]   agent + extract prompts, max 128         weight 1
    QuoteUser            [quote]   doc_qa prompts, max 128                  weight 1

The last three are the traffic suffix decoding is for (``load/prompts/README.md``): a later
turn that revises an earlier answer, an edited file returned whole, the next tool call of an
agent loop, records extracted one JSON object each, answers that quote a document.

``InputRepeatingUser`` sends prompts of ~450-700 tokens (SmolLM2 tokenizer): it needs a
model whose context holds that plus its output (the embedded default's 8k does).

Statistics. The row ``POST /v1/chat/completions`` (Type, Name) is Locust's own: success or
failure of the whole streamed request, all classes together; its response time is until the
response *headers*. The other rows have the class's tag as ``Type`` and ``Name`` one of:

    TTFT                        ms from sending to the first chunk with content, per request
    ITL                         ms between consecutive content chunks: one sample per gap, so
                                the percentiles are those of the gaps; a chunk can carry more
                                than one token when drafts are accepted, and events that
                                arrive in the same network read give gaps near 0
    TPOT                        ms per output token after the first, one sample per request:
                                (last chunk - first chunk) / (completion_tokens - 1)
    E2E                         ms from sending to ``[DONE]``, per request; response_length =
                                bytes of the stream
    tokens_per_s                NOT ms: output tokens per second of E2E for one request
                                (usage.completion_tokens / E2E); response_length = tokens
    speculation_on / _off       what the server decided (``x-speculation`` header), one
                                sample per successful request carrying its E2E in ms

Only successful requests give samples to the metric rows; failures are counted on the
``POST`` row. The ``Aggregated`` row mixes all of these and means nothing. A request fails
when the status is not 200, the connection fails, an in-band ``{"error": ...}`` event
arrives, the stream ends without ``[DONE]``, without a ``finish_reason`` or without the
usage chunk, or it takes longer than ``SPECSERVE_TIMEOUT_S``. Locust exits 1 (its
``--exit-code-on-error``) when any request failed. A summary of the speculation decisions
(modes, reasons, acceptance over all requests) is logged when the test stops. Requests
still running when ``-t`` ends are dropped, not counted, unless ``--stop-timeout`` lets
them finish. The ``--csv`` files get the final numbers (``_write_final_csv_rows``).

Environment:

    SPECSERVE_MODEL        served model name; default: asked once from GET /v1/models
    SPECSERVE_SPECULATION  on | off | router (default): on/off sends {"speculation":
                           {"enabled": true|false}}, router sends no extension
    SPECSERVE_RATE         total requests/s of this Locust process, Poisson arrivals: each of
                           the N users starts requests at exponential gaps of mean N/RATE
                           (superposed, a Poisson process at RATE). A user still busy when
                           its next arrival is due starts at once, its schedule restarts
                           from then (the achieved rate falls short) and the miss is counted
                           (``late arrivals`` in the summary: add users). Unset: closed loop,
                           every user sends its next request as soon as one finishes.
    SPECSERVE_MAX_TOKENS   caps every class's max_tokens (small-context models, quick runs)
    SPECSERVE_TEMPERATURE  sampling temperature, default 0 (greedy)
    SPECSERVE_IGNORE_EOS   1: ask for exactly max_tokens (``ignore_eos``), default 0
    SPECSERVE_TIMEOUT_S    per-request limit, sending to [DONE], default 120

In closed-loop mode a failed request is followed by a 0.5 s pause, so an unreachable host
is not hammered in a tight loop for the whole run.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import gevent
from gevent.lock import Semaphore
from locust import HttpUser, events, tag, task
from locust.stats import StatsCSVFileWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import load_prompts  # noqa: E402  (load/ is not a package)

log = logging.getLogger("specserve.load")
CHAT_PATH = "/v1/chat/completions"
SPECULATION_BODIES: dict[str, dict | None] = {
    "on": {"enabled": True}, "off": {"enabled": False}, "router": None}
FAILURE_PAUSE_S = 0.5
CONNECT_TIMEOUT_S = 10.0


class RequestTimeout(Exception):
    """The request ran past SPECSERVE_TIMEOUT_S (raised by a gevent.Timeout)."""


@dataclass(frozen=True)
class Settings:
    """What the environment asks for, checked once at import so a typo stops the run."""

    model: str | None
    speculation: str
    rate: float | None
    max_tokens_cap: int | None
    temperature: float
    ignore_eos: bool
    timeout_s: float

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        speculation = env.get("SPECSERVE_SPECULATION", "router").strip().lower() or "router"
        if speculation not in SPECULATION_BODIES:
            raise ValueError(f"SPECSERVE_SPECULATION must be on, off or router, not {speculation!r}")
        rate = _positive(env, "SPECSERVE_RATE", float)
        cap = _positive(env, "SPECSERVE_MAX_TOKENS", int)
        return cls(model=env.get("SPECSERVE_MODEL") or None, speculation=speculation, rate=rate,
                   max_tokens_cap=cap, temperature=float(env.get("SPECSERVE_TEMPERATURE", "0")),
                   ignore_eos=env.get("SPECSERVE_IGNORE_EOS", "0") not in ("", "0", "false"),
                   timeout_s=_positive(env, "SPECSERVE_TIMEOUT_S", float) or 120.0)


def _positive(env: dict[str, str], name: str, kind: type) -> float | int | None:
    """An optional positive number from the environment; ValueError names the variable."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    value = kind(raw)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, not {raw!r}")
    return value


SETTINGS = Settings.from_env(dict(os.environ))


@dataclass
class StreamResult:
    """What one SSE stream carried; times are ``time.perf_counter()`` values."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # chunks with non-empty content
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    done_at: float | None = None
    nbytes: int = 0

    def failure(self) -> str | None:
        """Why this stream counts as failed, or None when it is a success."""
        if self.error is not None:
            return f"in-band error: {self.error}"
        if self.done_at is None:
            return "stream ended without [DONE]"
        if self.finish_reason is None:
            return "stream ended without a finish_reason"
        if not self.usage:
            return "stream ended without the usage chunk"
        return None


def read_sse(lines: Iterable[bytes], result: StreamResult) -> StreamResult:
    """Fill ``result`` from the stream's lines, stamping each event as it arrives.

    It reads on after ``[DONE]`` to the end of the body (the server ends it there), so the
    connection goes back to the pool for the next request instead of being closed.
    """
    for raw in lines:
        result.nbytes += len(raw) + 1
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if not line.startswith("data:") or result.done_at is not None:
            continue  # blank separators, comments, other SSE fields, anything after [DONE]
        data = line[5:].strip()
        if data == "[DONE]":
            result.done_at = time.perf_counter()
        else:
            _apply_event(json.loads(data), result, time.perf_counter())
    return result


def _apply_event(event: dict, result: StreamResult, now: float) -> None:
    """One ``data:`` JSON object: an error, a chunk of choices, or the usage chunk."""
    if "error" in event:
        err = event["error"]
        result.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        return
    for choice in event.get("choices") or []:
        if (choice.get("delta") or {}).get("content"):
            result.chunk_times.append(now)
        if choice.get("finish_reason") is not None:
            result.finish_reason = choice["finish_reason"]
    if event.get("usage"):
        result.usage = event["usage"]


def metrics(result: StreamResult) -> list[tuple[str, float, int]]:
    """``(name, value, response_length)`` samples of one successful stream (see module doc)."""
    ms = lambda a, b: (b - a) * 1000.0
    tokens = int(result.usage.get("completion_tokens", 0))
    e2e = ms(result.start, result.done_at)
    out = [("E2E", e2e, result.nbytes)]
    times = result.chunk_times
    if times:
        out.append(("TTFT", ms(result.start, times[0]), 0))
        out += [("ITL", ms(a, b), 0) for a, b in zip(times, times[1:])]
    if times and tokens > 1:
        out.append(("TPOT", ms(times[0], times[-1]) / (tokens - 1), 0))
    if tokens > 0 and e2e > 0:
        out.append(("tokens_per_s", tokens / (e2e / 1000.0), tokens))
    return out


def speculation_mode(header: str | None) -> tuple[str, str]:
    """``(mode, reason)`` from ``x-speculation: on; reason=default; ...``."""
    if not header:
        return "missing", "missing"
    parts = [p.strip() for p in header.split(";")]
    reason = next((p[7:] for p in parts if p.startswith("reason=")), "unknown")
    return parts[0] or "missing", reason


@dataclass
class Summary:
    """Counts over the whole run (this process), logged when the test stops."""

    modes: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    spec: Counter = field(default_factory=Counter)
    late_arrivals: int = 0

    def add(self, header: str | None, usage: dict | None) -> None:
        mode, reason = speculation_mode(header)
        self.modes[mode] += 1
        self.reasons[f"{mode}:{reason}"] += 1
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            self.spec[key] += int(((usage or {}).get("speculation") or {}).get(key) or 0)

    def text(self) -> str:
        drafted, accepted = self.spec["num_draft_tokens"], self.spec["num_accepted_tokens"]
        rate = f"{accepted / drafted:.3f}" if drafted else "n/a"
        lines = [f"speculation modes: {dict(self.modes)}; reasons: {dict(self.reasons)}",
                 f"speculation: requested={SETTINGS.speculation} drafts={self.spec['num_drafts']} "
                 f"draft_tokens={drafted} accepted={accepted} acceptance_rate={rate}"]
        other = {"on": "off", "off": "on"}.get(SETTINGS.speculation)
        if other and self.modes[other]:
            lines.append(f"WARNING: asked for speculation {SETTINGS.speculation}, the server reported "
                         f"{other} for {self.modes[other]} requests (see the reasons)")
        if SETTINGS.rate is not None:
            lines.append(f"poisson arrivals: rate={SETTINGS.rate}/s late arrivals={self.late_arrivals}")
        return "\n".join(lines)


SUMMARY = Summary()
_model_lock = Semaphore()
_model_name: str | None = SETTINGS.model


@events.init.add_listener
def _select_classes_by_tag(environment, **_kwargs) -> None:
    """``-T``/``-E`` select whole user classes (each class's tag is its ``label``).

    Locust's tag filter only removes tasks: a class left with none is still spawned and
    raises "No tasks defined" in a tight loop, so drop those classes here.
    """
    opts = environment.parsed_options
    tags = set(getattr(opts, "tags", None) or [])
    excluded = set(getattr(opts, "exclude_tags", None) or [])
    keep = [u for u in environment.user_classes
            if (not tags or getattr(u, "label", None) in tags) and getattr(u, "label", None) not in excluded]
    if not keep:
        raise ValueError(f"no user class has the tags {sorted(tags)} (minus {sorted(excluded)})")
    environment.user_classes[:] = keep


@events.test_stop.add_listener
def _log_summary(**_kwargs) -> None:
    log.info("specserve load summary\n%s", SUMMARY.text())


def _write_final_csv_rows(writer) -> None:
    """Rewrite the --csv files from the final numbers before Locust closes them.

    Locust refreshes them once a second and never at shutdown (locustio/locust#1806,
    #2299), so the last second, including failures, would be missing from
    ``*_stats.csv`` while the console summary and the exit code have it.
    """
    writer.requests_csv_filehandle.seek(0)
    writer.requests_csv_writer.writerow(writer.requests_csv_columns)
    writer._requests_data_rows(writer.requests_csv_writer)
    writer.requests_csv_filehandle.truncate()
    writer._stats_history_data_rows(writer.stats_history_csv_writer, time.time())
    for kind in ("failures", "exceptions"):
        handle = getattr(writer, f"{kind}_csv_filehandle")
        handle.seek(getattr(writer, f"{kind}_csv_data_start"))
        getattr(writer, f"_{kind}_data_rows")(getattr(writer, f"{kind}_csv_writer"))
        handle.truncate()


def _patch_csv_close() -> None:
    """Make ``StatsCSVFileWriter.close_files`` write the final rows first (see above)."""
    original = StatsCSVFileWriter.close_files
    if getattr(original, "_specserve_final_rows", False):
        return

    def close_files(self) -> None:
        try:
            _write_final_csv_rows(self)
        except (AttributeError, OSError, ValueError) as exc:  # Locust internals changed
            log.warning("could not write the final CSV rows: %s", exc)
        original(self)

    close_files._specserve_final_rows = True
    StatsCSVFileWriter.close_files = close_files


_patch_csv_close()


@functools.cache
def prompt_pool(sets: tuple[str, ...]) -> list[dict]:
    """The prompts of ``sets``, read once per process."""
    return [p for name in sets for p in load_prompts(name)]


class SpecServeUser(HttpUser):
    """A streaming client; subclasses choose the prompts and the output length."""

    abstract = True
    label = "base"
    prompt_sets: tuple[str, ...] = ("chat",)
    max_tokens = 128

    def on_start(self) -> None:
        self.prompts = prompt_pool(self.prompt_sets)
        self.next_prompt = random.randrange(len(self.prompts))  # users spread over the set
        self.next_arrival = time.monotonic()
        if SETTINGS.rate is not None:  # the first arrival is random too, not at spawn
            gevent.sleep(self.wait_time())

    def wait_time(self) -> float:
        """Closed loop: 0. Poisson: until this user's next exponential arrival."""
        if SETTINGS.rate is None:
            return 0.0
        users = getattr(self.environment.runner, "target_user_count", 0) or 1
        self.next_arrival += random.expovariate(SETTINGS.rate / users)
        now = time.monotonic()
        if self.next_arrival < now:  # still busy when it was due: start now, count it
            SUMMARY.late_arrivals += 1
            self.next_arrival = now
        return self.next_arrival - now

    def model(self) -> str | None:
        """SPECSERVE_MODEL, else the first id of GET /v1/models (asked once per process)."""
        global _model_name
        with _model_lock:
            if _model_name is None:
                with self.client.get("/v1/models", catch_response=True,
                                     timeout=(CONNECT_TIMEOUT_S, 30)) as resp:
                    try:
                        _model_name = resp.json()["data"][0]["id"] if resp.status_code == 200 else None
                    except (ValueError, KeyError, IndexError):
                        _model_name = None
                    if _model_name is None:
                        resp.failure(f"GET /v1/models: HTTP {resp.status_code}")
        return _model_name

    def body(self, model: str) -> dict:
        """The request: the next prompt of the pool, streamed with usage."""
        prompt = self.prompts[self.next_prompt % len(self.prompts)]
        self.next_prompt += 1
        max_tokens = min(self.max_tokens, SETTINGS.max_tokens_cap or self.max_tokens)
        body = {"model": model, "messages": prompt["messages"], "max_tokens": max_tokens,
                "temperature": SETTINGS.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if SETTINGS.ignore_eos:
            body["ignore_eos"] = True
        if SPECULATION_BODIES[SETTINGS.speculation] is not None:
            body["speculation"] = SPECULATION_BODIES[SETTINGS.speculation]
        return body

    def stream_one(self) -> None:
        """One streamed request; its outcome on the POST row, its metrics on their rows."""
        model = self.model()
        ok = model is not None and self._post(model)
        if not ok and SETTINGS.rate is None:
            gevent.sleep(FAILURE_PAUSE_S)

    def _post(self, model: str) -> bool:
        start = time.perf_counter()
        with self.client.post(CHAT_PATH, json=self.body(model), stream=True, catch_response=True,
                              timeout=(CONNECT_TIMEOUT_S, SETTINGS.timeout_s)) as resp:
            try:
                reason, result = self._read(resp, start)
            finally:
                if resp.raw is not None:  # None when the connection failed
                    resp.close()
            if reason is not None:
                resp.failure(reason)
                return False
            resp.success()
        for name, value, length in metrics(result):
            self.fire(name, value, length)
        mode, _ = speculation_mode(resp.headers.get("x-speculation"))
        self.fire(f"speculation_{mode}", (result.done_at - start) * 1000.0, 0)
        return True

    def _read(self, resp, start: float) -> tuple[str | None, StreamResult]:
        """Consume the stream within the request's time limit; (failure reason, result)."""
        result = StreamResult(start=start)
        if resp.status_code != 200:
            return _http_failure(resp), result
        remaining = max(0.0, SETTINGS.timeout_s - (time.perf_counter() - start))
        try:
            with gevent.Timeout(remaining, RequestTimeout(f"no [DONE] within {SETTINGS.timeout_s:g} s")):
                read_sse(resp.iter_lines(), result)
        except RequestTimeout as exc:
            return str(exc), result
        except Exception as exc:  # a broken connection or a malformed event: a failure, not a crash
            return f"reading the stream: {type(exc).__name__}: {str(exc)[:120]}", result
        SUMMARY.add(resp.headers.get("x-speculation"), result.usage)
        return result.failure(), result

    def fire(self, name: str, value: float, length: int) -> None:
        """A custom sample: ``value`` goes in Locust's response_time column."""
        self.environment.events.request.fire(
            request_type=self.label, name=name, response_time=value, response_length=length,
            exception=None, context={})


def _http_failure(resp) -> str:
    """A short, stable failure text (Locust groups failures by it)."""
    if resp.status_code == 0:
        return f"connection failed: {type(resp.error).__name__}"
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:120]
    return f"HTTP {resp.status_code}: {message[:160]}"


class ShortOutputUser(SpecServeUser):
    """Short answers (16 tokens): time to first token and prefill dominate."""

    weight = 1
    label = "short"
    prompt_sets = ("chat", "code")
    max_tokens = 16

    @tag("short")
    @task
    def short(self) -> None:
        self.stream_one()


class LongOutputUser(SpecServeUser):
    """Long answers (256 tokens): decode dominates, where speculation pays or costs."""

    weight = 1
    label = "long"
    prompt_sets = ("chat", "code")
    max_tokens = 256

    @tag("long")
    @task
    def long(self) -> None:
        self.stream_one()


class ChatUser(SpecServeUser):
    """Open chat: little to copy from the prompt, so n-gram acceptance is low."""

    weight = 2
    label = "chat"
    prompt_sets = ("chat",)
    max_tokens = 128

    @tag("chat")
    @task
    def chat(self) -> None:
        self.stream_one()


class CodeUser(SpecServeUser):
    """Code generation from a short prompt: the output repeats its own identifiers."""

    weight = 2
    label = "code"
    prompt_sets = ("code",)
    max_tokens = 128

    @tag("code")
    @task
    def code(self) -> None:
        self.stream_one()


class InputRepeatingUser(SpecServeUser):
    """Rewrite / summarize: the answer copies the prompt, where n-gram speculation shines."""

    weight = 2
    label = "repeat"
    prompt_sets = ("rewrite", "summarize")
    max_tokens = 256

    @tag("repeat")
    @task
    def repeat(self) -> None:
        self.stream_one()


class EditUser(SpecServeUser):
    """Code edits that return the whole file, and later turns that revise an earlier answer."""

    weight = 1
    label = "edit"
    prompt_sets = ("code_edit", "revise")
    max_tokens = 256

    @tag("edit")
    @task
    def edit(self) -> None:
        self.stream_one()


class AgentUser(SpecServeUser):
    """Agent loops (tool schemas, earlier calls and results; the next call expected) and
    structured extraction (one JSON object per record)."""

    weight = 1
    label = "agent"
    prompt_sets = ("agent", "extract")
    max_tokens = 128

    @tag("agent")
    @task
    def agent(self) -> None:
        self.stream_one()


class QuoteUser(SpecServeUser):
    """Document QA that answers with quotes from the document in the prompt."""

    weight = 1
    label = "quote"
    prompt_sets = ("doc_qa",)
    max_tokens = 128

    @tag("quote")
    @task
    def quote(self) -> None:
        self.stream_one()
