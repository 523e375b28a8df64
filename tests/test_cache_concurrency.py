"""Many threads lease, copy and write the same snapshot at once: no write leaks.

Writes are real: ``KVCache.update_and_fetch`` (which assigns into the buffer in
place) and full model forwards (KVCache and ArraysCache models).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from cache import PromptCacheManager
from cache.entries import path_pages as _path_pages
from cache.restore import cache_arrays
from conftest import load, model_path
from test_cache_differential import prefill

THREADS = 8


def stored(mgr, ns, tokens):
    """Every array the stored snapshot keyed ``tokens`` is made of: its pages and its own layers."""
    node = mgr._groups[ns].tree.find(tokens)
    own = [c for c in node.value.private if c is not None]
    return [a for p in _path_pages(node) for a in p.arrays] + cache_arrays(own)


def frozen(arrays):
    return [np.array(a) for a in arrays]


def run_threads(fn):
    errors = []
    barrier = threading.Barrier(THREADS)

    def wrap(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(i,)) for i in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def test_update_and_fetch_writes_do_not_leak():
    model, tok = load(model_path("qwen3"))
    mgr = PromptCacheManager(max_bytes=1 << 28, max_entries=16)
    prompt = list(range(3, 103))
    prefill(model, mgr, prompt, step=2048)
    before = frozen(stored(mgr, "default", prompt))
    query = prompt + [7]  # stored entry covers the whole prompt: restored as-is (100 tokens)

    def work(i):
        for rep in range(5):
            hit = mgr.fetch("default", query)
            try:
                assert hit.cached_tokens == len(prompt)
                layer = hit.cache[0]
                off = layer.offset
                orig_k = np.array(layer.keys[..., :off, :])
                B, H, _, D = layer.keys.shape
                mine = mx.full((B, H, 3, D), float(100 + i * 10 + rep))
                k, v = layer.update_and_fetch(mine, mine)  # in-place write into the buffer
                mx.eval(k, v)
                assert np.array_equal(np.array(k[..., :off, :]), orig_k)
                assert np.all(np.array(k[..., off:, :]) == 100 + i * 10 + rep)
                # overwrite the restored region too (trim then write) on the copy
                layer.trim(off)
                k, v = layer.update_and_fetch(mine, mine)
                mx.eval(k, v)
            finally:
                mgr.release(hit.lease)

    run_threads(work)
    after = frozen(stored(mgr, "default", prompt))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert mgr.num_leases == 0
    mgr.sanity_check()


@pytest.mark.parametrize("arch", ["qwen3", "mamba2"])
def test_concurrent_forwards_match_serial(arch):
    model, tok = load(model_path(arch))
    mgr = PromptCacheManager(max_bytes=1 << 28, max_entries=64)
    prompt = [int(t) for t in tok.encode("the cache token prompt server batch " * 12)][:80]
    prefill(model, mgr, prompt, step=32)
    before = frozen(stored(mgr, "default", prompt))
    suffixes = [[int(t) for t in tok.encode(f" request {i} tenant {i * 7} water")] for i in range(THREADS)]

    def forward(cache, suffix):
        out = model(mx.array(suffix)[None], cache=cache)[0, -1]
        mx.eval(out)
        return np.array(out)

    # serial expectations
    expected = []
    for s in suffixes:
        hit = mgr.fetch("default", prompt + s)
        expected.append(forward(hit.cache, s))
        mgr.release(hit.lease)

    results = [None] * THREADS

    def work(i):
        hit = mgr.fetch("default", prompt + suffixes[i])
        try:
            assert hit.cached_tokens == len(prompt)
            results[i] = forward(hit.cache, suffixes[i])
        finally:
            mgr.release(hit.lease)

    run_threads(work)
    for i in range(THREADS):
        np.testing.assert_allclose(results[i], expected[i], atol=1e-5)
    after = frozen(stored(mgr, "default", prompt))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert mgr.num_leases == 0
    mgr.sanity_check()
