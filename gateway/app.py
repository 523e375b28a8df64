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
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import authenticate, authenticate_admin, identify
from gateway.config import ServeConfig
from gateway.errors import APIError
from gateway.generation import Generation, KeepAlive, new_id
from gateway.limits import Limiter, Ticket
from gateway.metrics import GatewayMetrics, prime
from gateway.middleware import GatewayMiddleware
from gateway.openapi import openapi_json
from gateway.request_log import RequestRecord
from gateway.tenants import Tenant, TenantTable, open_table
from gateway.usage import UsageBook
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
from gateway.structured import output_mask
from gateway.tool_stream import ToolCallStream
from gateway.tools import ToolPlan, plan_tools
from gateway.streaming import SSEResponse, comment, sse, wait_for_disconnect
from gateway.textout import Delta, TextAssembler
from scheduler import Engine, SamplingParams
from scheduler.grammar import Grammars, TokenMask
from scheduler.request import DoneEvent, ErrorEvent, ProgressEvent, PromptEvent, TokenEvent

log = logging.getLogger("mlx_gateway.app")


@dataclass
class ServerState:
    """What the routes need; ``engine`` is None until the model has loaded.

    ``tenants`` is replaced as a whole on reload (SIGHUP); requests in flight keep the
    :class:`Tenant` they started with.
    """

    config: ServeConfig
    registry: CollectorRegistry
    metrics: GatewayMetrics
    model_id: str
    tenants: TenantTable = field(default_factory=lambda: open_table(loopback=True))
    engine: Optional[Engine] = None
    tokenizer: object = None
    context_length: int = 32768
    vocab_size: int = 0
    grammars: Optional[Grammars] = None
    load_error: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))
    usage: UsageBook = field(default_factory=UsageBook)
    limiter: Limiter = field(default_factory=Limiter)

    def __post_init__(self) -> None:
        self.limiter.on_limited = lambda tenant, limit: self.metrics.rate_limited.labels(tenant, limit).inc()

    def set_tenants(self, table: TenantTable) -> None:
        """Use ``table`` from now on, apply its cache-group quotas and create its metric series."""
        self.tenants = table
        self.prime_metrics()
        if self.engine is not None:
            self.engine.prompt_cache.set_quotas(table.quotas())

    def prime_metrics(self) -> None:
        """Create the configured tenants' and cache groups' series at 0 (see :func:`prime`)."""
        tenants = self.tenants.all()
        prime(self.metrics, [t.name for t in tenants], self.model_id)
        if self.engine is not None:
            self.engine.prime_metrics([t.name for t in tenants], {t.cache_group for t in tenants})


# ---------------------------------------------------------------------- helpers
async def read_json(request: Request, limit: int, timeout: float, max_depth: int) -> object:
    """The request body as JSON.

    Args:
        limit: largest body, bytes.
        timeout: seconds the client has to send the whole body.
        max_depth: deepest nesting of arrays and objects allowed.

    Raises:
        APIError: 413 over ``limit`` bytes, 408 when the body takes over ``timeout``
            seconds, 400 for a body that is not JSON or is nested too deeply.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over the {limit}-byte limit", code="request_too_large")
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body over the {limit}-byte limit", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout")
    try:
        value = json.loads(b"".join(chunks))
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {max_depth} levels")
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")
    if _depth(value) > max_depth:
        raise APIError(400, f"the request body is nested deeper than {max_depth} levels")
    return value


def _depth(value: object) -> int:
    """Nesting depth of arrays and objects in a parsed JSON value (a scalar is 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _ready(state: ServerState) -> Engine:
    if state.engine is None:
        msg = state.load_error or "the model is still loading"
        raise APIError(503, msg, code="model_not_ready", headers={"Retry-After": "5"})
    if not state.engine.alive:
        raise APIError(503, "the model engine has stopped", code="engine_unavailable")
    return state.engine


def _model_names(state: ServerState, tenant: Tenant) -> list[str]:
    return [n for n in (state.model_id, *state.config.served_model_names) if tenant.may_use(n)]


def _check_model(state: ServerState, tenant: Tenant, model: Optional[str]) -> None:
    names = {state.model_id, *state.config.served_model_names}
    if model is not None and model not in names:
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    if not tenant.may_use(model or state.model_id):
        raise APIError(403, f"this key may not use the model '{model or state.model_id}'",
                       param="model", code="model_not_allowed")


def _sampling(state: ServerState, tenant: Tenant, req, max_tokens: Optional[int], logprobs: bool,
              top: int) -> SamplingParams:
    cfg = state.config
    limit = min(cfg.max_tokens_limit, tenant.max_tokens or cfg.max_tokens_limit)
    wanted = max_tokens if max_tokens is not None else min(cfg.max_tokens, limit)
    if wanted > limit:
        raise APIError(400, f"max_tokens {wanted} is over this key's limit of {limit}", param="max_tokens")
    top_k = req.top_k if req.top_k is not None else cfg.top_k
    if top_k >= state.vocab_size:
        top_k = 0  # keeping every token is no filter (and mlx-lm refuses k >= vocabulary)
    bias = req.logit_bias or {}
    for k in bias:
        if int(k) >= state.vocab_size:
            raise APIError(400, f"logit_bias token id {k} is outside the vocabulary (size {state.vocab_size})",
                           param="logit_bias")
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
        logit_bias=tuple((int(k), v) for k, v in bias.items()),
    )


