"""The allocator setting (gateway/cpu/allocator.py) is used only where its measurement
finds it faster: the decision follows the two timings, and what glibc then does with a
large freed block follows the decision."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from gateway.backend import backend
from gateway.cpu import allocator

CHOOSE = """
import ctypes, json, sys
sys.path.insert(0, {root!r})
from gateway.cpu import allocator
from test_cpu_attention import MallInfo2
timings = {timings!r}
allocator.race = lambda candidates, rounds, sync=None: {{name: timings[name] for name in candidates}}
setting = allocator.Allocator()
choice = setting.choose(lambda: None, lambda _: None)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
p = libc.malloc(64 << 20)
ctypes.memset(p, 1, 64 << 20)
libc.free(p)
print(json.dumps([choice.chosen, setting.kept, libc.mallinfo2().fordblks >= 64 << 20,
                  setting.choose(lambda: None, lambda _: None).chosen]))
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


ROOT = os.path.dirname(os.path.dirname(__file__))


def _last_line_of_fresh_process(script: str, drop: tuple = ("MLX_GATEWAY_MALLOC_TUNE",)) -> str:
    """Run ``script`` in a fresh Python (glibc's settings are the process's), without the
    environment variables ``drop``; the last line it printed."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.dirname(__file__)])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("seconds,want", [({"glibc": 0.050, "keep freed": 0.030}, "keep freed"),
                                          ({"glibc": 0.030, "keep freed": 0.029}, "glibc"),
                                          ({"glibc": 0.030, "keep freed": 0.045}, "glibc")])
def test_the_decision_follows_the_timings(seconds, want):
    assert allocator.decide(seconds) == want


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(),
                    reason="glibc's malloc (2.33 or later, for mallinfo2)")
@pytest.mark.skipif(backend().kind != "cpu", reason="the setting applies where MLX runs on the CPU")
@pytest.mark.parametrize("timings,kept", [({"glibc": 0.050, "keep freed": 0.030}, True),
                                          ({"glibc": 0.030, "keep freed": 0.045}, False)])
def test_the_setting_stays_only_where_it_measured_faster(timings, kept):
    """Given the two timings, the setting is in force after the choice (64 MiB freed stays in
    the heap as free bytes) or given back (glibc unmaps a block that large on free); a second
    model's load keeps the first decision."""
    import json

    out = _last_line_of_fresh_process(CHOOSE.format(root=ROOT, timings=timings))
    chosen = "keep freed" if kept else "glibc"
    assert json.loads(out) == [chosen, kept, kept, chosen]


def test_turned_off_it_is_not_measured(monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_MALLOC_TUNE", "0")
    monkeypatch.setattr(allocator, "race", lambda *a, **k: pytest.fail("must not measure"))
    choice = allocator.Allocator().choose(lambda: None, lambda _: None)
    assert (choice.chosen, choice.reason) == ("glibc", "MLX_GATEWAY_MALLOC_TUNE=0")


SERVE_STATE = """
import ctypes, json, sys
sys.path.insert(0, {root!r})
from gateway.cpu import allocator
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mmapped(n):  # glibc's chunk header, just before the block: bit 1 of its size is IS_MMAPPED
    p = libc.malloc(n)
    flag = bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    libc.free(p)
    return flag

before = mmapped(8 << 20)
setting = allocator.Allocator()
setting.as_it_will_serve()
print(json.dumps([before, mmapped(8 << 20), setting.decided, setting.kept]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(),
                    reason="glibc's malloc")
@pytest.mark.skipif(backend().kind != "cpu", reason="the setting applies where MLX runs on the CPU")
def test_measurements_at_load_see_the_heap_as_it_will_serve():
    """A fresh process's glibc serves an 8 MiB block with its own mmap (the dynamic
    threshold starts at 128 KiB), which page-faults afresh on every use; before the
    measurements at load, the allocator is set as it will serve whatever it decides then
    (blocks under 32 MiB from the heap), without deciding anything."""
    import json

    out = _last_line_of_fresh_process(SERVE_STATE.format(root=ROOT))
    assert json.loads(out) == [True, False, None, False]


ARENAS = """
import ctypes, sys, threading
sys.path.insert(0, {root!r})
from gateway.cpu import allocator
if {one!r}:
    assert allocator.one_arena() is None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.fclose.argtypes = [ctypes.c_void_p]
blocks, ready = [], threading.Barrier(5)

def work():  # threads allocating at once, as MLX's stream threads and the engine's do
    ready.wait()
    blocks.append(libc.malloc(1 << 20))
    ready.wait()

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
ready.wait()
ready.wait()
for t in threads:
    t.join()
f = libc.fopen({path!r}.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(f))
libc.fclose(f)
print(open({path!r}).read().count("<heap nr="))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(),
                    reason="glibc's malloc")
def test_serve_keeps_every_thread_on_one_arena(tmp_path):
    """glibc gives threads that allocate at once arenas of their own (malloc_info lists a
    heap per arena); after one_arena, as `serve` calls it first thing, they share the
    main one."""
    counts = [int(_last_line_of_fresh_process(ARENAS.format(root=ROOT, one=one, path=str(tmp_path / f"info{one}.xml")),
                                              drop=("MLX_GATEWAY_MALLOC_TUNE", "MALLOC_ARENA_MAX")))
              for one in (False, True)]
    assert counts[0] > 1 and counts[1] == 1, counts
