"""Registering a gateway with SGLang's router (sglang-router), and taking it out again.

A router started with ``--worker-urls`` knows its replicas from the start and health-checks
them; a replica it was not given (a new one, on another machine or port) must register
itself, with ``POST /workers {"url": ...}``. And a replica that drains (SIGTERM) answers new
requests 503 until the router's health checks notice (``--health-failure-threshold`` x
``--health-check-interval-secs``); taking itself out with ``DELETE /workers/{id}`` as the
drain begins spares its clients those 503s. :class:`RouterLink` does both, in one daemon
thread (``mlx-gateway serve --router-url URL [--advertise-url URL]``, which calls
:func:`link_to_router`; or, beside a gateway, ``python -m gateway.router_link --router URL
--worker URL``):

- once the gateway answers ``/health`` with 200 (its models loaded), it registers
  ``worker_url``, and checks every ``interval`` seconds that the router still lists it
  (a restarted router has forgotten the replicas registered with it), registering it again
  when not;
- once the gateway drains (``draining()`` turns true, or ``/health`` answers 503
  ``draining``, or stops answering), it deregisters it, once; in the stand-alone form it
  registers it again when the gateway (restarted) answers 200 again.

Errors talking to the router are logged (a WARNING the first time) and retried at the
next check; nothing here stops the gateway. The router's control plane may require a key
(``--control-plane-api-keys``): give it in ``MLX_GATEWAY_ROUTER_KEY``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import Callable, Optional
from urllib.parse import quote

import httpx

log = logging.getLogger("mlx_gateway")

KEY_ENV = "MLX_GATEWAY_ROUTER_KEY"


def advertised_url(host: str, port: int) -> str:
    """The URL a router reaches this gateway at, from ``--host``/``--port``: the machine's
    host name for a wildcard address (``0.0.0.0``, ``::``), ``[addr]`` for IPv6."""
    if host in ("", "0.0.0.0", "::"):
        import socket

        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def local_health_url(host: str, port: int) -> str:
    """This gateway's ``/health`` as it can ask itself: loopback for a wildcard ``--host``."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "[::1]"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/health"


def link_to_router(router_url: str, host: str, port: int, advertise_url: Optional[str] = None,
                   draining: Optional[Callable[[], bool]] = None) -> "RouterLink":
    """Start keeping the gateway serving on ``host``:``port`` registered with the router at
    ``router_url``, as ``advertise_url`` (default :func:`advertised_url`), until
    ``draining()`` (``mlx-gateway serve --router-url``)."""
    quiet = logging.getLogger("httpx")
    if quiet.level == logging.NOTSET:  # else a log line per check of the router
        quiet.setLevel(logging.WARNING)
    return RouterLink(router_url, advertise_url or advertised_url(host, port), local_health_url(host, port),
                      draining=draining).start()


