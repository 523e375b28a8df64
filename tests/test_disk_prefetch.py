"""Disk-tier entries are read when their request arrives, off the engine thread
(``scheduler/engine/prefetch.py``): the engine thread never reads a file for a request that
arrived through ``Engine.submit``, the answer is the one a cold gateway gives, and a
client that leaves while its file is read is cancelled without running."""

from __future__ import annotations

import threading
import time

import httpx

from cache.disk import DiskTier
from conftest import live_server, model_path, wait_until
from test_disconnect import raw_post

PROMPT = "alpha beta gamma delta epsilon zeta eta theta " * 12


def _ask(server, max_tokens: int = 8) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "test-model", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_disk_entries_are_read_off_the_engine_thread(tmp_path, monkeypatch):
    cache_dir = str(tmp_path / "pcache")
    with live_server(model_path("qwen3"), prompt_cache_dir=cache_dir) as server:
        cold = _ask(server)  # its snapshot goes to disk at the graceful stop
    readers: list[str] = []
    read = DiskTier.read

    def spy(self, entry):
        readers.append(threading.current_thread().name)
        return read(self, entry)

    monkeypatch.setattr(DiskTier, "read", spy)
    with live_server(model_path("qwen3"), prompt_cache_dir=cache_dir) as server:
        warm = _ask(server)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert readers and all(name.startswith("disk-prefetch") for name in readers), readers


def test_a_client_that_leaves_during_the_read_is_cancelled(tmp_path, monkeypatch):
    cache_dir = str(tmp_path / "pcache")
    with live_server(model_path("qwen3"), prompt_cache_dir=cache_dir) as server:
        _ask(server)
    read = DiskTier.read
    reading = threading.Event()

    def slow(self, entry):
        reading.set()
        time.sleep(1.5)
        return read(self, entry)

    monkeypatch.setattr(DiskTier, "read", slow)
    with live_server(model_path("qwen3"), prompt_cache_dir=cache_dir) as server:
        engine = server.engine
        admitted = engine.stats.admitted
        s = raw_post(server.url, {"model": "test-model", "prompt": PROMPT, "max_tokens": 50, "temperature": 0,
                                  "stream": True})
        assert reading.wait(30)
        s.close()
        wait_until(lambda: engine.stats.cancelled == 1, 30, "the request to be cancelled")
        assert engine.wait_idle(30)
        assert engine.stats.admitted == admitted, "a request cancelled while its file was read ran anyway"
        # and the next one is served from disk
        assert _ask(server)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
