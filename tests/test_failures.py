"""A failing request fails alone; a dead engine answers 503 instead of hanging."""

from __future__ import annotations

import threading

from conftest import live_server, model_path
from scheduler import EngineRequest, SamplingParams
from scheduler.request import DoneEvent, ErrorEvent


class Collector:
    def __init__(self, raise_on_first: bool = False):
        self.events, self.done = [], threading.Event()
        self.raise_on_first = raise_on_first

    def __call__(self, events):
        self.events.extend(events)
        if any(isinstance(e, (DoneEvent, ErrorEvent)) for e in events):
            self.done.set()
        if self.raise_on_first:
            self.raise_on_first = False
            raise RuntimeError("consumer broke")


def test_one_failing_request_does_not_hurt_the_others():
    with live_server(model_path("qwen3")) as server:
        engine = server.engine
        good, bad, broken = Collector(), Collector(), Collector(raise_on_first=True)
        engine.submit(EngineRequest("good", list(range(5, 60)), SamplingParams(max_tokens=20), good))
        # max_tokens 0 is refused by mlx-lm's batch insert: fails at admission.
        engine.submit(EngineRequest("bad", list(range(5, 30)), SamplingParams(max_tokens=0), bad))
        engine.submit(EngineRequest("broken", list(range(9, 40)), SamplingParams(max_tokens=5), broken))
        for c in (good, bad, broken):
            assert c.done.wait(60)
        assert isinstance(bad.events[-1], ErrorEvent)
        assert isinstance(good.events[-1], DoneEvent) and good.events[-1].finish_reason == "length"
        assert sum(1 for e in good.events if hasattr(e, "token")) == 20
        assert isinstance(broken.events[-1], DoneEvent)
        assert engine.alive
        with server.client() as c:
            assert c.get("/health").status_code == 200


def test_dead_engine_gives_503_not_a_hang():
    with live_server(model_path("qwen3")) as server:
        engine = server.engine

        def crash(*a, **k):
            raise SystemExit("simulated crash of the engine thread")

        engine.call(lambda: setattr(engine.core.batch.gen, "next", crash))
        with server.client(timeout=30) as c:
            r = c.post("/v1/completions", json={"model": "test-model", "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable"
            assert not engine.alive
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "dead"
            r = c.post("/v1/chat/completions", json={"model": "test-model", "messages": [{"role": "user", "content": "x"}],
                                                    "stream": True})
            assert r.status_code == 503


def test_a_failed_batch_step_leaves_sampling_working():
    """A sampler that raises inside mlx-lm's batched step (top_k equal to the vocabulary,
    which the gateway itself never sends) fails its request (alone: see
    test_row_faults.py); afterwards sampled requests, which use MLX's global random key,
    still work."""
    with live_server(model_path("qwen3")) as server:
        engine = server.engine
        bad = Collector()
        vocab = server.model.vocab_size
        engine.submit(EngineRequest("bad", list(range(5, 30)),
                                    SamplingParams(max_tokens=4, temperature=1.0, top_k=vocab), bad))
        assert bad.done.wait(60)
        assert isinstance(bad.events[-1], ErrorEvent)
        assert engine.alive
        with server.client() as c:
            for body in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0}):
                r = c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
                assert r.status_code == 200, r.text
            # The gateway treats top_k >= vocabulary as no filter instead of failing.
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1, "top_k": vocab})
            assert r.status_code == 200, r.text
