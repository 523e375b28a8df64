"""Reading a request body: bounded in bytes, time and JSON nesting."""

from __future__ import annotations

import json

import anyio
from starlette.requests import Request

from gateway.http.errors import APIError


async def read_json(request: Request, limit: int, timeout: float, max_depth: int) -> object:
    """The request body as JSON.

    Args:
        limit: largest body, bytes.
        timeout: seconds the client has to send the whole body.
        max_depth: deepest nesting of arrays and objects allowed.

    Raises:
        APIError: 413 over ``limit`` bytes, 408 when the body takes over ``timeout``
            seconds, 400 for a body that is not JSON or is nested too deeply.
    """
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
