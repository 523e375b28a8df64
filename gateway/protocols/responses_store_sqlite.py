"""Stored responses in a SQLite file (``--responses-store sqlite:PATH``; the default, in the
data directory): they survive a restart, a crash and a kill -9.

One table, ``responses(tenant, id, used, size, digest, body)``: ``body`` is the entry's JSON,
``digest`` its SHA-256, ``used`` its last use in ms since the epoch (the LRU order and the
TTL both read it; a store stamps after every other use of the tenant's entries). Every
store and delete is one transaction (``BEGIN IMMEDIATE``), so an entry and the evictions it
causes land together or not at all; a read writes nothing (the use times of the entries
read are written with the next transaction). The database runs in WAL mode with
``synchronous=FULL``: a store is on disk when it commits, before the response's final event
is sent, and a crash at any moment leaves the last committed state (SQLite drops a torn
tail of the WAL itself).

Opening checks the file (``PRAGMA quick_check``) and every entry (its digest and size); a
damaged entry is dropped and counted (``torn_at_open``), and a reading whose digest does
not match is dropped the same way. A file SQLite cannot read as a database is renamed
aside (``PATH.corrupt-<time>``, kept for inspection) and a new one started; the rename is
logged. Several gateways may share one file on one machine (SQLite's locking; a writer waits
up to :data:`BUSY_SECONDS` for another).

The file and its directory are created private to this user (0600, 0700). Calls come from
worker threads; one connection is shared under a lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from gateway.protocols.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, Outcome, check_bounds

log = logging.getLogger("mlx_gateway.responses_store")

BUSY_SECONDS = 10.0  # a writer waits this long for another process's transaction
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    used INTEGER NOT NULL,
    size INTEGER NOT NULL,
    digest BLOB NOT NULL,
    body BLOB NOT NULL,
    UNIQUE (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_by_use ON responses (tenant, used);
"""
_CORRUPT = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB


def _is_corrupt(e: sqlite3.DatabaseError) -> bool:
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in _CORRUPT
    return not isinstance(e, sqlite3.OperationalError)  # "database is locked" & co are operational


class _Damaged(sqlite3.DatabaseError):
    """``quick_check`` found the file damaged."""


def prepare_file(path: Path) -> None:
    """Create ``path``'s directory (0700, when missing) and the file itself (0600, empty,
    when missing), so that SQLite's files are private from the start.

    Raises:
        OSError: naming the path.
    """
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    except OSError as e:
        raise OSError(e.errno, f"response store {path}: cannot create it: {e.strerror}") from e


