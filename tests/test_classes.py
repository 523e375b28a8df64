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
from scheduler.engine.loop import EngineLoop
from scheduler.admission.policy import ClassShare, WaitingQueue
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
        self.events_done_at = None

    def __call__(self, events):
        if self.first_token_at is None and any(isinstance(e, TokenEvent) for e in events):
            self.first_token_at = time.monotonic()
        super().__call__(events)
        if self.done.is_set() and self.events_done_at is None:
            self.events_done_at = time.monotonic()


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


class Steady:
    """Requests of one class that keep coming (a thread): two outstanding at all times,
    ``count`` in all, ``length``-token prompts, ``n`` tokens each, until :meth:`stop`."""

    def __init__(self, e: Engine, prefix: str, priority: int, count: int, seed: int, length: int, n: int):
        self.sinks: list[EventSink] = []
        self._count = count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, args=(e, prefix, priority, count, seed, length, n))

    def _feed(self, e, prefix, priority, count, seed, length, n) -> None:
        for i in range(count):
            s = EventSink()
            self.sinks.append(s)
            e.submit(req(f"{prefix}{i}", tokens(seed + i, length), s, priority, n=n))
            while i >= 1 and not self._stop.is_set() and not self.sinks[i - 1].done.wait(0.01):
                pass
            if self._stop.is_set():
                return

    def start(self) -> None:
        self._thread.start()

    def all_done(self) -> bool:
        """Every one of the ``count`` requests was sent and has ended."""
        return len(self.sinks) == self._count and all(s.done.is_set() for s in self.sinks)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(60)


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
    assert steps.count({INTERACTIVE, BATCH}) == 2 and steps.count({INTERACTIVE}) == 6  # beside, never instead
    steps = [share.allowed({INTERACTIVE, STANDARD, BATCH}) for _ in range(8)]  # the lower ones take turns
    assert steps.count({INTERACTIVE, BATCH}) == 1 and steps.count({INTERACTIVE, STANDARD}) == 1
    assert steps.count({INTERACTIVE}) == 6
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


@pytest.mark.parametrize("share,slots", [(0.25, 1), (0.25, 4), (0.0, 1)])
def test_batch_work_keeps_its_share_of_steps(model, share, slots):
    """One batch prompt beside a steady stream of interactive ones (one always waiting):
    with a share it finishes while they keep coming; without one it cannot. Its share
    turns run beside the interactive prompts when a prompt slot is free (none of those is
    ever paused), instead of them when none is."""
    e = engine(model, loop=EngineLoop(batch_share=share), prompt_concurrency=slots)
    interactive = Steady(e, "i", INTERACTIVE, 60, seed=1000, length=128, n=1)
    try:
        batch = EventSink()
        e.submit(req("batch", tokens(7, 320), batch, BATCH))
        interactive.start()
        finished = batch.done.wait(60) and not interactive.all_done()
        interactive.stop()
        assert finished == (share > 0), (share, len(interactive.sinks))
        assert batch.done.wait(60)  # and with the interactive stream gone, it finishes anyway
        interactive_pauses = e.metrics.pauses.labels(str(INTERACTIVE))._value.get()
        assert (interactive_pauses == 0) == (slots > 1 or share == 0), interactive_pauses
    finally:
        interactive.stop()
        e.stop()


def test_an_interactive_prompt_prefills_alone_while_lower_streams_wait(model):
    """Standard rows decoding when an interactive prompt arrives: its prefill chunks run
    without their decode forward (they wait, KV untouched), and every answer is its solo
    answer."""
    streams = [tokens(20 + i, 64) for i in range(2)]
    prompt = tokens(98, 160)  # five 32-token chunks
    want = [solo(model, p, 40) for p in streams] + [solo(model, prompt, 4)]
    e = engine(model, loop=EngineLoop())
    try:
        sinks = [EventSink() for _ in range(3)]
        for i, p in enumerate(streams):
            e.submit(req(f"standard{i}", p, sinks[i], STANDARD, n=40))
        wait_until(lambda: all(len(s.tokens) >= 2 for s in sinks[:2]), 60, "the standard rows to decode")
        e.submit(req("interactive", prompt, sinks[2], INTERACTIVE))
        for s in sinks:
            assert s.done.wait(120)
        assert [s.tokens for s in sinks] == want
        assert e.metrics.decode_holds._value.get() >= 4  # its chunks but the one its last token joins
    finally:
        e.stop()


