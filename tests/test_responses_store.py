"""The Responses API's response store, backend by backend, on the real pieces: a SQLite
file, a real ``redis-server`` and the in-memory tables; bounds and least-recently-used
eviction, the TTL, tenants kept apart, damaged entries dropped and counted, a SQLite file
killed (SIGKILL) in the middle of writes, a Redis that goes away, and the metrics.

The HTTP side (chains across restarts and replicas) is in ``test_responses_durable.py``.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry

from conftest import ROOT, sample
from gateway.http.errors import APIError
from gateway.protocols.responses_store import ResponseStore, encode
from gateway.protocols.responses_store_memory import MemoryBackend
from gateway.protocols.responses_store_open import check_responses_store, open_backend, store_spec
from gateway.protocols.responses_store_redis import RedisBackend
from gateway.protocols.responses_store_sqlite import SQLiteBackend
from redis_server import RedisServer, require_redis

KINDS = ("memory", "sqlite", "redis")


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer(require_redis()) as server:
        yield server.url


@pytest.fixture
def make(tmp_path, redis_url, request):
    """``make(kind, **bounds)``: a new, empty backend of ``kind``."""
    made = []

    def build(kind: str, **kw):
        if kind == "memory":
            b = MemoryBackend(**kw)
        elif kind == "sqlite":
            b = SQLiteBackend(tmp_path / f"store-{len(made)}.sqlite3", **kw)
        else:
            b = RedisBackend(redis_url, prefix=f"test{len(made)}-{request.node.name}", **kw)
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


def entry(i: int, words: int = 10) -> tuple[dict, list[dict]]:
    """A response ``r{i}`` and its conversation, ``words`` x's long."""
    return ({"id": f"r{i}", "object": "response", "output": []},
            [{"type": "message", "role": "user", "content": "x" * words}])


def put(store: ResponseStore, tenant: str, i: int, **kw) -> bool:
    return anyio.run(store.put, tenant, *entry(i, **kw))


def get(store: ResponseStore, tenant: str, rid: str):
    return anyio.run(store.get, tenant, rid)


def delete(store: ResponseStore, tenant: str, rid: str) -> bool:
    return anyio.run(store.delete, tenant, rid)


def present(store: ResponseStore, tenant: str, n: int) -> list[bool]:
    return [get(store, tenant, f"r{i}") is not None for i in range(n)]


# ---------------------------------------------------------------------- bounds
@pytest.mark.parametrize("kind", KINDS)
def test_bounds_evict_the_least_recently_used_per_tenant(make, kind):
    size = len(encode(*entry(0)))
    store = ResponseStore(make(kind, max_responses=3, max_bytes=10_000))
    for i in range(3):
        assert put(store, "a", i)
    got = get(store, "a", "r0")  # r0 is now the most recently used
    assert got.response == entry(0)[0] and got.items == entry(0)[1] and got.size == size
    assert put(store, "a", 3)
    assert present(store, "a", 4) == [True, False, True, True]  # r1 was the least recently used
    assert store.metrics.totals["a"] == (3, 3 * size) and store.metrics.evictions == {"a": 1}
    assert get(store, "b", "r0") is None and not delete(store, "b", "r0")  # tenants are apart
    assert store.metrics.totals["b"] == (0, 0) and present(store, "a", 4) == [True, False, True, True]

    small = ResponseStore(make(kind, max_responses=100, max_bytes=3 * size + 1))
    for i in range(5):
        assert put(small, "a", i)
    assert present(small, "a", 5) == [False, False, True, True, True]
    assert small.metrics.totals["a"] == (3, 3 * size) and small.metrics.evictions["a"] == 2
    assert not put(small, "a", 9, words=10_000)  # alone over the byte bound: not stored, nothing evicted
    assert get(small, "a", "r9") is None and small.metrics.totals["a"] == (3, 3 * size)
    assert delete(small, "a", "r4") and not delete(small, "a", "r4")
    assert small.metrics.totals["a"] == (2, 2 * size)
    with pytest.raises(ValueError):
        make(kind, max_responses=0)


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_unused_for_the_ttl_expires(make, kind):
    """Memory and SQLite read the clock given (here a fake one); Redis its own server's."""
    now = [1000.0]
    step = (lambda dt: now.__setitem__(0, now[0] + dt)) if kind != "redis" else time.sleep
    store = ResponseStore(make(kind, ttl=1.0, **({"clock": lambda: now[0]} if kind != "redis" else {})))
    for i in range(2):
        assert put(store, "a", i)
    step(0.6)
    assert get(store, "a", "r1") is not None  # a read is a use: r1 lives on
    step(0.6)
    assert present(store, "a", 2) == [False, True]
    assert store.metrics.totals["a"] == (1, len(encode(*entry(1))))


