"""Quantized KV cache (``--kv-bits``): batched, chunked, cached and disk-restored paths
give the tokens of a cold single request with the same bits; snapshots are stored
quantized (bytes per token); models with other cache types are refused clearly."""

from __future__ import annotations

import random

import httpx
import mlx.core as mx
import mlx_lm
import pytest

from cache import PromptCacheManager
from cache.disk_codec import decode_snapshot, encode_snapshot
from cache.quantized import BatchQuantizedKVCache, QuantizedKVRow, quantize_kv, quantized_caches
from conftest import _MODEL_CACHE, TOKENIZERS, assert_same_greedy, engine_tokens, live_server, load, load_model, model_path
from gateway.models.demo_model import build_model_dir
from scheduler import Engine


def wide_head_model(arch: str):
    """The tiny ``arch`` model with 64-dimensional heads (a quantization group of 64 must
    divide the head dimension; the other test models have 16)."""
    tok, vocab = {"qwen3": (None, None), "llama": ("llama3", 128256)}[arch]
    return build_model_dir(_MODEL_CACHE / f"{arch}-hd64", arch, tokenizer_dir=TOKENIZERS / tok if tok else None,
                           vocab_size=vocab, overrides={"head_dim": 64})


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("bits", [8, 4])
def test_every_path_gives_the_cold_single_tokens(arch, bits):
    model, tok = load(wide_head_model(arch))
    quantize_kv(model, bits, 64)
    rng = random.Random(bits)
    shared = [rng.randrange(10, 900) for _ in range(70)]
    prompts = [shared + [rng.randrange(10, 900) for _ in range(n)] for n in (5, 23, 41)] + \
              [[rng.randrange(10, 900) for _ in range(33)]]
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, prefill_step_size=16, gather_wait=30.0)
    engine.start()
    try:
        solo = []
        for p in prompts:  # cold, one at a time
            engine.flush_cache()
            solo.append(engine_tokens(engine, [p], [12])[0])
        engine.flush_cache()
        assert engine_tokens(engine, prompts, [12] * len(prompts)) == solo  # batched, left-padded, chunked
        warm = engine_tokens(engine, prompts, [12] * len(prompts))  # every prompt cached (quantized snapshots)
        assert warm == solo
        assert engine.core.batch.first_tokens.hits == len(prompts)  # exact repeats: quantized rows joined whole
        assert engine.stats.cached_tokens > 0
        assert engine.wait_idle(60) and engine.prompt_cache.num_leases == 0
    finally:
        engine.stop()


def test_snapshots_are_stored_quantized():
    """Bytes per cached token against float (float32 model, group 64: 8 bits 0.28, 4 bits 0.16),
    through the prefix cache and the disk codec."""
    path = wide_head_model("qwen3")
    tokens = list(range(10, 300))
    per_token = {}
    for bits in (None, 8, 4):
        model = load_model(path)
        if bits:
            quantize_kv(model, bits, 64)
        manager = PromptCacheManager(1 << 30, 8)
        cache = mlx_lm.models.cache.make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])
        assert manager.insert("ns", tokens, cache)
        per_token[bits] = manager.nbytes / len(tokens)
        hit = manager.fetch("ns", tokens + [5])
        assert hit.cached_tokens == len(tokens)
        if bits:
            assert all(isinstance(c, QuantizedKVRow) and c.bits == bits for c in hit.cache)
            arrays, meta = encode_snapshot(hit.cache)
            back = decode_snapshot(arrays, meta)
            assert all(isinstance(c, QuantizedKVRow) for c in back)
            for a, b in zip(hit.cache, back):
                for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
                    assert mx.array_equal(x[..., : a.offset, :], y[..., : b.offset, :])
        manager.release(hit.lease)
        manager.close()
    assert per_token[8] / per_token[None] <= 0.3, per_token
    assert per_token[4] / per_token[None] <= 0.17, per_token


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_snapshots_are_paged_on_the_radix_tree(bits):
    """Snapshots after every turn of one conversation, and a branch, hold each token's
    quantized KV once (pages on the tree's edges, split where the branch leaves); each
    restores, bit for bit, the packed keys and values that were stored for its tokens (a
    token's page comes from the first snapshot that held it), merges into a batch, and
    decodes the greedy tokens of a cold prefill of its tokens (up to near-ties: a prefill
    of 60 tokens and one of 240 may sum in another order, docs/cache.md)."""
    from cache.pages import token_bytes

    model = load_model(wide_head_model("qwen3"))
    quantize_kv(model, bits, 64)
    rng = random.Random(bits)
    convo = [rng.randrange(10, 900) for _ in range(240)]
    branch = convo[:100] + [rng.randrange(10, 900) for _ in range(30)]

    def prefilled(tokens):
        cache = mlx_lm.models.cache.make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    manager = PromptCacheManager(1 << 30, 64)
    keys = [convo[:n] for n in (60, 120, 180, 240)] + [branch]
    inserted = []  # (key, the snapshot inserted for it), in order
    for key in keys:
        snapshot = prefilled(key)
        assert manager.insert("ns", key, snapshot)
        inserted.append((key, snapshot))
    per_token = token_bytes(prefilled(convo[:8]))
    assert manager.namespace_tokens("ns") == 240 + 30
    assert manager.nbytes == (240 + 30) * per_token  # not sum(60..240) + 130 tokens' worth
    manager.sanity_check()

    def stored(key, layer):
        """Layer ``layer``'s packed arrays of ``key`` as stored: each token from the first
        inserted snapshot whose key holds the same prefix up to it."""
        pieces, at = [], 0
        for k, snapshot in inserted:
            shared = next((i for i, (a, b) in enumerate(zip(k, key)) if a != b), min(len(k), len(key)))
            if shared > at:
                c = snapshot[layer]
                pieces.append([x[..., at:shared, :] for x in (*c.keys, *c.values)])
                at = shared
        assert at == len(key)
        return [mx.concatenate(parts, axis=2) for parts in zip(*pieces)]

    for key in keys + [convo[:100]]:
        hit = manager.fetch("ns", key + [5])
        assert hit.cached_tokens == len(key)
        cold = prefilled(key)
        assert all(isinstance(c, QuantizedKVRow) and c.bits == bits for c in hit.cache)
        for layer, got in enumerate(hit.cache):
            assert got.offset == cold[layer].offset == len(key)
            for x, y in zip((*got.keys, *got.values), stored(key, layer)):
                assert mx.array_equal(x[..., : len(key), :], y)
        batch = BatchQuantizedKVCache.merge([hit.cache[0], cold[0]], room=1)
        restored, fresh = batch.extract(0), batch.extract(1)
        for x, y in zip((*restored.keys, *restored.values), (*hit.cache[0].keys, *hit.cache[0].values)):
            assert mx.array_equal(x, y[..., : len(key), :])
        assert fresh.offset == len(key)
        assert assert_same_greedy(model, hit.cache, cold, [5], steps=8) > 0
        manager.release(hit.lease)
    assert manager.eviction.flush() == len(keys) and manager.nbytes == 0
    manager.close()


