"""MLX stays on the engine thread: once the engine loop runs, no other thread of a live
gateway calls MLX or touches the prefix cache's snapshots (several threads using MLX on
one stream at once is a crash class on Metal), except a model's load thread, which reads,
converts and probes that model's own weights before handing it to the loop (MLX gives
each thread its own stream).

A watcher records, per thread, every call of an ``mlx.core`` function (each one wrapped
for the test; nanobind functions give no profiler events) and every Python call into MLX
model code (``mlx.*``, ``mlx_lm.*``) or into the prefix cache's array-owning modules
(``cache.manager``, ``cache.restore``, ``cache.tree``). Before the engine thread exists
any thread may; after, only the engine thread and the ``model-load-*`` threads
(``mlx_lm.load`` and its probes). Excepted: mlx-lm's text-only modules (tokenizer,
detokenizer, tool-call parsers), the allocator counters ``/metrics`` reads, and the
prefix cache's read-only reports (:data:`READS`: walks of its index under the manager's
lock that read no array), which the explanation of a cache miss asks from a worker thread.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections import Counter

import mlx.core as mx

from conftest import live_server, model_path, sample, wait_until
from gateway.server import apply_tenants, reload_tenants
from gateway.tenancy.tenants import hash_key, load_tenants

ENGINE_THREAD = "mlx-gateway-engine"
LOAD_THREADS = "model-load-"
TEXT_ONLY = ("mlx_lm.tokenizer_utils", "mlx_lm.tool_parsers")
ARRAY_MODULES = ("cache.manager", "cache.restore", "cache.tree")
READS = {"report", "namespaces"}  # PromptCacheManager's thread-safe reads, and all they call
# Plain reads of allocator counters (see gateway.telemetry.metrics.MLXMemoryCollector).
COUNTERS = {"get_active_memory", "get_peak_memory", "get_cache_memory"}
CORE_MODULES = (mx, mx.fast, mx.random, mx.linalg, mx.fft, mx.metal)


class MLXThreadWatch:
    """Counts MLX calls per thread; ``violations`` are those off the engine thread once
    an engine thread has started."""

    def __init__(self) -> None:
        self.violations: Counter = Counter()
        self.engine_calls = 0
        self.startup_calls = 0
        self.load_calls = 0
        self._engine_started = False
        self._lock = threading.Lock()
        self._reads = threading.local()  # depth: frames of READS on this thread's stack

    def note(self, what: str) -> None:
        name = threading.current_thread().name
        if name == ENGINE_THREAD:
            self.engine_calls += 1
            return
        if name.startswith(LOAD_THREADS):
            self.load_calls += 1
            return
        if not self._engine_started:
            self._engine_started = any(t.name == ENGINE_THREAD and t.is_alive() for t in threading.enumerate())
            if not self._engine_started:
                self.startup_calls += 1
                return
        with self._lock:
            self.violations[(name, what)] += 1

    def profile(self, frame, event, arg) -> None:
        module = frame.f_globals.get("__name__", "")
        if module == "cache.manager" and frame.f_code.co_name in READS:
            if event in ("call", "return"):
                self._reads.depth = getattr(self._reads, "depth", 0) + (1 if event == "call" else -1)
            return
        if event != "call" or getattr(self._reads, "depth", 0):
            return
        if module.startswith(("mlx.", "mlx_lm.")) and not module.startswith(TEXT_ONLY) \
                or module in ARRAY_MODULES:
            self.note(f"{module}.{frame.f_code.co_name}")

    def wrap(self, module, name: str, fn):
        def wrapper(*args, **kwargs):
            self.note(f"{module.__name__}.{name}")
            return fn(*args, **kwargs)

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__doc__ = fn.__doc__
        return wrapper


@contextlib.contextmanager
def watching(monkeypatch):
    """An :class:`MLXThreadWatch` over every thread started inside the block."""
    gc.collect()  # garbage of earlier tests' servers is not this server's doing
    watch = MLXThreadWatch()
    for module in CORE_MODULES:
        for name in dir(module):
            fn = getattr(module, name)
            if type(fn).__name__ == "nb_func" and name not in COUNTERS:
                monkeypatch.setattr(module, name, watch.wrap(module, name, fn))
    threading.setprofile(watch.profile)
    sys.setprofile(watch.profile)
    try:
        yield watch
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def tenants_file(path, cache_bytes: str) -> str:
    path.write_text(f"""
[admin]
key_sha256 = ["{hash_key('mgw-admin')}"]

[tenants.team]
key_sha256 = ["{hash_key('mgw-team')}"]
cache_bytes = "{cache_bytes}"
""")
    return str(path)


def chat(c, text: str, **kw):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0, **kw}
    r = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer mgw-team"})
    assert r.status_code == 200, r.text
    return r


def test_no_mlx_off_the_engine_thread_after_start(tmp_path, monkeypatch):
    model = model_path("qwen3")
    tenants = tenants_file(tmp_path / "tenants.toml", "64M")
    with watching(monkeypatch) as watch:
        with live_server(model, tenants=tenants) as s, s.client() as c:
            engine = s.engine
            entries = lambda: engine.call(lambda: engine.prompt_cache.num_entries)  # noqa: E731
            chat(c, "Tell me about the sea " * 20)
            chat(c, "Tell me about the sea " * 20, stream=True, stop=["e"])
            assert entries() > 0
            # A reload (what SIGHUP does) that shrinks the group's quota evicts its snapshots.
            tenants_file(tmp_path / "tenants.toml", "1")
            assert reload_tenants(s.front)
            wait_until(lambda: entries() == 0, 60, "the smaller quota to evict the snapshots")
            assert "mlx_gateway_mlx_memory_bytes" in c.get("/metrics").text
            apply_tenants(s.front, load_tenants(tenants_file(tmp_path / "tenants.toml", "64M")))
            quota = lambda: sample(s.registry, "mlx_gateway_prompt_cache_quota_bytes", cache_group="team")  # noqa: E731
            wait_until(lambda: quota() == 64 << 20, 60, "the new quota")
            # The admin flush drops the snapshots made since.
            chat(c, "And about the mountains " * 20)
            assert entries() > 0
            r = c.post("/admin/cache/flush", json={}, headers={"Authorization": "Bearer mgw-admin"})
            assert r.status_code == 200 and r.json()["dropped_snapshots"] > 0, r.text
            assert entries() == 0
            violations = dict(watch.violations)
            # The watcher works: it saw the model's load and the engine, and sees a stray call.
            assert watch.load_calls > 0 and watch.engine_calls > 0
            mx.eval(mx.zeros(1))
            assert watch.violations[("MainThread", "mlx.core.eval")] == 1
    assert violations == {}, sorted(violations.items(), key=lambda kv: -kv[1])[:20]
