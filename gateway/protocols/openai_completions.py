"""OpenAI ``POST /v1/completions`` (legacy text completions): a raw prompt, no template,
no tools, no reasoning split."""

from __future__ import annotations

import time
from typing import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import Comment, Piece, Sampling
from gateway.conversation.generation import new_id
from gateway.conversation.prompts import render_completion
from gateway.conversation.calls import Front, admit
from gateway.conversation.prepare import sampling_params, text_assembler
from gateway.conversation.run import Run
from gateway.conversation.start import begin
from gateway.http.sse import comment, sse
from gateway.protocols.openai_format import (
    LogprobFormatter, finish_reason, stream_response, text_completion, usage, usage_chunk,
)
from gateway.models.handle import ModelHandle
from gateway.protocols.openai_schemas import CompletionRequest, parse


async def completions(request: Request) -> Response:
    front: Front = request.app.state.front
    call = await admit(front, request, "completions", "completions")
    req = parse(CompletionRequest, call.body)
    call.record.stream = req.stream
    want_lp = req.logprobs is not None
    sampling = Sampling(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, logprobs=want_lp,
        top_logprobs=req.logprobs or 0, ignore_eos=req.ignore_eos)

    async def start(model: ModelHandle) -> Run:
        params = sampling_params(model, call.tenant, sampling)
        with model.engine.arrivals.prepare(call.rank):  # the engine may wait for it
            prompt = await anyio.to_thread.run_sync(render_completion, model.tokenizer, req.prompt,
                                                    model.spec.checkpoint_every)
            return Run.submit(call, model, prompt, params,
                              text_assembler(model, list(req.stop or []), False, reasoning=False))

    run = await begin(call, req.model, req.stream, start)
    rid, model = new_id("cmpl"), call.model_name

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        async def chunks() -> AsyncIterator[bytes]:
            offset, fmt = 0, None
            async for ev in run.events():
                if isinstance(ev, Comment):
                    yield comment(ev.text)
                elif isinstance(ev, Piece):
                    if want_lp and fmt is None:  # (a stream may start before its model has loaded)
                        fmt = LogprobFormatter(run.model.tokenizer)
                    lp = fmt.completion_entries(ev.tokens, offset) if fmt and ev.tokens else None
                    if ev.text or lp:
                        yield sse(text_completion(rid, model, ev.text, None, lp, None, created))
                    offset += len(ev.text)
                else:
                    yield sse(text_completion(rid, model, "", finish_reason(ev.reason), None, None, created))
                    if include_usage:
                        yield sse(usage_chunk(rid, model, created, "text_completion", usage(ev.usage)))

        return stream_response(front, chunks())

    result = await run.collect(request)
    if result is None:
        return Response(status_code=499)
    lp = LogprobFormatter(run.model.tokenizer).completion_entries(result.tokens, 0) if want_lp else None
    return JSONResponse(text_completion(rid, model, result.text, finish_reason(result.finished.reason),
                                        lp, usage(result.finished.usage)))
