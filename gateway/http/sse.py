"""Server-sent events that stop when the client leaves.

Like Starlette's ``StreamingResponse`` under ASGI < 2.4, the body is raced against a
listener for ``http.disconnect`` in one task group, whatever ASGI version the server
speaks, so a client that leaves during a long prefill (when nothing is being sent) is
noticed at once and its generation cancelled by the body's ``finally``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

import anyio
from starlette.types import Receive, Scope, Send


# Characters that are legal inside JSON strings but that common line readers (Python's
# str.splitlines, JavaScript line-based parsers) take as line breaks: escaped, so that an
# event never splits however the client reads lines. SSE itself breaks only at CR and LF,
# which JSON always escapes.
# (The control characters among them, below U+0020, JSON escapes already.)
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def to_json(data: dict) -> str:
    """``data`` as one line of JSON, UTF-8 text kept, line-break-like characters escaped."""
    return json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)


def sse(data: dict | str) -> bytes:
    """One SSE ``data:`` event; dicts are JSON-encoded (:func:`to_json`)."""
    payload = data if isinstance(data, str) else to_json(data)
    return f"data: {payload}\n\n".encode()


HOLE = "\x00"  # where :func:`text_events` puts each event's text


def text_events(data: dict):
    """``text -> sse(data with text where HOLE is)``, byte for byte, for a stream of
    events that differ in one string (a chunk's text): ``data`` is encoded once around
    its last string :data:`HOLE` (no string after it) and each event is its JSON string
    put between the two halves."""
    head, _, tail = sse(data).rpartition(b'"\\u0000"')
    return lambda text: b"".join((head, to_json(text).encode(), tail))


def comment(text: str) -> bytes:
    """An SSE comment line (``: text``): ignored by clients, keeps proxies from timing out."""
    return f": {text}\n\n".encode()


class SSEResponse:
    """An ASGI response streaming ``body`` (bytes chunks) as ``text/event-stream`` (or
    ``media_type``: Ollama's streams are ``application/x-ndjson``).

    A client that does not take a chunk within ``send_timeout`` seconds (a stalled
    reader; up to a quarter more) is treated as gone: the stream stops and its
    generation is cancelled.
    """

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 send_timeout: float | None = None, media_type: str = "text/event-stream; charset=utf-8"):
        self.body = body
        self.media_type = media_type
        self.headers = headers or {}
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", self.media_type.encode()),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ] + [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]

        sending: list[float] = []  # when the chunk being sent began to be (empty: none is)

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            try:
                async for chunk in self.body:
                    sending.append(time.monotonic())
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    sending.clear()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away
                pass
            finally:
                with anyio.CancelScope(shield=True):
                    await self.body.aclose()

        def watch(timeout: float) -> None:
            """End the stream once a chunk has waited ``timeout`` seconds to be taken (a
            look every quarter of it: one timer a stream, not a cancel scope a chunk)."""
            if sending and time.monotonic() - sending[0] >= timeout:
                tg.cancel_scope.cancel()  # stream's finally closes the body
            else:
                timer[0] = loop.call_later(timeout / 4, watch, timeout)

        loop, timer = asyncio.get_running_loop(), [None]
        try:
            async with anyio.create_task_group() as tg:

                async def run_stream() -> None:
                    await stream()
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                if self.send_timeout is not None:
                    watch(self.send_timeout)
                await wait_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if timer[0] is not None:
                timer[0].cancel()


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must have been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def guarded(chunks: AsyncIterator[bytes], on_error, tail: bytes = b"") -> AsyncIterator[bytes]:
    """``chunks``, then ``tail``; an :class:`APIError` raised while streaming becomes the
    event ``on_error(error)`` (in the protocol's own shape), since the status line has
    already gone out. ``chunks`` is closed (and so its generation cancelled) however the
    stream ends."""
    from gateway.http.errors import APIError

    async def run() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:
            yield on_error(e)
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
        if tail:
            yield tail

    return run()


def named_event(event: str, data: dict) -> bytes:
    """One SSE event with an ``event:`` name line (Anthropic's and the Responses API's
    streams), its data JSON-encoded."""
    return f"event: {event}\ndata: {to_json(data)}\n\n".encode()
