"""DiskTier: prompt-cache snapshots in safetensors files, written by a background thread.

The store handles only numpy arrays and bytes (``disk_codec.py`` converts mlx-lm
layer caches on the engine thread), so its threads never touch ``mlx.core``.

Layout: ``root/`` (mode 0700) holds one directory per model identity
(``root/<identity[:32]>/``, 0700; ``disk_format.model_identity``); a tier sees only its
own. An entry is ``<entry_name(group, tokens)>.safetensors`` (0600) holding the arrays,
the caller's metadata and the reserved keys listed in ``disk_format.py``.

Writes are atomic (``disk_files.write_atomic``: temp file, fsync, rename, fsync of the
directory). A crash leaves at most a ``.tmp-*`` file, removed at the next start. Lookup mirrors ``manager.py`` ``_select``.

Bound: the sum of entry file sizes (bytes), counting the temp file being written,
stays ``<= max_bytes``: the writer evicts least recently used entries (file mtime
order at start; reads refresh recency) before it writes.

Metrics (on the given registry): ``mlx_gateway_prompt_cache_disk_bytes`` and
``..._disk_entries`` (gauges: bytes / files in the index),
``..._disk_writes_total{outcome=written|skipped|failed}``,
``..._disk_reads_total{outcome=hit|corrupt}`` (corrupt also counts invalid files
deleted at start) and ``..._disk_evictions_total`` (LRU evictions, also at start).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from .disk_files import secure_dir, unlink_quietly, write_atomic
from .disk_format import RESERVED_KEYS, build_file, entry_name, parse_file, read_file_header
from .restore import restorable
from .tree import Node, RadixTree

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_BELOW_SEARCH_LIMIT = 64  # subtree nodes a lookup inspects for a longer trimmable entry


class DiskEntry:
    """One stored file: ``group``, ``num_tokens`` (tokens covered), ``nbytes`` (file
    size), ``trimmable``, ``path``. Handed out by :meth:`DiskTier.lookup`."""

    __slots__ = ("group", "num_tokens", "nbytes", "trimmable", "path", "node", "alive")

    def __init__(self, group: str, num_tokens: int, nbytes: int, trimmable: bool, path: Path):
        self.group, self.num_tokens, self.nbytes, self.trimmable, self.path = group, num_tokens, nbytes, trimmable, path
        self.node: Node | None = None
        self.alive = True

    @property
    def name(self) -> str:
        return self.path.name[: -len(_SUFFIX)]

    def can_restore(self, wanted: int) -> bool:
        """Can this entry be brought to exactly ``wanted`` tokens (``restore.py`` rules)?"""
        return restorable(self.num_tokens, wanted, self.trimmable)

    def __repr__(self) -> str:
        return f"<DiskEntry {self.name} {self.group!r} {self.num_tokens} tokens {self.nbytes} B>"


class DiskTier:
    """A byte-bounded, LRU, per-group prefix store of encoded snapshots on disk.

    Args:
        root: directory holding one subdirectory per model identity; created 0700
            (set to 0700 if it exists with other permissions).
        max_bytes: bound on the sum of this model's entry file sizes (bytes).
        model_identity: ``disk_format.model_identity(...)``; letters, digits, ``_-.``.
        registry: prometheus registry for the metrics (a fresh private one if None).
        queue_limit: writes that may wait for the writer thread (more are skipped).

    Thread-safe, one writer thread; :meth:`close` drains and stops it. One tier at a
    time per model directory (an ``flock`` on its ``.lock`` file, released by
    :meth:`close` or process exit).

    Raises:
        ValueError: bad ``max_bytes``, ``queue_limit`` or ``model_identity``.
        PermissionError / NotADirectoryError / OSError: ``root`` or the model
            directory is not a writable directory of this user, or is in use.
    """

    def __init__(self, root: Path, max_bytes: int, model_identity: str,
                 registry: CollectorRegistry | None = None, queue_limit: int = 64):
        ident = str(model_identity)
        if max_bytes < 0 or queue_limit < 1:
            raise ValueError("max_bytes must be >= 0 and queue_limit >= 1")
        if not ident or ident[0] == "." or not all(c.isalnum() or c in "_-." for c in ident):
            raise ValueError(f"bad model identity {model_identity!r}")
        self.max_bytes = int(max_bytes)
        self.model_identity = ident
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._trees: dict[str, RadixTree] = {}
        self._by_name: dict[str, DiskEntry] = {}
        self._lru: OrderedDict[DiskEntry, None] = OrderedDict()  # oldest first
        self._bytes = 0
        self._pending: set[str] = set()  # names queued or being written
        self._submitted = self._done = 0
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=queue_limit)

        self.root = Path(root)
        secure_dir(self.root)
        self.dir = self.root / ident[:32]
        secure_dir(self.dir)
        self._lock_fd = self._take_dir_lock()
        try:
            self.registry = r = registry if registry is not None else CollectorRegistry()
            p = "mlx_gateway_prompt_cache_disk_"  # prometheus-client appends "_total" to counters
            self._g_bytes = Gauge(p + "bytes", "Bytes of prompt-cache files on disk", registry=r)
            self._g_entries = Gauge(p + "entries", "Prompt-cache files on disk", registry=r)
            self._writes = Counter(p + "writes", "Disk cache writes by outcome", ["outcome"], registry=r)
            self._reads = Counter(p + "reads", "Disk cache reads by outcome", ["outcome"], registry=r)
            self._evictions = Counter(p + "evictions", "Disk cache entries evicted (LRU)", registry=r)
            for o in ("written", "skipped", "failed"):
                self._writes.labels(outcome=o)
            for o in ("hit", "corrupt"):
                self._reads.labels(outcome=o)
            with self._lock:
                self._load_index()
                self._evict_until(self.max_bytes)
        except BaseException:
            self._release_dir_lock()
            raise
        self._thread = threading.Thread(target=self._run, name="prompt-cache-disk-writer", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        """Bytes of the entry files in the index."""
        return self._bytes

    @property
    def num_entries(self) -> int:
        """Entry files in the index."""
        return len(self._by_name)

    # -- start ----------------------------------------------------------------
    def _take_dir_lock(self) -> int | None:
        if fcntl is None:
            return None
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OSError(f"disk cache directory {self.dir} is in use by another DiskTier") from None
        return fd

    def _release_dir_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _load_index(self) -> None:
        """Index the entry files (headers only); delete temp and invalid files. Lock held."""
        found: list[tuple[int, DiskEntry, list[int]]] = []
        for p in self.dir.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                log.info("disk cache: removing leftover temp file %s", p)
                unlink_quietly(p)
            elif p.name.endswith(_SUFFIX) and not p.is_symlink() and p.is_file():
                try:
                    meta, tokens, size = read_file_header(p, self.model_identity)
                    mtime = os.stat(p).st_mtime_ns
                except Exception as e:  # ValueError, OSError
                    log.warning("disk cache: deleting unreadable entry %s: %s", p, e)
                    self._reads.labels(outcome="corrupt").inc()
                    unlink_quietly(p)
                    continue
                found.append((mtime, DiskEntry(meta["group"], len(tokens), size, meta["trimmable"] == "1", p), tokens))
        for _, entry, tokens in sorted(found, key=lambda x: x[0]):
            self._add(entry, tokens)

    # -- index (lock held) ----------------------------------------------------
    def _add(self, entry: DiskEntry, tokens: Sequence[int]) -> None:
        tree = self._trees.setdefault(entry.group, RadixTree())
        entry.node = tree.insert(tokens)
        tree.set_value(entry.node, entry)
        self._by_name[entry.name] = entry
        self._lru[entry] = None
        self._bytes += entry.nbytes
        self._update_gauges()

    def _discard(self, entry: DiskEntry) -> bool:
        """Drop ``entry`` from the index and delete its file; False if already gone."""
        if not entry.alive:
            return False
        entry.alive = False
        tree = self._trees[entry.group]
        tree.remove_value(entry.node)
        if tree.size == 0:
            del self._trees[entry.group]
        entry.node = None
        del self._by_name[entry.name]
        del self._lru[entry]
        self._bytes -= entry.nbytes
        self._update_gauges()
        unlink_quietly(entry.path)
        return True

    def _evict_until(self, budget: int) -> None:
        """Evict least recently used entries until ``nbytes <= budget``."""
        while self._bytes > budget and self._lru:
            self._discard(next(iter(self._lru)))
            self._evictions.inc()

    def _update_gauges(self) -> None:
        self._g_bytes.set(self._bytes)
        self._g_entries.set(len(self._by_name))

    # -- lookup / read --------------------------------------------------------
    def lookup(self, group: str, tokens: Sequence[int]) -> tuple[DiskEntry, int] | None:
        """The entry of ``group`` whose restore gives the most tokens (``<= len(tokens) - 1``).

        Returns:
            ``(entry, usable_tokens)`` or None. An entry whose key is a prefix of
            ``tokens`` gives ``len(key)`` tokens; a longer or diverging one gives the
            shared length only if ``entry.trimmable``. O(matched tokens) plus at most
            :data:`_BELOW_SEARCH_LIMIT` subtree nodes.
        """
        with self._lock:
            tree = self._trees.get(group)
            return None if tree is None else tree.best_restore(tokens, _BELOW_SEARCH_LIMIT)

    def read(self, entry: DiskEntry) -> tuple[dict[str, np.ndarray], dict[str, str]] | None:
        """Load and verify ``entry``'s file (any thread).

        Returns:
            ``(arrays, metadata)`` as given to :meth:`submit`, or None if the entry
            is gone, or its file is missing or corrupt: then it is logged, deleted,
            dropped from the index and counted ``corrupt``. A hit refreshes the
            entry's recency (file mtime and LRU position).
        """
        if not entry.alive:
            return None
        try:
            with open(entry.path, "rb") as f:
                arrays, meta, tokens = parse_file(f.read(), self.model_identity, entry.name)
            if len(tokens) != entry.num_tokens:
                raise ValueError("key does not match the index")
        except Exception as e:  # OSError, ValueError: any failure drops the file
            with self._lock:
                if not self._discard(entry):
                    return None  # evicted meanwhile
                self._reads.labels(outcome="corrupt").inc()
            log.warning("disk cache: dropping unreadable entry %s: %s", entry.path, e)
            return None
        try:
            os.utime(entry.path)
        except OSError:
            pass
        with self._lock:
            if entry.alive:
                self._lru.move_to_end(entry)
        self._reads.labels(outcome="hit").inc()
        return arrays, meta

    def key(self, entry: DiskEntry) -> list[int]:
        """The token key of ``entry`` (O(its tokens)).

        Raises:
            KeyError: the entry was dropped (evicted or found corrupt).
        """
        with self._lock:
            if not entry.alive:
                raise KeyError(f"disk entry {entry.name} is gone")
            return self._trees[entry.group].key(entry.node)

    def drop(self, entry: DiskEntry) -> bool:
        """Delete ``entry`` (e.g. its snapshot does not decode); False if already gone."""
        with self._lock:
            return self._discard(entry)

    # -- writes ---------------------------------------------------------------
    def submit(self, group: str, tokens: Sequence[int], arrays: dict[str, np.ndarray],
               metadata: dict[str, str], trimmable: bool) -> bool:
        """Queue a write of one snapshot; never blocks, never raises ``OSError``.

        Args:
            group: cache group of the entry.
            tokens: its key (the snapshot covers exactly these tokens).
            arrays, metadata: from ``disk_codec.encode_snapshot``; the store takes
                them over (do not modify them afterwards).
            trimmable: every layer can be trimmed to a shorter prefix.

        Returns:
            True if queued; False (counted ``skipped``) if closed, ``tokens`` is
            empty, the queue is full, the arrays alone exceed ``max_bytes`` bytes,
            or the key is already stored or queued.

        Raises:
            ValueError: ``metadata`` uses a reserved key or is not all strings.
        """
        if RESERVED_KEYS & metadata.keys():
            raise ValueError(f"metadata keys {sorted(RESERVED_KEYS & metadata.keys())} are reserved")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("metadata must map str to str")
        key = [int(t) for t in tokens]
        name = entry_name(group, key) if key else ""
        ok = bool(key) and sum(int(a.nbytes) for a in arrays.values()) <= self.max_bytes
        with self._lock:
            ok = ok and not self._closed and name not in self._by_name and name not in self._pending
            if ok:
                try:
                    self._queue.put_nowait((name, group, key, dict(arrays), dict(metadata), bool(trimmable)))
                    self._pending.add(name)
                    self._submitted += 1
                except queue.Full:
                    ok = False
        if not ok:
            self._writes.labels(outcome="skipped").inc()
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (seconds; None: no limit) until every write submitted so far is done;
        False if ``timeout`` passed first."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self) -> None:
        """Finish the queued writes, stop the writer thread, release the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)  # behind the queued jobs: the writer drains them first
        self._thread.join()
        self._release_dir_lock()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(*job)
            except Exception:  # never let the writer thread die
                log.exception("disk cache: unexpected error writing %s", job[0])
                self._writes.labels(outcome="failed").inc()
            finally:
                with self._cond:
                    self._pending.discard(job[0])
                    self._done += 1
                    self._cond.notify_all()

    def _write(self, name: str, group: str, tokens: list[int], arrays: dict[str, np.ndarray],
               metadata: dict[str, str], trimmable: bool) -> None:
        """Writer thread: serialize, make room (LRU), write atomically, index."""
        try:
            payload = build_file(arrays, metadata, model=self.model_identity, group=group,
                                 tokens=tokens, trimmable=trimmable)
        except ValueError as e:
            log.warning("disk cache: entry %s not written: %s", name, e)
            self._writes.labels(outcome="failed").inc()
            return
        del arrays
        size = len(payload)
        if size > self.max_bytes:
            self._writes.labels(outcome="skipped").inc()
            return
        with self._lock:
            self._evict_until(self.max_bytes - size)
        final = self.dir / f"{name}{_SUFFIX}"
        try:
            write_atomic(final, payload, _TMP_PREFIX)
        except OSError as e:  # ENOSPC, EFBIG, EDQUOT, EACCES, EIO, ...
            log.warning("disk cache: write of %s (%d bytes) skipped: %s", final.name, size, e)
            self._writes.labels(outcome="failed").inc()
            return
        with self._lock:
            self._add(DiskEntry(group, len(tokens), size, trimmable, final), tokens)
        self._writes.labels(outcome="written").inc()

    def sanity_check(self) -> None:
        """Assert index/accounting consistency and the byte bound. Raises AssertionError."""
        with self._lock:
            entries: list[DiskEntry] = []
            for tree in self._trees.values():
                tree.sanity_check(lambda n: entries.append(n.value))
            assert len(entries) == len(self._by_name) == len(self._lru)
            assert all(e.alive and e.node is not None and e.node.depth == e.num_tokens for e in entries)
            assert sum(e.nbytes for e in entries) == self._bytes <= self.max_bytes
