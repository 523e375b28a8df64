"""Paged KV in the prompt cache: memory proportional to unique tokens, shared pages freed
exactly once, the byte bound over shared pages, eviction order, exact restores.

Snapshots are real mlx-lm ``KVCache`` / ``ArraysCache`` layers whose contents encode the
tokens they cover (``test_cache_bounds.make``), so every restore is checked against its key.
"""

from __future__ import annotations

import gc
import random
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from cache import PromptCacheManager
from test_cache_bounds import check_restored, make

# make("kv", tokens): two KVCache layers of [1, 1, T, 2] float32 keys and values.
KV_PER_TOKEN = 2 * 2 * 2 * 4  # layers * (k, v) * width * bytes


def test_a_conversation_holds_each_token_once():
    mgr = PromptCacheManager(max_bytes=1 << 24, max_entries=100)
    convo = list(range(1, 401))
    for end in range(40, 401, 40):  # a snapshot after every turn, each a prefix of the next
        assert mgr.insert("a", convo[:end], make("kv", convo[:end]))
    assert mgr.namespace_tokens("a") == 400
    assert mgr.nbytes == 400 * KV_PER_TOKEN  # not sum(40..400) tokens' worth
    mgr.sanity_check()
    for end in range(40, 401, 40):
        hit = mgr.fetch("a", convo[:end] + [0])
        assert hit.cached_tokens == end
        check_restored(hit, convo[:end] + [0])
        mgr.release(hit.lease)


def test_branches_share_their_prefix_and_split_pages_exactly():
    mgr = PromptCacheManager(max_bytes=1 << 24, max_entries=100)
    trunk = list(range(1, 101))
    a = trunk + list(range(500, 550))
    b = trunk[:70] + list(range(600, 640))  # diverges inside the edge a's insert created
    assert mgr.insert("n", a, make("kv", a))
    assert mgr.insert("n", b, make("kv", b))
    assert mgr.insert("n", trunk[:30], make("kv", trunk[:30]))  # lands inside the shared edge
    assert mgr.namespace_tokens("n") == 150 + 40
    assert mgr.nbytes == 190 * KV_PER_TOKEN
    mgr.sanity_check()
    for key in (a, b, trunk[:30], trunk[:70] + [1]):
        q = key + [7]
        hit = mgr.fetch("n", q)
        check_restored(hit, q)
        mgr.release(hit.lease)
    # dropping b frees only b's own 40 tokens; the shared 70 stay for a
    assert mgr.eviction.flush() == 3 and mgr.nbytes == 0 and mgr.namespace_tokens("n") == 0


def test_eviction_is_lru_and_frees_only_unshared_pages():
    one = 50 * KV_PER_TOKEN
    mgr = PromptCacheManager(max_bytes=3 * one, max_entries=100)
    base = list(range(1, 51))
    a = base + list(range(100, 150))
    b = base + list(range(200, 250))
    for k in (base, a, b):
        assert mgr.insert("n", k, make("kv", k))
    assert mgr.nbytes == 3 * one  # base shared by a and b
    hit = mgr.fetch("n", a + [0])  # a is now the most recent; b the oldest leaf
    mgr.release(hit.lease)
    mgr.refresh("n", base)
    c = list(range(300, 350))
    assert mgr.insert("n", c, make("kv", c))
    # LRU order was b, a, base: dropping b alone frees 50 tokens, enough for c.
    assert mgr.match_length("n", b + [0]) == 50  # b gone, its prefix base kept
    assert mgr.match_length("n", a + [0]) == 100
    assert mgr.nbytes == 3 * one
    mgr.sanity_check()
    # Make base the oldest, with a still below it: dropping base frees nothing, so the
    # next insert must also drop a (which then frees base's pages too); the dry run
    # must predict that before evicting anything.
    for key in (a, c):
        mgr.refresh("n", key)
    d = list(range(400, 450))
    assert mgr.insert("n", d, make("kv", d))
    assert mgr.match_length("n", a + [0]) == 0 and mgr.match_length("n", base + [0]) == 0
    assert mgr.match_length("n", c + [0]) == 50 and mgr.match_length("n", d + [0]) == 50
    assert mgr.nbytes == 2 * one and mgr.namespace_tokens("n") == 100
    mgr.sanity_check()