def _fit_context(state: ServerState, prompt: Prompt, params: SamplingParams) -> SamplingParams:
    n = len(prompt.tokens)
    cap = state.config.max_prompt_tokens
    if cap is not None and n > cap:
        raise APIError(400, f"the prompt has {n} tokens; this server's limit is {cap} tokens",
                       param="messages", code="context_length_exceeded")
    if n >= state.context_length:
        raise APIError(400, f"the prompt has {n} tokens; this model's context is {state.context_length} tokens",
                       param="messages", code="context_length_exceeded")
    room = state.context_length - n
    if params.max_tokens > room:
        params = SamplingParams(**{**params.__dict__, "max_tokens": room})
    return params


@dataclass
class _Outcome:
    """One call: who made it, and what its generation produced (for answers, usage,
    metrics and the request log)."""

    tenant: Tenant
    ticket: Ticket
    record: RequestRecord
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: str = "stop"
    cached: int = 0


async def _drive(state: ServerState, gen: Generation, asm: TextAssembler, prompt_len: int,
                 out: _Outcome) -> AsyncIterator[tuple[Optional[Delta], object]]:
    """Run ``gen`` to its end, yielding ``(delta, tokens)`` pairs of text and the tokens
    behind it, and ``(None, comment)`` for SSE comments (prefill progress, keep-alive);
    fills ``out``.

    Raises:
        APIError: the engine failed the request.
    """
    tenant = out.tenant.name
    labels = (tenant, state.model_id)
    m = state.metrics
    rec = out.record
    first_at: Optional[float] = None
    try:
        async for ev in gen.events(keepalive=state.config.sse_keepalive):
            if isinstance(ev, KeepAlive):
                yield None, "keep-alive"
            elif isinstance(ev, ProgressEvent):
                yield None, f"prefill {ev.done}/{ev.total}"
            elif isinstance(ev, PromptEvent):
                out.cached = ev.cached_tokens
                rec.queue_seconds = time.monotonic() - gen.arrival
                rec.cached_tokens = ev.cached_tokens
                m.prompt_tokens.labels(*labels).inc(prompt_len)
                m.cached_tokens.labels(*labels).inc(ev.cached_tokens)
                state.usage.add(tenant, prompt=prompt_len, cached=ev.cached_tokens)
            elif isinstance(ev, TokenEvent):
                if first_at is None:
                    first_at = time.monotonic()
                    rec.ttft_seconds = first_at - gen.arrival
                    m.ttft.labels(*labels).observe(first_at - gen.arrival)
                out.tokens.append(ev)
                out.ticket.charge_completion(1)
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
        rec.completion_tokens = n
        rec.finish_reason = out.finish if gen.finished else "cancelled"
        m.completion_tokens.labels(*labels).inc(n)
        state.usage.add(tenant, completion=n)
        if first_at is not None:
            m.e2e.labels(*labels).observe(now - gen.arrival)
            if n > 1:
                m.tpot.labels(*labels).observe((now - first_at) / (n - 1))


async def _collect(request: Request, body: AsyncIterator[tuple[Optional[Delta], object]]) -> list[Delta]:
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
                    if delta is not None:
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
            asm: TextAssembler, out: _Outcome, mask: Optional[TokenMask] = None,
            ) -> tuple[Generation, AsyncIterator[tuple[Optional[Delta], object]]]:
    """Check the prompt against the limits, submit the request, and return it with its
    delta stream.

    Raises:
        APIError: 400 for a prompt over the context or the prompt limit, 413/429 from
            the tenant's prompt-token limit, 429 when the tenant's queue is full, 503
            when the engine cannot take it.
    """
    params = _fit_context(state, prompt, params)
    out.ticket.charge_prompt(len(prompt.tokens))
    t = out.tenant
    gen = Generation(engine, prompt.tokens, params, prompt.checkpoints, namespace=t.cache_group,
                     tenant=t.name, weight=t.weight, max_queued=t.max_queued, mask=mask)
    out.record.request_id = gen.id
    out.record.prompt_tokens = len(prompt.tokens)
    if state.config.log_prompts:
        out.record.prompt = state.tokenizer.decode(prompt.tokens)
    try:
        gen.submit()
    except APIError as e:
        if e.status == 429:
            state.metrics.rate_limited.labels(t.name, "queue").inc()
        raise
    return gen, _drive(state, gen, asm, len(prompt.tokens), out)