def test_a_chain_of_stores_keeps_the_latest_with_its_whole_history(make):
    """The routes store each turn with its whole conversation: a long chain under a byte
    bound keeps its latest turns, and the latest alone is enough to continue."""
    store = ResponseStore(make("sqlite", max_bytes=4000))
    items: list[dict] = []
    for i in range(30):
        items = items + [{"type": "message", "role": "user", "content": f"turn {i} " + "y" * 40}]
        assert anyio.run(store.put, "a", {"id": f"c{i}", "output": []}, items)
    latest = get(store, "a", "c29")
    assert latest is not None and len(latest.items) == 30
    count, nbytes = store.metrics.totals["a"]
    assert nbytes <= 4000 and count >= 1 and store.metrics.evictions["a"] == 30 - count


def test_blocking_backends_run_on_worker_threads(tmp_path):
    """A store that does I/O is called off the event loop's thread; the memory one on it."""
    seen: dict[str, set[int]] = {}

    def recording(cls):
        class Recording(cls):
            def put(self, *a):
                seen.setdefault(cls.__name__, set()).add(threading.get_ident())
                return super().put(*a)

        return Recording

    async def store_one(store: ResponseStore) -> int:
        assert await store.put("a", *entry(0))
        return threading.get_ident()

    sqlite = recording(SQLiteBackend)(tmp_path / "r.sqlite3")
    loop_thread = anyio.run(store_one, ResponseStore(sqlite))
    sqlite.close()
    assert seen["SQLiteBackend"] and loop_thread not in seen["SQLiteBackend"]
    loop_thread = anyio.run(store_one, ResponseStore(recording(MemoryBackend)()))
    assert seen["MemoryBackend"] == {loop_thread}


# ---------------------------------------------------------------------- SQLite file
def test_sqlite_file_is_private_and_survives_reopening(tmp_path):
    path = tmp_path / "data" / "responses.sqlite3"
    os.umask(old := os.umask(0))
    try:
        store = ResponseStore(SQLiteBackend(path))
        for i in range(3):
            assert put(store, "a" if i < 2 else "b", i)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for p in path.parent.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name
    anyio.run(store.aclose)
    again = SQLiteBackend(path)
    assert again.totals() == {"a": (2, 2 * len(encode(*entry(0)))), "b": (1, len(encode(*entry(2))))}
    assert again.torn_at_open == 0
    assert ResponseStore(again).metrics.totals["a"][0] == 2
    again.close()


def test_sqlite_reads_keep_their_recency_across_a_restart(tmp_path):
    """A read writes nothing; its use time goes with the next write, or at close. Uses in
    one millisecond (a clock that stands still) keep their order."""
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(SQLiteBackend(path, max_responses=2, clock=lambda: 1_000.0))
    assert put(store, "a", 0) and put(store, "a", 1)
    assert get(store, "a", "r0") is not None  # r0 is now the most recently used
    anyio.run(store.aclose)
    store = ResponseStore(SQLiteBackend(path, max_responses=2, clock=lambda: 1_000.0))
    assert put(store, "a", 2) and present(store, "a", 3) == [True, False, True]
    anyio.run(store.aclose)


def tamper(path: Path, rid: str, body: bytes) -> None:
    """Replace the stored body of ``rid`` behind the store's back (what a torn write or a bad
    sector would leave), keeping its digest and size."""
    with sqlite3.connect(path) as c:
        c.execute("UPDATE responses SET body = ? WHERE id = ?", (body, rid))


