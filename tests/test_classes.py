"""Latency classes: interactive before standard before batch, on a real engine (a tiny
qwen3 through ``mlx_lm.load``): a new interactive request prefills at once while batch
prompts are paused between chunks (their KV kept) and resume with exactly their solo
tokens; batch work keeps its guaranteed share of steps; and the gateway resolves a
request's class from its tenant, its body and its ``x-priority`` header."""

from __future__ import annotations

import random
import threading
import time

import mlx_lm
import pytest

from cache import PromptCacheManager
from conftest import EventSink, live_server, model_path, sample, wait_until
from scheduler import Engine, EngineRequest, SamplingParams
from scheduler.loop import EngineLoop
from scheduler.policy import ClassShare, WaitingQueue
from scheduler.request import TokenEvent

INTERACTIVE, STANDARD, BATCH = 0, 1, 2


@pytest.fixture(scope="module")
def model():
    return mlx_lm.load(str(model_path("qwen3")))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(n)]


class Timed(EventSink):
    """An :class:`EventSink` that also notes when its first token came."""

    def __init__(self):
        super().__init__()
        self.first_token_at = None

    def __call__(self, events):
        if self.first_token_at is None and any(isinstance(e, TokenEvent) for e in events):
            self.first_token_at = time.monotonic()
        super().__call__(events)


def engine(model, loop=None, **kw) -> Engine:
    m, tok = model
    e = Engine(m, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), loop=loop, **{
        "prompt_concurrency": 4, "decode_concurrency": 8, "prefill_step_size": 32, **kw})
    if loop is not None:
        loop.start()
    e.start()
    return e


def solo(model, prompt: list[int], n: int) -> list[int]:
    e = engine(model)
    try:
        s = EventSink()
        e.submit(EngineRequest("solo", prompt, SamplingParams(max_tokens=n), s))
        assert s.done.wait(60)
        return s.tokens
    finally:
        e.stop()


def req(rid: str, prompt: list[int], sink, priority: int, n: int = 4) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=n), sink, priority=priority, tenant=rid)


# ---------------------------------------------------------------------- the policy


def test_the_best_class_is_picked_first_and_the_share_comes_round():
    q = WaitingQueue()
    for rid, p in (("b1", BATCH), ("s1", STANDARD), ("i1", INTERACTIVE), ("b2", BATCH)):
        q.add(req(rid, tokens(1, 40), None, p))
    picked = [a.request.id for a in q.pick(4, lambda r: 0, [])]
    assert picked == ["i1", "s1", "b1", "b2"]
    for rid, p in (("b1", BATCH), ("i1", INTERACTIVE)):
        q.add(req(rid, tokens(1, 40), None, p))
    assert [a.request.id for a in q.pick(4, lambda r: 0, [], classes={INTERACTIVE})] == ["i1"]
    share = ClassShare(0.25)
    steps = [share.allowed({INTERACTIVE, BATCH}) for _ in range(8)]
    assert steps.count({BATCH}) == 2 and steps.count({INTERACTIVE}) == 6
    steps = [share.allowed({INTERACTIVE, STANDARD, BATCH}) for _ in range(8)]  # the lower ones take turns
    assert steps.count({BATCH}) == 1 and steps.count({STANDARD}) == 1 and steps.count({INTERACTIVE}) == 6
    assert ClassShare(0.0).allowed({INTERACTIVE, BATCH}) == {INTERACTIVE}
    assert ClassShare(0.25).allowed({STANDARD}) == {STANDARD}


# ---------------------------------------------------------------------- the engine


