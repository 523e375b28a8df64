"""The disk tier of the prompt cache: codec round trips, restart, prefix rules,
corruption, isolation, LRU byte budget, full disk, kill -9, permissions, non-blocking submit.

Snapshots are real mlx-lm layer caches; the store is exercised through its public API
on real files under ``tmp_path``. Crash and resource-limit cases run in a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import safetensors.numpy as st_numpy
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from cache.disk import DiskTier
from cache.disk_codec import decode_snapshot, encode_snapshot
from cache.disk_format import entry_name, model_identity, payload_checksum
from cache.restore import is_trimmable

ROOT = Path(__file__).resolve().parents[1]
IDENT = "a1" * 32
WRITES = "mlx_gateway_prompt_cache_disk_writes_total"
READS = "mlx_gateway_prompt_cache_disk_reads_total"

try:
    import resource
except ImportError:  # pragma: no cover
    resource = None


# ----------------------------------------------------------------- snapshots
def kv(n, dtype=mx.float32):
    c = KVCache()
    x = mx.random.normal((1, 2, n, 8)).astype(dtype)
    c.update_and_fetch(x, x * 2)
    return c


def rotating(n, dtype=mx.float32, singles=0):
    c = RotatingKVCache(max_size=8, keep=2)
    c.update_and_fetch(mx.random.normal((1, 2, n, 4)).astype(dtype), mx.random.normal((1, 2, n, 4)).astype(dtype))
    for _ in range(singles):
        x = mx.random.normal((1, 2, 1, 4)).astype(dtype)
        c.update_and_fetch(x, x)
    return c


def arrays(dtype=mx.float32, hole=False):
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 4)).astype(dtype)
    c[1] = None if hole else mx.random.normal((1, 3, 2)).astype(dtype)
    c[2] = mx.arange(6, dtype=mx.int32).reshape(1, 6)
    if hole:
        c.left_padding = mx.array([0])
    return c


def cachelist(dtype=mx.float32):
    return CacheList(kv(5, dtype), arrays(dtype))


def same(a, b):
    """Structural equality of two states / layer lists (arrays: dtype, shape and values)."""
    if isinstance(a, mx.array):
        return isinstance(b, mx.array) and a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "state"):
        return type(a) is type(b) and same(a.state, b.state) and getattr(a, "offset", None) == getattr(b, "offset", None)
    return type(a) is type(b) and a == b


def roundtrip(snapshot):
    arrs, meta = encode_snapshot(snapshot)
    assert all(isinstance(v, np.ndarray) and v.flags.owndata for v in arrs.values())
    assert all(isinstance(v, str) for v in meta.values())
    return decode_snapshot(arrs, meta)


def blob(i, n=1000):
    return {"x": np.full(n, i % 256, dtype=np.uint8)}, {"note": f"entry {i}"}


def files(d):
    return sorted(p.name for p in Path(d).iterdir() if p.name != ".lock")


@pytest.fixture
def tiers():
    made = []

    def make(root, max_bytes=10**7, ident=IDENT, **kw):
        t = DiskTier(root, max_bytes, ident, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def metric(tier, name, **labels):
    return tier.registry.get_sample_value(name, labels or None) or 0.0


# ----------------------------------------------------------------- 1. codec
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_codec_round_trip_each_class(dtype):
    snapshot = [kv(7, dtype), kv(300, dtype), rotating(5, dtype), rotating(12, dtype, singles=3),
                arrays(dtype), arrays(dtype, hole=True), cachelist(dtype), KVCache()]
    back = roundtrip(snapshot)
    assert len(back) == len(snapshot)
    for a, b in zip(snapshot, back):
        assert same(a, b), type(a).__name__
    assert back[2]._idx == snapshot[2]._idx and back[3].keep == 2 and back[3].max_size == 8
    assert [c.is_trimmable() for c in back[2:4]] == [True, False]
    # a restored cache keeps working
    x = mx.ones((1, 2, 1, 8), dtype)
    k, _ = back[0].update_and_fetch(x, x)
    assert k.shape[2] == 8 and back[0].offset == 8


def test_codec_rejects_malformed():
    arrs, meta = encode_snapshot([kv(3), arrays()])
    bad = dict(meta, layers=meta["layers"].replace('"KVCache"', '"Evil"'))
    with pytest.raises(ValueError, match="unknown cache class"):
        decode_snapshot(arrs, bad)
    with pytest.raises(ValueError, match="missing array"):
        decode_snapshot({k: v for k, v in arrs.items() if k != "0.0"}, meta)
    with pytest.raises(ValueError, match="stored as"):
        decode_snapshot(dict(arrs, **{"0.0": arrs["0.0"].astype(np.float64)}), meta)
    with pytest.raises(ValueError):
        decode_snapshot(arrs, dict(meta, codec="99"))
    with pytest.raises(ValueError):
        decode_snapshot(arrs, dict(meta, layers="{not json"))
    with pytest.raises(ValueError, match="not referenced"):
        decode_snapshot(dict(arrs, extra=np.zeros(1)), meta)
    members = encode_snapshot([cachelist()])
    bad = dict(members[1], layers=members[1]["layers"].replace('"ArraysCache"', '"os"'))
    with pytest.raises(ValueError):
        decode_snapshot(members[0], bad)


def test_model_identity(tmp_path):
    def make(name, seed, template=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "tokenizer.json").write_text('{"v": 1}')
        rng = np.random.default_rng(seed)
        st_numpy.save_file({"w": rng.standard_normal(600_000).astype(np.float32)}, d / "model.safetensors")
        return d

    a, b = make("a", 0), make("b", 1)  # same architecture, different weights (2.4 MB each)
    ia = model_identity(a)
    assert len(ia) == 64 and ia == model_identity(a)
    assert ia != model_identity(b)
    assert ia != model_identity(a, chat_template="{{ messages }}")
    assert ia != model_identity(a, loaded_as="float32")  # weights cast after loading: other snapshots
    assert model_identity(a, served_as="x") != model_identity(a, served_as="y")  # two names, two directories
    (a / "chat_template.jinja").write_text("x")
    assert ia != model_identity(a)
    with pytest.raises(FileNotFoundError):
        model_identity(tmp_path / "nope")


# ----------------------------------------------------------------- 2. restart
def test_write_restart_read_decode(tmp_path, tiers):
    snapshot = [kv(10, mx.bfloat16), rotating(10, singles=2), cachelist()]
    tokens = list(range(100, 112))
    tier = tiers(tmp_path / "root")
    arrs, meta = encode_snapshot(snapshot)
    assert tier.submit("g", tokens, arrs, meta, is_trimmable(snapshot))
    assert tier.flush(5)
    assert tier.num_entries == 1 and metric(tier, WRITES, outcome="written") == 1
    tier.close()
    tier.close()  # idempotent

    again = tiers(tmp_path / "root")  # a restart
    assert again.num_entries == 1 and again.nbytes == sum(
        p.stat().st_size for p in again.dir.glob("*.safetensors"))
    assert metric(again, "mlx_gateway_prompt_cache_disk_entries") == 1
    assert metric(again, "mlx_gateway_prompt_cache_disk_bytes") == again.nbytes
    entry, n = again.lookup("g", tokens + [7, 8])
    assert n == len(tokens) and entry.num_tokens == len(tokens) and not entry.trimmable
    got = again.read(entry)
    assert got is not None and got[1] == meta
    back = decode_snapshot(*got)
    assert all(same(a, b) for a, b in zip(snapshot, back))
    assert metric(again, READS, outcome="hit") == 1
    assert again.key(entry) == tokens
    assert again.drop(entry) and not again.drop(entry) and again.num_entries == 0
    assert not list(again.dir.glob("*.safetensors")) and again.read(entry) is None
    with pytest.raises(KeyError):
        again.key(entry)
    again.sanity_check()


# ----------------------------------------------------------------- 3. prefix rules
def test_prefix_rules(tmp_path, tiers):
    tier = tiers(tmp_path / "root")
    key = list(range(1, 11))
    assert tier.submit("n", key, *blob(1), trimmable=False)
    assert tier.submit("t", key, *blob(2), trimmable=True)
    tier.flush()

    def hit(group, q):
        r = tier.lookup(group, q)
        return None if r is None else r[1]

    for g in ("n", "t"):
        assert hit(g, key + [11, 12]) == 10  # longer query: the whole key
        assert hit(g, [0] + key) is None  # no shared prefix
        assert hit(g, key[:1]) is None  # nothing before the last token
    # same query: capped at len-1, only a trimmable entry can give 9
    assert hit("n", key) is None and hit("t", key) == 9
    # shorter query
    assert hit("n", key[:5]) is None and hit("t", key[:5]) == 4
    # diverging query
    q = key[:6] + [77, 78, 79]
    assert hit("n", q) is None and hit("t", q) == 6
    # a stored prefix serves when the longer entry cannot be trimmed
    assert tier.submit("n", key[:4], *blob(3), trimmable=False)
    tier.flush()
    assert hit("n", q) == 4 and hit("n", key[:5]) == 4
    tier.sanity_check()


# ----------------------------------------------------------------- 4. corruption
def test_corrupt_data_is_detected_deleted_and_counted(tmp_path, tiers, caplog):
    tier = tiers(tmp_path / "root")
    tier.submit("g", [1, 2, 3, 4], *blob(5, 5000), trimmable=True)
    tier.submit("g", [9, 9, 9], *encode_snapshot([kv(4)]), trimmable=True)
    tier.flush()
    path = tier.lookup("g", [1, 2, 3, 4, 5])[0].path
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a byte of tensor data
    path.write_bytes(bytes(data))
    entry, _ = tier.lookup("g", [1, 2, 3, 4, 5])
    with caplog.at_level(logging.WARNING, logger="cache.disk"):
        assert tier.read(entry) is None
    assert "checksum" in caplog.text
    assert not path.exists() and tier.lookup("g", [1, 2, 3, 4, 5]) is None
    assert metric(tier, READS, outcome="corrupt") == 1 and tier.num_entries == 1
    # header metadata edited in place (still parseable): caught by the checksum too
    entry, _ = tier.lookup("g", [9, 9, 9, 1])
    raw = entry.path.read_bytes()
    entry.path.write_bytes(raw.replace(b'\\"KVCache\\"', b'\\"KVCachf\\"'))
    assert entry.path.read_bytes() != raw
    assert tier.read(entry) is None and tier.num_entries == 0
    # a missing file
    tier.submit("g", [5, 6, 7], *blob(6), trimmable=True)
    tier.flush()
    entry, _ = tier.lookup("g", [5, 6, 7, 8])
    os.unlink(entry.path)
    assert tier.read(entry) is None and tier.num_entries == 0
    tier.sanity_check()


def test_bad_files_at_start_are_skipped(tmp_path, tiers, caplog):
    tier = tiers(tmp_path / "root")
    for i in range(3):
        tier.submit("g", [i + 1] * 4, *blob(i, 4000), trimmable=True)
    tier.flush()
    tier.close()
    d = tier.dir
    good, trunc, _ = sorted(d.glob("*.safetensors"))
    trunc.write_bytes(trunc.read_bytes()[:-1000])  # header intact, data cut
    (d / ("ab" * 20 + ".safetensors")).write_bytes(os.urandom(3000))  # garbage
    (d / ("cd" * 20 + ".safetensors")).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")  # no metadata
    (d / ".tmp-0123456789abcdef").write_bytes(b"partial")
    (d / "notes.txt").write_text("not ours")
    with caplog.at_level(logging.WARNING, logger="cache.disk"):
        again = tiers(tmp_path / "root")
    assert again.num_entries == 2
    assert metric(again, READS, outcome="corrupt") == 3
    assert caplog.text.count("deleting unreadable entry") == 3
    assert not trunc.exists() and good.exists()
    assert sorted(files(d)) == sorted([p.name for p in d.glob("*.safetensors")] + ["notes.txt"])
    assert len(files(d)) == 3
    for i in range(3):
        r = again.lookup("g", [i + 1] * 5)
        if entry_name("g", [i + 1] * 4) == trunc.stem:
            assert r is None  # never served
        else:
            assert r[1] == 4 and again.read(r[0])[0]["x"][0] == i


# ----------------------------------------------------------------- 5. isolation
def test_other_model_and_other_group_never_hit(tmp_path, tiers):
    a = tiers(tmp_path / "root")
    a.submit("g", [1, 2, 3], *blob(1), trimmable=True)
    a.flush()
    assert a.lookup("other", [1, 2, 3, 4]) is None
    assert a.lookup("g", [1, 2, 3, 4]) is not None
    a.close()
    b = tiers(tmp_path / "root", ident="b2" * 32)
    assert b.num_entries == 0 and b.lookup("g", [1, 2, 3, 4]) is None
    b.submit("g", [1, 2, 3], *blob(2), trimmable=True)
    b.flush()
    b.close()
    a2 = tiers(tmp_path / "root")
    assert a2.num_entries == 1
    entry, _ = a2.lookup("g", [1, 2, 3, 4])
    assert a2.read(entry)[1]["note"] == "entry 1"
    with pytest.raises(OSError, match="in use"):
        DiskTier(tmp_path / "root", 10**6, IDENT)  # one tier per model directory
    with pytest.raises(ValueError):
        DiskTier(tmp_path / "root", 10**6, "../escape")


# ----------------------------------------------------------------- 6. LRU byte budget
def test_lru_byte_budget(tmp_path, tiers):
    probe = tiers(tmp_path / "probe")
    probe.submit("g", [10] * 5, *blob(0), trimmable=True)
    probe.flush()
    size = probe.nbytes
    budget = 3 * size + size // 2
    tier = tiers(tmp_path / "root", max_bytes=budget)

    def put(i):
        assert tier.submit("g", [10 + i] * 5, *blob(i), trimmable=True)
        assert tier.flush(5)
        on_disk = sum(p.stat().st_size for p in tier.dir.iterdir() if p.name != ".lock")
        assert on_disk == tier.nbytes <= budget
        tier.sanity_check()

    def stored():
        return {i for i in range(10) if tier.lookup("g", [10 + i] * 6) is not None}

    for i in range(3):
        put(i)
    assert stored() == {0, 1, 2}
    assert tier.read(tier.lookup("g", [10] * 6)[0]) is not None  # 0 is now most recent
    put(3)
    assert stored() == {0, 2, 3}
    assert metric(tier, "mlx_gateway_prompt_cache_disk_evictions_total") == 1
    for i in range(4, 10):
        put(i)
    assert stored() == {7, 8, 9}
    assert tier.num_entries == 3
    # too big alone: skipped without evicting anything
    assert not tier.submit("g", [99], {"x": np.zeros(budget + 1, np.uint8)}, {}, trimmable=True)
    assert tier.num_entries == 3
    # at start, an over-budget directory is cut down to the new budget, oldest first
    tier.close()
    small = tiers(tmp_path / "root", max_bytes=size + 10)
    assert small.num_entries == 1 and small.nbytes <= size + 10


# ----------------------------------------------------------------- 7. full disk
_CHILD_PRELUDE = f"""
import os, sys, types, json, signal, time
sys.path.insert(0, {str(ROOT)!r})
pkg = types.ModuleType("cache"); pkg.__path__ = [{str(ROOT / "cache")!r}]; sys.modules["cache"] = pkg
import numpy as np
from cache.disk import DiskTier
"""


@pytest.mark.skipif(resource is None, reason="needs the resource module (POSIX)")
def test_full_disk_is_a_logged_skip(tmp_path):
    root = tmp_path / "root"
    script = _CHILD_PRELUDE + f"""
