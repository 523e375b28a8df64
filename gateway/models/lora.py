"""The LoRA adapters a gateway serves: names, paths and base models, and their loading.

An adapter is served under a name of its own (``--lora-modules NAME=PATH``, or ``POST
/v1/load_lora_adapter``) on a base model; a request names it as its ``model`` in any API.
The catalog here holds what is served; what is resident is the base engine's
(:class:`scheduler.lora.AdapterSet`, at most ``--max-loras`` adapters, the least recently
used idle one unloaded to make room and read again from its path when a request needs it;
while every slot is held by running requests, a request for another adapter waits its turn).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import anyio

from gateway.http.errors import APIError
from gateway.http.sse import wait_for_disconnect
from scheduler import EngineDead
from scheduler.lora import AdapterBusy, AdapterError, AdapterNoRoom, UnknownAdapter, adapters_of, read_files


@dataclass(frozen=True)
class Adapter:
    """A served adapter: its ``name``, its directory ``path`` and the ``base`` model's served name."""

    name: str
    path: str
    base: str


def parse_lora_module(item) -> tuple[str, str]:
    """One ``--lora-modules`` entry as ``(name, path)``: ``NAME=PATH``, vLLM's JSON form
    ``{"name": NAME, "path": PATH}`` (as text or a dict), or a ``(name, path)`` pair.

    Raises:
        ValueError: none of these, or an empty name or path.
    """
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except ValueError as e:
            raise ValueError(f"--lora-modules: not JSON: {e}") from None
    if isinstance(item, dict):
        name, path = item.get("name"), item.get("path")
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        name, path = item
    elif isinstance(item, str):
        name, sep, path = item.partition("=")
        name, path = (name, path) if sep else (None, None)
    else:
        name = path = None
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
    return name.strip(), str(path).strip()


def lora_modules(items) -> list[tuple[str, str]]:
    """Every ``--lora-modules`` entry (a list, or a ``{name: path}`` dict) as ``(name, path)``.

    Raises:
        ValueError: see :func:`parse_lora_module`.
    """
    if isinstance(items, dict):
        items = list(items.items())
    return [parse_lora_module(i) for i in items or []]


