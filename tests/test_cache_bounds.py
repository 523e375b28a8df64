"""Bounds, leases, eviction, namespaces and metrics of PromptCacheManager.

Snapshots are small real mlx-lm caches (``KVCache`` filled through
``update_and_fetch``, ``ArraysCache``) whose contents encode the tokens they cover,
so every restored copy can be checked against its key.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from prometheus_client import CollectorRegistry

from cache import PromptCacheManager


def kv_layer(tokens):
    c = KVCache()
    n = len(tokens)
    k = mx.stack([mx.array(tokens, dtype=mx.float32), mx.arange(n, dtype=mx.float32)], axis=-1)[None, None]
    c.update_and_fetch(k, k)
    return c


def prefix_hash(tokens):
    h = 7
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return h


def arrays_layer(tokens):
    c = ArraysCache(1)
    c[0] = mx.array([[float(prefix_hash(tokens))]])
    return c


def make(ns_kind, tokens):
    if ns_kind == "kv":
        return [kv_layer(tokens), kv_layer(tokens)]
    return [arrays_layer(tokens), kv_layer(tokens)]


def check_restored(hit, tokens):
    n = hit.cached_tokens
    assert 0 < n <= len(tokens) - 1
    for layer in hit.cache:
        if isinstance(layer, KVCache):
            assert layer.offset == n
            k, _ = layer.keys_and_values()
            assert k[0, 0, :, 0].tolist() == [float(t) for t in tokens[:n]]
        else:
            assert layer[0].item() == float(prefix_hash(tokens[:n]))


def sample(reg, name, **labels):
    v = reg.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


@pytest.mark.parametrize("seed,quota", [(0, None), (1, None), (2, 25_000)])
def test_randomized_bounds_and_leases(seed, quota):
    rng = random.Random(seed)
    max_bytes, max_entries = 70_000, 12
    mgr = PromptCacheManager(max_bytes=max_bytes, max_entries=max_entries)
    if quota is not None:
        mgr.eviction.set_quotas({"kv": quota})
    namespaces = {"kv": "kv", "hyb": "hyb"}
    bases = [[rng.randrange(4) for _ in range(60)] for _ in range(4)]
    held = []  # (lease, cache copy, tokens)
    refused = 0

    def random_tokens():
        base = rng.choice(bases)
        n = rng.randint(2, 60)
        toks = base[:n]
        if rng.random() < 0.4:
            toks = toks + [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        return toks

    for step in range(700):
        op = rng.random()
        ns = rng.choice(list(namespaces))
        if op < 0.4:
            toks = random_tokens()
            ok = mgr.insert(ns, toks, make(namespaces[ns], toks))
            refused += not ok
        elif op < 0.75:
            toks = random_tokens()
            want = mgr.match_length(ns, toks)
            hit = mgr.fetch(ns, toks)
            assert hit.cached_tokens == want
            if hit.cache is None:
                assert hit.lease is None and want == 0
                continue
            check_restored(hit, toks)
            # the receiver writes its copy
            for layer in hit.cache:
                if isinstance(layer, KVCache):
                    layer.update_and_fetch(mx.full((1, 1, 2, 2), -1.0), mx.full((1, 1, 2, 2), -1.0))
            if rng.random() < 0.6:
                held.append((hit.lease, toks, ns))
            else:
                mgr.release(hit.lease)
                mgr.release(hit.lease)  # idempotent
        elif op < 0.95 and held:
            lease, toks, ns = held.pop(rng.randrange(len(held)))
            assert lease._entry.alive  # leased entries are never evicted
            mgr.release(lease)
        elif op >= 0.98:
            mgr.eviction.flush(rng.choice([None, "kv", "hyb"]))
        assert mgr.nbytes <= max_bytes and mgr.num_entries <= max_entries
        if quota is not None:
            assert mgr.namespace_bytes("kv") <= quota
        assert mgr.num_leases == len(held)
        for lease, toks, ns in held:
            assert lease._entry.alive
        if step % 25 == 0:
            mgr.sanity_check()
    for lease, _, _ in held:
        mgr.release(lease)
    assert mgr.num_leases == 0
    mgr.sanity_check()
    reg = mgr.registry
    assert sample(reg, "mlx_gateway_prompt_cache_evictions_total", reason="bytes") + sample(
        reg, "mlx_gateway_prompt_cache_evictions_total", reason="entries") > 0
    assert sample(reg, "mlx_gateway_prompt_cache_active_leases") == 0


def test_prefix_entries_survive_longer_inserts():
    mgr = PromptCacheManager(max_bytes=1 << 20, max_entries=100)
    toks = list(range(1, 80))
    for n in (10, 30, 79):
        assert mgr.insert("hyb", toks[:n], make("hyb", toks[:n]))
    assert mgr.num_entries == 3
    # exact-only caches: every stored prefix is still an exact hit
    assert mgr.match_length("hyb", toks[:10] + [999]) == 10
    assert mgr.match_length("hyb", toks[:30] + [999]) == 30
    assert mgr.match_length("hyb", toks[:50]) == 30
    assert mgr.match_length("hyb", toks) == 30  # 79 itself would leave nothing to run
    # re-inserting an existing key keeps one entry
    assert mgr.insert("hyb", toks[:30], make("hyb", toks[:30]))
    assert mgr.num_entries == 3
    # KVCache entries: a longer entry serves shorter queries by trimming
    assert mgr.insert("kv", toks, make("kv", toks))
    hit = mgr.fetch("kv", toks[:40] + [999])
    assert hit.cached_tokens == 40
    check_restored(hit, toks[:40] + [999])
    mgr.release(hit.lease)
    mgr.sanity_check()


def test_namespaces_isolate_and_flush():
    mgr = PromptCacheManager(max_bytes=1 << 20, max_entries=100)
    toks = list(range(1, 40))
    mgr.insert("tenant-a", toks, make("kv", toks))
    assert mgr.fetch("tenant-b", toks).cache is None
    assert mgr.match_length("tenant-b", toks) == 0
    hit = mgr.fetch("tenant-a", toks)
    assert hit.cached_tokens == len(toks) - 1
    mgr.insert("tenant-b", toks[:5], make("kv", toks[:5]))
    assert mgr.eviction.flush("tenant-a") == 0  # leased: kept
    mgr.release(hit.lease)
    assert mgr.eviction.flush("tenant-a") == 1
    assert mgr.num_entries == 1 and mgr.match_length("tenant-b", toks) == 5
    assert mgr.eviction.flush() == 1 and mgr.num_entries == 0 and mgr.nbytes == 0
    assert sample(mgr.registry, "mlx_gateway_prompt_cache_evictions_total", reason="flush") == 2
    mgr.sanity_check()


def test_refuse_instead_of_breaking_bounds():
    mgr = PromptCacheManager(max_bytes=1 << 20, max_entries=1)
    a, b = list(range(1, 20)), list(range(50, 70))
    assert mgr.insert("kv", a, make("kv", a))
    hit = mgr.fetch("kv", a + [1])
    assert not mgr.insert("kv", b, make("kv", b))  # only entry is leased
    assert mgr.num_entries == 1
    mgr.release(hit.lease)
    assert mgr.insert("kv", b, make("kv", b))
    assert mgr.num_entries == 1 and mgr.match_length("kv", a + [1]) == 0
    assert sample(mgr.registry, "mlx_gateway_prompt_cache_evictions_total", reason="entries") == 1
    # a snapshot bigger than max_bytes is refused outright
    small = PromptCacheManager(max_bytes=100, max_entries=10)  # one snapshot takes 608 bytes
    assert not small.insert("kv", a, make("kv", a)) and small.num_entries == 0
    with pytest.raises(ValueError):
        mgr.insert("kv", a[:5], make("kv", a))  # cache covers 19 tokens, key 5
    mgr.sanity_check()


def test_short_lived_companion_groups_leave_no_metric_series():
    """An adapter's namespace is one per load (``<group>/lora:<name>#<load>``): its lookups
    count in its owner's group and its gauges go once it holds nothing, so a server that
    loads adapters for days keeps a bounded set of label series."""
    reg = CollectorRegistry()
    mgr = PromptCacheManager(max_bytes=1 << 20, max_entries=10, registry=reg)
    toks = list(range(1, 33))
    for load in range(1, 6):
        ns = f"g/lora:a#{load}"
        mgr.eviction.add_companion(ns, "g")
        mgr.insert(ns, toks, make("kv", toks))
        mgr.release(mgr.fetch(ns, toks + [7]).lease)
        assert sample(reg, "mlx_gateway_prompt_cache_entries", cache_type="KVCache", cache_group=ns) == 1
        mgr.eviction.flush(ns)
    names = {s.labels.get("cache_group") for m in reg.collect() for s in m.samples}
    assert not any("#" in (n or "") for n in names), names
    assert sample(reg, "mlx_gateway_prefix_cache_queries_total", cache_group="g") == 5
    assert sample(reg, "mlx_gateway_prefix_cache_hits_total", cache_group="g") == 5


def test_metrics_counters_and_gauges():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    mgr = PromptCacheManager(max_bytes=1 << 20, max_entries=10, registry=reg)
    PromptCacheManager(max_bytes=1, max_entries=1)  # a second manager coexists (own registry)
    toks = list(range(1, 33))
    mgr.insert("ns1", toks, make("hyb", toks))
    assert mgr.fetch("ns1", [99, 98]).cache is None  # miss
    hit = mgr.fetch("ns1", toks + [5, 6])  # exact snapshot: 32 tokens
    assert hit.cached_tokens == 32
    assert sample(reg, "mlx_gateway_prompt_cache_active_leases") == 1
    mgr.release(hit.lease)
    assert sample(reg, "mlx_gateway_prefix_cache_queries_total", cache_group="ns1") == 2
    assert sample(reg, "mlx_gateway_prefix_cache_hits_total", cache_group="ns1") == 1
    assert sample(reg, "mlx_gateway_prefix_cache_queries_tokens_total", cache_group="ns1") == 2 + 34
    assert sample(reg, "mlx_gateway_prefix_cache_hits_tokens_total", cache_group="ns1") == 32
    assert sample(reg, "mlx_gateway_prompt_cache_entries", cache_type="KVCache", cache_group="ns1") == 1
    assert sample(reg, "mlx_gateway_prompt_cache_entries", cache_type="ArraysCache", cache_group="ns1") == 1
    kv_bytes = sample(reg, "mlx_gateway_prompt_cache_bytes", cache_type="KVCache", cache_group="ns1")
    arr_bytes = sample(reg, "mlx_gateway_prompt_cache_bytes", cache_type="ArraysCache", cache_group="ns1")
    assert kv_bytes > 0 and arr_bytes == 4 and kv_bytes + arr_bytes == mgr.nbytes
    assert sample(reg, "mlx_gateway_prompt_cache_fetch_seconds_count", phase="lookup") == 2
    assert sample(reg, "mlx_gateway_prompt_cache_fetch_seconds_count", phase="copy") == 1
    assert mgr.match_length("ns1", toks + [1]) == 32
    assert sample(reg, "mlx_gateway_prefix_cache_queries_total", cache_group="ns1") == 2  # match_length is not a query
    mgr.eviction.flush()
    assert sample(reg, "mlx_gateway_prompt_cache_bytes", cache_type="KVCache", cache_group="ns1") == 0


def test_group_quota_evicts_only_its_own_group():
    reg = CollectorRegistry()
    probe = PromptCacheManager(max_bytes=1 << 20, max_entries=1)
    probe.insert("p", list(range(10)), make("kv", list(range(10))))
    one = probe.nbytes  # one 10-token snapshot with no prefix shared
    mgr = PromptCacheManager(max_bytes=100 * one, max_entries=100, registry=reg)
    mgr.eviction.set_quotas({"a": 3 * one})
    assert sample(reg, "mlx_gateway_prompt_cache_quota_bytes", cache_group="a") == 3 * one
    b_keys = [[200 + i] * 10 for i in range(5)]
    for k in b_keys:
        assert mgr.insert("b", k, make("kv", k))
    a_keys = [[100 + i] * 10 for i in range(5)]
    for k in a_keys:
        assert mgr.insert("a", k, make("kv", k))
    assert mgr.namespace_bytes("a") == 3 * one
    assert sample(reg, "mlx_gateway_prompt_cache_evictions_total", reason="quota") == 2
    assert all(mgr.match_length("b", k + [0]) == 10 for k in b_keys)  # the other group is untouched
    assert [mgr.match_length("a", k + [0]) for k in a_keys] == [0, 0, 10, 10, 10]  # LRU order
    # Leased snapshots are never evicted: with the whole quota leased, an insert is refused.
    hits = [mgr.fetch("a", k + [0]) for k in a_keys[2:]]
    assert not mgr.insert("a", [7] * 10, make("kv", [7] * 10))
    for h in hits:
        mgr.release(h.lease)
    assert mgr.insert("a", [7] * 10, make("kv", [7] * 10))
    # Lowering a quota sheds the group's oldest snapshots at once.
    mgr.eviction.set_quotas({"a": one})
    assert mgr.namespace_bytes("a") == one and mgr.match_length("a", [7] * 11) == 10
    # A snapshot leased while its quota shrinks goes when the lease is released.
    hit = mgr.fetch("a", [7] * 11)
    mgr.eviction.set_quotas({"a": 0})
    assert mgr.namespace_bytes("a") == one
    mgr.release(hit.lease)
    assert mgr.namespace_bytes("a") == 0 and mgr.match_length("a", [7] * 11) == 0
    mgr.sanity_check()
    big = list(range(300))
    assert not mgr.insert("a", big, make("kv", big))  # larger than the quota
