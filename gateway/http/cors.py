"""CORS whose allowed origins can change while serving: ``--allowed-origins`` (else
``OLLAMA_ORIGINS``) and every origin a tenant's keys are bound to (the tenants file is
reloaded on SIGHUP), all as Ollama's patterns (:mod:`gateway.http.origins`); and, on
Ollama's API alone (``/api/...`` and ``/``), Ollama's default local origins too.

Why Ollama's defaults only there: the clients of Ollama's API (desktop apps, editors,
local web UIs) count on them; on the other APIs, without ``--allowed-origins``, no page may
read an answer (docs/tenants.md, "Open mode and browsers"), and any local page, e.g. a
development server running code from a package registry, would otherwise be able to use
a keyless gateway.

A browser page may read an answer only when the gateway answers its origin here; the
key check binds after that (:func:`gateway.tenancy.auth.identify`): a key bound to other
origins is a 403 even from an origin another tenant allows.
"""

from __future__ import annotations

from typing import Callable, Collection

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http.origins import OLLAMA_LOCAL_ORIGINS, OriginPatterns, patterns_of

EXPOSED = ["Retry-After", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
           "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
           "x-ratelimit-reset-tokens"]


def ollama_path(path: str) -> bool:
    """Whether ``path`` is one of Ollama's API (``/api/...``, or ``/``, where Ollama
    answers "Ollama is running")."""
    return path == "/" or path == "/api" or path.startswith("/api/")


class _PatternCORS(CORSMiddleware):
    """Starlette's CORS middleware, answering the origins ``patterns`` match and those
    ``more()`` returns at the time of each request (always echoed, never ``*``)."""

    def __init__(self, app: ASGIApp, patterns: OriginPatterns, more: Callable[[], frozenset[str]]):
        super().__init__(app, allow_origins=(), allow_methods=["GET", "HEAD", "POST", "DELETE", "OPTIONS"],
                         allow_headers=["*"], expose_headers=EXPOSED, max_age=600)
        self.patterns, self.more = patterns, more

    def is_allowed_origin(self, origin: str) -> bool:
        return self.patterns.match(origin) or patterns_of(frozenset(self.more())).match(origin)


class DynamicCORS:
    """CORS for the whole app: ``allow_origins`` and ``more()`` on every path, and
    Ollama's default local origins (:data:`OLLAMA_LOCAL_ORIGINS`) on :func:`ollama_path`.

    Args:
        app: the app inside.
        allow_origins: origins and patterns always allowed (``chrome-extension://ID``,
            ``chrome-extension://*``, ``moz-extension://*``, ``https://host``, ``*``).
        more: called per request: further allowed origins and patterns (the tenants').
    """

    def __init__(self, app: ASGIApp, allow_origins: Collection[str], more: Callable[[], Collection[str]]):
        self.everywhere = _PatternCORS(app, OriginPatterns(allow_origins), more)
        self.ollama = _PatternCORS(app, OriginPatterns([*allow_origins, *OLLAMA_LOCAL_ORIGINS]), more)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        inner = self.ollama if ollama_path(scope.get("path", "")) else self.everywhere
        await inner(scope, receive, send)
