"""The LoRA adapters a gateway serves: names, paths and base models, and their loading.

An adapter is served under a name of its own (``--lora-modules NAME=PATH``, or ``POST
/v1/load_lora_adapter``) on a base model; a request names it as its ``model`` in any API.
The catalog here holds what is served; what is resident is the base engine's
(:class:`scheduler.lora.AdapterSet`, at most ``--max-loras`` adapters, the least recently
used idle one unloaded to make room and read again from its path when a request needs it).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Optional

import anyio

from gateway.http.errors import APIError
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


def load_on_engine(front, handle, adapter: Adapter, replace: bool = False) -> None:
    """Make ``adapter`` resident on ``handle``'s engine (blocking; run it in a worker
    thread): read its files here (numpy, off the engine thread), then install them on the
    engine between two steps, within the memory budget (the model's least recently used
    idle adapters are unloaded to make room). Done at once when it is resident (unless
    ``replace``). Counted in ``mlx_gateway_lora_*``.

    Raises:
        APIError: 400 when it does not fit the model (:class:`scheduler.lora.AdapterError`),
            503 when every adapter slot is held by running requests or the memory budget has
            no room for it.
        EngineDead, TimeoutError: see :meth:`scheduler.engine.Engine.call`.
    """
    if handle.kind == "embedding":
        raise APIError(400, f"the model '{handle.name}' is an embedding model: LoRA adapters apply to generating "
                       "models only", param="base_model_name", code="invalid_lora_adapter")
    found = adapter_set(handle, front.config)
    if not replace and found.resident(adapter.name) and found.names().get(adapter.name) == adapter.path:
        return
    m, start, result = front.metrics.lora, time.monotonic(), None
    try:
        files = read_files(adapter.path)
        slot = front.models.find(adapter.base)
        room = front.models.adapter_room(slot) if slot is not None else None
        handle.engine.call(lambda: found.install(adapter.name, files, room), timeout=300.0)
        result = "loaded"
    except AdapterError as e:
        result = "invalid"
        raise APIError(400, f"LoRA adapter '{adapter.name}' cannot be loaded: {e}", param="lora_path",
                       code="invalid_lora_adapter")
    except AdapterNoRoom as e:
        result = "no_room"
        raise APIError(503, f"LoRA adapter '{adapter.name}' cannot be loaded: {e}", code="memory_budget_exceeded",
                       headers={"Retry-After": "5"})
    except AdapterBusy as e:
        result = "busy"
        raise APIError(503, str(e), code="lora_slots_busy", headers={"Retry-After": "1"})
    finally:
        if result is not None:
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


async def ready_adapter(front, handle, adapter: Optional[Adapter]) -> None:
    """Make ``adapter`` resident for a request (a worker thread reads it and waits for the
    engine only when it must be read).

    Raises:
        APIError: 404 when it stopped being served, 400/503 from :func:`load_on_engine`,
            503 when the engine is not running or did not answer in time.
    """
    if adapter is None:
        raise APIError(404, "the LoRA adapter is not served any more", param="model", code="model_not_found")
    found = adapter_set(handle, front.config)
    if found.resident(adapter.name) and found.names().get(adapter.name) == adapter.path:
        return
    try:
        await anyio.to_thread.run_sync(lambda: load_on_engine(front, handle, adapter))
    except (EngineDead, TimeoutError) as e:
        raise APIError(503, f"the model engine could not load the adapter: {e!r}", code="engine_unavailable",
                       headers={"Retry-After": "1"})


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