def test_sqlite_drops_damaged_entries_at_open_and_on_read(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(SQLiteBackend(path))
    for i in range(4):
        assert put(store, "a", i)
    anyio.run(store.aclose)
    good = encode(*entry(0))
    tamper(path, "r1", good[: len(good) // 2])  # torn: half the entry
    tamper(path, "r2", good.replace(b"x", b"z"))  # same length, other bytes

    store = ResponseStore(SQLiteBackend(path))
    registry = CollectorRegistry()
    registry.register(store.metrics)
    assert store.backend.torn_at_open == 2 and sample(registry, "mlx_gateway_responses_torn_total") == 2
    assert present(store, "a", 4) == [True, False, False, True]
    assert store.metrics.totals["a"][0] == 2

    tamper(store.backend.path, "r3", good[:-1] + b"!")  # damaged while it runs: found on read
    assert get(store, "a", "r3") is None
    assert sample(registry, "mlx_gateway_responses_torn_total") == 3
    assert present(store, "a", 4) == [True, False, False, False]
    anyio.run(store.aclose)


def test_sqlite_file_that_is_no_database_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"this is not a database, " * 200)
    backend = SQLiteBackend(path)
    assert backend.moved_aside is not None and backend.moved_aside.read_bytes().startswith(b"this is not")
    assert "moved aside" in caplog.text
    store = ResponseStore(backend)
    assert put(store, "a", 0) and get(store, "a", "r0") is not None
    backend.close()


WRITER = """
import sys
from pathlib import Path
from gateway.protocols.responses_store import encode
from gateway.protocols.responses_store_sqlite import SQLiteBackend

store = SQLiteBackend(Path(sys.argv[1]), max_responses=40)
for i in range(100000):
    tenant = "ab"[i % 2]
    out = store.put(tenant, f"w{i}", encode({"id": f"w{i}", "output": []}, [{"content": "w" * (i % 997)}]))
    assert out.done
    if i % 3 == 0:
        store.get("ab"[(i + 1) % 2], f"w{i - 1}")
    print(tenant, f"w{i}", flush=True)
"""


def test_sqlite_killed_in_the_middle_of_writes_leaves_a_readable_store(tmp_path):
    """SIGKILL a process that stores, reads (recency updates) and evicts as fast as it can,
    several times, at different moments: each time the file opens with nothing damaged, and
    every store the process had reported done is there unless a later one evicted it."""
    path = tmp_path / "responses.sqlite3"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for round_, delay in enumerate((0.3, 0.55, 0.8)):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, env=env)
        done: list[tuple[str, str]] = []
        deadline = time.monotonic() + 60
        while len(done) < 50 and time.monotonic() < deadline:  # started and writing
            done.append(tuple(proc.stdout.readline().decode().split()))
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        done += [tuple(line.split()) for line in proc.stdout.read().decode().splitlines()]
        done = [d for d in done if len(d) == 2]  # not a line the kill cut
        assert len(done) >= 50, f"round {round_}: the writer did not run"
        backend = SQLiteBackend(path, max_responses=40)
        try:
            assert backend.moved_aside is None and backend.torn_at_open == 0, round_
            with sqlite3.connect(path) as c:
                assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            for tenant in "ab":  # the last 39 reported of each tenant are there (one more
                # store may have committed unreported, evicting the 40th)
                latest = [rid for t, rid in done if t == tenant][-39:]
                assert all(backend.get(tenant, rid).done for rid in latest), (round_, tenant)
            assert all(n <= 40 for n, _ in backend.totals().values())
        finally:
            backend.close()


# ---------------------------------------------------------------------- Redis
def test_redis_store_going_away_answers_unstored_and_503():
    with RedisServer(require_redis()) as server:
        store = ResponseStore(RedisBackend(server.url, timeout=0.5))
        registry = CollectorRegistry()
        registry.register(store.metrics)
        assert put(store, "a", 0)
        server.stop()
        assert not put(store, "a", 1)  # the caller answers store: false
        for call in (get, delete):
            with pytest.raises(APIError) as e:
                call(store, "a", "r0")
            assert e.value.status == 503 and e.value.headers.get("Retry-After")
        assert {op: sample(registry, "mlx_gateway_responses_store_failures_total", operation=op)
                for op in ("put", "get", "delete")} == {"put": 1, "get": 1, "delete": 1}
        server.start()  # a new, empty Redis on the same port: the store answers again
        assert put(store, "a", 2) and get(store, "a", "r2") is not None
        store.backend.close()


def test_redis_keys_expire_with_the_ttl(redis_url):
    import redis

    store = ResponseStore(RedisBackend(redis_url, ttl=3600, prefix="ttl"))
    assert put(store, "t", 0)
    client = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in client.keys("ttl:*"))
    assert keys == [f"ttl:{{t}}:responses:{k}" for k in ("body", "bytes", "size", "used")]
    assert all(0 < client.pttl(k) <= 3600_000 for k in keys)
    assert delete(store, "t", "r0") and client.hlen("ttl:{t}:responses:body") == 0
    client.close()
    store.backend.close()


# ---------------------------------------------------------------------- choosing
def test_store_spec_and_check(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_DATA_DIR", str(tmp_path / "data"))
    assert store_spec(None) == ("sqlite", str(tmp_path / "data" / "responses.sqlite3"))
    assert store_spec("memory") == ("memory", "")
    assert store_spec("sqlite:~/x.db") == ("sqlite", str(Path("~/x.db").expanduser()))
    assert store_spec("redis://127.0.0.1:6379/0") == ("redis", "redis://127.0.0.1:6379/0")
    for bad in ("sqlite:", "mysql://x", "/tmp/x.db", ""):
        with pytest.raises(ValueError):
            store_spec(bad)

    class Cfg:
        responses_store, responses_store_count, responses_store_bytes, responses_store_ttl = None, 5, 1000, 0.0

    check_responses_store(Cfg)
    assert (tmp_path / "data" / "responses.sqlite3").is_file()
    backend = open_backend(Cfg)
    assert isinstance(backend, SQLiteBackend) and backend.ttl is None and backend.max_responses == 5
    backend.close()
    (tmp_path / "file").write_text("")
    Cfg.responses_store = f"sqlite:{tmp_path / 'file' / 'x.db'}"  # its directory is a file
    with pytest.raises(OSError):
        check_responses_store(Cfg)
