"""OpenAIIngress: the OpenAI-compatible HTTP API (FastAPI under Serve).

Everything a request can get wrong is checked here, before it reaches a unit: the model
name, the JSON and its types, the bounds, the chat messages, and whether the prompt plus the
requested output fits the context. Errors are OpenAI-shaped
(``{"error": {"message", "type", "code", "param"}}``); a full unit answers 429 with
``Retry-After``. Every response carries ``x-speculation: on|off; reason=...``.

An error body helps and leaks nothing. A 4xx names what was wrong (``param`` is the field). A
5xx says in one sentence what happened and gives the request id; the detail (a unit's
exception arrives wrapped by Ray, whose text is the remote traceback with pids, actor ids and
host paths) goes to the server log under that id. Nothing, not even a bug, answers with a
traceback or a plain-text "Internal Server Error".

In front of that, per request: the API key (:mod:`specserve.serve.guard`; ``/health`` is
always open, ``/metrics`` optionally closed), whether the app is draining (503 with
``Retry-After``; ``/health`` says ``draining``), the key's request rate and requests in
flight (429 with ``Retry-After``), the body size (413) and, after tokenizing, the prompt
length. A request that runs past ``limits.request_timeout_s`` is cancelled, which frees its
slot, and ends with a 504 (in-band once a stream has started). Prompts and outputs are not
logged unless ``limits.log_request_content`` says so.

The app runs one ingress replica, so the per-key limits and the drain state are exact.

Here: the routes and the checks. Around them: the FastAPI app, its exception handlers, the
request id and the body limit (:mod:`.http_app`), the errors and what maps to them
(:mod:`.api_errors`), the unit's stream under the deadline, collected or sent as SSE
(:mod:`.streaming`), and OpenAI's response bodies (:mod:`.openai_shapes`).
"""

# No `from __future__ import annotations` here: FastAPI must see the real ``Request`` type
# on the class-based routes, not a string it cannot resolve.
import logging
import time
import weakref

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from specserve.app_config import AppConfig
from specserve.config import penalized
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.request import EngineRequest, RequestLimits, check_request
from specserve.engine.tokenizer import encode_chat, encode_prompt
from specserve.errors import ContextLengthExceeded, InvalidRequestError
from specserve.serve.api_errors import (
    ERROR_RESPONSES,
    RETRY_AFTER_S,
    APIError,
    from_unparsable,
    from_validation_errors,
)
from specserve.serve.direct_http import DirectHTTP
from specserve.serve.guard import Guard, Lease, Refusal
from specserve.serve.http_app import app, openapi_document, read_body, request_id
from specserve.serve.local_unit import HostsUnit, LocalUnit
from specserve.serve.metrics import exposition, get_hub, initialize_request_metrics, unpacked
from specserve.serve.openai_shapes import (
    TokenIdNames,
    echoed,
    logprobs_object,
    prompt_logprobs_object,
    response_body,
)
from specserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from specserve.serve.streaming import UnitReply, end_request
from specserve.serve.tools import ToolPlan, render_messages
from specserve.serve.unit_messages import UnitRequest

log = logging.getLogger(__name__)


def class_key(req, chat: bool, key_id: str, prompt_len: int) -> str:
    """The request's acceptance class for the router: route / API key / OpenAI's ``user`` /
    ``speculation.traffic_class`` / shape. ``user`` is whatever a client sends: without the
    key, one tenant could drag another's class below break-even and so switch its speculation
    off. The shape separates traffic of one route whose acceptance differs: the prompt's
    length (under 128, 512, 2048 tokens, or more), for chat whether the conversation carries
    earlier answers (a later turn often revises or quotes them), and whether a penalty pushes
    repeats down (what n-gram and suffix drafts are: bench-sampling measured n-gram's
    acceptance 0.55 -> 0.16). (Only ``user`` may contain ``|``, so the key stays unambiguous.)"""
    cls = req.speculation.traffic_class if req.speculation else None
    size = next((f"p<{n}" for n in (128, 512, 2048) if prompt_len < n), "p>=2048")
    turns = "multi" if chat and any(m.role == "assistant" for m in req.messages) else "single"
    shape = f"{size},{turns}" + (",penalized" if penalized(req) else "")
    return f"{'chat' if chat else 'completions'}|{key_id}|{req.user or ''}|{cls or ''}|{shape}"


