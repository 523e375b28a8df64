"""Reading a request body: declared as JSON, bounded in bytes, time and JSON nesting.

The ``Content-Type`` check matters for browsers: a ``text/plain`` or form-encoded POST is
a CORS "simple" request, which a web page on any origin may send without a preflight;
requiring ``application/json`` makes every such request a preflighted one, which CORS
then refuses for origins outside ``--allowed-origins``. Ollama's API (``/api/``) takes a
body of any declared type from a client that is not a browser page (no ``Origin``
header), as Ollama does: ``curl -d`` sends its bodies form-encoded.
"""

from __future__ import annotations

import json
from typing import Optional

import anyio
from starlette.requests import Request

from gateway.http.errors import APIError

JSON_MEDIA_TYPE = "application/json"


class UnsupportedMediaType(APIError):
    """415: a body that is not declared as ``application/json`` (an invalid-request
    error in both the OpenAI and the Anthropic format)."""

    def __init__(self, got: Optional[str]):
        shown = "no Content-Type" if not got else f"Content-Type '{got[:100]}'"
        super().__init__(415, f"the request body must be sent with Content-Type: {JSON_MEDIA_TYPE} "
                         f"(got {shown})", code="unsupported_media_type")


def check_json_content_type(request: Request) -> None:
    """Check that the body is declared as ``application/json`` (parameters such as
    ``; charset=utf-8`` allowed, case-insensitive); on ``/api/`` without an ``Origin``
    header, any declared type is taken.

    Raises:
        UnsupportedMediaType: 415 for any other Content-Type, or none.
    """
    if request.url.path.startswith("/api/") and "origin" not in request.headers:
        return
    declared = request.headers.get("content-type")
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise UnsupportedMediaType(declared)


async def read_json(request: Request, limit: int, timeout: float, max_depth: int) -> object:
    """The request body as JSON, after checking its ``Content-Type`` (before reading it).

    Args:
        limit: largest body, bytes.
        timeout: seconds the client has to send the whole body.
        max_depth: deepest nesting of arrays and objects allowed.

    Raises:
        UnsupportedMediaType: 415 for a body not declared as ``application/json``.
        APIError: 413 over ``limit`` bytes, 408 when the body takes over ``timeout``
            seconds, 400 for a body that is not JSON or is nested too deeply.
    """
    check_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over the {limit}-byte limit", code="request_too_large")
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body over the {limit}-byte limit", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout")
    try:
        value = json.loads(b"".join(chunks))
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {max_depth} levels")
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")
    if _depth(value) > max_depth:
        raise APIError(400, f"the request body is nested deeper than {max_depth} levels")
    return value


def _depth(value: object) -> int:
    """Nesting depth of arrays and objects in a parsed JSON value (a scalar is 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
