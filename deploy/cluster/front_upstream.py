"""One request from the cluster front (``front.py``) to a replica or the router, told apart
by how far it got, and its answer relayed to the client.

A request can fail at three points, and what the front may do differs:

- **not sent** (:class:`NotSent`): the connection was refused or not made in time, so the
  replica never saw the request; the front tries the next replica, as often as it has one;
- **lost before the first byte** (:class:`Lost`): the request went out, and the replica
  (or the router) failed before any byte of its answer came back (killed, crashed, reset);
  nothing reached the client, so the front sends the same request (body and headers, the
  client's ``Idempotency-Key`` included) once to another healthy replica. The first
  replica may have begun it (a prompt admitted and partly prefilled), never answered it;
- **lost after the first byte**: the answer's status and first bytes have gone to the
  client. A stream then ends with the error event of its protocol (``front_stream.py``); any
  other answer is cut (the client sees the connection end before the body does).

The router's own failures to reach a replica come back as answers: a 5xx with an
``x-smg-error-code`` header (sglang-router 0.3.2), e.g. ``call_upstream_request_error``
naming the replica's URL. :func:`router_lost` tells those (the replica never answered)
from a replica's own 5xx, which is an answer and goes to the client as it is. A 429 or any
4xx is always an answer: it is never sent again.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import httpx
from starlette.responses import StreamingResponse

from front_stream import StreamWatch, is_event_stream, protocol_of  # beside this script

log = logging.getLogger("mlx_gateway.front")

# Headers that belong to one connection, or that the HTTP client sets itself.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}

# sglang-router 0.3.2's x-smg-error-code values for a request no replica answered: it could
# not send it, the connection failed, or the replica's answer broke off before the router
# had it (the router reads a whole non-streamed answer before it answers). Not
# ``call_upstream_timeout``: the replica may still be working on it.
ROUTER_LOST_CODES = frozenset({
    "call_upstream_request_error", "call_upstream_connection_failed", "call_upstream_request_failed",
    "call_upstream_body_error", "no_available_workers",
})
URL = re.compile(rb"https?://[^\s/)\"]+")


class NotSent(Exception):
    """The request never reached the upstream (connection refused, or not made in time)."""


class Lost(Exception):
    """The request was sent, and the upstream failed before the first byte of its answer."""


class UpstreamLost(Exception):
    """The upstream went away after the first bytes of its (non-streamed) answer were relayed."""


@dataclass
class Opened:
    """An upstream answer whose status, headers and first bytes have come."""

    upstream: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes]

    @property
    def status(self) -> int:
        return self.upstream.status_code

    async def aclose(self) -> None:
        await self.upstream.aclose()


async def open_upstream(client: httpx.AsyncClient, request: httpx.Request) -> Opened:
    """Send ``request`` and wait for the status line and the first bytes of the answer.

    Raises:
        NotSent: the connection was refused or timed out (nothing was sent).
        Lost: the upstream failed after the request went out, before any byte of the answer.
        httpx.TimeoutException: the upstream stayed silent past the read timeout (not
            retried: it may still be working).
    """
    try:
        upstream = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise NotSent(str(e) or type(e).__name__) from e
    except httpx.TimeoutException:
        raise
    except httpx.TransportError as e:
        raise Lost(str(e) or type(e).__name__) from e
    rest = upstream.aiter_raw()
    try:
        first = await rest.__anext__()
    except StopAsyncIteration:
        first = b""
    except httpx.TimeoutException:
        await upstream.aclose()
        raise
    except httpx.TransportError as e:
        await upstream.aclose()
        raise Lost(str(e) or type(e).__name__) from e
    return Opened(upstream, first, rest)


def router_lost(opened: Opened) -> Optional[str]:
    """For the router's answer: the URL of the replica it failed to get an answer from
    ("" when it names none), or None when this is an answer to relay."""
    code = opened.upstream.headers.get("x-smg-error-code")
    if opened.status < 500 or code not in ROUTER_LOST_CODES:
        return None
    m = URL.search(opened.first)
    return m.group(0).decode() if m else ""


def draining(opened: Opened) -> bool:
    """A replica's 503 ``shutting_down``: it refused the request without starting it."""
    return opened.status == 503 and b"shutting_down" in opened.first


def relay(opened: Opened, path: str, on_chunk: Optional[Callable[[bytes], None]] = None,
          strip=frozenset()) -> StreamingResponse:
    """The upstream answer as it comes (status, headers but ``strip``, body). A stream
    (``text/event-stream``) that ends or breaks before its last event gets its protocol's
    error event (``front_stream.py``) and ends cleanly; any other answer that breaks raises
    :class:`UpstreamLost` (the connection is cut)."""
    upstream = opened.upstream
    watch = StreamWatch(protocol_of(path)) if is_event_stream(upstream.headers.get("content-type")) else None

    async def chunks() -> AsyncIterator[bytes]:
        if opened.first:
            yield opened.first
        async for chunk in opened.rest:
            yield chunk

    async def body() -> AsyncIterator[bytes]:
        what = f"{upstream.request.method} {upstream.request.url}"
        try:
            async for chunk in chunks():
                if on_chunk is not None:
                    on_chunk(chunk)
                out = watch.feed(chunk) if watch is not None else chunk
                if out:
                    yield out
            if watch is not None and not watch.ended:
                log.warning("%s: the stream ended before its last event", what)
                yield watch.failure("the replica's stream ended before the answer did (the replica was lost)")
        except httpx.HTTPError as e:
            log.warning("%s: the answer was cut: %s", what, e)
            if watch is None:
                raise UpstreamLost(str(e)) from e
            if not watch.ended:
                yield watch.failure(f"the replica was lost while it streamed the answer ({type(e).__name__})")
        finally:
            await upstream.aclose()

    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in strip}
    return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)


def _lost(e: BaseException) -> bool:
    if isinstance(e, UpstreamLost):
        return True
    inner = getattr(e, "exceptions", None)  # an exception group (anyio task groups)
    return bool(inner) and all(_lost(x) for x in inner)


class CutOnLoss:
    """ASGI wrapper: an answer (not a stream) whose upstream went away ends without its last
    bytes (the client sees the connection close mid-answer), logged as one line instead of
    a traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except BaseException as e:
            if not _lost(e):
                raise