def _sse_response(state: ServerState, body: AsyncIterator, chunks: AsyncIterator[bytes]) -> SSEResponse:
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

    return SSEResponse(events(), send_timeout=state.config.client_timeout)


def _assembler(state: ServerState, stop, opens_reasoning: bool, reasoning: bool = True) -> TextAssembler:
    tok = state.tokenizer
    think = (tok.think_start, tok.think_end) if reasoning and getattr(tok, "has_thinking", False) else None
    return TextAssembler(
        tok, stop=list(stop or []), think=think, in_reasoning=opens_reasoning and think is not None,
        skip_ids=frozenset(tok.eos_token_ids),
    )


async def _start(state: ServerState, request: Request, schema, endpoint: str):
    """Authenticate, admit against the tenant's limits, parse and check the body.

    Returns:
        (engine, parsed request, outcome holding the tenant, its ticket and the record).

    Raises:
        APIError: 401, 429, 503, 408, 413, 400, 404 or 403, in the order checked.
    """
    record = RequestRecord(model=state.model_id, endpoint=endpoint)
    request.state.record = record  # logged by the middleware whatever the outcome
    tenant = authenticate(state.tenants, request)
    record.tenant = tenant.name
    engine = _ready(state)
    ticket = state.limiter.begin(tenant)
    request.state.ticket = ticket
    state.usage.add(tenant.name, requests=1)
    cfg = state.config
    req = parse(schema, await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth))
    record.stream = bool(req.stream)
    _check_model(state, tenant, req.model)
    return engine, req, _Outcome(tenant, ticket, record)


# ---------------------------------------------------------------------- routes
def _prepare_chat(state: ServerState, req: ChatRequest) -> tuple[Prompt, Optional[ToolPlan], Optional[TokenMask]]:
    """Tools, prompt and output grammar of a chat request (worker thread: template,
    tokenizer and grammar compilation are CPU work that must not stall the event loop).

    Raises:
        APIError: 400 for bad tools, schemas or a conversation the template rejects.
    """
    plan = plan_tools(req, state.tokenizer)
    mask = output_mask(state.grammars, req.response_format, plan)
    cfg = state.config
    prompt = render_chat(state.tokenizer, req, cfg.chat_template_args, cfg.checkpoint_every, plan)
    return prompt, plan, mask


