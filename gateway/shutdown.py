"""Signals of ``mlx-gateway serve``: SIGTERM and SIGINT drain the server, SIGHUP reloads
the tenants file.

On the first SIGTERM (or SIGINT) the server drains: ``front.draining`` is set, so new
generation requests get 503 ``shutting_down`` with ``Retry-After`` and ``/health``
answers 503, while the requests already running go on. When they have all ended, or
``--shutdown-grace`` seconds after the signal, uvicorn stops. Requests still running at
the end of the grace period are cut first (:meth:`EngineLoop.stop <scheduler.engine.loop.EngineLoop.stop>`): each stream gets its
protocol's final error event (503), each cut request a WARNING line naming it and
``finish_reason: "error"`` in its request log record. A second signal cuts them at once;
a third exits without waiting for the connections to close.

The handlers are installed with ``loop.add_signal_handler``, so they run as ordinary
callbacks on the event loop. A ``signal.signal`` handler runs between two bytecodes of
whatever the loop thread was doing, and could re-enter a lock held there, such as
prometheus_client's metric locks, and deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Callable, Optional

import uvicorn

from gateway.front import Front, running_calls
from gateway.models.registry import ModelRegistry

log = logging.getLogger("mlx_gateway")

GRACE_ENDED = "server shutting down: the grace period ended"
CUT_AT_ONCE = "server shutting down: stopped at once by a second signal"
UVICORN_GRACE = 5.0  # seconds uvicorn waits for connections to close once the drain is over


class GatewayServer(uvicorn.Server):
    """uvicorn's server with the gateway's signal handling (see the module docstring).

    Args:
        config: uvicorn's settings.
        front: what requests meet; its ``draining`` is set at the first SIGTERM/SIGINT.
        models: the model registry, whose engine loop a cut stops.
        on_reload: called on the event loop at each SIGHUP (None: SIGHUP keeps its
            default action).
    """

    def __init__(self, config: uvicorn.Config, front: Front, models: ModelRegistry,
                 on_reload: Optional[Callable[[], object]] = None):
        super().__init__(config)
        self.front, self.models = front, models
        self.on_reload = on_reload
        self.drain_task: Optional[asyncio.Task] = None
        self._signals = 0
        self._reload_queued = False
        self._cut_now: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @contextlib.contextmanager
    def capture_signals(self):
        """Handle the signals on the running loop while uvicorn serves (uvicorn enters
        this around serving). Off the main thread nothing is installed; where the loop
        cannot take handlers (Windows), uvicorn's ``signal.signal`` handlers are kept and
        :meth:`handle_exit` passes the signal on to the loop."""
        self._loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handlers: dict[int, Callable] = {signal.SIGTERM: self.begin_shutdown, signal.SIGINT: self.begin_shutdown}
        if self.on_reload is not None and hasattr(signal, "SIGHUP"):
            handlers[signal.SIGHUP] = self._reload
        installed = []
        try:
            for sig, handler in handlers.items():
                self._loop.add_signal_handler(sig, handler, sig)
                installed.append(sig)
        except NotImplementedError:  # Windows' event loops take no signal handlers
            for sig in installed:
                self._loop.remove_signal_handler(sig)
            with super().capture_signals():
                yield
            return
        try:
            yield
        finally:
            for sig in installed:
                self._loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's ``signal.signal`` handler, used only where the loop takes none: start
        the shutdown on the loop (nothing else runs inside the handler)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_shutdown, sig)
        else:
            super().handle_exit(sig, frame)

    def _reload(self, sig: int) -> None:
        """SIGHUP: reload once the callbacks already queued have run, so that a burst of
        signals (one callback each) makes one reload."""
        if not self._reload_queued:
            self._reload_queued = True
            asyncio.get_running_loop().call_soon(self._run_reload, signal.Signals(sig).name)

    def _run_reload(self, name: str) -> None:
        self._reload_queued = False
        log.info("%s: reloading the tenants", name)
        try:
            self.on_reload()
        except Exception:
            log.exception("reloading the tenants failed; the current tenants stay")

    def begin_shutdown(self, sig: int) -> None:
        """Start draining at the first SIGTERM/SIGINT; a second one cuts the requests still
        running at once, a third one exits without waiting for the connections."""
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals == 1:
            self.front.draining = True
            self._cut_now = asyncio.Event()
            self.drain_task = asyncio.get_running_loop().create_task(self.drain(name))
        elif self._signals == 2:
            log.warning("%s while draining: cutting the requests still running now", name)
            self._cut_now.set()
        else:
            log.warning("%s a third time: exiting without waiting for the connections", name)
            self.force_exit = self.should_exit = True

    async def drain(self, name: str) -> None:
        """Wait, at most ``config.shutdown_grace`` seconds, for the running requests to end,
        cut those left, then let uvicorn stop (``should_exit``)."""
        grace = self.front.config.shutdown_grace
        try:
            if not self.models.loop.alive:
                log.warning("%s: shutting down (no model engine is running)", name)
                return
            engines = [h.engine for h in self.models.handles()]
            log.warning("%s: draining: %d requests running, %d waiting; new requests get 503; those still "
                        "running in %g s will be cut", name, sum(e.num_running for e in engines),
                        sum(e.num_waiting for e in engines), grace)
            if await self._wait_done(grace):
                log.info("drained: every request has ended; shutting down")
            else:
                await self._cut(CUT_AT_ONCE if self._cut_now.is_set() else GRACE_ENDED)
        except Exception:
            log.exception("draining failed; shutting down")
        finally:
            self.should_exit = True

    async def _wait_done(self, grace: float) -> bool:
        """True once every model's engine is idle and every admitted call has been
        answered; False when ``grace`` seconds pass first, or a second signal comes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        cut_now = asyncio.ensure_future(self._cut_now.wait())
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                idle = asyncio.ensure_future(asyncio.to_thread(self._wait_idle, left))
                await asyncio.wait({idle, cut_now}, return_when=asyncio.FIRST_COMPLETED)
                if cut_now.done() or not idle.result():
                    return False
                if not running_calls():
                    return True
                await asyncio.sleep(0.05)  # answers still going out, or prompts not yet submitted
        finally:
            cut_now.cancel()

    def _wait_idle(self, timeout: float) -> bool:
        """Block until every loaded model's engine is idle; False on timeout."""
        deadline = time.monotonic() + timeout
        for h in self.models.handles():
            if not h.engine.wait_idle(max(0.0, deadline - time.monotonic())):
                return False
        return True

    async def _cut(self, reason: str) -> None:
        """Stop the engine loop: every request ends with an error event (503, ``reason``),
        each logged as a WARNING and marked in its request record."""
        for call in running_calls():
            r = call.record
            r.error = reason
            log.warning("cutting request %s (tenant %s, %s): still running: %s",
                        r.request_id, r.tenant, r.endpoint, reason)
        await asyncio.to_thread(self.models.loop.stop, reason=reason)
