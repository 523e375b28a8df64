"""OpenAI ``POST /v1/chat/completions``: a thin adapter between OpenAI's JSON and the
internal :class:`Conversation` and its events."""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import Comment, Conversation, FunctionTool, Piece, Sampling, ToolCall, Turn
from gateway.conversation.generation import new_id
from gateway.conversation.calls import Front, admit
from gateway.conversation.start import start_conversation
from gateway.http.errors import APIError
from gateway.http.sse import comment, sse
from gateway.protocols.openai_format import (
    LogprobFormatter, chat_chunk, chat_completion, finish_reason, stream_response, usage, usage_chunk,
)
from gateway.protocols.openai_schemas import ChatRequest, parse


def to_conversation(req: ChatRequest) -> Conversation:
    """OpenAI's chat request as the internal form (``developer`` is a system turn)."""
    turns = [Turn(
        role="system" if m.role == "developer" else m.role, text=text, reasoning=m.reasoning_content,
        tool_calls=[ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []],
        tool_call_id=m.tool_call_id, name=m.name, images=images)
        for i, m in enumerate(req.messages) for text, images in [m.text_and_images(i)]]
    tools = [FunctionTool(t.function.name, t.function.description, t.function.parameters, f"tools.{i}.function",
                          strict=t.function.strict is True)
             for i, t in enumerate(req.tools or [])]
    choice, forced = req.tool_choice or "auto", None
    if not isinstance(choice, str):
        choice, forced = "function", choice.function.name
    fmt, schema = req.response_format, None
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs a json_schema object",
                           param="response_format.json_schema")
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
    sampling = Sampling(
        max_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
        ignore_eos=req.ignore_eos)
    strict = fmt is not None and fmt.json_schema is not None and fmt.json_schema.strict is True
    return Conversation(
        turns, sampling, tools, choice, forced, req.parallel_tool_calls is not False, schema,
        "response_format.json_schema.schema", strict, list(req.stop or []), dict(req.chat_template_kwargs or {}),
        req.model, req.stream)


def _tool_call_dicts(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _delta(piece: Piece) -> dict:
    d: dict = {}
    if piece.reasoning:
        d["reasoning_content"] = piece.reasoning
    if piece.text:
        d["content"] = piece.text
    if piece.tool_calls:
        d["tool_calls"] = []
        for t in piece.tool_calls:
            entry: dict = {"index": t.index, "function": {"arguments": t.arguments}}
            if t.id is not None:
                entry.update(id=t.id, type="function")
                entry["function"]["name"] = t.name
            d["tool_calls"].append(entry)
    return d


async def chat_completions(request: Request) -> Response:
    front: Front = request.app.state.front
    call = await admit(front, request, "chat", "chat")
    req = parse(ChatRequest, call.body)
    run = await start_conversation(call, to_conversation(req))
    rid, model = new_id("chatcmpl"), call.model_name

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        async def chunks() -> AsyncIterator[bytes]:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
            fmt = None
            async for ev in run.events():
                if isinstance(ev, Comment):
                    yield comment(ev.text)
                elif isinstance(ev, Piece):
                    d = _delta(ev)
                    if req.logprobs and fmt is None:  # (a stream may start before its model has loaded)
                        fmt = LogprobFormatter(run.model.tokenizer)
                    lps = [fmt.chat_entry(t) for t in ev.tokens] if fmt else None
                    if d or lps:
                        yield sse(chat_chunk(rid, model, created, d, None, lps))
                else:
                    yield sse(chat_chunk(rid, model, created, {}, finish_reason(ev.reason)))
                    if include_usage:
                        yield sse(usage_chunk(rid, model, created, "chat.completion.chunk", usage(ev.usage)))

        return stream_response(front, chunks())

    result = await run.collect(request)
    if result is None:
        return Response(status_code=499)
    lps = [LogprobFormatter(run.model.tokenizer).chat_entry(t) for t in result.tokens] if req.logprobs else None
    return JSONResponse(chat_completion(
        rid, model, result.text, result.reasoning, finish_reason(result.finished.reason), lps,
        usage(result.finished.usage), _tool_call_dicts(result.tool_calls)))

