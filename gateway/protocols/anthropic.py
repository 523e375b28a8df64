"""Anthropic ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: a thin adapter
between Anthropic's JSON and the internal :class:`Conversation` and its events.

Answers are built by :mod:`gateway.protocols.anthropic_events`. Streams are Anthropic's
named events (``message_start``, ``ping``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``; ``error`` for a failure once the stream has begun);
prefill progress and keep-alives go out as SSE comments. The ``anthropic-version`` and
``anthropic-beta`` headers are ignored.
"""

from __future__ import annotations

import json
from typing import Optional

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import (IMAGE_MARK, ChatResult, Conversation, Finished, ImageRef, Piece, Sampling,
                                       ToolCall, Turn, Usage)
from gateway.conversation.prepare import render_conversation
from gateway.conversation.run import Run
from gateway.conversation.schemas import check_schema
from gateway.conversation.start import converse, hold, ready
from gateway.conversation.tools import omitted_tools_header, plan_tools
from gateway.front import Call, admit
from gateway.http.errors import APIError
from gateway.http.sse import named_event
from gateway.protocols.anthropic_events import (STOP_REASONS, BlockStream, content_blocks, last_breakpoint, message,
                                                message_id, usage)
from gateway.protocols.anthropic_schemas import (CountTokensRequest, DroppedBlock, MediaBlock, MessageParam,
                                                 MessagesRequest, RedactedThinkingBlock, SearchResultBlock,
                                                 ServerToolResultBlock, ServerToolUseBlock, TextBlock, ThinkingBlock,
                                                 Tool, ToolReferenceBlock, ToolResultBlock, ToolUseBlock, parse)
from gateway.protocols.anthropic_tools import EFFORT_BUDGETS, context_edits, loaded_tool_text, split_tools
from gateway.protocols.respond import Format, respond
from gateway.models.handle import ModelHandle

TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


# ---------------------------------------------------------------------- request
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-request block: never part of the prompt


def _result(b: ToolResultBlock, tools: dict[str, Tool], model: Optional[str], where: str
            ) -> tuple[str, list[ImageRef]]:
    """A tool result's text and images: its text and search results, the definition of each
    tool it loads (``tool_reference``) where it loads it, and its images (Claude Code's Read
    of a picture) where they stand, each an ``IMAGE_MARK`` (a text model refuses them once
    it is known, as it refuses a user's).

    Raises:
        APIError: 400 for a document (the model, named, takes none).
    """
    if isinstance(b.content, str):
        return b.content, []
    parts, images = [], []
    for k, part in enumerate(b.content):
        if isinstance(part, MediaBlock):
            if part.type != "image":
                raise APIError(400, f"the model '{model}' does not accept {part.type}s: send text only",
                               param=f"{where}.content.{k}")
            parts.append(IMAGE_MARK)
            images.append(image_source(part.source, f"{where}.content.{k}"))
        elif isinstance(part, ToolReferenceBlock):
            parts.append(loaded_tool_text(tools.get(part.tool_name), part.tool_name))
        else:
            parts.append((part.text if isinstance(part, TextBlock) else part.text()).replace(IMAGE_MARK, ""))
    joiner = "\n" if any(isinstance(p, ToolReferenceBlock) for p in b.content) else ""
    return joiner.join(parts), images