class RouterLink:
    """Keeps ``worker_url`` registered with the router at ``router_url`` while the gateway
    serves, and deregisters it when it drains (see the module docstring).

    Args:
        router_url: the router's base URL (its ``/workers`` API).
        worker_url: the URL the router reaches this gateway at.
        health_url: where to ask whether the gateway serves (default ``worker_url/health``).
        draining: in-process, ``lambda: front.draining``: deregister as soon as it is true
            (without it, a 503 ``draining`` from ``health_url`` says so).
        interval: seconds between two checks that the router still lists the gateway.
        poll: seconds between two looks at ``draining``/``health_url``.
        api_key: the router's control-plane key (default ``MLX_GATEWAY_ROUTER_KEY``).
    """

    def __init__(self, router_url: str, worker_url: str, health_url: Optional[str] = None,
                 draining: Optional[Callable[[], bool]] = None, interval: float = 5.0, poll: float = 0.1,
                 api_key: Optional[str] = None):
        self.router_url = router_url.rstrip("/")
        self.worker_url = worker_url.rstrip("/")
        self.health_url = health_url or f"{self.worker_url}/health"
        self.draining = draining
        self.interval, self.poll = interval, poll
        key = api_key if api_key is not None else os.environ.get(KEY_ENV, "").strip()
        self.client = httpx.Client(timeout=5, headers={"Authorization": f"Bearer {key}"} if key else None)
        self.registered = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._warned = False

    # ------------------------------------------------------------------ router API
    def listed(self) -> list[str]:
        """The router's ids for this gateway's URL (usually one; none when not listed)."""
        r = self.client.get(f"{self.router_url}/workers")
        r.raise_for_status()
        return [w.get("id") or w["url"] for w in r.json().get("workers", [])
                if w.get("url", "").rstrip("/") == self.worker_url]

    def register(self) -> None:
        """``POST /workers {"url": worker_url}`` (the router checks the gateway, then adds it)."""
        r = self.client.post(f"{self.router_url}/workers", json={"url": self.worker_url})
        r.raise_for_status()
        self.registered = True
        log.info("registered with the router at %s as %s", self.router_url, self.worker_url)

    def deregister(self) -> None:
        """``DELETE /workers/{id}`` for every entry of this gateway's URL."""
        for wid in self.listed():
            self.client.delete(f"{self.router_url}/workers/{quote(wid, safe='')}").raise_for_status()
        self.registered = False
        log.info("deregistered from the router at %s (%s)", self.router_url, self.worker_url)

    # ------------------------------------------------------------------ the gateway
    def state(self) -> str:
        """``serving``, ``draining``, or ``down`` (not answering, or loading)."""
        if self.draining is not None and self.draining():
            return "draining"
        try:
            r = self.client.get(self.health_url)
        except httpx.HTTPError:
            return "down"
        if r.status_code == 200:
            return "serving"
        try:
            status = r.json().get("status")
        except ValueError:
            status = None
        return "draining" if status == "draining" else "down"

    # ------------------------------------------------------------------ the thread
    def start(self) -> "RouterLink":
        self._thread = threading.Thread(target=self.run, name="router-link", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def close(self) -> None:
        """Stop the thread and deregister the gateway if it is still registered (errors
        logged, never raised: the gateway is stopping)."""
        self.stop()
        if self.registered:
            try:
                self.deregister()
            except httpx.HTTPError as e:
                self._failed("deregistering", e)
        self.client.close()

    def _failed(self, what: str, e: Exception) -> None:
        (log.debug if self._warned else log.warning)("router link: %s at %s failed: %s", what, self.router_url, e)
        self._warned = True

    def run(self) -> None:
        next_check = 0.0
        while not self._stop.is_set():
            if self.draining is not None:  # in-process: after the first 200, only the drain matters
                state = "draining" if self.draining() else "serving" if self.registered else self.state()
            else:
                state = self.state()
            try:
                if state == "serving":
                    if time.monotonic() >= next_check:
                        if not self.registered or not self.listed():
                            self.register()
                        next_check = time.monotonic() + self.interval
                elif state == "draining":
                    if self.registered:
                        self.deregister()
                    if self.draining is not None:
                        return  # in-process: the drain ends with the process
                elif self.registered:
                    # stand-alone, the gateway gone (a drain with nothing in flight ends at
                    # once): take it out, rather than leave the router listing it unhealthy;
                    # it is registered again once it serves
                    self.deregister()
                    next_check = 0.0
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self._failed("deregistering" if state == "draining" else "registering", e)
                next_check = time.monotonic() + min(self.interval, 2.0)
            self._stop.wait(self.poll)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway.router_link",
                                description="Keep a gateway registered with SGLang's router while it serves, "
                                "and deregister it when it drains (docs/cluster.md).")
    p.add_argument("--router", required=True, help="the router's URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--worker", required=True, help="the URL the router reaches the gateway at")
    p.add_argument("--health-url", help="where to ask the gateway whether it serves (default WORKER/health)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between two checks that the router lists the gateway (default %(default)s)")
    p.add_argument("--poll", type=float, default=0.5,
                   help="seconds between two looks at the gateway's /health (default %(default)s)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    link = RouterLink(a.router, a.worker, a.health_url, interval=a.interval, poll=a.poll)
    try:
        link.run()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
