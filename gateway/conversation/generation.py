"""The async side of one request in the engine: submit, receive events, cancel."""

from __future__ import annotations

import asyncio
import collections
import functools
import time
import uuid
import weakref
from typing import AsyncIterator

from gateway.http.errors import APIError
from scheduler import Engine, EngineDead, EngineOverloaded, EngineRequest, SamplingParams, TenantQueueFull
from scheduler.lora import UnknownAdapter
from scheduler.request import DoneEvent, ErrorEvent, Event, wake_after


class KeepAlive:
    """Yielded by :meth:`Generation.events` when no event came for ``keepalive`` seconds."""


# The generations not yet garbage, for a fatal engine fault to end (gateway.engine_fault).
live: "weakref.WeakSet[Generation]" = weakref.WeakSet()


def new_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class _Hop:
    """The way from the engine thread to one event loop: each batch of events goes
    straight into its generation's buffer (a deque: appends are thread-safe), and one
    ``call_soon_threadsafe`` (one write to the loop's self-pipe) wakes the readers of every
    generation posted to meanwhile, after the engine's burst of a step's events
    (:func:`scheduler.request.one_wake_up`): one wake-up a step, no queue operations."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._pending: collections.deque = collections.deque()
        self._scheduled = False
        self._wake = functools.partial(loop.call_soon_threadsafe, self._deliver)

    def post(self, gen: "Generation", events: list[Event]) -> None:
        """Put ``events`` in ``gen``'s buffer and wake its reader on the loop (any thread)."""
        gen._buffer.append(events)
        self._pending.append(gen)
        if not self._scheduled:
            self._scheduled = True
            if not wake_after(self._wake):
                self._wake()

    def _deliver(self) -> None:
        self._scheduled = False  # before draining: a batch posted meanwhile schedules anew
        pending = self._pending
        while pending:
            waiter = pending.popleft()._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


_hops: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hop]" = weakref.WeakKeyDictionary()


class Generation:
    """One request running in the engine, seen from the event loop.

    The engine thread's events go into its buffer, its reader woken once a step (:class:`_Hop`).
    Iterating yields :mod:`scheduler.request` events until a ``DoneEvent`` or
    ``ErrorEvent``. :meth:`cancel` is idempotent and is called when the client leaves.
    ``id`` is the request's (:class:`gateway.conversation.books.Books` makes it).
    """

    def __init__(self, id: str, engine: Engine, tokens: list[int], params: SamplingParams, checkpoints: list[int],
                 namespace: str = "default", tenant: str = "default", weight: float = 1.0,
                 max_queued: int | None = None, mask=None, priority: int = 1, keep: dict | None = None,
                 processors: list | None = None):
        self.engine = engine
        self.id = id
        self.arrival = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._buffer: collections.deque[list[Event]] = collections.deque()  # batches from the engine thread
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits for a batch
        self._left = 0  # events of the batch being read not yet yielded
        self._since = 0.0  # the loop's time when the reader began waiting
        self._alarm: asyncio.TimerHandle | None = None  # the keep-alive timer (events)
        self._hop = _hops.get(self._loop) or _hops.setdefault(self._loop, _Hop(self._loop))
        self.finished = False
        sink = functools.partial(self._hop.post, self)  # events go straight into its buffer
        self.request = EngineRequest(id=self.id, tokens=tokens, params=params, sink=sink,
                                     checkpoints=checkpoints, namespace=namespace, tenant=tenant, weight=weight,
                                     max_queued=max_queued, mask=mask, priority=priority, keep=dict(keep or {}),
                                     processors=list(processors or []))
        live.add(self)

    def fail(self, status: int, message: str) -> None:
        """End the request with an error event from outside the engine (any thread): the
        engine loop is stalled or dead and will send nothing more."""
        if not self.finished:
            self._hop.post(self, [ErrorEvent(status, message)])

    def submit(self) -> None:
        """Hand the request to the engine.

        Raises:
            APIError: 503 when the engine is dead or its queue is full; 429 when the
                tenant's own queue is full.
        """
        try:
            self.engine.submit(self.request)
        except EngineDead as e:
            raise APIError(503, f"the model engine is not available: {e}", code="engine_unavailable")
        except EngineOverloaded as e:
            raise APIError(503, f"the server is overloaded: {e}", code="overloaded", headers={"Retry-After": "1"})
        except UnknownAdapter as e:  # unloaded by an admin since the call leased it
            raise APIError(503, f"the LoRA adapter {e} was unloaded meanwhile", code="lora_unloaded",
                           headers={"Retry-After": "1"})
        except TenantQueueFull as e:
            raise APIError(429, f"too many queued requests: {e}", code="queue_full", headers={"Retry-After": "1"})

    async def events(self, keepalive: float | None = None) -> AsyncIterator[Event | KeepAlive]:
        """Engine events until the request ends; a :class:`KeepAlive` after each
        ``keepalive`` seconds (if set) without one. One timer a stream, moved on only when
        it rings (:meth:`_ring`): ``asyncio.wait_for`` at each wait cost a timer, a second
        future and a callback for every batch of events, a stream's every token."""
        buffer, loop = self._buffer, self._loop
        try:
            while not self.finished:
                if not buffer:
                    self._waiter, self._since = loop.create_future(), loop.time()
                    if keepalive is not None and self._alarm is None:
                        self._alarm = loop.call_later(keepalive, self._ring, keepalive)
                    try:
                        woke = await self._waiter
                    finally:
                        self._waiter = None
                    if woke is KeepAlive:
                        yield KeepAlive()
                    continue
                batch = buffer.popleft()
                self._left = len(batch)
                for event in batch:
                    self._left -= 1
                    if isinstance(event, (DoneEvent, ErrorEvent)):
                        self.finished = True
                    yield event
        finally:
            if self._alarm is not None:
                self._alarm.cancel()
                self._alarm = None

    def _ring(self, keepalive: float) -> None:
        """The keep-alive timer of :meth:`events`: a reader waiting for ``keepalive``
        seconds is woken for a :class:`KeepAlive`; one waiting less, later."""
        self._alarm, waiter = None, self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: its next wait sets the timer again
        left = self._since + keepalive - self._loop.time()
        if left > 0:
            self._alarm = self._loop.call_later(left, self._ring, keepalive)
        else:
            waiter.set_result(KeepAlive)

    def ready(self) -> bool:
        """More events are at hand: :meth:`events` would yield the next without waiting
        (its reader is behind the engine)."""
        return self._left > 0 or bool(self._buffer)

    def cancel(self, reason: str = "cancelled") -> None:
        """End the request early; ``reason`` is its finish reason (``"stop"`` when a stop
        string matched, ``"cancelled"`` when the client left)."""
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.id, reason)
