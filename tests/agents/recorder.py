"""A recording reverse proxy: the agent CLIs talk to it, it forwards every request to the
gateway unchanged and keeps what went by (method, path, headers without secrets, the JSON
body, the status), so tests can assert on what a real client sent and got, and the
bodies can be saved as fixtures for the request-shape tests.

Runs in a thread of the test process (uvicorn on a loopback port); responses, streamed
or not, are passed through as they arrive.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import StreamingResponse

# Headers whose values are secrets or vary per run: left out of the record.
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "openai-organization", "openai-project"}
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


@dataclass
class Exchange:
    """One request that went through: ``body`` is the parsed JSON (None if there was
    none or it was not JSON); ``status`` the gateway's answer; ``response`` its body
    text (the SSE text for a stream)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any
    status: int = 0
    response: str = ""


@dataclass
class Recorder:
    """The exchanges seen so far, in arrival order."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, path_prefix: str) -> list[Exchange]:
        """The exchanges whose path starts with ``path_prefix``."""
        with self.lock:
            return [e for e in self.exchanges if e.path.startswith(path_prefix)]

    def app(self):
        """The proxy's ASGI app."""
        client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600, connect=10))

        async def asgi(scope, receive, send):
            if scope["type"] != "http":
                return
            request = Request(scope, receive)
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
            ex = Exchange(request.method, request.url.path, request.url.query,
                          {k: v for k, v in headers.items() if k.lower() not in SECRET_HEADERS}, body)
            with self.lock:
                self.exchanges.append(ex)
            upstream = await client.send(client.build_request(
                request.method, request.url.path, params=request.url.query, headers=headers, content=raw),
                stream=True)
            ex.status = upstream.status_code

            async def relay():
                parts = []
                try:
                    async for chunk in upstream.aiter_raw():
                        parts.append(chunk)
                        yield chunk
                finally:
                    await upstream.aclose()
                    ex.response = b"".join(parts).decode("utf-8", "replace")

            out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
            await StreamingResponse(relay(), status_code=upstream.status_code, headers=out)(scope, receive, send)

        return asgi


@contextlib.contextmanager
def recording(upstream: str, port: int) -> Iterator[Recorder]:
    """Serve a :class:`Recorder` in front of ``upstream`` on ``port`` until the block ends."""
    rec = Recorder(upstream)
    server = uvicorn.Server(uvicorn.Config(rec.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(3000):
        if server.started or not thread.is_alive():
            break
        threading.Event().wait(0.01)
    if not server.started:
        raise RuntimeError("the recording proxy did not start")
    try:
        yield rec
    finally:
        server.should_exit = True
        thread.join(10)


def sanitized(body: Any, secrets: Optional[list[str]] = None) -> Any:
    """``body`` with any of ``secrets`` (keys, tokens) replaced by ``"<secret>"`` wherever
    they appear in a string."""
    text = json.dumps(body, ensure_ascii=False)
    for s in secrets or []:
        if s:
            text = text.replace(s, "<secret>")
    return json.loads(text)
