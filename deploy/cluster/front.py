"""The cluster's front door: one address for every API of a cluster of ``mlx-gateway serve``
replicas behind SGLang's router (docs/cluster.md).

SGLang's router (sglang-router 0.3.2) serves OpenAI chat completions and completions
well: it routes by prefix (``cache_aware``) and health-checks the replicas. It does not
serve the rest of the gateway: it answers 404 to Anthropic's ``/v1/messages``, and it
re-writes every ``/v1/responses`` body with its own defaults (``temperature: 1.0``,
``top_p: 1.0``, ``top_k: -1``, ``priority: 0``, ``stream: null``, ``store: true``...), which
replace what the client left to the gateway's defaults, and which the gateway refuses
(``priority`` must be a latency class). It also drops the ``x-api-key`` and ``x-priority``
headers, and the fields of a chat body it does not know (``priority``, ``user``); answers
``/v1/models`` itself, without keys; and answers CORS itself (any origin, by default).

This front sends each request where it is served as sent:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (and anything not below): to the
  router, byte for byte (with an ``x-api-key`` copied into ``Authorization: Bearer``, which the
  router forwards), its CORS headers left out; but a browser's request (``Origin``) and one
  that asks for a latency class (``x-priority``, a chat body's ``priority``) go straight to a
  replica, as below;
- ``/v1/messages``, ``/v1/messages/count_tokens``, ``/v1/responses`` (and
  ``/v1/responses/{id}``), ``/v1/models``: straight to one replica, chosen by rendezvous
  hashing of the conversation's start (key, model, system prompt or instructions, first
  message), so that every turn of a conversation meets its prefix cache; a
  ``previous_response_id`` (or a stored response's id) goes to the replica that made it;
- ``/v1/usage``: every replica, the counts added up; ``/admin/...``: every replica, their
  answers listed.

The replicas are those the router holds as healthy (``GET /workers``, every ``--refresh``
seconds), so a replica the router takes out (failed health checks, ``DELETE /workers``) is
left out here too. A replica that refuses the connection is skipped for the next one in
the hashing order. A replica lost while it streams an answer cuts that stream (the client
sees the connection end before the response does), as the router does.

Which requests go around the router, and the affinity key, are in ``front_rules.py``.
Run it with the gateway's own dependencies (starlette, uvicorn, httpx)::

    python deploy/cluster/front.py --router http://127.0.0.1:30000 --port 8080
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections import OrderedDict
from typing import AsyncIterator, Optional

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from front_rules import affinity_key, around_router, merge_usage  # beside this script

log = logging.getLogger("mlx_gateway.front")

# Headers that belong to one connection, or that the HTTP client sets itself.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
CORS_HEADERS = frozenset({"access-control-allow-origin", "access-control-allow-credentials",
                          "access-control-expose-headers", "access-control-allow-methods",
                          "access-control-allow-headers", "access-control-max-age"})
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9A-Za-z]+)"')
REMEMBERED_IDS = 100_000  # response id -> replica, least recently used first out


class UpstreamLost(Exception):
    """A replica or the router went away while its answer was being streamed."""


class Replicas:
    """The replicas the router holds as healthy, refreshed from its ``GET /workers``."""

    def __init__(self, client: httpx.AsyncClient, router: str, refresh: float):
        self.client, self.router, self.refresh = client, router.rstrip("/"), refresh
        self.urls: list[str] = []
        self.router_up = False
        self.fresh = asyncio.Event()

    async def poll_once(self) -> None:
        try:
            r = await self.client.get(f"{self.router}/workers", timeout=5)
            r.raise_for_status()
            workers = r.json().get("workers", [])
            urls = sorted({w["url"].rstrip("/") for w in workers
                           if w.get("is_healthy") and w.get("worker_type", "regular") == "regular"})
            if urls != self.urls:
                log.info("replicas: %s", ", ".join(urls) or "none")
            self.urls, self.router_up = urls, True
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            if self.router_up:
                log.warning("the router at %s does not answer GET /workers (%s); keeping the last replicas", self.router, e)
            self.router_up = False
        self.fresh.set()

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.refresh)

    def order(self, key: bytes) -> list[str]:
        """The replicas, best first, for ``key`` (rendezvous hashing: a replica that goes or
        comes moves only its own share of the keys)."""
        return sorted(self.urls, key=lambda u: hashlib.blake2b(key + u.encode(), digest_size=8).digest(),
                      reverse=True)


class FrontApp:
    def __init__(self, router: str, refresh: float = 1.0, connect_timeout: float = 3.0,
                 read_timeout: Optional[float] = 600.0):
        self.router = router.rstrip("/")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=60, pool=None),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200), follow_redirects=False)
        self.replicas = Replicas(self.client, self.router, refresh)
        self.owners: OrderedDict[str, str] = OrderedDict()  # response id -> replica URL

    # ------------------------------------------------------------------ helpers
    def remember(self, rid: str, url: str) -> None:
        self.owners[rid] = url
        self.owners.move_to_end(rid)
        while len(self.owners) > REMEMBERED_IDS:
            self.owners.popitem(last=False)

    def owner_first(self, rid: Optional[str], order: list[str]) -> list[str]:
        owner = self.owners.get(rid) if rid else None
        if owner in order:
            return [owner] + [u for u in order if u != owner]
        return order

    @staticmethod
    def error(path: str, status: int, message: str, code: str) -> JSONResponse:
        if path.startswith("/v1/messages"):
            kind = {502: "api_error", 503: "overloaded_error"}.get(status, "api_error")
            return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
        return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                            status_code=status)

    @staticmethod
    def forward_headers(request: Request, to_router: bool) -> dict:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if to_router and "x-api-key" in headers and "authorization" not in headers:
            # the router forwards Authorization, not x-api-key; the gateway accepts either
            headers["authorization"] = f"Bearer {headers['x-api-key']}"
        return headers

    async def send(self, method: str, url: str, request: Request, body: bytes, to_router: bool) -> httpx.Response:
        req = self.client.build_request(method, url, params=request.query_params,
                                        headers=self.forward_headers(request, to_router), content=body)
        return await self.client.send(req, stream=True)

    def relay(self, upstream: httpx.Response, on_chunk=None, strip=frozenset()) -> StreamingResponse:
        """The upstream answer as it comes (status, headers but ``strip``, body)."""

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if on_chunk is not None:
                        on_chunk(chunk)
                    yield chunk
            except httpx.HTTPError as e:
                log.warning("%s %s: the answer was cut: %s", upstream.request.method, upstream.request.url, e)
                raise UpstreamLost(str(e)) from e
            finally:
                await upstream.aclose()

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in strip}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)

    async def to_replicas(self, request: Request, key: bytes, body: bytes, prefer: Optional[str] = None,
                          watch: bool = False) -> Response:
        """Send to the first replica, in the hashing order of ``key`` (``prefer`` first when
        it is one), that takes the connection."""
        path = request.url.path
        if not self.replicas.urls:
            await self.replicas.poll_once()  # perhaps the router knows of one by now
            if not self.replicas.urls:
                return self.error(path, 503, "no replica is available (the router holds none as healthy)",
                                  "no_available_replica")
        last: Optional[Exception] = None
        for url in self.owner_first(prefer, self.replicas.order(key)):
            try:
                upstream = await self.send(request.method, url + path, request, body, to_router=False)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing was sent: the next one
                log.warning("%s: cannot connect (%s); trying the next replica", url, e)
                last = e
                continue
            except httpx.HTTPError as e:
                return self.error(path, 502, f"the replica at {url} failed: {e}", "replica_error")
            return self.relay(upstream, _IdWatcher(self, url) if watch else None)
        return self.error(path, 502, f"no replica took the request: {last}", "replica_unavailable")

    # ------------------------------------------------------------------ routes
    async def to_router(self, request: Request) -> Response:
        """OpenAI chat completions and completions: to the router, unless the request uses
        what the router drops (see :func:`around_router`)."""
        body = await request.body()
        if around_router(request, body):
            return await self.conversation(request, body)
        try:
            upstream = await self.send(request.method, self.router + request.url.path, request, body, to_router=True)
        except httpx.HTTPError as e:
            return self.error(request.url.path, 502, f"the router at {self.router} failed: {e}", "router_unavailable")
        return self.relay(upstream, strip=CORS_HEADERS)  # the router's own "*": see around_router

    async def conversation(self, request: Request, body: Optional[bytes] = None) -> Response:
        """To a replica, by the conversation's start (:func:`affinity_key`); a
        ``previous_response_id`` to the replica that made it."""
        if body is None:
            body = await request.body()
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {}  # the replica answers the 400
        data = data if isinstance(data, dict) else {}
        path = request.url.path
        previous = data.get("previous_response_id") if path == "/v1/responses" else None
        previous = previous if isinstance(previous, str) else None
        auth = (request.headers.get("authorization") or request.headers.get("x-api-key") or "").encode()
        key = b"response:" + previous.encode() if previous else auth + affinity_key(path, data)
        return await self.to_replicas(request, key, body, prefer=previous, watch=path == "/v1/responses")

    async def stored_response(self, request: Request) -> Response:
        """``GET``/``DELETE /v1/responses/{id}``: the replica that made it, else each in turn
        until one has it."""
        if request.method == "OPTIONS":
            return await self.any_replica(request)
        rid = request.path_params["response_id"]
        order = self.owner_first(rid, self.replicas.order(b"response:" + rid.encode()))
        for i, url in enumerate(order):
            try:
                upstream = await self.send(request.method, url + request.url.path, request, b"", to_router=False)
            except httpx.HTTPError:
                continue
            if upstream.status_code == 404 and i < len(order) - 1:
                await upstream.aclose()
                continue
            if upstream.status_code == 200:
                self.remember(rid, url)
            return self.relay(upstream)
        return self.error(request.url.path, 502, "no replica answered", "replica_unavailable")

    async def any_replica(self, request: Request) -> Response:
        """``/v1/models``: the caller's models, from one replica (all serve the same ones)."""
        auth = (request.headers.get("authorization") or request.headers.get("x-api-key") or "").encode()
        return await self.to_replicas(request, auth, b"")

    async def every_replica(self, request: Request) -> Response:
        """``/v1/usage`` (the replicas' counts added up) and ``/admin/...`` (their answers listed)."""
        if request.method == "OPTIONS":  # a CORS preflight: every replica answers it alike
            return await self.any_replica(request)
        body = await request.body()
        urls = list(self.replicas.urls)
        if not urls:
            return self.error(request.url.path, 503, "no replica is available", "no_available_replica")

        async def one(url: str):
            try:
                req = self.client.build_request(request.method, url + request.url.path, params=request.query_params,
                                                headers=self.forward_headers(request, False), content=body)
                r = await self.client.send(req)
                cors = {k: v for k, v in r.headers.items() if k.lower() in CORS_HEADERS or k.lower() == "vary"}
                try:
                    return url, r.status_code, r.json(), cors
                except ValueError:
                    return url, r.status_code, r.text, cors
            except httpx.HTTPError as e:
                return url, 502, {"error": {"message": str(e), "type": "server_error", "code": "replica_error"}}, {}

        answers = await asyncio.gather(*(one(u) for u in urls))
        failed = [a for a in answers if not 200 <= a[1] < 300]
        cors = answers[0][3]  # the replicas answer CORS alike
        if request.url.path == "/v1/usage":
            if failed:
                return JSONResponse(failed[0][2], status_code=failed[0][1], headers=failed[0][3])
            merged = answers[0][2]
            for more in answers[1:]:
                merged = merge_usage(merged, more[2])
            return JSONResponse(merged, headers=cors)
        status = failed[0][1] if failed else 200
        return JSONResponse({"object": "list", "data": [{"replica": a[0], "status": a[1], "body": a[2]} for a in answers]},
                            status_code=status, headers=cors)

    async def health(self, request: Request) -> Response:
        ok = self.replicas.router_up and bool(self.replicas.urls)
        return JSONResponse({"status": "ok" if ok else "unavailable", "router": self.router,
                             "router_up": self.replicas.router_up, "workers": self.replicas.urls},
                            status_code=200 if ok else 503)

    def app(self) -> Starlette:
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/messages", self.conversation, methods=["POST", "OPTIONS"]),
            Route("/v1/messages/count_tokens", self.conversation, methods=["POST", "OPTIONS"]),
            Route("/v1/responses", self.conversation, methods=["POST", "OPTIONS"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE", "OPTIONS"]),
            Route("/v1/models", self.any_replica, methods=["GET", "OPTIONS"]),
            Route("/v1/models/{model_id:path}", self.any_replica, methods=["GET", "OPTIONS"]),
            Route("/v1/usage", self.every_replica, methods=["GET", "OPTIONS"]),
            Route("/admin/{rest:path}", self.every_replica, methods=methods),
            Route("/{rest:path}", self.to_router, methods=methods),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(app):
            await self.replicas.poll_once()
            task = asyncio.create_task(self.replicas.run())
            try:
                yield
            finally:
                task.cancel()
                await self.client.aclose()

        return Starlette(routes=routes, lifespan=lifespan)


class _IdWatcher:
    """Remembers which replica made a response, from the id in its first bytes (the JSON
    object, or the ``response.created`` event of a stream)."""

    def __init__(self, front: FrontApp, url: str):
        self.front, self.url = front, url
        self.seen = bytearray()
        self.done = False

    def __call__(self, chunk: bytes) -> None:
        if self.done:
            return
        self.seen.extend(chunk)
        m = RESPONSE_ID.search(self.seen)
        if m:
            self.front.remember(m.group(1).decode(), self.url)
        if m or len(self.seen) > 65536:
            self.done = True
            self.seen = bytearray()


def _lost(e: BaseException) -> bool:
    if isinstance(e, UpstreamLost):
        return True
    inner = getattr(e, "exceptions", None)  # an exception group (anyio task groups)
    return bool(inner) and all(_lost(x) for x in inner)


class _CutOnLoss:
    """ASGI wrapper: a stream whose upstream went away ends without its last chunk (the
    client sees the connection close mid-answer), logged as one line instead of a traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except BaseException as e:
            if not _lost(e):
                raise


def main(argv=None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="The front door of a cluster of mlx-gateway replicas behind "
                                "SGLang's router (docs/cluster.md).")
    p.add_argument("--router", required=True, help="the router's URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port (default %(default)s)")
    p.add_argument("--refresh", type=float, default=1.0,
                   help="seconds between two readings of the router's healthy replicas (default %(default)s)")
    p.add_argument("--read-timeout", type=float, default=600.0,
                   help="seconds an answer may stay silent (the gateway's streams send a keep-alive every 10 s) "
                   "(default %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    front = FrontApp(a.router, a.refresh, read_timeout=a.read_timeout)
    uvicorn.run(_CutOnLoss(front.app()), host=a.host, port=a.port, log_level=a.log_level.lower(),
                access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
