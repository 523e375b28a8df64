"""A recording HTTP proxy for tests: forwards every request to one upstream (a gateway
replica) as it came, streams the answer back, and keeps what it forwarded.

Put between SGLang's router and a replica (the router's worker URL is the proxy's), it
shows the bodies the router really sends, while the real gateway answers them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from cluster_stack import free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@dataclass
class Seen:
    """One request the proxy forwarded: method, path, headers (lower-case names), body."""

    method: str
    path: str
    headers: dict
    body: bytes


class RecordingProxy:
    """``http://127.0.0.1:PORT`` forwarding to ``upstream``; :attr:`seen` lists the requests
    other than ``/health`` and the router's info probes. Runs in a thread of its own."""

    PROBES = ("/health", "/server_info", "/model_info", "/get_server_info", "/get_model_info")

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[Seen] = []
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="error", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def _app(self) -> Starlette:
        async def forward(request: Request):
            body = await request.body()
            if request.url.path not in self.PROBES:
                self.seen.append(Seen(request.method, request.url.path, dict(request.headers), body))
            client = httpx.AsyncClient(timeout=60)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
            req = client.build_request(request.method, self.upstream + request.url.path,
                                       params=request.query_params, headers=headers, content=body)
            upstream = await client.send(req, stream=True)

            async def relay():
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    await upstream.aclose()
                    await client.aclose()

            out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            return StreamingResponse(relay(), status_code=upstream.status_code, headers=out)

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])

    def start(self) -> "RecordingProxy":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise AssertionError("the recording proxy did not start")
            time.sleep(0.02)
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