def test_pages_are_freed_when_the_last_snapshot_goes():
    mx.eval(mx.zeros(1))
    gc.collect()
    base = mx.get_active_memory()
    mgr = PromptCacheManager(max_bytes=1 << 26, max_entries=1000)
    rng = random.Random(3)
    for i in range(60):
        n = rng.randint(200, 2000)
        key = [rng.randint(1, 4)] * rng.randint(0, 300) + list(range(i * 10_000, i * 10_000 + n))
        mgr.insert("m", key, make("kv", key))
    assert mgr.nbytes > 1 << 20
    mgr.eviction.flush()
    assert mgr.nbytes == 0 and mgr.namespace_tokens("m") == 0
    gc.collect()
    assert mx.get_active_memory() - base < 1 << 20  # the pages' buffers were released


def test_random_operations_keep_pages_and_bounds_consistent():
    rng = random.Random(11)
    mgr = PromptCacheManager(max_bytes=600 * KV_PER_TOKEN + 64, max_entries=12)
    roots = [[rng.randint(1, 9) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    keys: list[list[int]] = []
    leases = []
    for step in range(400):
        op = rng.random()
        if op < 0.45 or not keys:
            key = list(rng.choice(roots))
            if keys and rng.random() < 0.6:
                other = rng.choice(keys)
                key = other[: rng.randint(1, len(other))]
            key += [rng.randint(1, 9) for _ in range(rng.randint(0, 80))]
            kind = rng.choice(["kv", "hyb"])
            ns = f"{kind}"
            mgr.insert(ns, key, make(kind, key))
            keys.append(key)
        elif op < 0.8:
            key = rng.choice(keys)
            q = key[: rng.randint(1, len(key))] + [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
            for ns, kind in (("kv", "kv"), ("hyb", "hyb")):
                hit = mgr.fetch(ns, q)
                if hit.cache is not None:
                    check_restored(hit, q)
                    leases.append(hit.lease)
        elif leases:
            mgr.release(leases.pop(rng.randrange(len(leases))))
        if step % 7 == 0:
            mgr.sanity_check()
    for lease in leases:
        mgr.release(lease)
    mgr.sanity_check()
    mgr.eviction.flush()
    assert mgr.nbytes == 0 and mgr.num_entries == 0


def test_byte_bound_holds_with_shared_pages_under_concurrency():
    limit = 3000 * KV_PER_TOKEN
    mgr = PromptCacheManager(max_bytes=limit, max_entries=64)
    prefix = list(range(1, 301))
    stop = threading.Event()
    errors: list[BaseException] = []
    worst = [0]

    def watch():
        while not stop.is_set():
            worst[0] = max(worst[0], mgr.nbytes)

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                key = prefix[: rng.randint(50, 300)] + [rng.randint(1000, 1200) for _ in range(rng.randint(1, 400))]
                mgr.insert("c", key, make("kv", key))
                hit = mgr.fetch("c", key[: rng.randint(2, len(key))] + [5])
                if hit.cache is not None:
                    check_restored(hit, key[: hit.cached_tokens] + [5])
                mgr.release(hit.lease)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors[0]
    assert worst[0] <= limit
    mgr.sanity_check()
    assert mgr.num_leases == 0


def test_a_snapshot_of_another_layout_is_refused():
    mgr = PromptCacheManager(max_bytes=1 << 20, max_entries=10)
    mgr.insert("n", [1, 2, 3], make("kv", [1, 2, 3]))
    wide = KVCache()
    wide.update_and_fetch(mx.zeros((1, 2, 3, 2)), mx.zeros((1, 2, 3, 2)))  # 2 heads, not 1
    with pytest.raises(ValueError, match="differ"):
        mgr.insert("n", [4, 5, 6], [wide, wide])
    assert mgr.insert("other", [4, 5, 6], [wide, wide])  # another namespace has its own layout


def test_paged_restore_merges_into_a_batch_like_mlx_lm():
    from mlx_lm.models.cache import BatchKVCache

    mgr = PromptCacheManager(max_bytes=1 << 22, max_entries=10)
    key = list(range(1, 90))
    for end in (30, 60, 89):  # three pages along the path
        mgr.insert("n", key[:end], make("kv", key[:end]))
    hit = mgr.fetch("n", key[:75] + [3])  # 75 tokens: the last page is cut
    assert hit.cached_tokens == 75
    plain = make("kv", list(range(500, 520)))
    for layer, other in zip(hit.cache, plain):
        got = type(layer).merge([layer, other])  # what mlx-lm's batch generator calls
        want = BatchKVCache.merge([make("kv", key[:75])[0], other])
        assert got.keys.shape == want.keys.shape == (2, 1, 75, 2)
        assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)
        assert got.left_padding.tolist() == want.left_padding.tolist() == [0, 55]
        assert got.offset.tolist() == want.offset.tolist()
    mgr.release(hit.lease)


@pytest.mark.parametrize("batch_len,room", [(40, 1), (100, 1), (75, 0)])
def test_rows_merged_into_a_decode_batch_match_mlx_lm_extend(batch_len, room):
    """Paged and plain rows written into a decode batch's buffer with ``into`` give what
    mlx-lm's merge-then-extend gives: each row's keys and values right-aligned at the same
    write index, the same left padding and offsets; the batch itself is left as it was."""
    from mlx_lm.models.cache import BatchKVCache

    from cache.pages import PagedKVCache

    mgr = PromptCacheManager(max_bytes=1 << 22, max_entries=10)
    key = list(range(1, 90))
    for end in (30, 60, 89):
        mgr.insert("n", key[:end], make("kv", key[:end]))
    hit = mgr.fetch("n", key[:75] + [3])
    plain = make("kv", list(range(500, 520)))
    batch_rows = [make("kv", list(range(700 + 100 * i, 700 + 100 * i + batch_len - 7 * i)))[0] for i in range(2)]

    def decode_batch():
        batch = BatchKVCache.merge(batch_rows)
        batch.update_and_fetch(*(mx.full((2, 1, 1, 2), 9.0) for _ in range(2)))  # one decode step
        return batch

    batch = decode_batch()
    before = (batch.keys, batch.left_padding.tolist(), batch.offset.tolist(), batch._idx)
    rows = [hit.cache[0], plain[0]]
    assert PagedKVCache.can_merge_into(batch, rows)
    got = PagedKVCache.merge(rows, room=room, into=batch)
    want = decode_batch()
    want.extend(PagedKVCache.merge(rows, room=room))
    assert (batch.keys, batch.left_padding.tolist(), batch.offset.tolist(), batch._idx)[1:] == before[1:]
    assert batch.keys is before[0]
    assert got._idx == want._idx and got.left_padding.tolist() == want.left_padding.tolist()
    assert got.offset.tolist() == want.offset.tolist()
    gk, gv = got.keys_and_values()
    wk, wv = want.keys_and_values()
    assert gk.shape == wk.shape and mx.array_equal(gk, wk) and mx.array_equal(gv, wv)
    if room:
        assert got.keys.shape[2] % BatchKVCache.step == 0 and got.keys.shape[2] > got._idx
    assert not PagedKVCache.can_merge_into(BatchKVCache([0]), rows)  # holds no tokens yet
    mgr.release(hit.lease)


def test_a_new_key_sharing_a_prefix_can_evict_the_snapshot_it_branches_from():
    one = 100 * KV_PER_TOKEN
    mgr = PromptCacheManager(max_bytes=one + one // 2, max_entries=100)  # room for one
    a = [7] + list(range(1000, 1099))
    b = [7] + list(range(2000, 2099))  # shares only its first token with a
    assert mgr.insert("g", a, make("kv", a))
    assert mgr.insert("g", b, make("kv", b))  # a is dropped, not kept for its one shared token
    assert mgr.match_length("g", a + [0]) == 1 and mgr.match_length("g", b + [0]) == 100
    assert mgr.nbytes == one
    # A key extending the stored one fits by itself even if the old snapshot has to go.
    longer = b + list(range(3000, 3040))
    assert mgr.insert("g", longer, make("kv", longer))
    assert mgr.match_length("g", longer + [0]) == 140 and mgr.nbytes == 140 * KV_PER_TOKEN
    # One diverging inside the stored edge: the whole old snapshot goes, shared part and all,
    # and the new one pays for its full key.
    c = longer[:60] + [5] * 41
    assert mgr.insert("g", c, make("kv", c))
    assert mgr.match_length("g", longer + [0]) == 60 and mgr.match_length("g", c + [0]) == 101
    assert mgr.nbytes == 101 * KV_PER_TOKEN
    mgr.sanity_check()
