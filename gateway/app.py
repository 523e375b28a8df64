"""The Starlette application: OpenAI-compatible routes over one :class:`Engine`."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import ServeConfig
from gateway.errors import APIError
from gateway.generation import Generation, new_id
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_json
from gateway.prompts import Prompt, render_chat, render_completion
from gateway.responses import (
    LogprobFormatter,
    chat_chunk,
    chat_completion,
    text_completion,
    usage,
    usage_chunk,
)
from gateway.schemas import ChatRequest, CompletionRequest, parse
from gateway.streaming import SSEResponse, sse, wait_for_disconnect
from gateway.textout import Delta, TextAssembler
from scheduler import Engine, SamplingParams
from scheduler.request import DoneEvent, ErrorEvent, PromptEvent, TokenEvent

log = logging.getLogger("mlx_gateway.app")


@dataclass
class ServerState:
    """What the routes need; ``engine`` is None until the model has loaded."""

    config: ServeConfig
    registry: CollectorRegistry
    metrics: GatewayMetrics
    model_id: str
    engine: Optional[Engine] = None
    tokenizer: object = None
    context_length: int = 32768
    load_error: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))


# ---------------------------------------------------------------------- helpers
async def read_json(request: Request, limit: int) -> object:
    """The request body as JSON.

    Raises:
        APIError: 413 over ``limit`` bytes, 400 for a body that is not JSON.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over the {limit}-byte limit", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body over the {limit}-byte limit", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")


def _ready(state: ServerState) -> Engine:
    if state.engine is None:
        msg = state.load_error or "the model is still loading"
        raise APIError(503, msg, code="model_not_ready", headers={"Retry-After": "5"})
    if not state.engine.alive:
        raise APIError(503, "the model engine has stopped", code="engine_unavailable")
    return state.engine


def _check_model(state: ServerState, model: Optional[str]) -> None:
    names = {state.model_id, *state.config.served_model_names}
    if model is not None and model not in names:
        raise APIError(404, f"the model '{model}' does not exist; this server serves {sorted(names)}",
                       param="model", code="model_not_found")


def _sampling(state: ServerState, req, max_tokens: Optional[int], logprobs: bool, top: int) -> SamplingParams:
    cfg = state.config
    wanted = max_tokens if max_tokens is not None else cfg.max_tokens
    if wanted > cfg.max_tokens_limit:
        raise APIError(400, f"max_tokens {wanted} is over this server's limit of {cfg.max_tokens_limit}",
                       param="max_tokens")
    top_k = req.top_k if req.top_k is not None else cfg.top_k
    return SamplingParams(
        max_tokens=wanted,
        temperature=req.temperature if req.temperature is not None else cfg.temp,
        top_p=req.top_p if req.top_p is not None else cfg.top_p,
        top_k=max(0, top_k),
        min_p=req.min_p if req.min_p is not None else cfg.min_p,
        seed=req.seed,
        logprobs=logprobs,
        top_logprobs=top,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 0.0,
        logit_bias=tuple((int(k), v) for k, v in (req.logit_bias or {}).items()),
    )


def _fit_context(state: ServerState, prompt: Prompt, params: SamplingParams) -> SamplingParams:
    n = len(prompt.tokens)
    if n >= state.context_length:
        raise APIError(400, f"the prompt has {n} tokens; this model's context is {state.context_length} tokens",
                       param="messages", code="context_length_exceeded")
    room = state.context_length - n
    if params.max_tokens > room:
        params = SamplingParams(**{**params.__dict__, "max_tokens": room})
    return params


@dataclass
class _Outcome:
    """What a finished generation produced (for non-streaming answers and usage)."""

    content: str = ""
    reasoning: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: str = "stop"
    cached: int = 0


