"""Tool calls read out of a model's output as it streams, as OpenAI tool-call deltas.

Free output (``tool_choice`` ``auto``): text that may start a call is held back, and a
call is released whole (a delta with its id and name, then one with its arguments)
once its end tag (tagged format) or the end of the output (json format) has arrived and
it parses with mlx-lm's parser; text that turns out not to be a call is released as
content. Clients never see half a call that later fails to parse.

Constrained output (``required`` or a named function): the grammar guarantees the
shape ``{"name":"F","arguments":{...}}`` (compact, name first), so the id and name go
out as soon as the name is complete and the arguments stream as they are generated.

The non-streamed answer is built by the same class from the whole text, so a stream's
deltas assembled always equal it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from gateway.conversation.textout import holdback
from gateway.conversation.form import ToolCall, ToolCallDelta
from gateway.conversation.tools import ToolPlan


def new_call_id() -> str:
    """An OpenAI-style tool call id, ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: Any, arguments: Any) -> Optional[ToolCall]:
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        return None
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), name, arguments)


def _json_calls(text: str, names: list[str]) -> Optional[list[ToolCall]]:
    """Calls from a bare JSON text (an object or an array of them), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        call = _call(item["name"], item.get("arguments", item.get("parameters")))
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _tagged_calls(body: str, plan: ToolPlan) -> Optional[list[ToolCall]]:
    """Calls from the text between a start and an end tag, by mlx-lm's parser, or None."""
    try:
        parsed = plan.format.parser(body, plan.tools)
    except Exception:
        return None
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        call = _call(item.get("name"), item.get("arguments")) if isinstance(item, dict) else None
        if call is None or call.name not in plan.names:
            return None
        calls.append(call)
    return calls or None


def whole_call_deltas(calls: list[ToolCall], first_index: int) -> list[ToolCallDelta]:
    """Deltas for complete calls: one each, with its id, name and all its arguments."""
    return [ToolCallDelta(i, call.arguments, call.id, call.name) for i, call in enumerate(calls, first_index)]


def merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """``deltas`` with consecutive pieces of one call joined, so that one piece of output
    carries at most one delta per call index (OpenAI's streams never carry two entries
    of one index in a chunk, and clients that merge per chunk break on it)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1]
            out[-1] = ToolCallDelta(d.index, last.arguments + d.arguments, last.id or d.id, last.name or d.name)
        else:
            out.append(d)
    return out


class ToolCallStream:
    """Splits one request's content text into content and tool-call deltas.

    :meth:`feed` and :meth:`finish` return ``(content, deltas)``: text to release and
    :class:`ToolCallDelta` pieces (a call's first piece has its id and name, later ones
    add to its arguments). :attr:`calls` holds the calls so far.
    """

    _HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,256})","arguments":')

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False
        self._is_text = False
        self._blank = ""
        self._constrained = plan.choice in ("required", "function")
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add content text; returns what can be released now (at most one delta per call)."""
        self._buf += text
        if self._constrained:
            return "", merged(self._scan_constrained())
        if self.plan.format.kind == "json":
            return self._feed_json(), []
        return self._feed_tagged(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: release what is held back (at most one delta per call)."""
        if self._constrained:
            return "", merged(self._scan_constrained())
        if self.plan.format.kind == "json":
            text, self._buf = self._buf, ""
            calls = _json_calls(text.strip(), self.plan.names) if text.strip() else None
            if not calls:
                return text, []
            return "", self._add(calls)
        out, deltas = self._feed_tagged(final=True)
        out, self._blank = out + ("" if self.calls else self._blank), ""
        return out, deltas

    def _add(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        first = len(self.calls)
        self.calls += calls
        return whole_call_deltas(calls, first)

    # ------------------------------------------------------------------ constrained
    def _scan_constrained(self) -> list[ToolCallDelta]:
        """Stream calls of the grammar's shape: separators and tags between calls are
        skipped, the name is sent once complete, the arguments as they come."""
        deltas = []
        while self._buf:
            if not self._in_call:
                m = self._HEAD.search(self._buf)
                if m is None:
                    break
                call = ToolCall(new_call_id(), m.group(1), "")
                self.calls.append(call)
                deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, call.name))
                self._buf = self._buf[m.end():]
                self._in_call, self._depth = True, 0
            end = self._arguments_end()
            piece = self._buf if end is None else self._buf[:end]
            self._buf = "" if end is None else self._buf[end:]
            if piece:
                self.calls[-1].arguments += piece
                deltas.append(ToolCallDelta(len(self.calls) - 1, piece))
            if end is not None:
                self._in_call = False
        return deltas

    def _arguments_end(self) -> Optional[int]:
        """Where the arguments value ends in the buffer (exclusive), or None if it goes on.
        Tracks strings, escapes and nesting across calls."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    # ------------------------------------------------------------------ free output
    def _feed_json(self) -> str:
        """A json-format call is the whole output: hold everything once the output
        starts with ``{`` or ``[``."""
        if not self._is_text:
            stripped = self._buf.lstrip()
            if self._in_call or (stripped and stripped[0] in "{["):
                self._in_call = True
                return ""
            if not stripped:
                return ""
            self._is_text = True
        text, self._buf = self._buf, ""
        return text

    def _feed_tagged(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        start, end = self.plan.format.start, self.plan.format.end
        out, deltas = "", []
        while self._buf:
            if not self._in_call:
                i = self._buf.find(start)
                if i < 0:
                    keep = 0 if final else holdback(self._buf, [start])
                    out += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out += self._buf[:i]
                self._buf = self._buf[i:]
                self._in_call = True
            j = self._buf.find(end, len(start)) if end else -1
            if j < 0 and not final:
                break
            raw = self._buf if j < 0 else self._buf[: j + len(end)]
            self._buf = "" if j < 0 else self._buf[j + len(end):]
            self._in_call = False
            calls = _tagged_calls(raw[len(start): len(raw) - (len(end) if j >= 0 else 0)], self.plan)
            if calls:
                deltas += self._add(calls)
            else:
                out += raw
        # Blank text around calls (the newlines between blocks) is layout, not content.
        if not out.strip():
            out, self._blank = "", self._blank + out
        else:
            out, self._blank = self._blank + out, ""
        return out, deltas
