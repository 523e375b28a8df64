"""Anthropic ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: a thin adapter
between Anthropic's JSON and the internal :class:`Conversation` and its events.

Content blocks come out in Anthropic's shapes: ``thinking`` (reasoning, with an empty
``signature``), ``text`` and ``tool_use`` (ids ``toolu_...``). Streams are Anthropic's
named events (``message_start``, ``ping``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``; ``error`` for a failure once the stream has begun);
prefill progress and keep-alives go out as SSE comments. ``usage`` splits the prompt the
way the prefix cache served it: ``cache_read_input_tokens`` were read from the cache,
``cache_creation_input_tokens`` were stored in it by this request, ``input_tokens`` are
the rest. The ``anthropic-version`` and ``anthropic-beta`` headers are ignored.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, Optional

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import (IMAGE_MARK, ChatResult, Comment, Conversation, Finished, FunctionTool, ImageRef,
                                       Piece, Sampling,
                                       ToolCall, Turn, Usage)
from gateway.conversation.calls import Front, admit
from gateway.conversation.prompts import render_chat
from gateway.conversation.run import start_conversation
from gateway.conversation.tools import check_schema, plan_tools
from gateway.http.errors import APIError
from gateway.http.sse import SSEResponse, comment, guarded, named_event
from gateway.protocols.anthropic_schemas import (CountTokensRequest, MediaBlock, MessageParam, MessagesRequest,
                                                 TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock, parse)
from gateway.models.handle import ModelHandle

STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
                "tool_calls": "tool_use"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def message_id() -> str:
    """An Anthropic-style message id, ``msg_`` and 24 hex digits."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """The ``toolu_`` id of an internal ``call_`` id (other ids are kept as they are)."""
    return "toolu_" + call_id[5:] if call_id.startswith("call_") else call_id


# ---------------------------------------------------------------------- request
def _message_turns(m: MessageParam, i: int, model: Optional[str]) -> tuple[list[Turn], list[float]]:
    """The turns of message ``i``: a user message's tool results become ``tool`` turns,
    followed by its text as a user turn; an assistant message is one turn (its
    ``tool_use`` blocks as calls, its ``thinking`` as reasoning). Blocks with
    ``cache_control`` become breakpoints at their end (a text block's in its turn's text,
    a tool result's at the end of its turn); a breakpoint on a block that has no text of
    its own (a call) is returned, to be placed at the start of the next turn.

    Raises:
        APIError: 400 for a block its role may not hold, or an image or document (the
            model, named, takes none).
    """
    if isinstance(m.content, str):
        return [Turn(m.role, m.content)], []
    turns, text, reasoning, calls, breaks, carry, images = [], [], [], [], [], [], []
    allowed = (TextBlock, ToolResultBlock) if m.role == "user" else (TextBlock, ToolUseBlock, ThinkingBlock)
    for j, b in enumerate(m.content):
        if isinstance(b, MediaBlock):
            if b.type != "image" or m.role != "user":
                raise APIError(400, f"the model '{model}' does not accept {b.type}s: send text only",
                               param=f"messages.{i}.content.{j}")
            text.append(IMAGE_MARK)
            images.append(image_source(b.source, f"messages.{i}.content.{j}"))
            continue
        if isinstance(b, TextBlock):
            text.append(b.text.replace(IMAGE_MARK, ""))
            if b.cache_control is not None:
                breaks.append((len("".join(text)), b.cache_control.seconds))
        elif not isinstance(b, allowed):
            if b.type != "redacted_thinking" or m.role != "assistant":
                raise APIError(400, f"a {m.role} message may not hold {b.type} blocks",
                               param=f"messages.{i}.content.{j}.type")
        elif isinstance(b, ToolResultBlock):
            result = b.text()
            result = f"Error: {result}" if b.is_error else result
            cc = [(len(result), b.cache_control.seconds)] if b.cache_control is not None else []
            turns.append(Turn("tool", result, tool_call_id=b.tool_use_id, breaks=cc))
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False)))
            if b.cache_control is not None:
                carry.append(b.cache_control.seconds)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
    if m.role == "assistant":
        return [Turn("assistant", "".join(text), "".join(reasoning) if reasoning else None, calls, breaks=breaks)], carry
    if text or not turns:
        turns.append(Turn("user", "".join(text), breaks=breaks, images=images))
    return turns, carry


def image_source(source, param: str) -> ImageRef:
    """An image block's ``source``: ``base64`` (``media_type``, ``data``) or ``url``. Any
    other (a ``file`` id, a missing field) gives a reference with neither, refused with a
    400 once the model is known (a text model's 400 says it takes no images)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return ImageRef(param, data=source["data"], media_type=source.get("media_type"))
    if kind == "url" and isinstance(source.get("url"), str):
        return ImageRef(param, url=source["url"])
    return ImageRef(param)


def to_conversation(req: CountTokensRequest) -> Conversation:
    """An Anthropic request as the internal form (a :class:`CountTokensRequest` has no
    sampling settings: the defaults are used). A last ``assistant`` message is a prefill:
    the answer continues it. ``cache_control`` breakpoints (system and message blocks;
    a tool's at the end of the system prompt, where templates render tools) become the
    turns' ``breaks``.

    Raises:
        APIError: 400 for a content block in the wrong role, or an image.
    """
    turns = [Turn("system", s, breaks=req.system_breaks())] if (s := req.system_text()) is not None else []
    tool_ttls = [t.cache_control.seconds for t in req.tools or [] if t.cache_control is not None]
    carry: list[float] = []
    for i, m in enumerate(req.messages):
        new, later = _message_turns(m, i, req.model)
        if carry and new:  # a breakpoint on an earlier call: where the next turn begins
            new[0].breaks.insert(0, (0, max(carry)))
        turns += new
        carry = later
    if tool_ttls:  # a tool's breakpoint: the prompt up to the first message (templates render tools first)
        if turns and turns[0].role == "system":
            turns[0].breaks.append((len(turns[0].text), max(tool_ttls)))
        elif turns:
            turns[0].breaks.insert(0, (0, max(tool_ttls)))
    tools = [FunctionTool(t.name, t.description, t.input_schema, f"tools.{i}", "input_schema")
             for i, t in enumerate(req.tools or [])]
    tc = req.tool_choice
    choice = TOOL_CHOICES[tc.type] if tc is not None else "auto"
    parallel = not (tc is not None and tc.disable_parallel_tool_use)
    schema, schema_param = None, "output_config.format.schema"
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_
    elif req.output_format is not None:
        schema, schema_param = req.output_format.schema_, "output_format.schema"
    kwargs = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    # Anthropic's structured outputs always follow the schema: strict.
    conv = Conversation(turns, Sampling(), tools, choice, tc.name if choice == "function" else None, parallel,
                        schema, schema_param, schema is not None, template_kwargs=kwargs, model=req.model)
    conv.continue_final = req.messages[-1].role == "assistant"
    if req.thinking is not None and req.thinking.type == "enabled":
        conv.thinking_budget = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        conv.sampling = Sampling(
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias)
        conv.stop = [s for s in req.stop_sequences or [] if s]
        conv.stream = req.stream
    return conv


# ---------------------------------------------------------------------- response
def usage(u: Usage, breakpoint: int = 0) -> dict:
    """Anthropic's ``usage``: ``cache_read_input_tokens`` came from the prefix cache,
    ``cache_creation_input_tokens`` are written to it up to the last ``cache_control``
    breakpoint (``breakpoint``, tokens; 0 when there is none), ``input_tokens`` the rest;
    the three sum to the prompt."""
    created = max(0, min(breakpoint, u.prompt) - u.cached)
    return {"input_tokens": u.prompt - u.cached - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": u.cached, "output_tokens": u.completion}


def last_breakpoint(run) -> int:
    """The offset (tokens) of the prompt's last cache breakpoint; 0 when it has none."""
    return max(run.prompt.breakpoints, default=0)


def tool_input(arguments: str) -> dict:
    """A call's arguments text as the ``input`` object ({} when it is not a JSON object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(result: ChatResult) -> list[dict]:
    """The content of a whole answer: thinking, text (when not empty), then tool uses."""
    blocks: list[dict] = []
    if result.reasoning:
        blocks.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text:
        blocks.append({"type": "text", "text": result.text})
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": tool_input(c.arguments)}
               for c in result.tool_calls]
    return blocks


def message(mid: str, model: str, content: list[dict], finished: Optional[Finished], use: dict) -> dict:
    """A ``message`` object (``finished`` None: the start of a stream)."""
    reason = STOP_REASONS.get(finished.reason, "end_turn") if finished is not None else None
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": finished.stop_sequence if finished is not None else None,
            "usage": use}


class BlockStream:
    """Turns :class:`Piece` s into content-block events; one block is open at a time
    (the current one is closed before another opens), indexes count from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: Optional[str] = None

    def open(self, kind: str, block: dict) -> bytes:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                         "content_block": block})

    def delta(self, delta: dict) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": delta})

    def close(self) -> bytes:
        """Close the open block, if any."""
        if self.kind is None:
            return b""
        out = self.delta({"type": "signature_delta", "signature": ""}) if self.kind == "thinking" else b""
        self.kind = None
        return out + named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def feed(self, piece: Piece) -> bytes:
        """The events for one piece: reasoning, then text, then tool-call pieces."""
        out = b""
        if piece.reasoning:
            if self.kind != "thinking":
                out += self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self.delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.text:
            if self.kind != "text":
                out += self.open("text", {"type": "text", "text": ""})
            out += self.delta({"type": "text_delta", "text": piece.text})
        for d in piece.tool_calls:
            if d.id is not None:
                out += self.open("tool_use", {"type": "tool_use", "id": tool_use_id(d.id), "name": d.name,
                                              "input": {}})
            if d.arguments:
                out += self.delta({"type": "input_json_delta", "partial_json": d.arguments})
        return out


# ---------------------------------------------------------------------- routes
async def messages(request: Request) -> Response:
    """``POST /v1/messages``: a message, or its stream of events.

    Raises:
        APIError: 400 for a bad body (Anthropic's error shape, by the middleware), 401,
            403/404 for the model, 413/429/503 when it cannot be queued.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, "messages", "messages")
    req = parse(MessagesRequest, call.body)
    run = await start_conversation(call, to_conversation(req))
    mid, model = message_id(), call.model_name

    if req.stream:

        async def events() -> AsyncIterator[bytes]:
            blocks, started = BlockStream(), False
            async for ev in run.events():
                if isinstance(ev, Comment):
                    yield comment(ev.text)
                    continue
                if not started:  # after the prompt event: the cache read is known
                    started = True
                    u = Usage(len(run.prompt.tokens), 0, run.cached)
                    yield named_event("message_start", {"type": "message_start", "message": message(
                        mid, model, [], None, usage(u, last_breakpoint(run)))}) + named_event("ping", {"type": "ping"})
                if isinstance(ev, Piece):
                    out = blocks.feed(ev)
                    if out:
                        yield out
                else:
                    yield blocks.close() + named_event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": STOP_REASONS.get(ev.reason, "end_turn"),
                                  "stop_sequence": ev.stop_sequence},
                        "usage": usage(ev.usage, last_breakpoint(run))}) + named_event("message_stop",
                                                                                      {"type": "message_stop"})

        return SSEResponse(guarded(events(), lambda e: named_event("error", e.anthropic_body())),
                           send_timeout=front.config.client_timeout)

    result = await run.collect(request)
    if result is None:
        return Response(status_code=499)
    return JSONResponse(message(mid, model, content_blocks(result), result.finished,
                                usage(result.finished.usage, last_breakpoint(run))))


def _count(model: ModelHandle, conv: Conversation) -> int:
    """Prompt tokens of ``conv`` with the model's chat template (worker thread)."""
    plan = plan_tools(conv, model.tokenizer)
    if conv.output_schema is not None:
        check_schema(conv.output_schema, conv.output_param)
    spec = model.spec
    return len(render_chat(model.tokenizer, conv, spec.chat_template_args, spec.checkpoint_every, plan).tokens)


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt a
    ``/v1/messages`` request with this body would have (nothing is generated).

    Raises:
        APIError: 400 for a bad body or conversation, 401, 403/404 for the model, 429.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, "count_tokens", "messages")
    conv = to_conversation(parse(CountTokensRequest, call.body))
    model = await call.model(conv.model)
    n = await anyio.to_thread.run_sync(_count, model, conv)
    return JSONResponse({"input_tokens": n})