import resource
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
t = DiskTier({str(root)!r}, 10**8, {IDENT!r})
big = t.submit("g", [1, 2, 3], {{"x": np.ones(1_000_000, np.uint8)}}, {{}}, True)
t.flush()
small = t.submit("g", [4, 5, 6], {{"x": np.ones(1000, np.uint8)}}, {{}}, True)
t.flush()
v = lambda o: t.registry.get_sample_value("mlx_gateway_prompt_cache_disk_writes_total", {{"outcome": o}})
print(json.dumps([big, small, v("failed"), v("written"), t.num_entries, sorted(os.listdir(t.dir))]))
t.close()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    big, small, failed, written, n, names = json.loads(r.stdout)
    assert big and small and failed == 1 and written == 1 and n == 1
    assert "write of" in r.stderr and "skipped" in r.stderr
    assert not [x for x in names if x.startswith(".tmp-")] and len(names) == 2  # entry + .lock


# ----------------------------------------------------------------- 8. kill -9
def test_kill_during_write_keeps_completed_entries(tmp_path, tiers):
    root = tmp_path / "root"
    script = _CHILD_PRELUDE + f"""
t = DiskTier({str(root)!r}, 10**9, {IDENT!r})
for i in range(3):
    t.submit("g", [i + 1] * 3, {{"x": np.full(1000, i, np.uint8)}}, {{}}, True)
t.flush()
t.submit("g", [9] * 3, {{"x": np.ones(128 << 20, np.uint8)}}, {{}}, True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    if any(n.startswith(".tmp-") for n in os.listdir(t.dir)):
        print("MIDWAY", flush=True)
        break
    if t.num_entries == 4:
        print("LATE", flush=True)
        break
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr
    model_dir = root / IDENT[:32]
    if "MIDWAY" in r.stdout:
        expect = 3
        assert [n for n in files(model_dir) if n.startswith(".tmp-")]  # the interrupted write
    else:  # the write finished before the kill (very fast disk): still all readable
        assert "LATE" in r.stdout
        expect = 4
    tier = tiers(root)
    assert tier.num_entries == expect
    assert not [n for n in files(model_dir) if n.startswith(".tmp-")]
    for i in range(3):
        entry, n = tier.lookup("g", [i + 1] * 4)
        arrs, _ = tier.read(entry)
        assert n == 3 and (arrs["x"] == i).all()
    assert metric(tier, READS, outcome="corrupt") == 0


# ----------------------------------------------------------------- 9. permissions
def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_permissions_with_umask_zero(tmp_path, tiers):
    old = os.umask(0)
    try:
        tier = tiers(tmp_path / "a" / "root")
        tier.submit("g", [1, 2], *blob(1), trimmable=True)
        tier.flush()
    finally:
        os.umask(old)
    assert _mode(tier.root) == 0o700 and _mode(tier.dir) == 0o700
    assert [_mode(p) for p in tier.dir.glob("*.safetensors")] == [0o600]
    assert _mode(tier.dir / ".lock") == 0o600

    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o755)
    (wide / IDENT[:32]).mkdir()
    os.chmod(wide / IDENT[:32], 0o777)
    t2 = tiers(wide)
    assert _mode(wide) == 0o700 and _mode(t2.dir) == 0o700

    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(NotADirectoryError):
        DiskTier(not_dir, 10**6, IDENT)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_root_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, -1)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        DiskTier(d, 10**6, IDENT)


# ----------------------------------------------------------------- 10. submit never blocks
def test_submit_never_blocks(tmp_path, tiers, monkeypatch):
    tier = tiers(tmp_path / "root", queue_limit=2)
    gate = threading.Event()
    entered = threading.Event()
    real_fsync = os.fsync

    def stalled_fsync(fd):
        entered.set()
        gate.wait(10)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", stalled_fsync)
    try:
        assert tier.submit("g", [1, 1], *blob(1), trimmable=True)
        assert entered.wait(5)  # the writer is stuck in fsync
        assert tier.submit("g", [2, 2], *blob(2), trimmable=True)
        assert tier.submit("g", [3, 3], *blob(3), trimmable=True)
        t0 = time.perf_counter()
        assert not tier.submit("g", [4, 4], *blob(4), trimmable=True)  # queue full
        assert not tier.submit("g", [2, 2], *blob(2), trimmable=True)  # already queued
        assert time.perf_counter() - t0 < 0.5  # the writer stays stalled for up to 10 s
        assert not tier.flush(timeout=0.05)
        assert metric(tier, WRITES, outcome="skipped") == 2
    finally:
        gate.set()
    assert tier.flush(5)
    monkeypatch.undo()
    assert tier.num_entries == 3
    assert not tier.submit("g", [3, 3], *blob(3), trimmable=True)  # already stored
    with pytest.raises(ValueError, match="reserved"):
        tier.submit("g", [5], *blob(5)[:1], {"checksum": "x"}, trimmable=True)
    tier.close()
    assert not tier.submit("g", [6, 6], *blob(6), trimmable=True)


def test_checksum_covers_names_and_metadata():
    a = {"x": np.arange(4, dtype=np.int32)}
    base = payload_checksum(a, {"k": "v"})
    assert base == payload_checksum({"x": np.arange(4, dtype=np.int32)}, {"k": "v", "checksum": "ignored"})
    assert base != payload_checksum({"y": a["x"]}, {"k": "v"})
    assert base != payload_checksum(a, {"k": "w"})
    assert base != payload_checksum({"x": a["x"].astype(np.uint32)}, {"k": "v"})
