"""LoRA adapters served beside their base model, rows of different adapters in one forward.

An :class:`AdapterSet` is attached to one served model (:func:`adapters_of`). It keeps the
resident adapters (at most ``max_loras``; the least recently used idle one is unloaded to
make room), wraps the model's adapted linear layers once (:mod:`scheduler.lora.layers`) and
restacks their factors whenever the resident set changes. Base weights are never copied.

A request chooses an adapter by name (:attr:`scheduler.request.EngineRequest.adapter`).
:meth:`AdapterSet.admit` moves it into a prefix-cache namespace of the adapter's own,
``"<namespace>/lora:<name>#<serial>"`` (a companion of the request's namespace: it counts
in that quota and stays off the disk tier), so a prompt under one adapter never reuses KV
computed under another one, under the base, or under an earlier load of the same name.
The row's adapter is read back from that namespace at each forward (:meth:`slot_of`),
which holds for every row the engine runs for it, next-turn precomputes included.

An adapter's files are read on any thread (:func:`scheduler.lora.files.read_files`: numpy,
no MLX); installing it (:meth:`AdapterSet.install`: check, MLX arrays, restack), unloading
and the per-forward selection run on the engine thread (:meth:`scheduler.engine.Engine.call`),
so the rows decoding wait only for the install. :meth:`admit`, :meth:`lease`,
:meth:`slot_free`, :meth:`names` and :attr:`nbytes` may be called from any thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from scheduler.lora.files import AdapterError, AdapterFiles, AdapterWeights, check_adapter, read_files
from scheduler.request import DoneEvent, ErrorEvent
from scheduler.lora.layers import RowSlots, build_stack, wrap_linears

MARK = "/lora:"  # an adapter's prefix-cache namespace is the request's, this, and name#serial
DEFAULT_MAX_RANK = 64
DEFAULT_MAX_LORAS = 8
NO_ADAPTER = nullcontext()  # the selection of a forward when no adapter is served (reusable: it does nothing)

log = logging.getLogger("mlx_gateway.engine")

__all__ = ["AdapterError", "AdapterFiles", "AdapterSet", "AdapterBusy", "AdapterNoRoom", "UnknownAdapter",
           "adapters_of", "read_files", "MARK"]


class UnknownAdapter(KeyError):
    """No adapter of that name is loaded (a 404)."""


class AdapterBusy(RuntimeError):
    """Every adapter slot is held by running requests (a load may wait for :attr:`AdapterSet.on_free`)."""


class AdapterNoRoom(AdapterBusy):
    """The adapter's bytes do not fit the memory left to the model's adapters, even with
    every idle one unloaded (a 503; the message gives the bytes)."""


@dataclass
class Resident:
    """A loaded adapter: its name, serial (one per load), weights, and running requests."""

    name: str
    serial: int
    weights: AdapterWeights
    refs: int = 0
    used: int = 0  # the set's clock at its last admission (least recently used out first)
    retired: bool = field(default=False)

    @property
    def key(self) -> str:
        return f"{self.name}#{self.serial}"


class AdapterSet:
    """The adapters resident on one model.

    Args:
        model: the served mlx-lm model; its adapted layers are wrapped at the first load.
        max_loras: adapters resident at once.
        max_rank: the largest rank accepted at load.
    """

    def __init__(self, model, max_loras: int = DEFAULT_MAX_LORAS, max_rank: int = DEFAULT_MAX_RANK):
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.rows = RowSlots()
        self._lock = threading.Lock()
        self._by_name: dict[str, Resident] = {}
        self._slots: list[Resident] = []  # slot i + 1 is _slots[i]; retired ones stay while used
        self._known: dict[str, str] = {}  # served name -> path (resident or unloaded to make room)
        self._keys: dict[str, int] = {}  # resident key (name#serial) -> slot
        self._serials = itertools.count(1)
        self._clock = itertools.count(1)
        self._stack_bytes = 0  # bytes of the wrapped layers' stacks (set at each restack)
        self.on_free: Optional[Callable[[], None]] = None  # called (any thread) when an adapter's last holder ends

    # ----------------------------------------------------------------- any thread
    def names(self) -> dict[str, str]:
        """Served adapter name -> its path (resident or not)."""
        with self._lock:
            return dict(self._known)

    @property
    def nbytes(self) -> int:
        """Bytes the resident adapters hold: their factors (kept to restack) and the layers'
        stacks of them (slot 0's zeros and rank padding included)."""
        with self._lock:
            return sum(r.weights.nbytes for r in self._slots) + self._stack_bytes

    @property
    def slot_keys(self) -> dict[str, int]:
        """Key (name#serial) -> slot of every adapter in a slot, retired ones still running
        included; a new dict object at each restack (read it, do not change it)."""
        return self._keys

    def resident_names(self) -> list[str]:
        """The adapters resident now (requests of them need no read)."""
        with self._lock:
            return list(self._by_name)

    def admit(self, request) -> None:
        """Move ``request`` (with ``adapter`` set) into its adapter's namespace and count it
        as running until its last event (its ``sink`` is wrapped).

        Raises:
            UnknownAdapter: no adapter of that name is loaded.
        """
        with self._lock:
            r = self._by_name.get(request.adapter)
            if r is None:
                raise UnknownAdapter(request.adapter)
            r.refs += 1
            r.used = next(self._clock)
        request.namespace = f"{request.namespace}{MARK}{r.key}"
        sink = request.sink

        def counted(events, _sink=sink, _r=r):
            try:
                _sink(events)
            finally:
                if any(isinstance(e, (DoneEvent, ErrorEvent)) for e in events):
                    self._let_go(_r)

        request.sink = counted

    def release(self, request) -> None:
        """Undo :meth:`admit` for a request the engine refused at submit."""
        key = request.namespace.rpartition(MARK)[2]
        with self._lock:
            held = [r for r in self._slots if r.key == key]
        for r in held:
            self._let_go(r)

    def lease(self, name: str, path: Optional[str] = None) -> Optional[Callable[[], None]]:
        """Hold the resident adapter ``name`` (loaded from ``path``, when given) as a running
        request does, so that no load unloads it, until the returned callable (idempotent) is
        called; None when it is not resident (from that path)."""
        with self._lock:
            r = self._by_name.get(name)
            if r is None or (path is not None and self._known.get(name) != path):
                return None
            r.refs += 1
            r.used = next(self._clock)
        held = [r]

        def release() -> None:
            if held:
                self._let_go(held.pop())

        return release

    def slot_free(self) -> bool:
        """Whether a load could find a slot now: fewer than ``max_loras`` adapters are held
        by running requests or leases (an idle one is unloaded to make room)."""
        with self._lock:
            return sum(r.refs > 0 for r in self._slots) < self.max_loras

    def _let_go(self, r: Resident) -> None:
        """One holder of ``r`` ended; :attr:`on_free` is told when it was the last."""
        with self._lock:
            r.refs -= 1
            free = r.refs <= 0
        if free and self.on_free is not None:
            self.on_free()

    # ----------------------------------------------------------------- engine thread
    def load(self, name: str, path: str, room: Optional[int] = None) -> AdapterWeights:
        """Read the adapter at ``path`` on this thread, then :meth:`install` it."""
        return self.install(name, read_files(path), room)

    def install(self, name: str, files: AdapterFiles, room: Optional[int] = None) -> AdapterWeights:
        """Serve the adapter read as ``files`` (:func:`read_files`) as ``name``, replacing a
        loaded one of that name (requests already running keep the old one to their end).

        Args:
            room: the bytes every resident adapter together may hold (:attr:`nbytes`; None:
                no bound); the least recently used idle ones are unloaded to fit the new one.
                The set's bytes are estimated by :func:`charge` (rank padding aside).

        Raises:
            AdapterError: the adapter does not fit this model (nothing is kept).
            AdapterBusy: ``max_loras`` adapters are resident and none is idle.
            AdapterNoRoom: it does not fit ``room`` even with every idle adapter unloaded.
        """
        weights = check_adapter(files, self.model, self.max_rank)
        with self._lock:
            self._sweep()
            old = self._by_name.get(name)
            keep = [r for r in self._slots if not (r is old and r.refs <= 0)]
            idle = sorted((r for r in keep if r.refs <= 0 and not r.retired), key=lambda r: r.used)
            victims: list[Resident] = []

            def after() -> list[int]:  # the factors' bytes of the set the load would leave
                return [r.weights.nbytes for r in keep if r not in victims] + [weights.nbytes]

            while idle and (len(after()) > self.max_loras or (room is not None and charge(after()) > room)):
                victims.append(idle.pop(0))
            if len(after()) > self.max_loras:
                raise AdapterBusy(f"all {self.max_loras} adapter slots are in use (--max-loras)")
            if room is not None and charge(after()) > room:
                held = charge(after()[:-1])
                raise AdapterNoRoom(
                    f"with it its model's adapters would take {charge(after()) / 1e6:.2f} MB and the memory budget "
                    f"leaves them {max(room, 0) / 1e6:.2f} MB (--memory-budget), {held / 1e6:.2f} MB of that held by "
                    "adapters serving requests")
            for gone in (old, *victims):
                if gone is not None:
                    self._drop(gone)
            r = Resident(name, next(self._serials), weights, used=next(self._clock))
            self._slots.append(r)
            self._by_name[name] = r
            self._known[name] = files.path
            self._sweep()
        self._restack()
        return weights

    def unload(self, name: str) -> None:
        """Stop serving ``name``; running requests keep it to their end.

        Raises:
            UnknownAdapter: no adapter of that name is served.
        """
        with self._lock:
            if self._known.pop(name, None) is None:
                raise UnknownAdapter(name)
            r = self._by_name.get(name)
            if r is not None:
                self._drop(r)
            self._sweep()
        self._restack()

    def _drop(self, r: Resident) -> None:
        if self._by_name.get(r.name) is r:
            del self._by_name[r.name]
        r.retired = True

    def _sweep(self) -> None:
        self._slots = [r for r in self._slots if not (r.retired and r.refs <= 0)]

    def _restack(self) -> None:
        """Wrap the layers the resident adapters adapt and rebuild every wrapped layer's stack."""
        with self._lock:
            slots = list(self._slots)
        wanted = sorted({p for r in slots for p in r.weights.layers})
        wrapped = wrap_linears(self.model, wanted, self.rows)
        stacks = {path: build_stack([r.weights.layers.get(path) for r in slots]) for path in wrapped}
        built = [s for s in stacks.values() if s is not None]
        mx.eval([s.arrays() for s in built])  # one evaluation for every layer (not one each)
        for path, layer in wrapped.items():
            layer.set_stack(stacks[path])
        total = sum(s.nbytes for s in built)
        self._keys = {r.key: i + 1 for i, r in enumerate(slots)}
        with self._lock:
            self._stack_bytes = total

    def slot_of(self, namespace: Optional[str]) -> int:
        """The slot of the adapter a row of ``namespace`` runs under (0: the base).

        An adapter stays resident while a request admitted under it runs, so a row whose
        adapter is gone belongs to a request that already ended (its last forward's output
        is dropped): it runs as the base's rather than failing the whole step."""
        if namespace is None or MARK not in namespace:
            return 0
        key = namespace.rpartition(MARK)[2]
        slot = self._keys.get(key)
        if slot is None:
            log.warning("a row of adapter %s ran after its adapter was unloaded", key)
            return 0
        return slot

    def forward(self, uids: Callable[[], list[int]], namespace_of: Callable[[int], Optional[str]]):
        """The selection for one batch's forward calls (a context manager): its rows (by
        ``uids()``, read at each forward) take their adapters' slots."""
        if not self._keys:
            return NO_ADAPTER
        return self.rows.forward(uids, lambda u: self.slot_of(namespace_of(u)))


def charge(sizes: list[int]) -> int:
    """Bytes a set of resident adapters holds, from each one's factors' bytes: its factors
    (kept to restack), its copy in the layers' stacks, and slot 0's zeros (as large as the
    largest); rank padding is not counted."""
    return 2 * sum(sizes) + max(sizes, default=0)


def adapters_of(model, create: bool = False, **kwargs) -> Optional[AdapterSet]:
    """The :class:`AdapterSet` attached to ``model`` (made with ``kwargs`` when ``create``);
    None when it has none."""
    found = getattr(model, "_adapter_set", None)
    if found is None and create:
        found = AdapterSet(model, **kwargs)
        object.__setattr__(model, "_adapter_set", found)
    return found


def rows_hook(model, namespace_of: Callable[[int], Optional[str]], prompt_cache=None) -> Callable:
    """For the batch generator: ``hook(batch)`` is the adapter selection of ``batch``'s
    forward calls (a context manager; nothing when ``model`` serves no adapter). An
    adapter's namespace met for the first time becomes a companion of its request's
    namespace in ``prompt_cache`` (:meth:`cache.lru.LRUEviction.add_companion`: it counts in
    that quota and stays off the disk tier, whose files are keyed by the base alone); that
    happens before any snapshot of it is stored, since snapshots follow forwards. Once an
    adapter has left its slot (unloaded, no row left), its namespaces are forgotten
    (:meth:`cache.manager.PromptCacheManager.forget`): a load of it again has a new serial,
    so their snapshots would never be used, and over days of adapter switches they grew."""
    known: dict[str, str] = {}  # adapter namespace met -> its adapter's key (name#serial)
    seen: list = [None]  # the adapter set's keys when the namespaces were last checked

    def hook(batch):
        found = adapters_of(model)
        if found is None:
            return NO_ADAPTER
        if prompt_cache is not None:
            for uid in batch.uids:
                ns = namespace_of(uid)
                if ns is not None and MARK in ns and ns not in known:
                    prompt_cache.eviction.add_companion(ns, ns.rpartition(MARK)[0])
                    known[ns] = ns.rpartition(MARK)[2]
            if found.slot_keys is not seen[0]:  # a new dict at every restack
                seen[0] = live = found.slot_keys
                gone = [ns for ns, key in known.items() if key not in live]
                if gone:
                    prompt_cache.forget(gone)
                    for ns in gone:
                        del known[ns]
        return found.forward(lambda: batch.uids, namespace_of)

    return hook


@contextmanager
def admitted_adapter(model, request):
    """For :meth:`scheduler.engine.Engine.submit`: a request with ``adapter`` set is admitted
    to ``model``'s :class:`AdapterSet` (:meth:`AdapterSet.admit`), undone if the block
    raises (the engine refused it).

    Raises:
        UnknownAdapter: the model serves no adapter of that name, or none at all.
    """
    if request.adapter is None:
        yield
        return
    found = adapters_of(model)
    if found is None:
        raise UnknownAdapter(request.adapter)
    found.admit(request)
    try:
        yield
    except BaseException:
        found.release(request)
        raise