@pytest.mark.parametrize("interactive_first", [True, False])
def test_lower_class_prompts_prefill_one_at_a_time_while_interactive_requests_are_about(model, interactive_first):
    """After an interactive request, standard prompts prefill one at a time (the step a new
    interactive request waits for holds one prompt's chunk); without one, together."""
    prompts = [tokens(40 + i, 256) for i in range(3)]
    want = [solo(model, p, 4) for p in prompts]
    e = engine(model, loop=EngineLoop())
    try:
        if interactive_first:
            s = EventSink()
            e.submit(req("interactive", tokens(5, 40), s, INTERACTIVE))
            assert s.done.wait(60)
        sinks = [EventSink() for _ in prompts]
        for i, p in enumerate(prompts):
            e.submit(req(f"standard{i}", p, sinks[i], STANDARD))
        for s in sinks:
            assert s.done.wait(120)
        assert [s.tokens for s in sinks] == want
        assert (e.stats.max_prefill_batch == 1) == interactive_first, e.stats.max_prefill_batch
    finally:
        e.stop()


def test_lower_prompts_do_not_prefill_while_an_interactive_row_decodes(model):
    """Streams first: from an interactive request's first token to its last, a standard
    prompt in prefill does not advance (no share here); both answers are their solo ones."""
    long_prompt, short = tokens(70, 1200), tokens(71, 40)
    want = [solo(model, long_prompt, 4), solo(model, short, 24)]
    e = engine(model, loop=EngineLoop(batch_share=0.0))
    seen = {}

    class Watch(Timed):
        def __call__(self, events):
            first = self.first_token_at is None and any(isinstance(x, TokenEvent) for x in events)
            super().__call__(events)  # the engine's thread: its counters are between steps
            if first:
                seen["first"] = e.stats.prefill_tokens
            if self.done.is_set() and "done" not in seen:
                seen["done"] = e.stats.prefill_tokens

    try:
        sinks = [EventSink(), Watch()]
        e.submit(req("standard", long_prompt, sinks[0], STANDARD))
        wait_until(lambda: e.stats.prefill_tokens >= 64, 60, "the standard prompt to be prefilling")
        e.submit(req("interactive", short, sinks[1], INTERACTIVE, n=24))
        for s in sinks:
            assert s.done.wait(120)
        assert [s.tokens for s in sinks] == want
        assert seen["done"] == seen["first"], seen  # no prefill while it decoded
        assert seen["first"] < len(long_prompt) - 64  # the standard prompt was still prefilling
    finally:
        e.stop()


def test_the_loop_holds_its_next_step_for_an_interactive_request_being_prepared():
    """While the gateway prepares an interactive request (and none waits or decodes), the
    loop waits for its submission, at most INTERACTIVE_ARRIVAL_WAIT seconds and once per
    preparation; a standard one is not waited for."""
    from types import SimpleNamespace

    from scheduler.admission.arrivals import Arrivals
    from scheduler.engine.loop import INTERACTIVE_ARRIVAL_WAIT

    loop = EngineLoop()
    arrivals = Arrivals(lambda: loop.post(("arrived", None)))
    engines = [SimpleNamespace(arrivals=arrivals, interactive_busy=False)]

    def waited(priority: int, prepared_for: float | None = None) -> float:
        """Seconds the loop held while a request of ``priority`` was being prepared (for
        ``prepared_for`` seconds by another thread; None: for longer than the bound)."""
        started, release = threading.Event(), threading.Event()

        def prepare():
            with arrivals.prepare(priority):
                started.set()
                release.wait(prepared_for if prepared_for is not None else 1.0)

        t = threading.Thread(target=prepare)
        t.start()
        started.wait()
        t0 = time.monotonic()
        loop._await_interactive(engines)
        held = time.monotonic() - t0
        release.set()
        t.join()
        return held

    assert waited(1) < INTERACTIVE_ARRIVAL_WAIT / 2  # a standard request: no wait
    assert waited(0) >= INTERACTIVE_ARRIVAL_WAIT * 0.9  # not submitted in time: the whole bound
    assert waited(0, 0.005) < INTERACTIVE_ARRIVAL_WAIT * 0.9  # until it is submitted, not the bound
    with arrivals.prepare(0):  # once per preparation: a loop turn after the wait goes on
        loop._await_interactive(engines)
        t = time.monotonic()
        loop._await_interactive(engines)
        assert time.monotonic() - t < INTERACTIVE_ARRIVAL_WAIT / 2
    engines[0].interactive_busy = True
    with arrivals.prepare(0):
        t = time.monotonic()
        loop._await_interactive(engines)
        assert time.monotonic() - t < INTERACTIVE_ARRIVAL_WAIT / 2  # one already waits or decodes: go on


def test_a_row_taken_out_before_its_first_decode_step_goes_on_exactly(model):
    """A row that joined the decode batch in a step that held the decode forward (its input
    still its last prompt token) and is then taken out and put back decodes the tokens it
    would have: its state says it has not decoded yet."""
    from scheduler.batch.generator import JoiningBatchGenerator
    from scheduler.sampling import greedy

    m, _ = model
    prompts = [tokens(80, 24), tokens(81, 30)]

    def run(take: bool) -> dict:
        gen = JoiningBatchGenerator(m, max_tokens=1 << 20, prefill_batch_size=4, completion_batch_size=4,
                                    prefill_step_size=64, sampler=greedy)
        uids = gen.insert(prompts, max_tokens=[12, 12])
        gen.next()  # prefill: both rows have only their last prompt token left
        gen.hold_decode = True
        gen.next()  # they join the decode batch; no forward
        gen.hold_decode = False
        out = {u: [] for u in uids}
        if take:
            state = gen.take_decoding(uids[0])
            assert state is not None and state.fresh
            out[gen.put_decoding(state)] = out.pop(uids[0])
        while any(len(v) < 12 for v in out.values()):
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
        gen.close()
        return sorted(out.values())

    assert run(True) == run(False)