class SQLiteBackend:
    """Per-tenant LRU tables in the SQLite file ``path`` (see the module docstring),
    bounded by ``max_responses`` and ``max_bytes`` per tenant; an entry unused for ``ttl``
    seconds (None: never) expires. ``clock``: seconds since the epoch.

    Raises:
        ValueError: a bound below 1, or a file made by a newer gateway.
        OSError, sqlite3.Error: the file cannot be created or opened.
    """

    blocking = True

    def __init__(self, path: Path, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl: Optional[float] = None, clock: Callable[[], float] = time.time):
        check_bounds(max_responses, max_bytes)
        self.path = Path(path)
        self.max_responses, self.max_bytes, self.ttl, self.clock = max_responses, max_bytes, ttl, clock
        self.moved_aside: Optional[Path] = None
        self._lock = threading.Lock()
        self._touched: dict[tuple[str, str], int] = {}  # (tenant, id) -> a use not written yet
        self._touched_top: dict[str, int] = {}  # tenant -> the latest of its uses not written yet
        prepare_file(self.path)
        try:
            self._conn = self._connect()
        except sqlite3.DatabaseError as e:
            if not _is_corrupt(e):
                raise
            self.moved_aside = self._move_aside(e)
            self._conn = self._connect()
        self.torn_at_open, self._totals_at_open = self._check()

    def describe(self) -> str:
        return f"sqlite:{self.path}"

    def totals(self) -> dict[str, tuple[int, int]]:
        return dict(self._totals_at_open)

    # ------------------------------------------------------------------ opening
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            problems = [r[0] for r in conn.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise _Damaged("; ".join(problems[:3]))
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ValueError(f"response store {self.path} was written by a newer mlx-gateway "
                                 f"(schema {version}); give another --responses-store")
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self, error: sqlite3.DatabaseError) -> Path:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                os.replace(src, Path(f"{aside}{suffix}"))
        log.error("response store %s is damaged (%s): moved aside to %s, starting an empty store",
                  self.path, error, aside)
        prepare_file(self.path)
        return aside

    def _check(self) -> tuple[int, dict[str, tuple[int, int]]]:
        """Drop expired and damaged entries; (damaged ones, the tenants' totals)."""
        with self._txn() as c:
            if self.ttl is not None:
                c.execute("DELETE FROM responses WHERE used < ?", (self._now() - int(self.ttl * 1000),))
            bad = [(rowid,) for rowid, size, digest, body in c.execute("SELECT rowid, size, digest, body FROM responses")
                   if len(body) != size or hashlib.sha256(body).digest() != digest]
            c.executemany("DELETE FROM responses WHERE rowid = ?", bad)
            totals = {t: (n, int(b)) for t, n, b in
                      c.execute("SELECT tenant, count(*), total(size) FROM responses GROUP BY tenant")}
        if bad:
            log.warning("response store %s: %d damaged entries dropped", self.path, len(bad))
        return len(bad), totals

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _txn(self):
        """One write transaction under the lock (rolled back on any error); the recency of
        the entries read since the last one is written first."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                if self._touched:
                    c.executemany("UPDATE responses SET used = max(used, ?) WHERE tenant = ? AND id = ?",
                                  [(used, t, rid) for (t, rid), used in self._touched.items()])
                yield c
                c.execute("COMMIT")
            except BaseException:
                try:
                    c.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the failed COMMIT already ended it
                raise
            self._touched.clear()
            self._touched_top.clear()

    def _now(self) -> int:
        return int(self.clock() * 1000)

    def _expire(self, c: sqlite3.Connection, tenant: str, now: int) -> None:
        if self.ttl is not None:
            c.execute("DELETE FROM responses WHERE tenant = ? AND used < ?", (tenant, now - int(self.ttl * 1000)))

    def _stamp(self, c: sqlite3.Connection, tenant: str, now: int) -> int:
        """A use time after every other use of the tenant's entries, those read since the
        last write included (two uses in one millisecond keep their order)."""
        ((top,),) = c.execute("SELECT max(used) FROM responses WHERE tenant = ?", (tenant,)).fetchall()
        top = max(top if top is not None else -1, self._touched_top.get(tenant, -1))
        return now if top < now else top + 1

    @staticmethod
    def _totals(c: sqlite3.Connection, tenant: str) -> tuple[int, int]:
        ((n, b),) = c.execute("SELECT count(*), total(size) FROM responses WHERE tenant = ?", (tenant,)).fetchall()
        return n, int(b)

    # ------------------------------------------------------------------ operations
    def put(self, tenant: str, rid: str, body: bytes) -> Outcome:
        digest = hashlib.sha256(body).digest()
        with self._txn() as c:
            now = self._now()
            c.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
            self._expire(c, tenant, now)
            if len(body) > self.max_bytes:
                return Outcome(False, *self._totals(c, tenant))
            c.execute("INSERT INTO responses (tenant, id, used, size, digest, body) VALUES (?, ?, ?, ?, ?, ?)",
                      (tenant, rid, self._stamp(c, tenant, now), len(body), digest, body))
            n, b = self._totals(c, tenant)
            gone: list[tuple[int]] = []
            if n > self.max_responses or b > self.max_bytes:
                for rowid, size in c.execute("SELECT rowid, size FROM responses WHERE tenant = ? AND id != ? "
                                             "ORDER BY used", (tenant, rid)).fetchall():
                    if n <= self.max_responses and b <= self.max_bytes:
                        break
                    gone.append((rowid,))
                    n, b = n - 1, b - size
                c.executemany("DELETE FROM responses WHERE rowid = ?", gone)
            return Outcome(True, n, b, evicted=len(gone))

    def get(self, tenant: str, rid: str) -> Outcome:
        """A read, without a write: the entry's new use time is kept here and written with
        the next write (it only matters to eviction and expiry, which writes do; lost in a
        crash, it leaves the entry a little older)."""
        with self._lock:
            c, now = self._conn, self._now()
            rows = c.execute("SELECT used, size, digest, body FROM responses WHERE tenant = ? AND id = ?",
                             (tenant, rid)).fetchall()
            if not rows:
                return Outcome(False, *self._totals(c, tenant))
            used, size, digest, body = rows[0]
            used = max(used, self._touched.get((tenant, rid), 0))
            expired = self.ttl is not None and used < now - int(self.ttl * 1000)
            torn = not expired and (len(body) != size or hashlib.sha256(body).digest() != digest)
            if not expired and not torn:
                stamp = self._touched[(tenant, rid)] = self._stamp(c, tenant, now)
                self._touched_top[tenant] = stamp
                return Outcome(True, *self._totals(c, tenant), body=bytes(body))
        if torn:
            log.warning("response store %s: entry %s of tenant %s is damaged: dropped", self.path, rid, tenant)
        with self._txn() as c:
            c.execute("DELETE FROM responses WHERE tenant = ? AND id = ? AND digest = ?", (tenant, rid, digest))
            return Outcome(False, *self._totals(c, tenant), torn=int(torn))

    def delete(self, tenant: str, rid: str) -> Outcome:
        with self._txn() as c:
            done = c.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid)).rowcount > 0
            return Outcome(done, *self._totals(c, tenant))

    def close(self) -> None:
        """Write the pending use times, checkpoint the WAL into the file and close (a later
        open needs neither)."""
        try:
            if self._touched:
                with self._txn():
                    pass
            with self._lock:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # never waits for another process
        finally:
            self._conn.close()