async def _drive(state: ServerState, gen: Generation, asm: TextAssembler, prompt_len: int,
                 out: _Outcome) -> AsyncIterator[tuple[Delta, list[TokenEvent]]]:
    """Run ``gen`` to its end, yielding text deltas with their tokens; fills ``out``.

    Raises:
        APIError: the engine failed the request.
    """
    labels = ("default", state.model_id)
    m = state.metrics
    first_at: Optional[float] = None
    try:
        async for ev in gen.events():
            if isinstance(ev, PromptEvent):
                out.cached = ev.cached_tokens
                m.prompt_tokens.labels(*labels).inc(prompt_len)
                m.cached_tokens.labels(*labels).inc(ev.cached_tokens)
            elif isinstance(ev, TokenEvent):
                if first_at is None:
                    first_at = time.monotonic()
                    m.ttft.labels(*labels).observe(first_at - gen.arrival)
                out.tokens.append(ev)
                delta = asm.feed(ev.token)
                if asm.stopped:
                    gen.cancel()
                    out.finish = "stop"
                    yield delta, [ev]
                    break
                yield delta, [ev]
            elif isinstance(ev, DoneEvent):
                if ev.finish_reason in ("stop", "length"):
                    out.finish = ev.finish_reason
                break
            elif isinstance(ev, ErrorEvent):
                raise APIError(ev.status, ev.message)
        tail = asm.finish()
        if tail:
            yield tail, []
    finally:
        gen.cancel()
        now = time.monotonic()
        n = len(out.tokens)
        m.completion_tokens.labels(*labels).inc(n)
        if first_at is not None:
            m.e2e.labels(*labels).observe(now - gen.arrival)
            if n > 1:
                m.tpot.labels(*labels).observe((now - first_at) / (n - 1))


async def _collect(request: Request, body: AsyncIterator[tuple[Delta, list[TokenEvent]]]) -> list[Delta]:
    """Consume ``body`` and return its deltas; stop (and so cancel the generation) if the
    client leaves first.

    Raises:
        APIError: the generation failed.
    """
    parts: list[Delta] = []
    error: list[APIError] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            try:
                async for delta, _ in body:
                    parts.append(delta)
            except APIError as e:
                error.append(e)
            finally:
                with anyio.CancelScope(shield=True):
                    await body.aclose()
            tg.cancel_scope.cancel()

        tg.start_soon(consume)
        await wait_for_disconnect(request.receive)
        tg.cancel_scope.cancel()
    if error:
        raise error[0]
    return parts


def _launch(state: ServerState, engine: Engine, prompt: Prompt, params: SamplingParams,
            asm: TextAssembler, out: _Outcome) -> tuple[Generation, AsyncIterator[tuple[Delta, list[TokenEvent]]]]:
    """Fit ``params`` to the context, submit the request, and return it with its delta stream.

    Raises:
        APIError: 400 for a prompt over the context, 503 when the engine cannot take it.
    """
    params = _fit_context(state, prompt, params)
    gen = Generation(engine, prompt.tokens, params, prompt.checkpoints)
    gen.submit()
    return gen, _drive(state, gen, asm, len(prompt.tokens), out)


