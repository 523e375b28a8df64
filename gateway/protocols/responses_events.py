"""The output of a Responses API answer: :class:`Piece` s in, output items and the
stream's events out.

One :class:`OutputBuilder` serves both the streamed and the whole answer, so their
output items are the same. Items never interleave: the open item is closed (its
``.done`` events) before the next one is added. Item kinds, in the order a model makes
them: ``reasoning`` (the thinking text as one ``reasoning_text`` content part; no
summary is made; with ``encrypted_content`` when the request includes it), ``message``
(one ``output_text`` part), and the calls: ``function_call`` (with its ``namespace``
for a namespace tool's function), ``custom_tool_call`` (its ``input`` the free-form
text, streamed as ``response.custom_tool_call_input`` events once the call is whole) and
``local_shell_call`` (its ``action``). Every event carries ``type`` and an increasing
``sequence_number``.
"""

from __future__ import annotations

import json
import secrets
from typing import Callable, Optional

from gateway.conversation.form import Finished, FunctionTool, Piece


def object_id(prefix: str) -> str:
    """An id of the API's form: ``prefix``, ``_`` and 48 hex digits (e.g. ``resp_...``)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """Turns pieces into output items (:attr:`items`) and the events that build them.

    :meth:`feed` and :meth:`finish` return event dicts (``type``, ``sequence_number``,
    ...) in order; the last item of :attr:`items` is the open one, if any.
    """

    def __init__(self, offered: Optional[dict[str, FunctionTool]] = None,
                 seal: Optional[Callable[[str], str]] = None) -> None:
        """``offered``: the request's tools by the name the model calls them
        (:func:`gateway.conversation.tools.offered_name`); ``seal``: makes a reasoning
        item's ``encrypted_content`` (None: the request did not include it)."""
        self.seq = 0
        self.items: list[dict] = []
        self.kind: Optional[str] = None
        self.text = ""
        self.offered = offered or {}
        self.seal = seal

    def event(self, kind: str, **data) -> dict:
        """The next event of type ``kind`` (numbered)."""
        ev = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return ev

    # ------------------------------------------------------------------ items
    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, item: dict) -> list[dict]:
        out = self.close()
        self.items.append(item)
        self.kind, self.text = item["type"], ""
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if self.kind == "message":
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=_text_part("")))
        elif self.kind == "reasoning":
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open item (if any) with ``status``; returns its closing events."""
        if self.kind is None:
            return []
        item, where, out = self.items[-1], self._where(), []
        if self.kind == "message":
            part = _text_part(self.text)
            out.append(self.event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        elif self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
            if self.seal is not None:
                item["encrypted_content"] = self.seal(self.text)
        elif self.kind == "custom_tool_call":
            item["input"] = custom_input(self.text)
            if item["input"]:
                out.append(self.event("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            out.append(self.event("response.custom_tool_call_input.done", **where, input=item["input"]))
        elif self.kind == "local_shell_call":
            item["action"] = shell_action(self.text)
        else:
            item["arguments"] = self.text
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=self.text))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        self.kind = None
        return out

    # ------------------------------------------------------------------ pieces
    def feed(self, piece: Piece) -> list[dict]:
        """The events of one piece: its reasoning, then its text, then its tool-call pieces."""
        out: list[dict] = []
        if piece.reasoning:
            if self.kind != "reasoning":
                out += self._open({"id": object_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                   "status": "in_progress"})
            self.text += piece.reasoning
            out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                  delta=piece.reasoning))
        if piece.text:
            if self.kind != "message":
                out += self._open({"id": object_id("msg"), "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": []})
            self.text += piece.text
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=piece.text, logprobs=[]))
        for d in piece.tool_calls:
            if d.id is not None:
                out += self._open(self._call_item(d.id, d.name))
            if d.arguments and self.kind in ("function_call", "custom_tool_call", "local_shell_call"):
                self.text += d.arguments
                if self.kind == "function_call":
                    out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=d.arguments))
        return out

    def _call_item(self, call_id: str, name: str) -> dict:
        """The item a call opens, by the kind of tool it calls."""
        tool = self.offered.get(name)
        if tool is not None and tool.kind == "custom":
            return {"id": object_id("ctc"), "type": "custom_tool_call", "call_id": call_id, "name": tool.name,
                    "input": "", "status": "in_progress"}
        if tool is not None and tool.kind == "local_shell":
            return {"id": object_id("lsc"), "type": "local_shell_call", "call_id": call_id, "action": {},
                    "status": "in_progress"}
        item = {"id": object_id("fc"), "type": "function_call", "call_id": call_id,
                "name": tool.name if tool is not None else name, "arguments": "", "status": "in_progress"}
        if tool is not None and tool.namespace:
            item["namespace"] = tool.namespace
        return item

    def finish(self, finished: Finished) -> list[dict]:
        """Close the last item: ``incomplete`` when the answer was cut by length."""
        return self.close("incomplete" if finished.reason == "length" else "completed")


def custom_input(arguments: str) -> str:
    """A custom tool's free-form input from the arguments it was generated as
    (``{"input": "..."}``); the text as it is when it is not that shape."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def shell_action(arguments: str) -> dict:
    """A ``local_shell_call``'s ``action`` from the arguments it was generated as."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = {}
    value = value if isinstance(value, dict) else {}
    command = value.get("command")
    return {"type": "exec", "command": command if isinstance(command, list) else [str(command or "")],
            "env": value.get("env") or {}, "timeout_ms": value.get("timeout_ms"),
            "working_directory": value.get("working_directory"), "user": None}
