"""DiskLink: moves snapshots between the in-memory manager and the disk tier.

- Evicted snapshots are queued by the manager under its lock (``evicted``: references
  only, no copy) and encoded on the thread that owns MLX at the next :meth:`spill`
  (the manager calls it after each insert); the disk tier's writer thread then
  writes the numpy copies, so decoding never waits for the disk.
- A request that memory would serve poorly has its disk entry read when it arrives, on
  the engine's prefetch thread (:meth:`prefetch`: the file is read and verified there);
  its lookup on the engine thread (:meth:`load`) then only turns those arrays into MLX
  arrays and inserts them into memory like any other snapshot. A lookup with nothing
  read ahead reads the file itself.
- At a graceful shutdown the manager hands its snapshots to :meth:`spill` too
  (``PromptCacheManager.persist``).

A snapshot the disk already covers (the same key, or a longer trimmable entry) is not
written again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import restore as rules
from .disk import DiskTier
from .disk_codec import decode_snapshot, encode_snapshot
from .pages import Page, assemble

log = logging.getLogger(__name__)

# Tokens a disk entry must restore beyond the memory hit before it is read: reading a
# file for a handful of tokens costs more than computing them.
MIN_GAIN = 16
# Files read ahead and not yet taken (their request was cancelled, or memory served it
# after all): the oldest go first beyond this many, or beyond this many bytes.
READ_AHEAD = 8
READ_AHEAD_BYTES = 1 << 30


@dataclass
class Spill:
    """A snapshot leaving memory: its key, the pages on its path and its own layers."""

    namespace: str
    tokens: list[int]
    pages: list[Page]
    private: list[Any]
    trimmable: bool


def _nbytes(read: tuple) -> int:
    """Bytes of a read file's arrays."""
    return sum(a.nbytes for a in read[0].values())


class DiskLink:
    """The manager's side of a :class:`DiskTier` (see the module docstring).

    Args:
        tier: the disk store (owned: :meth:`close` closes it).
    """

    def __init__(self, tier: DiskTier):
        self.tier = tier
        self._pending: list[Spill] = []
        self._lock = threading.Lock()
        self._read_ahead: dict[str, tuple] = {}  # entry name -> (arrays, metadata), oldest first
        self._reading: set[str] = set()  # entry names being read ahead

    def evicted(self, spill: Spill) -> None:
        """Queue a snapshot for :meth:`spill` (any thread; cheap: keeps references)."""
        with self._lock:
            self._pending.append(spill)

    def covered(self, namespace: str, tokens: Sequence[int]) -> bool:
        """True if the disk can already restore all of ``tokens``."""
        hit = self.tier.lookup(namespace, [*tokens, -1])
        return hit is not None and hit[1] == len(tokens)

    def spill(self, extra: Sequence[Spill] = ()) -> int:
        """Encode the queued snapshots (and ``extra``) and hand them to the writer.

        Runs on the thread that owns MLX. Returns the number submitted; a snapshot that
        fails to encode is logged and skipped.
        """
        with self._lock:
            todo, self._pending = [*self._pending, *extra], []
        sent = 0
        for s in todo:
            if self.covered(s.namespace, s.tokens):
                continue
            try:
                cache = assemble(rules.safe_copy(s.private), s.pages, len(s.tokens))
                arrays, meta = encode_snapshot(cache)
            except Exception:
                log.exception("encoding a %d-token snapshot for the disk tier failed", len(s.tokens))
                continue
            sent += self.tier.submit(s.namespace, s.tokens, arrays, meta, s.trimmable)
        return sent

    def worth_reading(self, namespace: str, tokens: Sequence[int], have: int):
        """The disk entry that restores the most of ``tokens`` if it gives at least
        :data:`MIN_GAIN` tokens more than ``have`` (what memory restores), else None
        (any thread: an index lookup, no file read)."""
        found = self.tier.lookup(namespace, tokens)
        return None if found is None or found[1] < have + MIN_GAIN else found[0]

    def prefetch(self, namespace: str, tokens: Sequence[int], have: int) -> bool:
        """Read and verify the file of the entry :meth:`worth_reading` finds, on this
        thread (not the engine's: no MLX here), for a later :meth:`load`; True if one was
        read."""
        entry = self.worth_reading(namespace, tokens, have)
        if entry is None:
            return False
        with self._lock:
            if entry.name in self._read_ahead or entry.name in self._reading:
                return True  # read (or being read) for another request: one read serves both
            self._reading.add(entry.name)
        try:
            got = self.tier.read(entry)
        finally:
            with self._lock:
                self._reading.discard(entry.name)
        if got is None:
            return False
        with self._lock:
            self._read_ahead[entry.name] = got
            while len(self._read_ahead) > READ_AHEAD or (
                    len(self._read_ahead) > 1 and sum(_nbytes(a) for a in self._read_ahead.values()) > READ_AHEAD_BYTES):
                del self._read_ahead[next(iter(self._read_ahead))]
        return True

    def load(self, namespace: str, tokens: Sequence[int], have: int) -> tuple[list[int], list[Any]] | None:
        """Read the disk entry that restores the most of ``tokens``, if it gives at least
        :data:`MIN_GAIN` tokens more than ``have`` (what memory restores).

        Returns:
            ``(key, cache)``: the entry's own key and its decoded layer caches (covering
            exactly ``key``), or None (nothing better, or the file was unreadable:
            the tier logs and deletes it).
        """
        entry = self.worth_reading(namespace, tokens, have)
        if entry is None:
            return None
        with self._lock:
            got = self._read_ahead.pop(entry.name, None)  # verified when read, even if evicted since
        if got is None:
            got = self.tier.read(entry)
        if got is None:
            return None
        arrays, meta = got
        try:
            cache = decode_snapshot(arrays, meta)
            key = [int(t) for t in self.tier.key(entry)]
        except (ValueError, KeyError) as e:
            log.warning("disk cache: dropping entry %s, which does not decode: %s", entry.path, e)
            self.tier.drop(entry)
            return None
        return key, cache

    def persist(self, spills: Sequence[Spill], timeout: float | None = None) -> int:
        """:meth:`spill` the queued snapshots and ``spills``, wait up to ``timeout`` seconds
        for the writes, then stop the writer (a graceful shutdown); returns how many were
        submitted."""
        sent = self.spill(spills)
        if self.tier.flush(timeout):
            self.tier.close()
        else:
            log.warning("the disk tier did not finish its writes in %s s", timeout)
        return sent
