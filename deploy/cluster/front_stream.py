"""How the cluster front (``front.py``) relays a replica's event stream, and ends one that
the replica (or the router) lost before its end: pure functions and one small parser, no
I/O.

A streamed answer's status line and first events have reached the client before the
replica can fail, so a lost replica cannot be hidden any more; the stream must then end as
each protocol ends a stream that failed, so that clients (the OpenAI and Anthropic SDKs,
agent frameworks) raise their usual error instead of a broken connection, or nothing:

- OpenAI chat completions and completions: ``data: {"error": {...}}`` then
  ``data: [DONE]`` (what the gateway itself sends when a generation fails mid-stream);
- Anthropic Messages: ``event: error`` with ``{"type": "error", "error": {"type":
  "api_error", "message": ...}}``;
- OpenAI Responses: ``event: response.failed`` with the response object from the stream's
  ``response.created``, its ``status`` ``failed`` and ``error`` set, numbered after the
  last event (``event: error`` when no ``response.created`` came).

:class:`StreamWatch` forwards whole events only (an event cut in the middle by the loss is
dropped, never half-sent), and knows whether the stream's own last event went through.
"""

from __future__ import annotations

import json
import re
from typing import Optional

# The event that ends a stream, per protocol: once forwarded, nothing is missing.
OPENAI_END = b"data: [DONE]"
ENDING_EVENTS = {"anthropic": {b"message_stop", b"error"},
                 "responses": {b"response.completed", b"response.incomplete", b"response.failed", b"error"}}
SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


def protocol_of(path: str) -> str:
    """``anthropic`` (``/v1/messages``), ``responses`` (``/v1/responses``) or ``openai``."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/responses"):
        return "responses"
    return "openai"


def is_event_stream(content_type: Optional[str]) -> bool:
    return bool(content_type) and content_type.split(";")[0].strip().lower() == "text/event-stream"


class StreamWatch:
    """Follows one SSE stream: :meth:`feed` takes the bytes as they come and gives back
    the whole events among them (a partial event waits for its end); :attr:`ended` is
    true once the protocol's last event went out; :meth:`failure` is the event that ends
    the stream when it was lost before that.

    Args:
        protocol: ``openai``, ``anthropic`` or ``responses`` (:func:`protocol_of`).
    """

    def __init__(self, protocol: str):
        self.protocol = protocol
        self.pending = b""
        self.ended = False
        self.sequence = -1  # the last sequence_number seen (Responses)
        self.created: Optional[dict] = None  # the response object of response.created

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what came so far, to forward now."""
        self.pending += chunk
        cut = self.pending.rfind(b"\n\n")
        if cut < 0:
            return b""
        out, self.pending = self.pending[:cut + 2], self.pending[cut + 2:]
        for event in out.split(b"\n\n"):
            if event:
                self._look(event)
        return out

    def _look(self, event: bytes) -> None:
        name, data = b"", b""
        for line in event.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data = line[5:].strip()
        if self.protocol == "openai":
            if data == OPENAI_END[6:]:
                self.ended = True
            return
        if name in ENDING_EVENTS[self.protocol]:
            self.ended = True
        if self.protocol == "responses":
            m = SEQUENCE.search(data)
            if m:
                self.sequence = max(self.sequence, int(m.group(1)))
            if name == b"response.created" and self.created is None:
                try:
                    self.created = json.loads(data).get("response")
                except (ValueError, AttributeError):
                    self.created = None

    def failure(self, message: str) -> bytes:
        """The event(s) that end this stream as failed, in its protocol's shape."""
        if self.protocol == "anthropic":
            return _event(b"error", {"type": "error", "error": {"type": "api_error", "message": message}})
        if self.protocol == "responses":
            n = self.sequence + 1
            if isinstance(self.created, dict):
                response = {**self.created, "status": "failed", "error": {"code": "server_error", "message": message}}
                return _event(b"response.failed", {"type": "response.failed", "sequence_number": n,
                                                   "response": response})
            return _event(b"error", {"type": "error", "code": "server_error", "message": message, "param": None,
                                     "sequence_number": n})
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_lost"}}
        return b"data: " + json.dumps(body).encode() + b"\n\n" + OPENAI_END + b"\n\n"


def _event(name: bytes, data: dict) -> bytes:
    return b"event: " + name + b"\ndata: " + json.dumps(data).encode() + b"\n\n"
