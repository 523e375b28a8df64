"""CORS whose allowed origins can change while serving: ``--allowed-origins`` and every
origin a tenant's keys are bound to (the tenants file is reloaded on SIGHUP).

A browser page may read an answer only when the gateway answers its origin here; the
key check binds after that (:func:`gateway.tenancy.auth.identify`): a key bound to other
origins is a 403 even from an origin another tenant allows.
"""

from __future__ import annotations

from typing import Callable, Collection

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

EXPOSED = ["Retry-After", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
           "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
           "x-ratelimit-reset-tokens"]


class DynamicCORS(CORSMiddleware):
    """Starlette's CORS middleware, allowing ``allow_origins`` and whatever ``more()``
    returns at the time of each request (e.g. the tenants' origins).

    Args:
        app: the app inside.
        allow_origins: origins always allowed (``chrome-extension://ID``,
            ``moz-extension://ID`` and ``https://host`` forms alike).
        more: called per request: further allowed origins.
    """

    def __init__(self, app: ASGIApp, allow_origins: Collection[str], more: Callable[[], Collection[str]]):
        super().__init__(app, allow_origins=list(allow_origins), allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                         allow_headers=["*"], expose_headers=EXPOSED, max_age=600)
        self.more = more

    def is_allowed_origin(self, origin: str) -> bool:
        return super().is_allowed_origin(origin) or origin.rstrip("/") in self.more()
