"""OpenAI ``POST /v1/chat/completions``: a thin adapter between OpenAI's JSON and the
internal :class:`Conversation` and its events."""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from gateway.conversation.form import ChatResult, Conversation, Finished, FunctionTool, Piece, Sampling, ToolCall, Turn
from gateway.conversation.run import Run
from gateway.conversation.start import converse
from gateway.front import admit
from gateway.http.errors import APIError
from gateway.http.sse import HOLE, sse, text_events
from gateway.protocols.openai_format import (LogprobFormatter, OpenAIFormat, chat_chunk, chat_completion, finish_reason,
                                             usage, usage_chunk)
from gateway.protocols.openai_schemas import ChatRequest, parse
from gateway.protocols.respond import respond


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
    sampling = Sampling(max_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature,
                        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, logprobs=req.logprobs,
                        top_logprobs=req.top_logprobs or 0, ignore_eos=req.ignore_eos)
    strict = fmt is not None and fmt.json_schema is not None and fmt.json_schema.strict is True
    return Conversation(turns, sampling, tools, choice, forced, req.parallel_tool_calls is not False, schema,
                        "response_format.json_schema.schema", strict, list(req.stop or []),
                        dict(req.chat_template_kwargs or {}), req.model, req.stream)


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


class ChatFormat(OpenAIFormat):
    """Chat completions' answer: ``chat.completion`` or its chunks."""

    _content_chunk = None  # text -> a chunk of that content alone, made at the first

    def opening(self) -> bytes:
        return sse(chat_chunk(self.rid, self.call.model_name, self.created, {"role": "assistant", "content": ""}))

    def _logprobs(self, run: Run, tokens: list) -> Optional[list]:
        if self.req.logprobs and self.logprobs is None:
            self.logprobs = LogprobFormatter(run.model.tokenizer)
        return [self.logprobs.chat_entry(t) for t in tokens] if self.req.logprobs else None

    def piece(self, run: Run, piece: Piece) -> bytes:
        d, lps = _delta(piece), self._logprobs(run, piece.tokens)
        if not lps and len(d) == 1 and "content" in d:  # the common chunk: content alone
            if self._content_chunk is None:
                self._content_chunk = text_events(chat_chunk(self.rid, self.call.model_name, self.created,
                                                             {"content": HOLE}))
            return self._content_chunk(d["content"])
        return sse(chat_chunk(self.rid, self.call.model_name, self.created, d, None, lps)) if d or lps else b""

    async def finish(self, run: Run, ev: Finished) -> bytes:
        model = self.call.model_name
        out = sse(chat_chunk(self.rid, model, self.created, {}, finish_reason(ev.reason)))
        if self.req.stream_options and self.req.stream_options.include_usage:
            out += sse(usage_chunk(self.rid, model, self.created, "chat.completion.chunk", usage(ev.usage)))
        return out

    async def whole(self, run: Run, result: ChatResult) -> dict:
        return chat_completion(self.rid, self.call.model_name, result.text, result.reasoning,
                               finish_reason(result.finished.reason), self._logprobs(run, result.tokens),
                               usage(result.finished.usage), _tool_call_dicts(result.tool_calls))


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``: admitted, parsed, answered (:func:`converse`, :func:`respond`)."""
    call = await admit(request.app.state.front, request, "chat", "chat")
    req = parse(ChatRequest, call.body)
    return await respond(request, converse(call, to_conversation(req)), ChatFormat(req, call, "chatcmpl"))
