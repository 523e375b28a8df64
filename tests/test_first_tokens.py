"""Exact repeats take their first token from the logits kept after their prompt
(``scheduler/batch/first_tokens.py``): the same tokens as their first answer, per
architecture, alone and as a burst joining the decode batch together; requests whose
first token depends on more than the logits take the forward as before."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from conftest import EventSink, engine_tokens, load, model_path, sample, wait_until
from scheduler import Engine, EngineRequest, SamplingParams
from scheduler.batch.first_tokens import FirstTokenStore
from scheduler.request import ErrorEvent
from scheduler.speculative import SpeculationConfig

TEXTS = ["the model cache token prompt server batch request tenant prefix memory apple code agent " * 3,
         "browser extension stream answer question system user assistant reason think water light " * 5,
         "a short one about water and light"]


@contextmanager
def _engine(arch: str, speculation: SpeculationConfig = SpeculationConfig(), dtype=None, registry=None):
    """A running engine on the tiny ``arch`` model (its weights cast to ``dtype`` if given,
    its metrics on ``registry`` if given), :data:`TEXTS` as token ids, and its first-token
    store; the engine stops on exit."""
    model, tok = load(model_path(arch))
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())  # here: the engine thread cannot run this thread's ops
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, gather_wait=30.0, speculation=speculation, registry=registry)
    engine.start()
    try:
        yield engine, [tok.encode(t) for t in TEXTS], engine.core.batch.first_tokens
    finally:
        engine.stop()


@pytest.mark.parametrize("arch,speculation", [("qwen3", "off"), ("qwen3", "ngram"), ("qwen3", "bfloat16"),
                                               ("gemma3_text", "off"), ("qwen3_5", "off"), ("nemotron_h", "off")])
def test_exact_repeats_give_the_tokens_of_their_first_answer(arch, speculation):
    """``bfloat16``: the weights (so the logits) in the type most released MLX models use."""
    n = 24 if speculation == "ngram" else 8  # long enough for the tiny model's answers to loop and be drafted
    with _engine(arch, SpeculationConfig("ngram", 4) if speculation == "ngram" else SpeculationConfig(),
                 mx.bfloat16 if speculation == "bfloat16" else None) as (engine, prompts, store):
        cold = [engine_tokens(engine, [p], [n])[0] for p in prompts]  # one at a time, nothing cached
        assert len(store) == len(prompts) and store.hits == 0
        alone = [engine_tokens(engine, [p], [n])[0] for p in prompts]
        burst = engine_tokens(engine, prompts, [n] * len(prompts))  # all three join in one merge
        assert alone == cold and burst == cold
        if speculation == "ngram":
            assert engine.stats.speculation.verify_steps > 0, engine.stats.speculation
        # every repeat restored its whole prompt: a trimmable cache from the prompt + answer
        # entry, a hybrid or sliding-window one from the snapshot its first run took at the
        # prompt's end (cache.checkpoints.row_snapshots, ``whole``)
        assert store.hits == 2 * len(prompts)
        assert engine.wait_idle(60) and engine.prompt_cache.num_leases == 0


def test_a_seeded_sampled_repeat_draws_what_its_first_run_drew():
    registry = CollectorRegistry()
    with _engine("qwen3", registry=registry) as (engine, prompts, store):
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
        first = engine_tokens(engine, [prompts[1]], [params])[0]
        assert sample(registry, "mlx_gateway_repeat_first_tokens_total") == 0
        again = engine_tokens(engine, [prompts[1]], [params])[0]
        assert store.hits == 1 and again == first
        # the metrics: one first token from the store, which holds one [V] float32 row
        assert sample(registry, "mlx_gateway_repeat_first_tokens_total") == 1
        kept = sample(registry, "mlx_gateway_first_token_store_bytes")
        assert kept == store.nbytes and kept >= 4 * engine.model.args.vocab_size


def test_requests_whose_first_token_needs_more_than_the_logits_take_the_forward():
    with _engine("qwen3") as (engine, prompts, store):
        plain = engine_tokens(engine, [prompts[0]], [8])[0]
        biased = SamplingParams(max_tokens=8, logit_bias=((plain[0], -100.0),))
        got = engine_tokens(engine, [prompts[0]], [biased])[0]
        assert store.hits == 0 and got[0] != plain[0]  # its bias applied to a forward's logits
        one = engine_tokens(engine, [prompts[0]], [1])[0]  # one token: ends in the step that feeds it
        assert store.hits == 0 and one == plain[:1]
        assert engine.wait_idle(60) and engine.prompt_cache.num_leases == 0


def test_the_store_keeps_the_most_recent_prompts_within_its_bytes():
    def request(n: int, namespace: str = "default") -> EngineRequest:
        return EngineRequest(f"r{n}", list(range(n, n + 10)), SamplingParams(), lambda e: None, namespace=namespace)

    lp = np.linspace(-5, 0, 100, dtype=np.float32)
    per = lp.nbytes + 8 * 10
    store = FirstTokenStore(max_bytes=3 * per)
    for n in range(3):
        store.put(request(n), lp)
    assert store.get(request(0)) is not None  # now the most recent
    store.put(request(3), lp)
    assert store.get(request(1)) is None and store.get(request(0)) is not None and len(store) == 3
    assert store.nbytes == 3 * per
    assert store.get(request(0, "other")) is None  # namespaces never share
    store.put(request(9), np.zeros(1, dtype=np.float32))  # not a distribution: ignored
    assert store.get(request(9)) is None
    store.put(request(5), mx.array(lp).astype(mx.bfloat16))  # a bfloat16 model's: kept widened
    assert np.array_equal(store.get(request(5)), np.array(mx.array(lp).astype(mx.bfloat16).astype(mx.float32)))


def test_a_repeat_whose_merge_fails_fails_alone(monkeypatch):
    """The merge that joins a repeat to the decode batch raises: the repeat ends with a 500,
    the row already decoding keeps its exact tokens, and no lease is left."""
    import scheduler.batch.decode_batch as decode_batch

    with _engine("qwen3") as (engine, prompts, store):
        engine_tokens(engine, [prompts[0]], [8])  # kept: its repeat joins without a forward
        solo = engine_tokens(engine, [prompts[1]], [40])[0]
        running = EventSink()  # a repeat too: it joins before the merge breaks
        engine.submit(EngineRequest("running", prompts[1], SamplingParams(max_tokens=40), running))
        wait_until(lambda: len(running.tokens) >= 4, 60, "the first row to decode")

        def broken(batch, caches):
            raise RuntimeError("no memory for the merge")

        monkeypatch.setattr(decode_batch, "extend_with_rows", broken)
        repeat = EventSink()
        engine.submit(EngineRequest("repeat", prompts[0], SamplingParams(max_tokens=8), repeat))
        assert repeat.done.wait(60)
        monkeypatch.undo()
        assert store.hits == 2 and isinstance(repeat.events[-1], ErrorEvent) and repeat.events[-1].status == 500
        assert running.done.wait(60) and running.tokens == solo
        assert engine.wait_idle(60) and engine.prompt_cache.num_leases == 0
