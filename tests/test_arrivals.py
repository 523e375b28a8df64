"""An idle engine waits (``gather_wait``) for requests the gateway is still preparing, so
that a burst starts in one step; a request alone, or one arriving while rows run, never
waits; the wait is bounded; a failed preparation does not leave a count behind. A
pending next-turn precompute is held back while requests are served.

A real tiny qwen3 model runs in a real engine. Assertions read the engine's own
admission marks (``timings``) and its ``mlx_gateway_gather_wait_seconds`` histogram;
the only wall-time bounds are the wait settings themselves (seconds apart from the
fractions a step takes).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import httpx
import mlx_lm
import pytest
from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from conftest import EventSink, live_server, model_path, wait_until
from scheduler import Engine, EngineRequest, SamplingParams
from scheduler.admission.precompute import GRACE, Precompute, PrecomputeBook, PrecomputeMetrics


@pytest.fixture(scope="module")
def model():
    return mlx_lm.load(str(model_path("qwen3")))


def make_engine(model, gather_wait: float) -> tuple[Engine, CollectorRegistry]:
    m, tok = model
    reg = CollectorRegistry()
    engine = Engine(m, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, registry=reg, gather_wait=gather_wait)
    engine.start()
    return engine, reg


@contextlib.contextmanager
def running_engine(model, gather_wait: float) -> Iterator[tuple[Engine, CollectorRegistry]]:
    """:func:`make_engine`, stopped at the end of the block."""
    engine, reg = make_engine(model, gather_wait)
    try:
        yield engine, reg
    finally:
        engine.stop()


def request(rid: str, seed: int, max_tokens: int = 4) -> tuple[EngineRequest, EventSink]:
    rng = random.Random(seed)
    sink = EventSink()
    return EngineRequest(rid, [rng.randrange(10, 900) for _ in range(40)], SamplingParams(max_tokens=max_tokens),
                         sink), sink


def submit_prepared(engine: Engine, r: EngineRequest) -> float:
    """Submit ``r`` the way the gateway does (inside its preparation); the submit time."""
    with engine.arrivals.prepare():
        t = time.monotonic()
        engine.submit(r)
    return t


def gathered(reg: CollectorRegistry) -> tuple[float, float]:
    """(gathers, seconds waited in all)."""
    return (reg.get_sample_value("mlx_gateway_gather_wait_seconds_count") or 0.0,
            reg.get_sample_value("mlx_gateway_gather_wait_seconds_sum") or 0.0)


def test_a_burst_starts_in_one_step(model):
    with running_engine(model, gather_wait=30.0) as (engine, reg):
        a, sa = request("a", 1)
        b, sb = request("b", 2)
        late = engine.arrivals.prepare()
        late.__enter__()  # b is still being tokenized
        submit_prepared(engine, a)
        time.sleep(0.5)
        assert "engine_admitted" not in a.timings  # a waits for b ...
        t_b = time.monotonic()
        engine.submit(b)
        late.__exit__(None, None, None)
        assert sa.done.wait(60) and sb.done.wait(60)
        # ... and starts with it, in the same admission, long before the 30 s bound.
        assert t_b <= a.timings["engine_admitted"] <= b.timings["engine_admitted"] < t_b + 10
        assert len(sa.tokens) == len(sb.tokens) == 4
        assert gathered(reg)[0] == 1
        assert engine.arrivals.preparing == 0


def test_a_request_alone_does_not_wait(model):
    with running_engine(model, gather_wait=30.0) as (engine, reg):
        a, sa = request("a", 1)
        t = submit_prepared(engine, a)
        assert sa.done.wait(60)
        assert a.timings["engine_admitted"] - t < 10  # not the 30 s bound
        assert gathered(reg)[0] == 0


def test_no_wait_while_rows_run(model):
    with running_engine(model, gather_wait=30.0) as (engine, reg):
        running, s_running = request("running", 1, max_tokens=4000)
        submit_prepared(engine, running)
        wait_until(lambda: s_running.tokens, 60, "the first row decoding")
        with engine.arrivals.prepare():  # another request is being tokenized meanwhile
            a, sa = request("a", 2)
            t = time.monotonic()
            engine.submit(a)
            assert sa.done.wait(60)
        assert a.timings["engine_admitted"] - t < 10
        assert not s_running.done.is_set()
        assert gathered(reg)[0] == 0


def test_the_wait_is_bounded(model):
    with running_engine(model, gather_wait=0.3) as (engine, reg):
        stuck = engine.arrivals.prepare()
        stuck.__enter__()  # a preparation that does not end while a is served
        a, sa = request("a", 1)
        t = submit_prepared(engine, a)
        assert sa.done.wait(60)
        n, seconds = gathered(reg)
        assert n == 1 and 0.25 <= seconds < 5
        assert a.timings["engine_admitted"] - t >= 0.25
        stuck.__exit__(None, None, None)
        assert engine.arrivals.preparing == 0


def test_a_preparation_that_raises_is_not_counted(model):
    with running_engine(model, gather_wait=30.0) as (engine, _):
        with pytest.raises(RuntimeError):
            with engine.arrivals.prepare():
                raise RuntimeError("the template rejected it")
        assert engine.arrivals.preparing == 0
        a, sa = request("a", 1)
        t = submit_prepared(engine, a)
        assert sa.done.wait(60) and a.timings["engine_admitted"] - t < 10


def test_rejected_requests_leave_no_count_in_the_gateway():
    """A 400 from the grammar compile (worker thread) and one from the prompt limit (at
    submit) both end their preparation; the next request is served without waiting."""
    with live_server(model_path("qwen3"), gather_wait=30.0, max_prompt_tokens=64) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            bad_schema = {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}, "strict": True}}
            r = c.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}],
                                                     "response_format": bad_schema})
            assert r.status_code == 400, r.text
            r = c.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "word " * 200}]})
            assert r.status_code == 400, r.text
            r = c.post("/v1/completions", json={"model": "test-model", "max_tokens": 4, "prompt": "word " * 200})
            assert r.status_code == 400, r.text
            assert srv.engine.arrivals.preparing == 0
            t = time.monotonic()
            r = c.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            assert time.monotonic() - t < 10  # not the 30 s bound


def test_serving_holds_back_a_due_precompute():
    book = PrecomputeBook(PrecomputeMetrics(CollectorRegistry()))
    book.add(Precompute([1, 2, 3], due=time.monotonic() - 1))
    assert book.seconds_until_due() == 0
    book.hold()
    assert GRACE / 2 < book.seconds_until_due() <= GRACE


def test_a_precompute_waits_for_requests_being_prepared(model):
    """A precompute that is due does not start while a request is being tokenized."""
    with running_engine(model, gather_wait=0.0) as (engine, _):
        with engine.arrivals.prepare():
            engine.submit_precompute(Precompute([5] * 40 + [6] * 40, due=time.monotonic() - 1)) \
                if engine.reserve_precompute() else pytest.fail("no reservation")
            time.sleep(0.5)
            assert engine.call(lambda: len(engine.precomputes)) == 1  # still pending
        wait_until(lambda: engine.call(lambda: len(engine.precomputes)) == 0, 30, "the precompute to start")
        assert engine.wait_idle(60)


def test_concurrent_preparations_count_exactly():
    from scheduler.admission.arrivals import Arrivals

    woken = []
    arrivals = Arrivals(lambda: woken.append(1))

    def work():
        for _ in range(200):
            with arrivals.prepare():
                pass

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arrivals.preparing == 0 and len(woken) == 1600


def test_stopping_while_gathering_fails_the_waiting_request(model):
    from scheduler.request import ErrorEvent

    engine, _ = make_engine(model, gather_wait=30.0)
    stuck = engine.arrivals.prepare()
    stuck.__enter__()
    a, sa = request("a", 1)
    submit_prepared(engine, a)
    # Answered from inside the gather: a is in the engine's queue, not admitted.
    wait_until(lambda: engine.call(lambda: len(engine.core.waiting)) == 1, 10, "a to wait in the engine")
    t = time.monotonic()
    engine.stop(timeout=20)
    assert time.monotonic() - t < 10 and not engine.alive
    assert sa.done.is_set() and "engine_admitted" not in a.timings
    assert [e.status for e in sa.events if isinstance(e, ErrorEvent)] == [503]
    stuck.__exit__(None, None, None)