class AdapterCatalog:
    """The served adapters by name (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_name: dict[str, Adapter] = {}

    def add(self, adapter: Adapter) -> None:
        with self._lock:
            self._by_name[adapter.name] = adapter

    def remove(self, name: str) -> Optional[Adapter]:
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: Optional[str]) -> Optional[Adapter]:
        with self._lock:
            return self._by_name.get(name) if name is not None else None

    def all(self) -> list[Adapter]:
        with self._lock:
            return list(self._by_name.values())

    def base_of(self, name: Optional[str]) -> Optional[str]:
        """The base model's name when ``name`` is an adapter's, else ``name``."""
        a = self.get(name)
        return a.base if a is not None else name


def adapter_set(handle, cfg):
    """The engine-side adapter set of a loaded model (made on first use with the
    server's ``--max-loras`` and ``--max-lora-rank``)."""
    return adapters_of(handle.engine.model, create=True, max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank)


LOAD_TIMEOUT = 300.0  # seconds a load waits for its engine


def load_on_engine(front, handle, adapter: Adapter, replace: bool = False) -> Optional[Callable[[], None]]:
    """Make ``adapter`` resident on ``handle``'s engine (blocking; run it in a worker
    thread): read its files here (numpy, off the engine thread), then install them on the
    engine between two steps, within the memory budget (the model's least recently used
    idle adapters are unloaded to make room). Counted in ``mlx_gateway_lora_*``.

    Args:
        replace: install it even when it is resident (an admin's load). Else (a request's)
            it is leased in the same engine call (:meth:`scheduler.lora.AdapterSet.lease`,
            a load made meanwhile leased instead), so that no load unloads it before the
            request runs, and the lease's release is returned.

    Raises:
        APIError: 400 when it does not fit the model (:class:`scheduler.lora.AdapterError`),
            503 when the memory budget has no room for it.
        AdapterBusy: every adapter slot is held by running requests (not counted here).
        EngineDead, TimeoutError: see :meth:`scheduler.engine.Engine.call`.
    """
    if handle.kind == "embedding":
        raise APIError(400, f"the model '{handle.name}' is an embedding model: LoRA adapters apply to generating "
                       "models only", param="base_model_name", code="invalid_lora_adapter")
    found = adapter_set(handle, front.config)
    m, start, result = front.metrics.lora, time.monotonic(), None

    taken, lock = [], threading.Lock()  # the lease; [None]: the caller timed out and let go of it

    def install(files, room):  # on the engine thread, where every install runs: none between it and the lease
        held, result = (None if replace else found.lease(adapter.name, adapter.path)), "resident"
        if held is None:
            found.install(adapter.name, files, room)
            held, result = (None if replace else found.lease(adapter.name)), "loaded"
        with lock:  # (a call that timed out may run later: nobody else would let go of its lease)
            if taken and held is not None:
                held()
            taken.append(held)
        return held, result

    try:
        files = read_files(adapter.path)
        slot = front.models.find(adapter.base)
        room = front.models.adapter_room(slot) if slot is not None else None
        held, result = handle.engine.call(lambda: install(files, room), timeout=LOAD_TIMEOUT)
        return held
    except TimeoutError:
        with lock:
            for held in taken:
                if held is not None:
                    held()
            taken.append(None)
        raise
    except AdapterError as e:
        result = "invalid"
        raise APIError(400, f"LoRA adapter '{adapter.name}' cannot be loaded: {e}", param="lora_path",
                       code="invalid_lora_adapter")
    except AdapterNoRoom as e:
        result = "no_room"
        raise APIError(503, f"LoRA adapter '{adapter.name}' cannot be loaded: {e}", code="memory_budget_exceeded",
                       headers={"Retry-After": "5"})
    finally:
        if result not in (None, "resident"):
            m.loads.labels(handle.name, result).inc()
        if result == "loaded":
            m.load_seconds.labels(handle.name).observe(time.monotonic() - start)
        resident_changed(front, handle)


def resident_changed(front, handle) -> None:
    """Set the model's resident-adapter gauges and give the prefix caches what is left."""
    found = adapters_of(handle.engine.model)
    if found is None:
        return
    front.metrics.lora.resident.labels(handle.name).set(len(found.resident_names()))
    front.metrics.lora.bytes.labels(handle.name).set(found.nbytes)
    front.models.charges_changed()


class SlotWaiters:
    """The calls waiting for a slot of one model's adapters (on the event loop), in arrival
    order: only the head loads, when :meth:`scheduler.lora.AdapterSet.slot_free` says it may,
    woken by the set's ``on_free`` (an adapter's last request or lease ended, on any thread)
    and by the call before it leaving. Bounded as the engine's waiting queue is: by
    ``--max-waiting`` (with the engine's waiting requests) and the tenant's ``max_queued``."""

    def __init__(self):
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the first waiter's
        self.queue: deque[tuple[str, asyncio.Event]] = deque()  # (tenant, its wake-up)

    def freed(self) -> None:
        """A slot may have freed (any thread)."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop has closed: the server stopped
            pass

    def _wake(self) -> None:
        if self.queue:
            self.queue[0][1].set()

    def check_room(self, tenant, engine) -> None:
        """Raises:
            APIError: 503 ``overloaded`` when ``--max-waiting`` requests already wait here
                and in ``engine``'s queue; 429 ``queue_full`` when the tenant's ``max_queued``
                wait here."""
        waiting = len(self.queue) + engine.num_waiting
        if waiting >= engine.max_waiting:
            raise APIError(503, f"the server is overloaded: {waiting} requests are already waiting",
                           code="overloaded", headers={"Retry-After": "1"})
        mine = sum(t == tenant.name for t, _ in self.queue)
        if tenant.max_queued is not None and mine >= tenant.max_queued:
            raise APIError(429, f"too many queued requests: {mine} requests of this tenant are already waiting",
                           code="queue_full", headers={"Retry-After": "1"})

    async def wait(self, call, found, load: Callable[[], Awaitable[Optional[Callable]]],
                   resident: Callable[[], Optional[Callable]]) -> Callable:
        """Wait (after :meth:`check_room`) for the call's turn, then ``resident()`` (its
        adapter's lease, None when it is not resident: a call before it may have loaded it)
        or, once a slot of ``found`` is free, ``await load()`` (None when the slot was taken
        meanwhile: it waits again); what they gave.

        Raises:
            APIError: 499 when the client left while it waited; what ``load`` raises.
        """
        self._loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self.queue.append(me := (call.tenant.name, wake))
        gone, woken = asyncio.ensure_future(wait_for_disconnect(call.request.receive)), None
        try:
            while True:
                wake.clear()
                if self.queue[0] is me and ((held := resident()) is not None
                                            or found.slot_free() and (held := await load()) is not None):
                    return held
                if not wake.is_set():  # (set while it loaded: it looks again at once)
                    woken = asyncio.ensure_future(wake.wait())
                    await asyncio.wait([woken, gone], return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()  # (and in the finally: the call may be cancelled while it waits)
                if gone.done():
                    raise APIError(499, "the client left while its request waited for a LoRA adapter slot",
                                   code="client_closed")
        finally:
            gone.cancel()
            if woken is not None:
                woken.cancel()
            self.queue.remove(me)
            self._wake()


_waiters: "weakref.WeakKeyDictionary[object, SlotWaiters]" = weakref.WeakKeyDictionary()  # by AdapterSet


def waiters_of(found) -> SlotWaiters:
    """The :class:`SlotWaiters` of an :class:`scheduler.lora.AdapterSet` (made, and made its
    ``on_free``, at first use)."""
    w = _waiters.get(found)
    if w is None:
        w = _waiters[found] = SlotWaiters()
        found.on_free = w.freed
    return w


async def ready_adapter(call, handle) -> None:
    """Make the call's adapter resident on ``handle`` and lease it until the call is answered
    (a worker thread reads it and waits for the engine only when it must be read). While
    every adapter slot is held by running requests, or other calls wait for one, the call
    waits (:class:`SlotWaiters`; counted as a ``busy`` load), and loads it when a slot frees
    (the least recently used idle adapter unloaded).

    Raises:
        APIError: 404 when it stopped being served, 400/503 from :func:`load_on_engine`,
            503/429 from :meth:`SlotWaiters.check_room`, 499 from :meth:`SlotWaiters.wait`,
            503 when the engine is not running or did not answer in time.
    """
    front = call.front
    found = adapter_set(handle, front.config)

    def served() -> Adapter:
        adapter = front.adapters.get(call.adapter)
        if adapter is None:
            raise APIError(404, "the LoRA adapter is not served any more", param="model", code="model_not_found")
        return adapter

    def kept(held: Optional[Callable[[], None]]):  # released once the call is answered, however it ends
        if held is not None:
            call.request.state.on_close.append(held)
        return held

    async def load() -> Optional[Callable[[], None]]:
        adapter = served()
        try:
            return await anyio.to_thread.run_sync(lambda: kept(load_on_engine(front, handle, adapter)))
        except AdapterBusy:
            return None
        except (EngineDead, TimeoutError) as e:
            raise APIError(503, f"the model engine could not load the adapter: {e!r}", code="engine_unavailable",
                           headers={"Retry-After": "1"})

    def resident() -> Optional[Callable[[], None]]:
        adapter = served()
        return kept(found.lease(adapter.name, adapter.path))

    waiters = waiters_of(found)
    if resident() is not None:
        return
    if waiters.queue or await load() is None:  # others wait first, or every slot is held by running requests
        waiters.check_room(call.tenant, handle.engine)
        front.metrics.lora.loads.labels(handle.name, "busy").inc()
        await waiters.wait(call, found, load, resident)


def unload_on_engine(front, handle, name: str) -> None:
    """Stop serving ``name`` on ``handle``'s engine (running requests keep it to their end)."""
    found = adapters_of(handle.engine.model)
    if found is None:
        return

    def unload():
        try:
            found.unload(name)
        except UnknownAdapter:
            pass

    handle.engine.call(unload)
    resident_changed(front, handle)
