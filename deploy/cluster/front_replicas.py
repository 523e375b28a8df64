"""Which replicas the cluster front (``front.py``) sends to, and which one a conversation
or a stored response belongs to.

- :class:`Replicas`: the replicas the router holds as healthy (its ``GET /workers``), in
  rendezvous-hashing order for a key;
- :class:`Remembered`: the replica that made a response, or that served a conversation,
  so that its next requests go back to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict

import httpx

log = logging.getLogger("mlx_gateway.front")

REMEMBERED = 100_000  # response ids and conversations -> replica, least recently used first out


class Replicas:
    """The replicas the router holds as healthy, refreshed from its ``GET /workers``.

    While the router does not answer, the last list stays; so it does while the router
    holds none as healthy (a router that just started has not yet added or checked its
    replicas): a replica that is really gone refuses the connection, and the front tries
    the next, or answers 502.
    """

    def __init__(self, client: httpx.AsyncClient, router: str, refresh: float):
        self.client, self.router, self.refresh = client, router.rstrip("/"), refresh
        self.urls: list[str] = []
        self.router_up = False

    async def poll_once(self) -> None:
        try:
            r = await self.client.get(f"{self.router}/workers", timeout=5)
            r.raise_for_status()
            workers = [w for w in r.json().get("workers", []) if w.get("worker_type", "regular") == "regular"]
            urls = sorted({w["url"].rstrip("/") for w in workers if w.get("is_healthy")})
            if not urls and self.urls:
                urls = self.urls  # none yet (a router that just started): keep the last ones
            if urls != self.urls:
                log.info("replicas: %s", ", ".join(urls) or "none")
            if not self.router_up:
                log.info("the router at %s answers", self.router)
            self.urls, self.router_up = urls, True
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            if self.router_up:
                log.warning("the router at %s does not answer GET /workers (%s); keeping the last replicas", self.router, e)
            self.router_up = False

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.refresh)

    def order(self, key: bytes) -> list[str]:
        """The replicas, best first, for ``key`` (rendezvous hashing: a replica that goes or
        comes moves only its own share of the keys)."""
        return sorted(self.urls, key=lambda u: hashlib.blake2b(key + u.encode(), digest_size=8).digest(),
                      reverse=True)


class Remembered(OrderedDict):
    """A bounded map (least recently used out first) from a response id or a conversation
    to the replica that served it."""

    def put(self, key, url: str) -> None:
        self[key] = url
        self.move_to_end(key)
        while len(self) > REMEMBERED:
            self.popitem(last=False)

    def first(self, key, order: list[str]) -> list[str]:
        """``order`` with the remembered replica of ``key`` first (when it is in ``order``)."""
        owner = self.get(key) if key else None
        if owner in order:
            return [owner] + [u for u in order if u != owner]
        return order
