"""The model registry: every served model, loaded on demand under one memory budget.

Each served model (:class:`~gateway.models.spec.ModelSpec`) has a :class:`Slot`:
unloaded, loading, loaded, or unloading. A request *holds* its model for as long as it
runs (:meth:`ModelRegistry.hold` / :meth:`ModelRegistry.release`): the hold starts the
load of a model that is not loaded (concurrent first requests share one load), and a
model with a hold is never unloaded. Loads run on a thread of their own
(:mod:`gateway.models.loader`); before the weights are read, the registry makes room
under the budget (:mod:`gateway.models.budget`), unloading the least recently used idle
models, or refuses the load. A model whose ``keep_alive`` has run out since its last
request is unloaded by a keeper thread; a pinned one never is. Unloading detaches the
model's engine from the engine loop (its prefix cache goes to the disk tier, if one is
configured, and comes back from it after the next load).

Thread-safe: holds and releases come from the event loop, loads and unloads run on
threads of their own, and one lock guards the slots. Nothing here uses MLX.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable, Optional

from prometheus_client import CollectorRegistry

from cache import CacheBudget
from gateway.models.budget import Holder, NoRoom, gib, plan_room
from gateway.models.handle import ModelHandle
from gateway.models.loader import load_switch_interval
from gateway.models.slot import ModelUnavailable, Slot
from gateway.models.spec import ModelSpec
from gateway.telemetry.model_metrics import ModelMetrics
from scheduler.engine import PERSIST_SECONDS
from scheduler.engine.loop import EngineLoop

log = logging.getLogger("mlx_gateway.models")

# (spec, registry for its metrics, reserve(bytes)) -> the loaded model; see loader.load_model.
Loader = Callable[[ModelSpec, CollectorRegistry, Callable[[int], None]], ModelHandle]
KEEPER_TICK = 0.5  # seconds between keep_alive checks


class ModelRegistry:
    """Every served model and its state (see the module docstring).

    Args:
        specs: the served models; the first answers requests that name no model.
        loader: loads one model (:func:`gateway.models.loader.load_model`, bound to the
            server's settings).
        loop: the engine loop every model runs on.
        metrics: where the models' series go.
        budget: the memory budget (bytes) of the loaded models.
        max_loaded: most models loaded at once (0: no limit).
        cache_budget: the byte bound of every model's prefix cache together; it gets what
            the models' weights leave of ``budget``, at most ``prompt_cache_bytes``.
        prompt_cache_bytes: the most every prefix cache may hold together (bytes).
    """

    def __init__(self, specs: list[ModelSpec], loader: Loader, loop: EngineLoop, metrics: ModelMetrics, budget: int,
                 max_loaded: int = 0, cache_budget: Optional[CacheBudget] = None, prompt_cache_bytes: int = 8 << 30):
        self.slots = [Slot(s) for s in specs]
        self._by_name = {n: slot for slot in self.slots for n in slot.spec.names}
        self._loader = loader
        self.loop = loop
        self.metrics = metrics
        self.budget = budget
        self.max_loaded = max(0, max_loaded)
        self.cache_budget = cache_budget
        self.prompt_cache_bytes = prompt_cache_bytes
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._started_loads: list[Future] = []
        metrics.budget.set(budget)

    # ----------------------------------------------------------------- lookup
    def find(self, name: Optional[str]) -> Optional[Slot]:
        """The slot serving ``name`` (a served name or an alias); the first model for None."""
        return self.slots[0] if name is None else self._by_name.get(name)

    def add_alias(self, name: str, slot: Slot) -> None:
        """Serve ``slot``'s model as ``name`` too, until the server stops (Ollama's
        ``/api/copy``).

        Raises:
            ValueError: ``name`` already names a model.
        """
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"the name '{name}' is already taken by the model '{self._by_name[name].name}'")
            self._by_name[name] = slot
            slot.spec = replace(slot.spec, aliases=(*slot.spec.aliases, name))

    def handles(self) -> list[ModelHandle]:
        """The loaded models."""
        with self._lock:
            return [s.handle for s in self.slots if s.handle is not None]

    def startup(self) -> tuple[str, Optional[str]]:
        """``("ok", None)`` once the models to load at start are loaded; ``("loading", None)``
        before; ``("error", why)`` when a pinned one failed to load."""
        with self._lock:
            for s in self.slots:
                if s.spec.pin and s.state != "loaded" and s.error:
                    return "error", f"{s.name}: {s.error}"
            if not all(f.done() for f in self._started_loads):
                return "loading", None
        return "ok", None

    # ----------------------------------------------------------------- holds
    def hold(self, slot: Slot) -> Future:
        """Hold ``slot``'s model for one request and return a Future of its handle (done
        at once when it is loaded; otherwise when its load ends, with
        :class:`ModelUnavailable` if the load failed). Pair with :meth:`release`."""
        with self._lock:
            slot.in_flight += 1
            self._touch(slot)
            future = self._loaded_or_load(slot, evict=True)
        self.metrics.in_flight.labels(slot.name).set(slot.in_flight)
        return future

    def release(self, slot: Slot) -> None:
        """End one hold of ``slot`` (the request is answered)."""
        with self._lock:
            slot.in_flight = max(0, slot.in_flight - 1)
            self._touch(slot)
            idle_now = slot.in_flight == 0 and slot.keep_alive == 0
        self.metrics.in_flight.labels(slot.name).set(slot.in_flight)
        if idle_now:
            self._wake.set()  # keep_alive 0: the keeper unloads it now

    def keep_for(self, slot: Slot, seconds: Optional[float]) -> None:
        """Keep ``slot``'s model loaded ``seconds`` after its last use (None: until
        unloaded otherwise; 0: unloaded once idle), as a request asks (Ollama's
        ``keep_alive``); a pinned model stays loaded."""
        with self._lock:
            slot.keep_alive = seconds
            idle_now = slot.in_flight == 0 and seconds == 0
        if idle_now:
            self._wake.set()

    def load(self, slot: Slot) -> Future:
        """Load ``slot``'s model if it is not loaded (an admin's request); a Future of its handle."""
        with self._lock:
            self._touch(slot)
            return self._loaded_or_load(slot, evict=True)

    def unload(self, slot: Slot, reason: str = "admin") -> None:
        """Unload ``slot``'s model now (blocks until its engine has left the loop).

        Raises:
            ValueError: it is pinned, being loaded, or has requests in flight (the
                message says which); unloading a model that is not loaded is a no-op.
        """
        with self._lock:
            if slot.state in ("unloaded", "unloading"):
                return
            if slot.spec.pin:
                raise ValueError(f"the model '{slot.name}' is pinned (pin = true): it is never unloaded")
            if slot.state == "loading":
                raise ValueError(f"the model '{slot.name}' is being loaded")
            if slot.in_flight:
                raise ValueError(f"the model '{slot.name}' has {slot.in_flight} requests in flight")
            handle = self._begin_unload(slot)
        self._finish_unload(slot, handle, reason)

    # ----------------------------------------------------------------- start and stop
    def start(self) -> None:
        """Load the models marked ``preload`` (in order, on one thread, each only when it
        fits without unloading another) and start the keep_alive keeper."""
        preload = [s for s in self.slots if s.spec.preload]
        with self._lock:
            futures = [Future() for _ in preload]
            self._started_loads = futures

        def run() -> None:
            for slot, done in zip(preload, futures):
                with self._lock:
                    future = self._loaded_or_load(slot, evict=False)
                try:
                    future.result()
                except Exception as e:
                    log.error("model %s was not loaded at start: %s", slot.name, e)
                done.set_result(None)

        threading.Thread(target=run, name="model-preload", daemon=True).start()
        threading.Thread(target=self._keep, name="model-keeper", daemon=True).start()

    def close(self) -> None:
        """Stop the keeper; the engine loop's stop unloads what is loaded."""
        self._closed = True
        self._wake.set()

    # ----------------------------------------------------------------- loading
    def _touch(self, slot: Slot) -> None:
        slot.last_used, slot.last_used_wall = time.monotonic(), time.time()

    def _loaded_or_load(self, slot: Slot, evict: bool) -> Future:
        """Lock held: a done Future for a loaded model (whose engine runs), the running
        load's Future, or a new load's; a failed one when the engine loop has stopped."""
        if not self.loop.alive:
            failed: Future = Future()
            failed.set_exception(ModelUnavailable(f"the model engine has stopped: {self.loop.error!r}",
                                                  code="engine_unavailable", retry_after=None))
            return failed
        if slot.state == "loaded" and slot.handle.engine.alive:
            done: Future = Future()
            done.set_result(slot.handle)
            return done
        if slot.state == "loading":
            return slot.loading
        future: Future = Future()
        previous, slot.state, slot.loading, slot.error = slot.handle, "loading", future, None
        slot.handle = None
        threading.Thread(target=self._load, args=(slot, future, evict, previous), name=f"model-load-{slot.name}",
                         daemon=True).start()
        return future

    def _load(self, slot: Slot, future: Future, evict: bool, previous: Optional[ModelHandle]) -> None:
        """The load thread: wait for an unload in progress, drop a dead engine, then load."""
        slot.unloaded.wait()
        if previous is not None:  # its engine stopped (it failed): take it out before loading again
            self._finish_unload(slot, previous, "failed")
        registry = CollectorRegistry(auto_describe=True)
        started = time.monotonic()
        log.info("loading model %s from %s", slot.name, slot.spec.path)
        try:
            with load_switch_interval():
                handle = self._loader(slot.spec, registry, lambda need: self._reserve(slot, need, evict))
        except NoRoom as e:
            self._failed(slot, future, ModelUnavailable(str(e), code="insufficient_memory"))
            return
        except Exception as e:
            log.exception("loading model %s failed", slot.name)
            self._failed(slot, future, ModelUnavailable(f"loading the model '{slot.name}' failed: {e}",
                                                        code="model_load_failed"))
            return
        seconds = time.monotonic() - started
        with self._lock:
            slot.handle, slot.state, slot.loading, slot.reserved = handle, "loaded", None, 0
            slot.kind = handle.kind
        if hasattr(handle.engine, "set_memory_room"):  # a generating engine (not an embedding one)
            handle.engine.set_memory_room(self._kv_room)
        self.metrics.per_model.add(slot.name, registry)
        self.metrics.loaded.labels(slot.name).set(1)
        self.metrics.weights.labels(slot.name).set(handle.weights_bytes)
        self.metrics.load_seconds.labels(slot.name).observe(seconds)
        self._update_cache_bound()
        gc.freeze()  # what a load made lives as long as the model: out of later cyclic-GC passes
        log.info("model %s ready in %.1f s (%s of weights, context %d tokens)", slot.name, seconds,
                 gib(handle.weights_bytes), handle.context_length)
        future.set_result(handle)

    def _failed(self, slot: Slot, future: Future, error: ModelUnavailable) -> None:
        with self._lock:
            slot.state, slot.loading, slot.reserved, slot.error = "unloaded", None, 0, error.message
        self._update_cache_bound()
        future.set_exception(error)

    def _reserve(self, slot: Slot, need: int, evict: bool) -> None:
        """On the load thread, before the weights are read: make room for ``need`` bytes.

        Raises:
            NoRoom: not without unloading a pinned or busy model (or, with ``evict``
                False, any model).
        """
        kv = self._kv_bytes()
        with self._lock:
            holders = [Holder(s.name, s.weights + kv.get(s.name, 0), s.last_used, s.in_flight, s.spec.pin,
                              s.state in ("loading", "unloading"))
                       for s in self.slots if s is not slot and s.state != "unloaded"]
            victims = plan_room(slot.name, need, holders, self.budget, self.max_loaded)
            if victims and not evict:
                raise NoRoom(f"the model '{slot.name}' ({gib(need)}) does not fit beside the models already "
                             f"loaded without unloading {', '.join(victims)}")
            slot.reserved = need
            unloading = [(v, self._begin_unload(v)) for v in (self._by_name[n] for n in victims)]
        for v, handle in unloading:
            log.info("unloading model %s (least recently used) to make room for %s", v.name, slot.name)
            self._finish_unload(v, handle, "lru")
        self._update_cache_bound()

    def _kv_room(self) -> int:
        """Bytes the memory budget leaves after every model's weights (and loads' reservations):
        the running rows' KV and the prefix caches share them."""
        with self._lock:
            return self.budget - sum(s.weights for s in self.slots)

    def adapter_room(self, slot: Slot) -> int:
        """Bytes of the budget ``slot``'s resident LoRA adapters may hold together: what the
        other models' charges, its own weights and its running KV leave (may be negative)."""
        kv = self._kv_bytes()
        with self._lock:
            others = sum(s.weights + kv.get(s.name, 0) for s in self.slots if s is not slot and s.state != "unloaded")
            own = slot.handle.weights_bytes if slot.handle is not None else slot.reserved
        return self.budget - others - own - kv.get(slot.name, 0)

    def charges_changed(self) -> None:
        """A loaded model's charge changed (its adapters): give the prefix caches what is left."""
        self._update_cache_bound()

    def _kv_bytes(self) -> dict[str, int]:
        """Bytes of each loaded model's running batch KV (asked of its engine)."""
        out = {}
        for h in self.handles():
            try:
                out[h.name] = h.engine.kv_bytes(timeout=10)
            except Exception:
                out[h.name] = 0
        return out

    # ----------------------------------------------------------------- unloading
    def _begin_unload(self, slot: Slot) -> ModelHandle:
        """Lock held: mark ``slot`` unloading and take its handle."""
        handle, slot.handle, slot.state = slot.handle, None, "unloading"
        slot.unloaded.clear()
        return handle

    def _finish_unload(self, slot: Slot, handle: ModelHandle, reason: str) -> None:
        """Outside the lock: detach ``handle``'s engine (writing its prefix cache to the
        disk tier, if any), drop its series, and mark ``slot`` unloaded."""
        try:
            handle.engine.stop(timeout=PERSIST_SECONDS + 10, reason=f"the model '{slot.name}' was unloaded")
        finally:
            handle.engine.close_cache()
            self.metrics.per_model.remove(slot.name)
            self.metrics.loaded.labels(slot.name).set(0)
            self.metrics.weights.labels(slot.name).set(0)
            self.metrics.unloads.labels(slot.name, reason).inc()
            with self._lock:
                if slot.state == "unloading":  # (a new load may have begun meanwhile)
                    slot.state = "unloaded"
            slot.unloaded.set()
            self._update_cache_bound()
            self._collect()
        log.info("model %s unloaded (%s)", slot.name, reason)

    def _collect(self) -> None:
        """Free what the unloaded model leaves in reference cycles: a load freezes the objects
        it made (``gc.freeze``), and frozen objects are never collected, so without this each
        unload kept its weights (measured by benchmarks/soak.py: MLX's active memory grew by
        the model's weights at every load and unload). On the engine thread, where its MLX
        arrays belong; one full collection per unload."""
        def collect() -> None:
            gc.unfreeze()
            gc.collect()
            gc.freeze()

        try:
            self.loop.call(collect, timeout=60)
        except Exception:  # the loop is not running: nothing runs MLX either
            collect()

    def _update_cache_bound(self) -> None:
        """Give the prefix caches what the weights leave of the budget (on the engine
        loop's thread: shrinking it drops snapshots, which are MLX arrays)."""
        if self.cache_budget is None:
            return
        with self._lock:
            weights = sum(s.weights for s in self.slots)
        bound = max(0, min(self.prompt_cache_bytes, self.budget - weights))
        try:
            self.loop.call(lambda: self.cache_budget.set_max_bytes(bound), timeout=60)
        except Exception:  # the loop is not running: nothing is cached either
            self.cache_budget.max_bytes = bound

    def _keep(self) -> None:
        """The keeper thread: unload idle models whose keep_alive ran out, and take out
        models whose engine stopped."""
        while not self._closed:
            self._wake.wait(KEEPER_TICK)
            self._wake.clear()
            if self._closed or not self.loop.alive:  # stopping: the loop's stop ends every engine
                continue
            now = time.monotonic()
            due = []
            with self._lock:
                for s in self.slots:
                    if s.state != "loaded" or s.in_flight:
                        continue
                    dead = not s.handle.engine.alive
                    expired = (s.keep_alive is not None and not s.spec.pin and now - s.last_used >= s.keep_alive)
                    if dead or expired:
                        due.append((s, self._begin_unload(s), "failed" if dead else "keep_alive"))
            for s, handle, reason in due:
                try:
                    self._finish_unload(s, handle, reason)
                except Exception:
                    log.exception("unloading model %s failed", s.name)
