"""OpenAI ``POST /v1/completions`` (legacy text completions): a raw prompt, no template,
no tools, no reasoning split."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import Comment, Piece, Sampling
from gateway.conversation.generation import new_id
from gateway.conversation.prompts import render_completion
from gateway.conversation.run import Run, sampling_params, text_assembler
from gateway.http.calls import admit, check_model
from gateway.http.sse import comment, sse
from gateway.protocols.openai_format import (
    LogprobFormatter, finish_reason, stream_response, text_completion, usage, usage_chunk,
)
from gateway.protocols.openai_schemas import CompletionRequest, parse

if TYPE_CHECKING:
    from gateway.http.app import ServerState



async def completions(request: Request) -> Response:
    state: "ServerState" = request.app.state.gateway
    call = await admit(state, request, "completions", "completions")
    req = parse(CompletionRequest, call.body)
    call.record.stream = req.stream
    check_model(state, call.tenant, req.model)
    want_lp = req.logprobs is not None
    params = sampling_params(state, call.tenant, Sampling(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, logprobs=want_lp,
        top_logprobs=req.logprobs or 0))
    with call.engine.arrivals.prepare():  # an idle engine may wait for it (scheduler.arrivals)
        prompt = await anyio.to_thread.run_sync(render_completion, state.tokenizer, req,
                                                state.config.checkpoint_every)
        run = Run.submit(state, call, prompt, params,
                         text_assembler(state, list(req.stop or []), False, reasoning=False))
    fmt = LogprobFormatter(state.tokenizer) if want_lp else None
    rid, model = new_id("cmpl"), state.model_id

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        async def chunks() -> AsyncIterator[bytes]:
            offset = 0
            async for ev in run.events():
                if isinstance(ev, Comment):
                    yield comment(ev.text)
                elif isinstance(ev, Piece):
                    lp = fmt.completion_entries(ev.tokens, offset) if fmt and ev.tokens else None
                    if ev.text or lp:
                        yield sse(text_completion(rid, model, ev.text, None, lp, None, created))
                    offset += len(ev.text)
                else:
                    yield sse(text_completion(rid, model, "", finish_reason(ev.reason), None, None, created))
                    if include_usage:
                        yield sse(usage_chunk(rid, model, created, "text_completion", usage(ev.usage)))

        return stream_response(state, chunks())

    result = await run.collect(request)
    if result is None:
        return Response(status_code=499)
    lp = fmt.completion_entries(result.tokens, 0) if fmt else None
    return JSONResponse(text_completion(rid, model, result.text, finish_reason(result.finished.reason),
                                        lp, usage(result.finished.usage)))