def test_an_interactive_request_prefills_at_once_and_paused_prompts_resume_exactly(model):
    long_prompts = [tokens(10 + i, 640) for i in range(3)]
    short = tokens(99, 96)
    want = [solo(model, p, 4) for p in long_prompts] + [solo(model, short, 4)]
    e = engine(model, loop=EngineLoop(batch_share=0.0))
    try:
        sinks = [Timed() for _ in range(4)]
        for i, p in enumerate(long_prompts):
            e.submit(req(f"batch{i}", p, sinks[i], BATCH))
        wait_until(lambda: e.stats.prefill_tokens >= 3 * 64, 60, "the batch prompts to be prefilling")
        e.submit(req("interactive", short, sinks[3], INTERACTIVE))
        for s in sinks:
            assert s.done.wait(120)
        # The interactive prompt (96 tokens: three 32-token chunks) had its first token while
        # the batch prompts (640 tokens each) were paused.
        assert all(sinks[3].first_token_at < s.first_token_at for s in sinks[:3])
        assert [s.tokens for s in sinks] == want  # resumed from their kept KV: solo tokens
        assert e.metrics.pauses.labels("2")._value.get() >= 3
        assert e.metrics.resumes.labels("2")._value.get() == e.metrics.pauses.labels("2")._value.get()
    finally:
        e.stop()


@pytest.mark.parametrize("share", [0.25, 0.0])
def test_batch_work_keeps_its_share_of_steps(model, share):
    """One batch prompt beside a steady stream of interactive ones (one always waiting):
    with a share it finishes while they keep coming; without one it cannot."""
    e = engine(model, loop=EngineLoop(batch_share=share), prompt_concurrency=1)
    stop, interactive = threading.Event(), []

    def feed():  # two interactive requests outstanding at all times, 60 in all
        for i in range(60):
            s = EventSink()
            interactive.append(s)
            e.submit(req(f"i{i}", tokens(1000 + i, 128), s, INTERACTIVE, n=1))
            while i >= 1 and not stop.is_set() and not interactive[i - 1].done.wait(0.01):
                pass
            if stop.is_set():
                return

    try:
        batch = EventSink()
        e.submit(req("batch", tokens(7, 320), batch, BATCH))
        t = threading.Thread(target=feed)
        t.start()
        finished = batch.done.wait(60) and sum(s.done.is_set() for s in interactive) < 60
        stop.set()
        t.join(60)
        assert finished == (share > 0), (share, len(interactive))
        assert batch.done.wait(60)  # and with the interactive stream gone, it finishes anyway
    finally:
        stop.set()
        e.stop()


# ---------------------------------------------------------------------- the gateway


TENANTS = """
[tenants.ext]
key_sha256 = ["{ext}"]
priority = "interactive"

[tenants.agent]
key_sha256 = ["{agent}"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from gateway.tenancy.tenants import hash_key

    path = tmp_path_factory.mktemp("classes") / "tenants.toml"
    path.write_text(TENANTS.format(ext=hash_key("mgw-ext"), agent=hash_key("mgw-agent")))
    with live_server(model_path("qwen3"), tenants=str(path)) as s:
        yield s


def chat(c, key: str, headers=None, **body):
    return c.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "hi"}], **body},
                  headers={"Authorization": f"Bearer {key}", **(headers or {})})


def test_a_request_may_lower_its_class_never_raise_it(server):
    with server.client() as c:
        before = sample(server.registry, "mlx_gateway_class_time_to_first_token_seconds_count", priority="batch")
        assert chat(c, "mgw-ext", priority="batch").status_code == 200
        assert chat(c, "mgw-ext", headers={"x-priority": "standard"}).status_code == 200
        assert chat(c, "mgw-ext").status_code == 200
        assert sample(server.registry, "mlx_gateway_class_time_to_first_token_seconds_count",
                      priority="batch") == before + 1
        assert sample(server.registry, "mlx_gateway_class_time_to_first_token_seconds_count",
                      priority="interactive") >= 1
        r = chat(c, "mgw-agent", priority="interactive")
        assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed", r.text
        r = chat(c, "mgw-agent", headers={"x-priority": "interactive"})
        assert r.status_code == 403 and r.json()["error"]["param"] == "priority", r.text
        r = chat(c, "mgw-agent", priority="urgent")
        assert r.status_code == 400 and "interactive, standard, batch" in r.json()["error"]["message"], r.text
        r = c.post("/v1/messages", json={"model": "test-model", "max_tokens": 2, "priority": "interactive",
                                         "messages": [{"role": "user", "content": "hi"}]},
                   headers={"x-api-key": "mgw-agent"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