def _sse_response(body: AsyncIterator, chunks: AsyncIterator[bytes]) -> SSEResponse:
    """Stream ``chunks`` (built from ``body``); an engine error becomes an SSE error event,
    and the stream always ends with ``data: [DONE]``."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:
            yield sse(e.body())
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
                await body.aclose()
        yield sse("[DONE]")

    return SSEResponse(events())


def _assembler(state: ServerState, stop, opens_reasoning: bool, reasoning: bool = True) -> TextAssembler:
    tok = state.tokenizer
    think = (tok.think_start, tok.think_end) if reasoning and getattr(tok, "has_thinking", False) else None
    return TextAssembler(
        tok, stop=list(stop or []), think=think, in_reasoning=opens_reasoning and think is not None,
        skip_ids=frozenset(tok.eos_token_ids),
    )


async def _start(state: ServerState, request: Request, schema):
    engine = _ready(state)
    req = parse(schema, await read_json(request, state.config.max_body_bytes))
    _check_model(state, req.model)
    return engine, req


# ---------------------------------------------------------------------- routes
async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    engine, req = await _start(state, request, ChatRequest)
    params = _sampling(state, req, req.max_completion_tokens or req.max_tokens, req.logprobs,
                       req.top_logprobs or 0 if req.logprobs else 0)
    prompt = await anyio.to_thread.run_sync(
        render_chat, state.tokenizer, req, state.config.chat_template_args, state.config.checkpoint_every
    )
    asm = _assembler(state, req.stop, prompt.opens_reasoning)
    out = _Outcome()
    gen, body = _launch(state, engine, prompt, params, asm, out)
    fmt = LogprobFormatter(state.tokenizer) if req.logprobs else None
    rid, model, n_prompt = new_id("chatcmpl"), state.model_id, len(prompt.tokens)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        async def chunks() -> AsyncIterator[bytes]:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
            async for delta, toks in body:
                d = {}
                if delta.reasoning:
                    d["reasoning_content"] = delta.reasoning
                if delta.content:
                    d["content"] = delta.content
                lps = [fmt.chat_entry(t) for t in toks] if fmt else None
                if d or lps:
                    yield sse(chat_chunk(rid, model, created, d, None, lps))
            yield sse(chat_chunk(rid, model, created, {}, out.finish))
            if include_usage:
                yield sse(usage_chunk(rid, model, created, "chat.completion.chunk",
                                      usage(n_prompt, len(out.tokens), out.cached)))

        return _sse_response(body, chunks())

    parts = await _collect(request, body)
    if not gen.finished and not out.tokens and not parts:
        return Response(status_code=499)
    content = "".join(d.content for d in parts)
    reasoning = "".join(d.reasoning for d in parts)
    lps = [fmt.chat_entry(t) for t in out.tokens] if fmt else None
    return JSONResponse(chat_completion(rid, model, content, reasoning, out.finish, lps,
                                        usage(n_prompt, len(out.tokens), out.cached)))


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    engine, req = await _start(state, request, CompletionRequest)
    want_lp = req.logprobs is not None
    params = _sampling(state, req, req.max_tokens, want_lp, req.logprobs or 0)
    prompt = await anyio.to_thread.run_sync(
        render_completion, state.tokenizer, req, state.config.checkpoint_every
    )
    asm = _assembler(state, req.stop, False, reasoning=False)  # raw completions: no reasoning split
    out = _Outcome()
    gen, body = _launch(state, engine, prompt, params, asm, out)
    fmt = LogprobFormatter(state.tokenizer) if want_lp else None
    rid, model, n_prompt = new_id("cmpl"), state.model_id, len(prompt.tokens)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        async def chunks() -> AsyncIterator[bytes]:
            offset = 0
            async for delta, toks in body:
                lp = fmt.completion_entries(toks, offset) if fmt and toks else None
                if delta.content or lp:
                    yield sse(text_completion(rid, model, delta.content, None, lp, None, created))
                offset += len(delta.content)
            yield sse(text_completion(rid, model, "", out.finish, None, None, created))
            if include_usage:
                yield sse(usage_chunk(rid, model, created, "text_completion",
                                      usage(n_prompt, len(out.tokens), out.cached)))

        return _sse_response(body, chunks())

    parts = await _collect(request, body)
    lp = fmt.completion_entries(out.tokens, 0) if fmt else None
    return JSONResponse(text_completion(rid, model, "".join(d.content for d in parts), out.finish, lp,
                                        usage(n_prompt, len(out.tokens), out.cached)))


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    names = [state.model_id, *state.config.served_model_names]
    return JSONResponse({
        "object": "list",
        "data": [{"id": n, "object": "model", "created": state.created, "owned_by": "mlx-gateway"} for n in names],
    })


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    if state.engine is None:
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
    if not state.engine.alive:
        return JSONResponse({"status": "dead", "detail": repr(state.engine.error)}, status_code=503)
    return JSONResponse({
        "status": "ok",
        "model": state.model_id,
        "running": state.engine.num_running,
        "waiting": state.engine.num_waiting,
    })


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------- assembly
class ErrorAndMetricsMiddleware:
    """Answers :class:`APIError` (and any other exception, as 500) in OpenAI's format,
    and counts every answer by endpoint and status."""

    ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500, "started": False}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except APIError as e:
            status["code"] = e.status
            if not status["started"]:
                await e.response()(scope, receive, send)
        except Exception as e:
            log.exception("unhandled error on %s", scope.get("path"))
            status["code"] = 500
            if not status["started"]:
                await APIError(500, f"internal error: {type(e).__name__}").response()(scope, receive, send)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in self.ENDPOINTS else "other"
            self.state.metrics.requests.labels("default", self.state.model_id, endpoint,
                                               str(status["code"])).inc()


def create_app(state: ServerState) -> Starlette:
    """The ASGI app serving ``state``."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]

    async def not_found(request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        return APIError(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}").response()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.gateway = state
    app.add_middleware(ErrorAndMetricsMiddleware, state=state)
    return app
