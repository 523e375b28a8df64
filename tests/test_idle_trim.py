"""After a quiet spell the kept heap goes back to the kernel (``gateway.cpu.idle_trim``):
when the trimmer trims, that ``malloc_trim`` really lowers the resident size, and what the
server's engine reports as activity."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import live_server, model_path
from gateway.cpu.idle_trim import IdleTrimmer, idle_seconds_setting


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_once_per_quiet_spell():
    clock, trims, state = Clock(), [], {"steps": None}
    t = IdleTrimmer(lambda: state["steps"], 30.0, trim=lambda: trims.append(clock.now) or True, clock=clock)

    def at(seconds: float, steps) -> bool:
        clock.now, state["steps"] = seconds, steps
        return t.poll()

    assert not at(0, None) and not at(100, None)  # busy (or not loaded): never
    assert not at(101, 7)  # idle from here
    assert not at(120, 7)
    assert at(131, 7)  # 30 s after it went quiet
    assert not at(200, 7) and not at(400, 7)  # once per spell
    assert not at(401, 9)  # it worked again (two steps between polls, never busy at a poll)
    assert not at(420, 9) and not at(425, 10)  # a step restarts the wait
    assert not at(450, 10)
    assert at(456, 10)
    assert trims == [131, 456] and t.trims == 2


def test_setting(monkeypatch):
    monkeypatch.delenv("MLX_GATEWAY_IDLE_TRIM_SECONDS", raising=False)
    assert idle_seconds_setting() == 30.0
    monkeypatch.setenv("MLX_GATEWAY_IDLE_TRIM_SECONDS", "0")
    assert idle_seconds_setting() == 0.0
    for bad in ("soon", "inf", "nan"):
        monkeypatch.setenv("MLX_GATEWAY_IDLE_TRIM_SECONDS", bad)
        with pytest.raises(ValueError, match="MLX_GATEWAY_IDLE_TRIM_SECONDS must be a finite number"):
            idle_seconds_setting()


TRIM = """
import ctypes, sys
sys.path.insert(0, {root!r})
from gateway.cpu.allocator import Allocator
from gateway.cpu.idle_trim import release_free_memory, resident_bytes
print(Allocator().keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(256 << 20)
ctypes.memset(p, 1, 256 << 20)
libc.free(p)
kept = resident_bytes()
print(release_free_memory())
print((kept - resident_bytes()) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/statm"),
                    reason="glibc's malloc_trim and /proc")
def test_trim_returns_kept_memory_to_the_kernel():
    """256 MiB freed under the allocator setting stays resident; the trim gives it back."""
    here = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if k != "MLX_GATEWAY_MALLOC_TUNE"}
    out = subprocess.run([sys.executable, "-c", TRIM.format(root=os.path.dirname(here))], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    if out[0] != "None":
        pytest.skip(f"the allocator setting does not apply here: {' '.join(out[:-2])}")
    assert out[1] == "True", out
    assert int(out[2]) >= 200, f"only {out[2]} MiB went back"


FREED = """
import ctypes, sys
sys.path.insert(0, {root!r})
from gateway.cpu.idle_trim import heap_free_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = heap_free_bytes()
blocks = [libc.malloc(64 << 10) for _ in range(2048)]  # 128 MiB of 64 KiB blocks: below mmap's threshold
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:  # the last one keeps the rest from being the heap's top, which free would trim
    libc.free(b)
print(before, heap_free_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_heap_free_bytes_counts_what_malloc_keeps():
    """128 MiB freed in 64 KiB blocks shows up as free heap bytes (what the resident size
    counts although nothing holds it)."""
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", FREED.format(root=os.path.dirname(here))],
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    if out[0] == "None":
        pytest.skip("no mallinfo2 here (glibc before 2.33)")
    assert int(out[1]) - int(out[0]) >= 120 << 20, out


def test_engine_activity_is_the_step_count_when_idle():
    with live_server(model_path("qwen3")) as server, server.client() as c:
        assert server.engine.wait_idle(60)
        before = server.gateway.activity()
        r = c.post("/v1/completions", json={"model": "test-model", "prompt": "the sea", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert server.engine.wait_idle(60)
        after = server.gateway.activity()
        assert isinstance(before, int) and isinstance(after, int) and after > before
        slot = server.gateway.models.slots[0]
        handle, slot.handle = slot.handle, None  # what the trimmer sees before a model has loaded
        try:
            assert server.gateway.activity() is None
        finally:
            slot.handle = handle


def test_trims_while_busy_past_the_free_heap_limit():
    """While the engine works, the free heap is read once per ``busy_every`` and trimmed
    only when it is over the limit and the resident size has grown by the limit since the
    last trim (a trim leaves the free blocks on malloc's lists: the free heap reads the same
    after it); idle trims go on as before."""
    clock, trims, state = Clock(), [], {"steps": None, "free": 100, "rss": 5000}
    reads = []

    def free() -> int:
        reads.append(clock.now)
        return state["free"]

    def trim() -> bool:
        trims.append(clock.now)
        state["rss"] -= 800
        return True

    t = IdleTrimmer(lambda: state["steps"], 30.0, trim=trim, clock=clock, busy_free_limit=500, busy_every=60.0,
                    free_bytes=free, resident=lambda: state["rss"])

    def at(seconds: float, steps=None, heap=None, rss=None) -> bool:
        clock.now, state["steps"] = seconds, steps
        state["free"] = state["free"] if heap is None else heap
        state["rss"] = state["rss"] if rss is None else rss
        return t.poll()

    assert not at(10) and not at(59)  # busy, but not a minute yet: the heap is not read
    assert not at(61, heap=400)  # read, under the limit
    assert not at(90, heap=900)  # over it, but read again only a minute later
    assert at(122)  # resident 5000 -> 4200
    assert not at(183) and not at(244, rss=4700)  # free still over the limit, but grown by 500 only
    assert at(305, rss=4701)
    assert not at(310, 5) and not at(339, 5)  # idle: 30 s of quiet first
    assert at(341, 5)
    assert trims == [122, 305, 341] and reads == [61, 122, 305] and (t.trims, t.busy_trims) == (3, 2)


def test_no_busy_trim_without_a_limit():
    clock, trims = Clock(), []
    t = IdleTrimmer(lambda: None, 30.0, trim=lambda: trims.append(clock.now) or True, clock=clock,
                    free_bytes=lambda: 1 << 40)
    for clock.now in range(0, 1000, 10):
        assert not t.poll()
    assert trims == []
