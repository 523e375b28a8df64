"""A decode batch's merge of row caches spread over two streams (gateway/cpu/merges.py,
scheduler.batch_merge.spread_merges): the same batch as on one, the same tokens as mlx-lm,
the choice made by the measurement, and the engine thread told it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from cache.pages import PagedKVCache
from conftest import assert_same_tokens, load_model, model_path, prefilled
from gateway.backend import CpuTuning
from gateway.cpu import merges
from gateway.cpu.measure import Choice
from scheduler import batch_merge
from scheduler.batch_merge import extend_with_rows, extra_streams, merge_with_room
from scheduler.batch.generator import JoiningBatchGenerator
from test_generator import run


def rows(n_layers: int, lengths: list[int]) -> list[list]:
    """Per row, its layer caches: paged (two pages) for even rows, plain for odd ones."""
    out = []
    for i, n in enumerate(lengths):
        layers = []
        for layer in range(n_layers):
            k = mx.random.normal((1, 2, n, 8), key=mx.random.key(100 * i + layer))
            v = k + 1
            if i % 2 == 0:
                layers.append(PagedKVCache([k[..., : n // 2, :], k[..., n // 2:, :]],
                                           [v[..., : n // 2, :], v[..., n // 2:, :]]))
            else:
                plain = KVCache()
                plain.update_and_fetch(k, v)
                layers.append(plain)
        out.append(layers)
    return out


def same_batches(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert x._idx == y._idx and x.left_padding.tolist() == y.left_padding.tolist()
        assert x.offset.tolist() == y.offset.tolist()
        assert mx.array_equal(x.keys, y.keys) and mx.array_equal(x.values, y.values)


def test_merging_on_two_streams_gives_the_one_stream_batch():
    one = merge_with_room(rows(5, [7, 12, 3]), streams=())
    two = merge_with_room(rows(5, [7, 12, 3]), streams=extra_streams(2))
    same_batches(one, two)
    batch_one = merge_with_room(rows(5, [9, 4]), streams=())
    batch_two = merge_with_room(rows(5, [9, 4]), streams=())
    batch_merge.spread_merges(2)
    try:
        assert batch_merge.merge_streams() == 2
        joined_two = extend_with_rows(batch_two, rows(5, [20, 6]))
    finally:
        batch_merge.spread_merges(1)
    assert batch_merge.merge_streams() == 1
    same_batches(extend_with_rows(batch_one, rows(5, [20, 6])), joined_two)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_the_generator_on_two_streams_gives_mlx_lm_tokens(arch):
    model = load_model(model_path(arch))
    base = [(5 * i + 2) % 200 + 10 for i in range(48)]
    warm = prefilled(model, base[:40])
    batch_rows = [
        ([base[:25]], None, [], 6),
        ([[base[40]]], warm, base[:40], 6),  # warm rows join the decoding ones
        ([base[40:44], [base[44]]], warm, base[:40], 4),
        ([[base[40]]], warm, base[:40], 5),
    ]
    want = run(BatchGenerator, model, batch_rows, prefill_batch=2, decode_batch=4)
    batch_merge.spread_merges(2)
    try:
        got = run(JoiningBatchGenerator, model, batch_rows, prefill_batch=2, decode_batch=4)
    finally:
        batch_merge.spread_merges(1)
    assert got[1] == want[1]
    for i, (g, w) in enumerate(zip(got[0], want[0])):
        assert_same_tokens(g, w, f"{arch} row {i}")


@pytest.mark.parametrize("times,want", [({"one stream": 0.060, "two streams": 0.040}, 2),
                                        ({"one stream": 0.060, "two streams": 0.058}, 1),  # within the margin
                                        ({"one stream": 0.040, "two streams": 0.060}, 1)])
def test_the_choice_follows_the_measurement(monkeypatch, times, want):
    """The first model of a process decides (the CPU tuning keeps its choice)."""
    model = load_model(model_path("qwen3"))
    raced = []
    monkeypatch.setattr(merges, "race", lambda candidates, *a, **k: raced.append(set(candidates)) or dict(times))
    monkeypatch.setenv("MLX_GATEWAY_CPU_ATTENTION", "0")  # the merges alone are timed
    monkeypatch.setenv("MLX_GATEWAY_MALLOC_TUNE", "0")
    tuning = CpuTuning()
    tuning.prepare(model, rounds=1)
    assert isinstance(tuning.merges, Choice) and tuning.merges.seconds == times
    assert tuning.merge_streams == want
    first = tuning.merges
    tuning.prepare(model, rounds=1)
    assert tuning.merges is first and raced == [set(merges.CANDIDATES)]
    assert batch_merge.merge_streams() == 1  # only the thread told merges on two


def test_a_model_without_float32_attention_is_not_measured():
    model = load_model(model_path("qwen3"))
    choice = merges.choose(model, {(4, 2, 16, mx.bfloat16)})
    assert choice.chosen == "one stream" and choice.reason and not choice.seconds


def test_each_thread_merges_on_the_streams_it_was_told_of():
    """The load chooses on its thread, the engine thread merges: the choice is the engine
    thread's (MLX refuses a stream made on another thread), each thread on streams of its own."""
    import threading

    want = merge_with_room(rows(4, [5, 9]), streams=())
    got = {}
    batch_merge.spread_merges(2)
    try:
        merge_with_room(rows(4, [3, 4]))  # this thread's streams made first

        def engine_thread(told: int):
            if told:
                batch_merge.spread_merges(told)
            batch = merge_with_room(rows(4, [5, 9]))
            mx.eval([(c.keys, c.values, c.offset, c.left_padding) for c in batch])
            got[told] = (batch, batch_merge.merge_streams())

        for told in (0, 2):
            worker = threading.Thread(target=engine_thread, args=(told,))
            worker.start()
            worker.join(60)
    finally:
        batch_merge.spread_merges(1)
    assert got[0][1] == 1 and got[2][1] == 2
    same_batches(want, got[0][0])
    same_batches(want, got[2][0])


def test_a_served_model_s_engine_thread_merges_on_the_measured_streams(monkeypatch):
    """The loader gives the engine loop's thread the streams the CPU tuning measured."""
    from conftest import live_server
    from gateway import backend as backend_module

    monkeypatch.setattr(CpuTuning, "merge_streams", property(lambda self: 2))
    if backend_module.backend().kind != "cpu":
        pytest.skip("the merge streams are measured where MLX runs on the CPU")
    with live_server(model_path("qwen3")) as server, server.client() as c:
        assert server.engine.loop.call(batch_merge.merge_streams) == 2
        r = c.post("/v1/completions", json={"model": "test-model", "prompt": "the sea", "max_tokens": 4})
        assert r.status_code == 200, r.text