def _chat_finish(out: _Outcome, calls: list[dict]) -> str:
    return "tool_calls" if calls and out.finish == "stop" else out.finish


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    engine, req, out = await _start(state, request, ChatRequest, "chat")
    params = _sampling(state, out.tenant, req, req.max_completion_tokens or req.max_tokens, req.logprobs,
                       req.top_logprobs or 0 if req.logprobs else 0)
    prompt, plan, mask = await anyio.to_thread.run_sync(_prepare_chat, state, req)
    asm = _assembler(state, req.stop, prompt.opens_reasoning)
    gen, body = _launch(state, engine, prompt, params, asm, out, mask)
    fmt = LogprobFormatter(state.tokenizer) if req.logprobs else None
    rid, model, n_prompt = new_id("chatcmpl"), state.model_id, len(prompt.tokens)
    calls = ToolCallStream(plan) if plan is not None and plan.parses else None

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def content_chunks(text: str, deltas: list[dict]) -> list[bytes]:
            chunks = [sse(chat_chunk(rid, model, created, {"content": text}))] if text else []
            return chunks + [sse(chat_chunk(rid, model, created, {"tool_calls": [d]})) for d in deltas]

        async def chunks() -> AsyncIterator[bytes]:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
            async for delta, toks in body:
                if delta is None:
                    yield comment(toks)
                    continue
                d = {}
                if delta.reasoning:
                    d["reasoning_content"] = delta.reasoning
                content = delta.content
                if calls is not None and content:
                    content, deltas = calls.feed(content)
                    for chunk in content_chunks("", deltas):
                        yield chunk
                if content:
                    d["content"] = content
                lps = [fmt.chat_entry(t) for t in toks] if fmt else None
                if d or lps:
                    yield sse(chat_chunk(rid, model, created, d, None, lps))
            if calls is not None:
                for chunk in content_chunks(*calls.finish()):
                    yield chunk
            yield sse(chat_chunk(rid, model, created, {}, _chat_finish(out, calls.calls if calls else [])))
            if include_usage:
                yield sse(usage_chunk(rid, model, created, "chat.completion.chunk",
                                      usage(n_prompt, len(out.tokens), out.cached)))

        return _sse_response(state, body, chunks())

    parts = await _collect(request, body)
    if not gen.finished and not out.tokens and not parts:
        return Response(status_code=499)
    content = "".join(d.content for d in parts)
    reasoning = "".join(d.reasoning for d in parts)
    found: list[dict] = []
    if calls is not None:
        content = calls.feed(content)[0] + calls.finish()[0]
        found = calls.calls
    lps = [fmt.chat_entry(t) for t in out.tokens] if fmt else None
    return JSONResponse(chat_completion(rid, model, content, reasoning, _chat_finish(out, found), lps,
                                        usage(n_prompt, len(out.tokens), out.cached), found))


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    engine, req, out = await _start(state, request, CompletionRequest, "completions")
    want_lp = req.logprobs is not None
    params = _sampling(state, out.tenant, req, req.max_tokens, want_lp, req.logprobs or 0)
    prompt = await anyio.to_thread.run_sync(
        render_completion, state.tokenizer, req, state.config.checkpoint_every
    )
    asm = _assembler(state, req.stop, False, reasoning=False)  # raw completions: no reasoning split
    gen, body = _launch(state, engine, prompt, params, asm, out)
    fmt = LogprobFormatter(state.tokenizer) if want_lp else None
    rid, model, n_prompt = new_id("cmpl"), state.model_id, len(prompt.tokens)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        async def chunks() -> AsyncIterator[bytes]:
            offset = 0
            async for delta, toks in body:
                if delta is None:
                    yield comment(toks)
                    continue
                lp = fmt.completion_entries(toks, offset) if fmt and toks else None
                if delta.content or lp:
                    yield sse(text_completion(rid, model, delta.content, None, lp, None, created))
                offset += len(delta.content)
            yield sse(text_completion(rid, model, "", out.finish, None, None, created))
            if include_usage:
                yield sse(usage_chunk(rid, model, created, "text_completion",
                                      usage(n_prompt, len(out.tokens), out.cached)))

        return _sse_response(state, body, chunks())

    parts = await _collect(request, body)
    lp = fmt.completion_entries(out.tokens, 0) if fmt else None
    return JSONResponse(text_completion(rid, model, "".join(d.content for d in parts), out.finish, lp,
                                        usage(n_prompt, len(out.tokens), out.cached)))


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.gateway
    tenant = authenticate(state.tenants, request)
    return JSONResponse({
        "object": "list",
        "data": [{"id": n, "object": "model", "created": state.created, "owned_by": "mlx-gateway"}
                 for n in _model_names(state, tenant)],
    })


async def usage_report(request: Request) -> Response:
    """``GET /v1/usage``: the calling tenant's usage; an admin key sees every tenant."""
    state: ServerState = request.app.state.gateway
    tenant, admin = identify(state.tenants, request)
    if not admin:
        return JSONResponse(state.usage.report(tenant.name))
    return JSONResponse({"object": "list", "data": [state.usage.report(t.name) for t in state.tenants.all()]})


async def flush_cache(request: Request) -> Response:
    """``POST /admin/cache/flush`` with an optional body ``{"cache_group": NAME}``
    (absent or null: every group). Leased snapshots stay."""
    state: ServerState = request.app.state.gateway
    authenticate_admin(state.tenants, request)
    engine = _ready(state)
    cfg = state.config
    body = await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth) \
        if request.headers.get("content-length", "0") != "0" else {}
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    group = body.get("cache_group")
    if group is not None and not isinstance(group, str):
        raise APIError(400, "cache_group must be a string", param="cache_group")
    dropped = await anyio.to_thread.run_sync(engine.prompt_cache.flush, group)
    return JSONResponse({"object": "cache.flush", "cache_group": group, "dropped_snapshots": dropped})


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
def create_app(state: ServerState) -> Starlette:
    """The ASGI app serving ``state``: routes inside :class:`GatewayMiddleware`, inside
    CORS (``config.allowed_origins``; ``chrome-extension://ID`` and
    ``moz-extension://ID`` origins are matched like any other)."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/usage", usage_report, methods=["GET"]),
        Route("/admin/cache/flush", flush_cache, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]

    async def not_found(request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        return APIError(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}").response()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.gateway = state
    app.add_middleware(GatewayMiddleware, state=state)
    if state.config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                            "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                            "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"],
            max_age=600,
        )
    return app