def test_batch_cache_filter_extend_extract():
    mx.random.seed(0)
    rows = []
    for n in (3, 7, 5):
        r = QuantizedKVRow(64, 8)
        r.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(r)
    batch = BatchQuantizedKVCache.merge(rows[:2], room=1)
    more = BatchQuantizedKVCache.merge(rows[2:])
    batch.extend(more)
    assert batch.left_padding.tolist() == [4, 0, 2]
    for i, r in enumerate(rows):
        got = batch.extract(i)
        assert got.offset == r.offset
        for x, y in zip((*got.keys, *got.values), (*r.keys, *r.values)):
            assert mx.array_equal(x, y[..., : r.offset, :])
    batch.filter([0, 2])
    assert batch.left_padding.tolist() == [2, 0] and batch.offset.tolist() == [3, 5]
    assert mx.array_equal(batch.extract(1).keys[0], rows[2].keys[0][..., :5, :])


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5"])
def test_models_with_other_caches_are_refused(arch):
    model = load_model(model_path(arch))
    with pytest.raises(ValueError, match="cannot quantize the KV cache"):
        quantized_caches(model, 8, 64)
    with pytest.raises(ValueError, match="kv_bits must be 4 or 8"):
        quantized_caches(load_model(model_path("qwen3")), 3, 64)


def test_disk_tier_round_trip_and_identity(tmp_path):
    """A quantized gateway's snapshots come back from its disk tier after a restart with
    the same answer; a float gateway on the same directory never reads them."""
    path = wide_head_model("qwen3")
    body = {"model": "test-model", "prompt": "one two three four five six seven " * 12, "max_tokens": 10,
            "temperature": 0}
    cache_dir = str(tmp_path / "pcache")

    def ask(**config):
        with live_server(path, prompt_cache_dir=cache_dir, **config) as server:
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    first, cached_first = ask(kv_bits=8)
    again, cached_again = ask(kv_bits=8)  # restored from disk after the graceful stop
    assert cached_first == 0 and cached_again > 0 and again == first
    _, cached_float = ask()  # another identity: no quantized snapshot for a float cache
    assert cached_float == 0
    _, cached_4 = ask(kv_bits=4)
    assert cached_4 == 0


def test_start_refuses_a_model_it_cannot_quantize(tmp_path):
    from gateway.config import ServeConfig
    from gateway.models.spec import ModelsFileError, defaults, load_models_file

    with pytest.raises(Exception, match="cannot quantize the KV cache"):
        with live_server(model_path("gemma3_text"), kv_bits=8):
            pass
    f = tmp_path / "m.toml"
    f.write_text('[models.a]\npath = "demo"\nkv_bits = 8\nkv_group_size = 32\n')
    (a,) = load_models_file(f, defaults(ServeConfig()))
    assert (a.kv_bits, a.kv_group_size) == (8, 32)
    for bad in ("kv_bits = 3", "kv_group_size = 48", "kv_bits = true"):
        f.write_text(f'[models.a]\npath = "demo"\n{bad}\n')
        with pytest.raises(ModelsFileError):
            load_models_file(f, defaults(ServeConfig()))


def test_a_group_size_that_does_not_fit_the_heads_is_refused():
    model = load_model(wide_head_model("qwen3"))  # 64-dimensional heads
    with pytest.raises(ValueError, match="does not divide the model's head dimension 64"):
        quantize_kv(model, 8, 128)
    small, _ = mlx_lm.load(str(model_path("qwen3")))  # 16-dimensional heads
    with pytest.raises(ValueError, match="head dimension 16"):
        quantize_kv(small, 8, 32)
