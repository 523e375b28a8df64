"""The output of a Responses API answer: :class:`Piece` s in, output items and the
stream's events out.

One :class:`OutputBuilder` serves both the streamed and the whole answer, so their
output items are the same. Items never interleave: the open item is closed (its
``.done`` events) before the next one is added. Item kinds, in the order a model makes
them: ``reasoning`` (the thinking text as one ``reasoning_text`` content part; no
summary is made), ``message`` (one ``output_text`` part) and ``function_call``.
Every event carries ``type`` and an increasing ``sequence_number``.
"""

from __future__ import annotations

import secrets
from typing import Optional

from gateway.conversation.form import Finished, Piece


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

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []
        self.kind: Optional[str] = None
        self.text = ""

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
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=_text_part("")))
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
            out.append(self.event("response.output_text.done", **where, content_index=0, text=self.text,
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        elif self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
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
                out += self._open({"id": object_id("fc"), "type": "function_call", "call_id": d.id,
                                   "name": d.name, "arguments": "", "status": "in_progress"})
            if d.arguments and self.kind == "function_call":
                self.text += d.arguments
                out.append(self.event("response.function_call_arguments.delta", **self._where(),
                                      delta=d.arguments))
        return out

    def finish(self, finished: Finished) -> list[dict]:
        """Close the last item: ``incomplete`` when the answer was cut by length."""
        return self.close("incomplete" if finished.reason == "length" else "completed")