def _message_turns(m: MessageParam, i: int, model: Optional[str], tools: dict[str, Tool]
                   ) -> tuple[list[Turn], list[float]]:
    """The turns of message ``i``: a user message's tool results become ``tool`` turns,
    followed by its text as a user turn; an assistant message is one turn (its
    ``tool_use`` and server tool blocks as calls, its ``thinking`` as reasoning; the
    results of server tools come after it as tool turns); a ``system`` message is a
    system turn where it stands. Blocks with ``cache_control`` become breakpoints at
    their end (a text block's in its turn's text, a tool result's at the end of its
    turn); a breakpoint on a block that has no text of its own (a call) is returned, to
    be placed at the start of the next turn.

    Raises:
        APIError: 400 for a block its role may not hold, a document, or an image outside a
            user message or a tool result (images are refused later, with the model named,
            when it takes none).
    """
    if isinstance(m.content, str):
        return [Turn(m.role, m.content)] if not _is_billing(m.role, m.content) else [], []
    turns, text, reasoning, calls, breaks, carry, after, images = [], [], [], [], [], [], [], []
    allowed = {"user": (TextBlock, ToolResultBlock, SearchResultBlock, DroppedBlock),
               "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock, ServerToolUseBlock,
                             ServerToolResultBlock, DroppedBlock),
               "system": (TextBlock,)}[m.role]
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(b, MediaBlock):
            if b.type != "image" or m.role != "user":
                raise APIError(400, f"the model '{model}' does not accept {b.type}s: send text only", param=where)
            text.append(IMAGE_MARK)
            images.append(image_source(b.source, where))
            continue
        if not isinstance(b, allowed):
            raise APIError(400, f"a {m.role} message may not hold {b.type} blocks", param=f"{where}.type")
        if isinstance(b, (TextBlock, SearchResultBlock)):
            if isinstance(b, TextBlock) and _is_billing(m.role, b.text):
                continue
            text.append((b.text if isinstance(b, TextBlock) else b.text()).replace(IMAGE_MARK, ""))
            if b.cache_control is not None:
                breaks.append((len("".join(text)), b.cache_control.seconds))
        elif isinstance(b, ToolResultBlock):
            result, pictures = _result(b, tools, model, where)
            result = f"Error: {result}" if b.is_error else result
            cc = [(len(result), b.cache_control.seconds)] if b.cache_control is not None else []
            turns.append(Turn("tool", result, tool_call_id=b.tool_use_id, breaks=cc, images=pictures))
        elif isinstance(b, (ToolUseBlock, ServerToolUseBlock)):
            calls.append(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False)))
            if b.cache_control is not None:
                carry.append(b.cache_control.seconds)
        elif isinstance(b, ServerToolResultBlock):
            after.append(Turn("tool", json.dumps(b.content, ensure_ascii=False), tool_call_id=b.tool_use_id))
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
    if m.role == "assistant":
        turn = Turn("assistant", "".join(text), "".join(reasoning) if reasoning else None, calls, breaks=breaks)
        return [turn] + after, carry
    if m.role == "system":
        return ([Turn("system", "".join(text), breaks=breaks)] if text else []), carry
    if text or not turns:
        turns.append(Turn("user", "".join(text), breaks=breaks, images=images))
    return turns, carry


def _is_billing(role: str, text: str) -> bool:
    """Claude Code's billing block (``x-anthropic-billing-header: cc_version=...;``), which
    several versions change on every request: left out, so the prompt's prefix stays."""
    return role == "system" and text.lstrip().startswith(BILLING_HEADER)


def system_turn(req: CountTokensRequest) -> Optional[Turn]:
    """The ``system`` parameter as a turn (its blocks joined, the billing block left out,
    ``cache_control`` breakpoints kept), or None."""
    if req.system is None:
        return None
    if isinstance(req.system, str):
        return None if _is_billing("system", req.system) else Turn("system", req.system)
    text, breaks = "", []
    for b in req.system:
        if _is_billing("system", b.text):
            continue
        text += b.text
        if b.cache_control is not None:
            breaks.append((len(text), b.cache_control.seconds))
    return Turn("system", text, breaks=breaks) if text or breaks else None


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


def to_conversation(req: CountTokensRequest) -> tuple[Conversation, list[str]]:
    """An Anthropic request as the internal form (a :class:`CountTokensRequest` has no
    sampling settings: the defaults are used), and the server tools left out of it. A
    last ``assistant`` message is a prefill: the answer continues it. ``cache_control``
    breakpoints (system and message blocks; a tool's at the end of the system prompt,
    where templates render tools) become the turns' ``breaks``. ``output_config.effort``
    sets the thinking budget (:data:`EFFORT_BUDGETS`) when thinking is on without one;
    ``context_management`` edits are applied when the prompt is rendered.

    Raises:
        APIError: 400 for a content block in the wrong role, an image, or a
            ``tool_choice`` that forces a server tool.
    """
    by_name = {t.name: t for t in req.tools or []}
    first = system_turn(req)
    turns = [first] if first is not None else []
    tool_ttls = [t.cache_control.seconds for t in req.tools or [] if t.cache_control is not None]
    carry: list[float] = []
    for i, m in enumerate(req.messages):
        new, later = _message_turns(m, i, req.model, by_name)
        if carry and new:  # a breakpoint on an earlier call: where the next turn begins
            new[0].breaks.insert(0, (0, max(carry)))
        turns += new
        carry = later
    if tool_ttls:  # a tool's breakpoint: the prompt up to the first message (templates render tools first)
        if turns and turns[0].role == "system":
            turns[0].breaks.append((len(turns[0].text), max(tool_ttls)))
        elif turns:
            turns[0].breaks.insert(0, (0, max(tool_ttls)))
    tools, omitted = split_tools(req.tools or [])
    tc = req.tool_choice
    choice = TOOL_CHOICES[tc.type] if tc is not None else "auto"
    if choice == "function" and tc.name in omitted:
        raise APIError(400, f"tool_choice forces '{tc.name}', a server tool this gateway does not run",
                       param="tool_choice.name")
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
    effort = req.output_config.effort if req.output_config is not None else None
    if req.thinking is not None and req.thinking.type == "enabled":
        conv.thinking_budget = req.thinking.budget_tokens
    elif effort is not None and (req.thinking is None or req.thinking.type != "disabled"):
        conv.thinking_budget = EFFORT_BUDGETS.get(effort.lower())
    conv.edits = context_edits(req.context_management)
    if isinstance(req, MessagesRequest):
        conv.sampling = Sampling(
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias, ignore_eos=req.ignore_eos)
        conv.stop = [s for s in req.stop_sequences or [] if s]
        conv.stream = req.stream
    return conv, omitted


