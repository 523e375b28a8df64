"""The cluster's front door: one address for every API of a cluster of ``mlx-gateway serve``
replicas behind SGLang's router (docs/cluster.md).

SGLang's router (sglang-router 0.3.2) serves OpenAI chat completions and completions
well: it routes by prefix (``cache_aware``) and health-checks the replicas. It does not
serve the rest of the gateway: it answers 404 to Anthropic's ``/v1/messages``, and it
re-writes every ``/v1/responses`` body with its own defaults (``temperature: 1.0``,
``top_p: 1.0``, ``top_k: -1``, ``priority: 0``, ``stream: null``, ``store: true``...), which
replace what the client left to the gateway's defaults, and drops its
``prompt_cache_key`` and ``safety_identifier``. It also drops the ``x-api-key`` and
``x-priority`` headers, and the fields of a chat body it does not know (``priority``,
``user``, ``rid``); answers ``/v1/models`` itself, without keys; answers CORS itself (any
origin, by default); and, run with ``--disable-retries`` so that a tenant's 429 is not sent
again, it sends a request to a dead replica until its health checks notice.

This front sends each request where it is served as sent, by the rule of its route in the
gateway's route table (``gateway/routes/table.py``, ``cluster``):

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, the gateway's
  ``/metrics``, ``/openapi.json`` and SGLang-style info routes, and any path the gateway
  does not serve: to the router, byte for byte (with an ``x-api-key`` copied into
  ``Authorization: Bearer``, which the router forwards), its CORS headers left out; but a
  browser's request (``Origin``), one that asks for a latency class (``x-priority``, a chat
  body's ``priority``) and one that names its session (``prompt_cache_key``,
  ``safety_identifier``, ``user``) go straight to a replica, as below;
- ``/v1/messages``, ``/v1/messages/count_tokens``, ``/v1/responses``: straight to one
  replica: the one that served the conversation before, else one chosen by rendezvous
  hashing of the client's session key (``prompt_cache_key``, ``safety_identifier``,
  ``user``, Anthropic's ``metadata.user_id``) or of the conversation's start (key, model,
  system prompt or instructions, first message), so that every turn meets its prefix
  cache, and a replica that joins takes new conversations without moving running ones; a
  ``previous_response_id`` goes to the replica that made it;
- ``/v1/responses/{id}`` and ``/v1/responses/{id}/input_items``: the replica that made the
  response, else each in turn until one has it (a 404 from all of them is the answer);
- ``/v1/models``, ``/v1/models/{id}``: one replica, by the caller's key;
- ``/v1/usage``: every replica, the counts added up; ``/admin/...``: every replica, their
  answers listed; ``/health``: the front's own.

The replicas are those the router holds as healthy (``GET /workers``, every ``--refresh``
seconds), so a replica the router takes out (failed health checks, ``DELETE /workers``) is
left out here too. Failover (``front_upstream.py``): a replica that refuses the connection
is skipped for the next one; a request whose replica (or the router's) fails before the
first byte of the answer, or that a draining replica refuses, goes once to another
replica; the router unreachable, or answering that its replica failed, the request goes
straight to a replica. A 429 or any 4xx is an answer: it is never sent again. A stream
lost after its first byte ends with its protocol's error event (``front_stream.py``).

Which requests go around the router, and the affinity key, are in ``front_rules.py``.
Run it with the gateway's own dependencies (starlette, uvicorn, httpx)::

    python deploy/cluster/front.py --router http://127.0.0.1:30000 --port 8080 [--reuse-port]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Optional

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the gateway's source tree, for its routes and errors
from gateway.http.errors import APIError  # noqa: E402
from gateway.routes.table import ANY, EVERY, FRONT, REPLICA, ROUTER, ROUTES, STORED, error_style  # noqa: E402

# beside this script
from front_replicas import Remembered, Replicas  # noqa: E402
from front_rules import affinity_key, around_router, merge_usage, session_key  # noqa: E402
from front_serve import serve  # noqa: E402
from front_upstream import (HOP_BY_HOP, CutOnLoss, Lost, NotSent, draining, open_upstream, relay,  # noqa: E402
                            router_lost)

log = logging.getLogger("mlx_gateway.front")

CORS_HEADERS = frozenset({"access-control-allow-origin", "access-control-allow-credentials",
                          "access-control-expose-headers", "access-control-allow-methods",
                          "access-control-allow-headers", "access-control-max-age"})
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9A-Za-z]+)"')


class FrontApp:
    def __init__(self, router: str, refresh: float = 1.0, connect_timeout: float = 3.0,
                 read_timeout: Optional[float] = 600.0):
        self.router = router.rstrip("/")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=60, pool=None),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200), follow_redirects=False)
        self.replicas = Replicas(self.client, self.router, refresh)
        self.owners = Remembered()  # response id -> replica URL
        self.sessions = Remembered()  # digest of a conversation's affinity key -> replica URL
        self.failovers = 0  # requests sent again to another replica (logged)
        self.draining = False  # SIGTERM with --drain-seconds: answers close their connections

    # ------------------------------------------------------------------ helpers
    def remember(self, rid: str, url: str) -> None:
        self.owners.put(rid, url)

    @staticmethod
    def error(path: str, status: int, message: str, code: str) -> JSONResponse:
        """The front's own error, in the shape of ``path``'s API (:func:`error_style`)."""
        return APIError(status, message, code=code).response(error_style(path))

    def build(self, method: str, url: str, request: Request, body: bytes, to_router: bool) -> httpx.Request:
        """``request`` to ``url``, its hop-by-hop headers left out."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if to_router and "x-api-key" in headers and "authorization" not in headers:
            # the router forwards Authorization, not x-api-key; the gateway accepts either
            headers["authorization"] = f"Bearer {headers['x-api-key']}"
        return self.client.build_request(method, url, params=request.query_params, headers=headers, content=body)

    async def to_replicas(self, request: Request, key: bytes, body: bytes, prefer: Optional[str] = None,
                          watch: bool = False, exclude: frozenset = frozenset(), retries: int = 1) -> Response:
        """Send to the first replica, in the order of ``key`` (``prefer``'s replica first,
        then the conversation's remembered one, then rendezvous hashing), that takes it:
        past a replica that refuses the connection, and ``retries`` times past one lost
        before the first byte of its answer or draining (``front_upstream.py``)."""
        path = request.url.path
        if not self.replicas.urls:
            await self.replicas.poll_once()  # perhaps the router knows of one by now
            if not self.replicas.urls:
                return self.error(path, 503, "no replica is available (the router holds none as healthy)",
                                  "no_available_replica")
        session = hashlib.blake2b(key, digest_size=16).digest()
        order = self.owners.first(prefer, self.sessions.first(session, self.replicas.order(key)))
        last: Optional[Exception] = None
        for url in order:
            if url in exclude:
                continue
            try:
                opened = await open_upstream(self.client, self.build(request.method, url + path, request, body, False))
            except NotSent as e:  # nothing was sent: the next one
                log.warning("%s: cannot connect (%s); trying the next replica", url, e)
                last = e
                continue
            except Lost as e:
                last = e
                if retries <= 0:
                    return self.error(path, 502, f"the replica at {url} failed before answering: {e}", "replica_error")
                retries -= 1
                self.failovers += 1
                log.warning("%s %s: the replica at %s failed before answering (%s); sending it to the next replica",
                            request.method, path, url, e)
                continue
            except httpx.HTTPError as e:
                return self.error(path, 504 if isinstance(e, httpx.TimeoutException) else 502,
                                  f"the replica at {url} failed: {e}", "replica_error")
            if draining(opened) and retries > 0:
                await opened.aclose()
                retries -= 1
                self.failovers += 1
                last = Exception(f"{url} is draining")
                continue
            if opened.status < 500:
                self.sessions.put(session, url)
            return relay(opened, path, _IdWatcher(self, url) if watch else None)
        return self.error(path, 502, f"no replica took the request: {last}", "replica_unavailable")

    # ------------------------------------------------------------------ routes
    async def to_router(self, request: Request) -> Response:
        """OpenAI chat completions and completions: to the router, unless the request uses
        what the router drops (see :func:`around_router`). When the router cannot be
        reached, or answers that it got no answer from the replica it chose (before any
        byte reached the client), the request goes straight to a replica instead, the
        failed one left out."""
        body = await request.body()
        path = request.url.path
        if around_router(request, body):
            return await self.conversation(request, body)
        try:
            opened = await open_upstream(self.client, self.build(request.method, self.router + path, request, body,
                                                                 True))
        except NotSent as e:
            log.warning("%s %s: the router at %s cannot be reached (%s); sending it to a replica",
                        request.method, path, self.router, e)
            return await self.conversation(request, body)
        except Lost as e:
            self.failovers += 1
            log.warning("%s %s: the router failed before answering (%s); sending it to a replica", request.method,
                        path, e)
            return await self.conversation(request, body, retries=0)
        except httpx.HTTPError as e:
            return self.error(path, 504 if isinstance(e, httpx.TimeoutException) else 502,
                              f"the router at {self.router} failed: {e}", "router_unavailable")
        failed = router_lost(opened)
        if failed is not None:
            await opened.aclose()
            self.failovers += 1
            log.warning("%s %s: the router got no answer from %s (%s); sending it to another replica",
                        request.method, path, failed or "a replica", opened.upstream.headers.get("x-smg-error-code"))
            return await self.conversation(request, body, exclude=frozenset({failed.rstrip("/")}), retries=0)
        return relay(opened, path, strip=CORS_HEADERS)  # the router's own "*": see around_router

    async def conversation(self, request: Request, body: Optional[bytes] = None, exclude: frozenset = frozenset(),
                           retries: int = 1) -> Response:
        """To a replica, by the conversation (:func:`affinity_key`: the client's session
        key, else the conversation's start); a ``previous_response_id`` to the replica that
        made it."""
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
        key = b"response:" + previous.encode() if previous and session_key(path, data) is None \
            else auth + affinity_key(path, data)
        return await self.to_replicas(request, key, body, prefer=previous, watch=path == "/v1/responses",
                                      exclude=exclude, retries=retries)

    async def stored_response(self, request: Request) -> Response:
        """``GET``/``DELETE /v1/responses/{id}``: the replica that made it, else each in turn
        until one has it."""
        if request.method == "OPTIONS":
            return await self.any_replica(request)
        rid = request.path_params["response_id"]
        order = self.owners.first(rid, self.replicas.order(b"response:" + rid.encode()))
        for i, url in enumerate(order):
            try:
                opened = await open_upstream(self.client, self.build(request.method, url + request.url.path, request,
                                                                     b"", False))
            except (NotSent, Lost, httpx.HTTPError):
                continue
            if opened.status == 404 and i < len(order) - 1:
                await opened.aclose()
                continue
            if opened.status == 200:
                self.remember(rid, url)
            return relay(opened, request.url.path)
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
                r = await self.client.send(self.build(request.method, url + request.url.path, request, body, False))
                cors = {k: v for k, v in r.headers.items() if k.lower() in CORS_HEADERS or k.lower() == "vary"}
                try:
                    return url, r.status_code, r.json(), cors
                except ValueError:
                    return url, r.status_code, r.text, cors
            except httpx.HTTPError as e:
                return url, 502, APIError(502, str(e), code="replica_error").body(), {}

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
        """200 while the front knows a replica (it serves them without the router too), else
        503; with the router's state and the requests sent again to another replica."""
        ok = bool(self.replicas.urls)
        return JSONResponse({"status": "ok" if ok else "unavailable", "router": self.router,
                             "router_up": self.replicas.router_up, "workers": self.replicas.urls,
                             "failovers": self.failovers}, status_code=200 if ok else 503)

    def app(self) -> Starlette:
        rules = {ROUTER: self.to_router, REPLICA: self.conversation, STORED: self.stored_response,
                 ANY: self.any_replica, EVERY: self.every_replica, FRONT: self.health}
        methods: dict[str, set] = {}
        for r in ROUTES:  # the gateway's routes, each sent by its rule
            methods.setdefault(r.path, {"OPTIONS"} if r.cluster != FRONT else set()).update(r.methods)
        routes = [Route(path, rules[next(r.cluster for r in ROUTES if r.path == path)], methods=sorted(m))
                  for path, m in methods.items()]
        # anything else (SGLang's own routes, unknown paths) to the router
        routes.append(Route("/{rest:path}", self.to_router,
                            methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]))

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


def main(argv=None) -> None:
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
    p.add_argument("--reuse-port", action="store_true",
                   help="listen with SO_REUSEPORT, so that a new front can start on the port before the old one "
                   "stops (a restart that refuses no connection: docs/cluster.md)")
    p.add_argument("--drain-seconds", type=float, default=None,
                   help="at SIGTERM, keep serving this long, each answer closing its connection, before stopping "
                   "(default 2 with --reuse-port, else 0)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    front = FrontApp(a.router, a.refresh, read_timeout=a.read_timeout)
    drain = a.drain_seconds if a.drain_seconds is not None else (2.0 if a.reuse_port else 0.0)
    serve(CutOnLoss(front.app()), front, a.host, a.port, a.log_level.lower(), a.reuse_port, drain)


if __name__ == "__main__":
    main()
