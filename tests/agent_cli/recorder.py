"""A recording reverse proxy: the agent CLIs talk to it, it forwards every request to the
gateway unchanged and keeps what went by (method, path, headers without secrets, the JSON
body, the status, the response text), so tests can assert on what a real client sent and
got, and the bodies can be saved as fixtures for the request-shape tests.

Runs in a thread of the test process (uvicorn on a loopback port); responses, streamed
or not, are passed through as they arrive. A request the gateway does not answer (refused
connection, reset) is answered 502 and recorded so.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

# Headers that are never recorded: credentials, and anything named like one.
SECRET_HEADERS = {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
                  "openai-organization", "openai-project", "chatgpt-account-id"}
_SECRET_NAME = re.compile(r"key|auth|token|secret|cookie|password", re.I)
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive"}


def secret_header(name: str) -> bool:
    """Whether a header named ``name`` may carry a credential."""
    name = name.lower()
    return name in SECRET_HEADERS or bool(_SECRET_NAME.search(name))


@dataclass
class Exchange:
    """One request that went through: ``body`` is the parsed JSON (None if there was
    none or it was not JSON); ``status`` the gateway's answer; ``response`` its body
    text (the SSE text for a stream); ``started``/``ended`` epoch seconds."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any
    status: int = 0
    response: str = ""
    started: float = 0.0
    ended: Optional[float] = None

    def describe(self) -> str:
        """``METHOD /path?query -> status: <start of the response>`` for messages."""
        q = f"?{self.query}" if self.query else ""
        return f"{self.method} {self.path}{q} -> {self.status}: {self.response[:600]}"


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

    def snapshot(self) -> list[Exchange]:
        """The exchanges so far (a copy of the list)."""
        with self.lock:
            return list(self.exchanges)

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
                          {k: v for k, v in headers.items() if not secret_header(k)}, body, started=time.time())
            with self.lock:
                self.exchanges.append(ex)
            try:
                upstream = await client.send(client.build_request(
                    request.method, request.url.path, params=request.url.query, headers=headers, content=raw),
                    stream=True)
            except httpx.HTTPError as e:
                ex.status, ex.response, ex.ended = 502, f"recording proxy: upstream failed: {e!r}", time.time()
                await Response(ex.response, status_code=502)(scope, receive, send)
                return
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
                    ex.ended = time.time()

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


def sanitized(body: Any, replacements: Optional[dict[str, str]] = None) -> Any:
    """``body`` with each key of ``replacements`` (API keys, machine paths) replaced by its
    value wherever it appears in a string, and anything shaped like an API key
    (``sk-...``, ``sk-ant-...``) replaced by ``"<secret>"``."""
    text = json.dumps(body, ensure_ascii=False)
    for old, new in sorted((replacements or {}).items(), key=lambda kv: -len(kv[0])):
        if old:
            text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
    text = re.sub(r"\bsk-[A-Za-z0-9_\-]{8,}", "<secret>", text)
    return json.loads(text)


# ---------------------------------------------------------------------- answers
def sse_events(text: str) -> list[tuple[Optional[str], Any]]:
    """The events of an SSE body as (event name or None, parsed JSON data or the raw
    string, e.g. ``[DONE]``); comments and blank lines skipped."""
    events, name, data = [], None, []
    for line in text.splitlines() + [""]:
        if line == "":
            if data:
                raw = "\n".join(data)
                try:
                    events.append((name, json.loads(raw)))
                except ValueError:
                    events.append((name, raw))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    return events


def _streamed(ex: Exchange) -> bool:
    return isinstance(ex.body, dict) and bool(ex.body.get("stream"))


def generated_text(ex: Exchange) -> str:
    """The answer text the gateway generated in ``ex`` (a chat completion, an Anthropic
    message or a Responses response, streamed or not): visible text only, no reasoning,
    no tool-call arguments."""
    if ex.path.endswith("/chat/completions"):
        if not _streamed(ex):
            return json.loads(ex.response)["choices"][0]["message"].get("content") or ""
        return "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                       for _, c in sse_events(ex.response) if isinstance(c, dict) and c.get("choices"))
    if ex.path.endswith("/messages"):
        if not _streamed(ex):
            return "".join(b.get("text", "") for b in json.loads(ex.response)["content"] if b.get("type") == "text")
        return "".join(d["delta"].get("text", "") for _, d in sse_events(ex.response)
                       if isinstance(d, dict) and d.get("type") == "content_block_delta"
                       and d["delta"].get("type") == "text_delta")
    if ex.path.endswith("/responses"):
        if _streamed(ex):
            done = [d["response"] for _, d in sse_events(ex.response)
                    if isinstance(d, dict) and d.get("type") in ("response.completed", "response.incomplete")]
            if not done:
                return ""
            response = done[-1]
        else:
            response = json.loads(ex.response)
        return "".join(c.get("text", "") for item in response.get("output", []) if item.get("type") == "message"
                       for c in item.get("content", []) if c.get("type") == "output_text")
    raise ValueError(f"not a generation request: {ex.path}")


GENERATION_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/chat/completions", "/messages",
                    "/responses")


def is_generation(ex: Exchange) -> bool:
    """Whether ``ex`` asked the gateway to generate (a POST to a completion endpoint)."""
    return ex.method == "POST" and ex.path.endswith(GENERATION_PATHS)