# ---------------------------------------------------------------------- routes
class MessageFormat(Format):
    """A message, or its stream of events (:class:`gateway.protocols.respond.Format`);
    ``message_start`` comes with the first piece, once the prompt's cache read is known."""

    def __init__(self, req: MessagesRequest, call: Call, omitted: list[str]):
        self.req, self.stream, self.call, self.headers = req, req.stream, call, omitted_tools_header(omitted)
        self.mid, self.blocks, self.started = message_id(), BlockStream(), False

    def _edits(self, run: Run) -> Optional[list[dict]]:
        return run.prompt.applied_edits if self.req.context_management is not None else None

    def _start(self, run: Run) -> bytes:
        if self.started:
            return b""
        self.started = True
        u = Usage(len(run.prompt.tokens), 0, run.cached)
        return named_event("message_start", {"type": "message_start", "message": message(
            self.mid, self.call.model_name, [], None, usage(u, last_breakpoint(run)))}) + named_event(
            "ping", {"type": "ping"})

    def piece(self, run: Run, piece: Piece) -> bytes:
        return self._start(run) + self.blocks.feed(piece)

    async def finish(self, run: Run, ev: Finished) -> bytes:
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": STOP_REASONS.get(ev.reason, "end_turn"), "stop_sequence": ev.stop_sequence},
                 "usage": usage(ev.usage, last_breakpoint(run))}
        if self._edits(run) is not None:
            delta["context_management"] = {"applied_edits": self._edits(run)}
        return self._start(run) + self.blocks.close() + named_event("message_delta", delta) + named_event(
            "message_stop", {"type": "message_stop"})

    def error(self, e: APIError) -> bytes:
        return named_event("error", e.anthropic_body())

    async def whole(self, run: Run, result: ChatResult) -> dict:
        return message(self.mid, self.call.model_name, content_blocks(result), result.finished,
                       usage(result.finished.usage, last_breakpoint(run)), self._edits(run))


async def messages(request: Request) -> Response:
    """``POST /v1/messages``: a message, or its stream of events.

    Raises:
        APIError: 400 for a bad body (Anthropic's error shape, by the middleware), 401,
            403/404 for the model, 413/429/503 when it cannot be queued.
    """
    call = await admit(request.app.state.front, request, "messages", "messages")
    req = parse(MessagesRequest, call.body)
    conv, omitted = to_conversation(req)
    return await respond(request, converse(call, conv), MessageFormat(req, call, omitted))


def _count(model: ModelHandle, conv: Conversation) -> int:
    """Prompt tokens of ``conv`` as ``/v1/messages`` would render it, context edits
    applied (worker thread)."""
    plan = plan_tools(conv, model.tokenizer)
    if conv.output_schema is not None:
        check_schema(conv.output_schema, conv.output_param)
    return len(render_conversation(model, conv, plan).tokens)


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt a
    ``/v1/messages`` request with this body would have (nothing is generated).

    Raises:
        APIError: 400 for a bad body or conversation, 401, 403/404 for the model, 429.
    """
    call = await admit(request.app.state.front, request, "count_tokens", "messages")
    conv, _ = to_conversation(parse(CountTokensRequest, call.body))
    model = await ready(hold(call, conv.model))
    n = await anyio.to_thread.run_sync(_count, model, conv)
    return JSONResponse({"input_tokens": n})