def test_paused_streams_finish_beside_a_steady_better_class(model):
    """One decode slot, a batch-class stream in it, and standard requests always waiting:
    the stream is paused for them and still finishes on its share of turns, with its
    solo tokens."""
    want = solo(model, tokens(90, 32), 40)
    e = engine(model, loop=EngineLoop(batch_share=0.25), prompt_concurrency=1, decode_concurrency=1)
    standard = Steady(e, "s", STANDARD, 200, seed=2000, length=24, n=2)
    try:
        stream = EventSink()
        e.submit(req("stream", tokens(90, 32), stream, BATCH, n=40))
        wait_until(lambda: len(stream.tokens) >= 2, 60, "the batch stream to decode")
        standard.start()
        finished = stream.done.wait(60) and not standard.all_done()
        standard.stop()
        assert finished, len(standard.sinks)
        assert stream.tokens == want
        assert e.metrics.decode_pauses.labels(str(BATCH))._value.get() >= 1
    finally:
        standard.stop()
        e.stop()


@pytest.mark.parametrize("speculative", [False, True])
def test_a_full_decode_batch_pauses_lower_streams_for_an_interactive_request(model, speculative):
    """Both decode slots held by standard streams (one greedy, one seeded sampling with a
    repetition penalty): an interactive request takes the place of one, which is paused
    with its whole state and goes on later; every answer is its solo answer."""
    from scheduler.speculative import SpeculationConfig

    spec = {"speculation": SpeculationConfig("ngram", 3)} if speculative else {}
    greedy = SamplingParams(max_tokens=48)
    seeded = SamplingParams(max_tokens=48, temperature=0.9, seed=7, repetition_penalty=1.2)
    streams = [(tokens(60, 48), greedy), (tokens(61, 48), seeded)]
    short = tokens(62, 40)

    def alone(prompt, params):
        e = engine(model, **spec)
        try:
            s = EventSink()
            e.submit(EngineRequest("solo", prompt, params, s))
            assert s.done.wait(60)
            return s.tokens
        finally:
            e.stop()

    want = [alone(p, params) for p, params in streams] + [alone(short, SamplingParams(max_tokens=4))]
    e = engine(model, loop=EngineLoop(), prompt_concurrency=2, decode_concurrency=2, **spec)
    try:
        sinks = [Timed() for _ in range(3)]
        for i, (p, params) in enumerate(streams):
            e.submit(EngineRequest(f"standard{i}", p, params, sinks[i], priority=STANDARD, tenant="agent"))
        wait_until(lambda: all(len(s.tokens) >= 4 for s in sinks[:2]), 60, "both streams to decode")
        e.submit(req("interactive", short, sinks[2], INTERACTIVE))
        for s in sinks:
            assert s.done.wait(120)
        assert sinks[2].done.is_set() and all(sinks[2].first_token_at < s.events_done_at for s in sinks[:2])
        assert [s.tokens for s in sinks] == want
        assert e.metrics.decode_pauses.labels(str(STANDARD))._value.get() == 1
    finally:
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


# ---------------------------------------------------------------------- chunk sizes


def test_capped_chunks_are_sized_per_class_and_may_go_below_the_usual_alignment():
    """The cost per token is kept by the classes prefilling: a short interactive prompt's
    fast chunk does not size the next chunk of long standard prompts; under a class cap,
    three prompts share the cap in chunks smaller than ALIGN."""
    from scheduler.batch.chunking import ALIGN, CAP_ALIGN, ChunkPlanner

    p = ChunkPlanner(2048, 0.2)
    p.record(96, 96, 0, 0.0096, (STANDARD,))  # 0.1 ms a token: long contexts
    p.record(2048, 200, 0, 0.002, (INTERACTIVE,))  # 0.01 ms a token: a short prompt
    capped = p.next_chunk(3, 0, cap=0.005, classes=(STANDARD,))
    assert capped < ALIGN and capped % CAP_ALIGN == 0
    assert 3 * capped * 1e-4 <= 0.005  # within the cap at the standard prompts' cost
    assert p.next_chunk(1, 0, cap=0.005, classes=(INTERACTIVE,)) > 10 * capped
    assert p.next_chunk(3, 0, cap=0.005, classes=(BATCH,)) == capped  # untimed: the costliest known
