"""Admission by predicted memory (scheduler/admission/memory.py): the KV a request may grow
to is reserved before it joins the batch, so a burst under a small ``--memory-budget``
stays under it, every request answered 200 or 503 with ``Retry-After``."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from conftest import live_server, load, load_model, model_path
from scheduler.admission.memory import gate_for, kv_bytes_per_token


def _held(caches, n: int) -> int:
    """Bytes the layer caches hold for ``n`` tokens (their arrays cut to ``n``)."""
    total = 0
    for c in caches:
        for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state]):
            if hasattr(a, "nbytes"):
                total += a[..., :n, :].nbytes if a.ndim == 4 else a.nbytes
    return total


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_predicted_kv_bytes_are_what_a_prefill_holds(arch):
    model = load_model(model_path(arch))
    caches = make_prompt_cache(model)
    shape = kv_bytes_per_token(model, caches)
    n = 300
    model(mx.array([[1] * n]), cache=caches)
    mx.eval([c.state for c in caches])
    assert shape.bytes_for(n) == _held(caches, n) > 0


def test_a_burst_stays_under_a_small_memory_budget():
    path = model_path("qwen3")
    model, tok = load(path)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    gate = gate_for(model, make_prompt_cache(model), 512)
    words = " ".join(f"w{i % 97}" for i in range(300))
    prompt_tokens, max_tokens = len(tok.encode("11 " + words)), 1000
    need = gate.need(prompt_tokens, max_tokens)
    # room for three such rows at once, one of them prefilling
    budget = weights + gate.transient + 3 * need + gate.prefill_need(prompt_tokens) + need // 2
    del model
    mx.clear_cache()
    base = mx.get_active_memory()
    with live_server(path, memory_budget=budget, prefill_step_size=512) as s:
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], mx.get_active_memory() - base)
                time.sleep(0.002)

        def ask(i):
            with s.client() as c:
                r = c.post("/v1/completions", json={"model": "test-model", "prompt": f"{i} {words}",
                                                    "max_tokens": max_tokens, "ignore_eos": True})
            return r.status_code, r.headers.get("retry-after"), r.json()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        stop.set()
        sampler.join()
        rows = s.engine.metrics.memory_waits._value.get()
    for status, retry, body in answers:
        assert status == 200 or (status == 503 and retry), (status, body)
        if status == 200:
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == max_tokens
    assert peak[0] <= budget * 1.05, (peak[0], budget)
    assert sum(a[0] == 200 for a in answers) >= 3
    assert rows > 0  # some waited for memory


@pytest.mark.parametrize("queries,keys,heads,array_mask", [
    (17, 2048, (4, 2, 16), False), (32, 4096, (4, 2, 16), False), (64, 1024, (4, 2, 16), False),
    (64, 1024, (4, 2, 16), True), (40, 2048, (9, 3, 64), True)])
def test_a_prefill_chunk_reserves_what_the_cpu_block_kernel_holds(queries, keys, heads, array_mask):
    """The block kernel's transient memory for one layer (its scores, their exponentials,
    a byte of exponent each, and its copy of the values with a column of ones), measured
    with MLX's peak counter, fits in what a chunk's reservation counts beside its
    activations: the heads of the tiny test models (4 query heads over 2 KV heads of 16)
    and SmolLM2's (9 over 3 of 64), with the causal mode or a boolean mask as a batch
    cache gives one (``[1, 1, queries, keys]``)."""
    from gateway.cpu.attention import FEW_QUERIES
    from gateway.cpu.attention_kernels import compiled_blocks
    from scheduler.admission.memory import BLOCK_QUERIES, KVShape, MemoryGate

    assert BLOCK_QUERIES == FEW_QUERIES
    hq, hk, d = heads
    q, k, v = (mx.random.normal((1, h, n, d)) for h, n in ((hq, queries), (hk, keys), (hk, keys)))
    mask = (mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None])[None, None] if array_mask else "causal"
    mx.eval(q, k, v, *([mask] if array_mask else []))
    mx.eval(compiled_blocks(q, k, v, d ** -0.5, mask))  # compiled once before measuring
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = compiled_blocks(q, k, v, d ** -0.5, mask)
    mx.eval(out)
    held = mx.get_peak_memory() - base - out.nbytes
    gate = MemoryGate(KVShape(per_token=2 * hk * d * 4), hidden=64, vocab=100, chunk=queries, heads=hq, scores=True)
    reserved = gate.prefill_need(keys, keys - queries) - queries * gate.activation
    assert held <= reserved, (held, reserved)