# Helpers above this line (or imported): @serve.ingress serializes the app when the class is
# decorated, so functions defined after the class would be missing in the replica.
@serve.ingress(app)
class OpenAIIngress(HostsUnit):
    def __init__(self, unit, config: dict) -> None:
        """``unit``: the units' deployment handle, or None where the one unit runs in this
        process (``unit_in_ingress``: built here, called the same way)."""
        self.cfg = AppConfig.model_validate(config)
        # The metrics hub first: its actor's process starts while the model loads. Asked for
        # after, it would still be starting as the first requests arrive, its imports taking
        # the CPU from their forwards on a small machine (a second of CPU on 2 cores). A unit
        # here needs none: a scrape reads it (serve/metrics.py).
        self.app_name = serve.get_replica_context().app_name
        self.hub = None if unit is None else get_hub(self.app_name)
        self.local = None
        if unit is None:
            self.local = unit = LocalUnit(self.cfg.unit.model_dump())
        self.unit = unit if self.local else unit.options(stream=True)
        self.unit_calls = unit
        target = self.cfg.unit.engine.target
        src = resolve(target.source, target.cache_dir)
        self.tokenizer = load_tokenizer(src)
        self.model_name = self.cfg.served_model_name or src.name
        self.max_model_len = self.cfg.unit.engine.max_model_len
        self.created = int(time.time())
        self.limits = self.cfg.limits
        self.guard = Guard(self.cfg.auth, self.limits)  # no keys while auth is on: fails here
        if self.guard.keys is None:
            log.warning("specserve: authentication is OFF (auth.enabled: false): anyone who can "
                        "reach this port can use the API")
        self.draining = False
        self.request_limits = RequestLimits(len(self.tokenizer), self.max_model_len,
                                            self.cfg.unit.engine.max_num_seqs)
        self.openapi_doc = openapi_document(self.model_name)
        initialize_request_metrics()
        if self.cfg.direct_http is not None:  # the same app, from this process's own server
            async def asgi(scope, receive, send) -> None:
                await self.app(scope, receive, send)  # (Serve's wrapper sets it after this)

            self.direct = DirectHTTP(asgi, self.cfg.direct_http.host, self.cfg.direct_http.port)

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """Always open. 200 while serving; 503 ``draining`` once a drain has begun."""
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": RETRY_AFTER_S})
        return JSONResponse({"status": "ok"})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> dict:
        """The OpenAPI document: request bodies from the pydantic models, ``model`` fixed to the
        served one, every error status with the OpenAI error object."""
        return self.openapi_doc

    @app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def models(self, request: Request) -> dict:
        self._authenticate(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "specserve",
                                            "max_model_len": self.max_model_len}]}

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus exposition: this ingress's request metrics and every unit's numbers."""
        from prometheus_client import CONTENT_TYPE_LATEST

        if self.cfg.auth.protect_metrics:
            self._authenticate(request)
        if self.local is not None:
            return PlainTextResponse(exposition(self.local.metrics()), media_type=CONTENT_TYPE_LATEST)
        try:
            units = unpacked(await self.hub.snapshot.remote())
        except Exception:  # noqa: BLE001  the hub was lost: start a new one, units re-report
            log.warning("metrics hub unavailable; recreating it", exc_info=True)
            self.hub, units = get_hub(self.app_name), {}
        return PlainTextResponse(exposition(units), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/units/stats", responses={401: ERROR_RESPONSES[401]})
    async def unit_stats(self, request: Request) -> dict:
        """One unit's live numbers (running, waiting, free slots, draft state)."""
        self._authenticate(request)
        return await self.unit_calls.stats.remote()

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(self, request: Request) -> Response:
        rid = request_id(request, "cmpl-")
        lease = self._admit(request)
        try:
            req = await self._parse(request, CompletionRequest)
            prompt = req.prompt
            if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):  # a batch of one
                prompt = prompt[0]
            ids = self._truncated(req, list(prompt) if isinstance(prompt, list) else
                                  encode_prompt(self.tokenizer, prompt, req.add_special_tokens is not False))
            echo = None
            if req.echo:
                whole = isinstance(prompt, str) and req.truncate_prompt_tokens is None
                echo = (prompt if whole else self.tokenizer.decode(ids), ids)
            return await self._run(req, ids, lease, rid, chat=False, echo=echo)
        finally:
            lease.release()  # no-op once a stream owns it

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(self, request: Request) -> Response:
        rid = request_id(request, "chatcmpl-")
        lease = self._admit(request)
        try:
            req = await self._parse(request, ChatCompletionRequest)
            plan = req.tool_plan()
            ids = self._truncated(req, self._chat_ids(req, req.tools if plan else None))
            return await self._run(req, ids, lease, rid, chat=True, tools=plan)
        finally:
            lease.release()

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(self, request: Request) -> dict:
        """vLLM's: a prompt, or chat messages, to the token ids the generation routes run."""
        self._authenticate(request)
        req = await self._parse(request, TokenizeRequest)
        if req.prompt is not None:
            ids = encode_prompt(self.tokenizer, req.prompt, req.add_special_tokens is not False)
        else:
            ids = self._chat_ids(req, req.tools)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(self, request: Request) -> dict:
        """vLLM's: token ids to text, special tokens included."""
        self._authenticate(request)
        req = await self._parse(request, DetokenizeRequest)
        vocab = len(self.tokenizer)
        if req.tokens and max(req.tokens) >= vocab:
            raise APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # -- lifecycle (Serve handle calls) -------------------------------------------------------
    def drain(self) -> dict:
        """Stop taking generation requests (503 with Retry-After; /health says draining) and
        let the ones in flight finish. Returns :meth:`drain_status`."""
        if not self.draining:
            log.info("draining: %d request(s) in flight", self.guard.requests_in_flight)
        self.draining = True
        return self.drain_status()

    def drain_status(self) -> dict:
        return {"draining": self.draining, "in_flight": self.guard.requests_in_flight}

    # -- shared path --------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> str:
        kid = self.guard.authenticate(request.headers.get("authorization"))
        if isinstance(kid, Refusal):
            raise APIError.refused(kid)
        return kid

    def _admit(self, request: Request) -> Lease:
        """Key, drain state, then the key's rate and requests in flight; a lease or an error."""
        kid = self._authenticate(request)
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica or shortly",
                           "service_unavailable", "draining")
        lease = self.guard.admit(kid)
        if isinstance(lease, Refusal):
            raise APIError.refused(lease)
        return lease

    async def _parse(self, request: Request, model):
        body = await read_body(request, self.limits.max_request_bytes)
        try:
            req = model.model_validate_json(body)
        except ValidationError as exc:
            if exc.errors()[0]["type"] in ("json_invalid", "json_type"):
                raise from_unparsable(body, exc.errors()) from exc
            raise from_validation_errors(exc.errors()) from exc
        if req.model is not None and req.model != self.model_name:  # (optional on /tokenize)
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                                f"'{self.model_name}'", code="model_not_found", param="model")
        refused = req.refusal()
        if refused is not None:
            raise APIError(400, refused[0], param=refused[1])
        return req

    def _chat_ids(self, req, tools: list | None) -> list[int]:
        """A chat request's messages (with ``tools``' signatures where given) rendered by the
        chat template with the request's options, as token ids; the template's refusal a 400."""
        tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        messages = render_messages([m.model_dump(exclude_none=True) for m in req.messages], tools)
        try:
            return encode_chat(self.tokenizer, messages, **req.template_options(),
                               add_special_tokens=bool(req.add_special_tokens))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    def _truncated(self, req, ids: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: the context's
        length; an empty prompt, k = 0, is check_request's to refuse)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.max_model_len if k == -1 else k
        return ids[len(ids) - k:] if k < len(ids) else ids

    def _max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str) -> int:
        """The server's own caps (``limits.max_prompt_tokens``, ``max_tokens_cap``), OpenAI's
        refusal of a ``max_tokens`` past the context, and the default ``max_tokens``; a prompt
        that fills the context is :func:`check_request`'s to refuse.
        ``prompt_param``: the field holding the prompt (chat: messages; completions: prompt)."""
        cap = self.limits.max_prompt_tokens
        if cap is not None and prompt_len > cap:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                                f"{cap} (limits.max_prompt_tokens)", code="context_length_exceeded",
                           param=prompt_param)
        room = self.max_model_len - prompt_len  # (none left: check_request refuses the prompt)
        if requested is None:
            return min(max(room, 1), self.cfg.max_tokens_cap)
        if requested > self.cfg.max_tokens_cap:
            raise APIError(400, f"max_tokens: at most {self.cfg.max_tokens_cap}", param="max_tokens")
        if 0 < room < requested:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} "
                                f"tokens; you requested {prompt_len + requested} ({prompt_len} in "
                                f"the prompt, {requested} for the completion)",
                           code="context_length_exceeded", param="max_tokens")
        return requested

    def _engine_request(self, req, prompt_ids: list[int], chat: bool) -> EngineRequest:
        """The request as the engine runs it, checked here once (:func:`check_request`); its
        grammar is the API field's, compiled in the unit (where its masks are filled)."""
        prompt_param = "messages" if chat else "prompt"
        requested = req.requested_max_tokens if chat else req.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt_ids), prompt_param)
        try:
            asked = req.grammar()
        except InvalidRequestError as exc:
            field = req.grammar_fields()[0]
            raise APIError(400, f"{field}: {exc}", param=field) from None
        spec, field = asked or (None, "response_format")
        try:
            return check_request(prompt_ids, req.sampling_params(max_tokens), self.request_limits,
                                 n=req.n, grammar=spec, grammar_param=field)
        except InvalidRequestError as exc:
            param = prompt_param if exc.param == "prompt" else exc.param
            code = exc.code if isinstance(exc, ContextLengthExceeded) else None
            raise APIError(400, str(exc), code=code, param=param) from None

    async def _run(self, req, prompt_ids: list[int], lease: Lease, rid: str, *,
                   chat: bool, echo: tuple[str, list[int]] | None = None,
                   tools: ToolPlan | None = None) -> Response:
        """``echo``: the prompt's text and ids, returned before the output (completions);
        ``tools``: the chat request's tools, whose calls are parsed out of each reply."""
        deadline = time.monotonic() + self.limits.request_timeout_s
        served = self.cfg.unit.engine.speculative.method
        asked = req.speculation.method if req.speculation else None
        if asked is not None and asked != served:
            raise APIError(400, f"speculation.method '{asked}' is not served here; this deployment "
                                f"runs '{served}'", param="speculation.method")
        payload = UnitRequest(self._engine_request(req, prompt_ids, chat), speculation=req.speculation,
                              stream=req.stream, token_ids=req.return_token_ids,
                              class_key=class_key(req, chat, lease.key_id, len(prompt_ids)))
        if self.limits.log_request_content:
            log.info("request %s (%s): prompt %r", rid, lease.key_id, req.model_dump().get(
                "messages" if chat else "prompt"))
        stream = self.unit.generate.remote(payload)
        reply = UnitReply(stream, deadline, self.limits, rid=rid, chat=chat, n=req.n)
        start = await reply.start()
        headers = {"x-speculation": start.decision.header()}
        names = TokenIdNames() if req.return_tokens_as_token_ids else self.tokenizer  # logprobs' tokens
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            every = include_usage and req.stream_options.continuous_usage_stats  # (vLLM: both)
            lease = lease.hand_over()
            body = reply.sse(names, self.model_name, lease, include_usage, echo, tools,
                             usage_so_far=len(prompt_ids) if every else None,
                             prompt_ids=prompt_ids if req.return_token_ids else None)
            # A client gone before the body starts never runs the generator's ``finally``:
            # free the slot and the lease when the generator is dropped.
            weakref.finalize(body, end_request, stream, lease)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        finals, usage = await reply.collect()
        choices = []
        for chunk in finals:
            prefix, items = echoed(echo, chunk.prompt_logprobs, chunk.logprobs, req.num_logprobs)
            text, calls = prefix + chunk.text, []
            if tools is not None:
                text, calls = tools.parse(text)
            scored = None if req.prompt_logprobs is None else prompt_logprobs_object(
                self.tokenizer, prompt_ids, chunk.prompt_logprobs or [], req.prompt_logprobs)
            choices.append({"text": text, "finish": "tool_calls" if calls else chunk.finish_reason,
                            "logprobs": logprobs_object(names, items, chat),
                            "tool_calls": calls, "prompt_logprobs": scored, "token_ids": chunk.token_ids})
        return JSONResponse(response_body(rid, self.model_name, chat, choices, usage,
                                          prompt_ids if req.return_token_ids else None), headers=headers)
