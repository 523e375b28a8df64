"""Anthropic Messages answers: the ``message`` object, its content blocks and ``usage``,
and the stream's content-block events, from the internal :class:`Piece` s and results.

Content blocks come out in Anthropic's shapes: ``thinking`` (reasoning, with an empty
``signature``), ``text`` and ``tool_use`` (ids ``toolu_...``). ``usage`` splits the prompt
the way the prefix cache served it: ``cache_read_input_tokens`` were read from the cache,
``cache_creation_input_tokens`` were stored in it by this request, ``input_tokens`` are
the rest.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from gateway.conversation.form import ChatResult, Finished, Piece, Usage
from gateway.http.sse import named_event

STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
                "tool_calls": "tool_use"}


def message_id() -> str:
    """An Anthropic-style message id, ``msg_`` and 24 hex digits."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """The ``toolu_`` id of an internal ``call_`` id (other ids are kept as they are)."""
    return "toolu_" + call_id[5:] if call_id.startswith("call_") else call_id


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


def message(mid: str, model: str, content: list[dict], finished: Optional[Finished], use: dict,
            edits: Optional[list[dict]] = None) -> dict:
    """A ``message`` object (``finished`` None: the start of a stream); ``edits``, when the
    request asked for context management, are the ``applied_edits`` reported."""
    reason = STOP_REASONS.get(finished.reason, "end_turn") if finished is not None else None
    out = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": reason, "stop_sequence": finished.stop_sequence if finished is not None else None,
           "usage": use}
    if edits is not None:
        out["context_management"] = {"applied_edits": edits}
    return out


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
