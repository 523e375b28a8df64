"""Growing reservations and preemption (scheduler/admission/preemption.py): under a budget
too small for every row's answer at once, rows that cannot grow are preempted to the
waiting queue, their KV in the prefix cache, and go on where they stopped: the same
greedy tokens as a cold solo run, no token duplicated or lost, usage as if uninterrupted."""

from __future__ import annotations

import functools
import gc
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from cache import PromptCacheManager
from conftest import engine_tokens, live_server, load, model_path
from scheduler import Engine, SamplingParams
from scheduler.admission.memory import gate_for


QUANTUM = 64  # the grant of new tokens here (MLX_GATEWAY_RESERVATION_QUANTUM; 256 by default): short answers outgrow it


@pytest.fixture(autouse=True)
def _quantum(monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_RESERVATION_QUANTUM", str(QUANTUM))


CHUNK = 16  # prefill tokens a step over HTTP: a small prefill reservation, so that the KV decides


def _prompts(tok, n: int, words: int) -> list[list[int]]:
    return [tok.encode(f"{i} " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words))) for i in range(n)]


def _preemptions(engine) -> float:
    return sum(m.value for metric in engine.metrics.preemptions.collect() for m in metric.samples
               if m.name.endswith("_total") and m.labels.get("outcome") == "requeued")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_preempted_rows_give_the_tokens_of_cold_solo_runs(arch):
    """Four rows whose answers (280 tokens, EOS ignored) outgrow a room that holds two
    rows' first grants and one 16-token prefill chunk: rows are preempted and
    readmitted, and every answer is the one a cold engine gives the prompt alone."""
    max_tokens = 3 * QUANTUM + 88
    model, tok, prompts, params, want, room = _engine_and_solo(arch, max_tokens, n=4)
    engine = _tight_engine(model, tok, room, prompts=4, decodes=8)
    try:
        got = engine_tokens(engine, prompts, [params] * len(prompts), timeout=600)
    finally:
        engine.stop()
    assert _preemptions(engine) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == max_tokens, (i, len(g))
        assert g == w, (i, next(k for k, (a, b) in enumerate(zip(g, w)) if a != b))


def _count(counter, **labels) -> float:
    return sum(m.value for metric in counter.collect() for m in metric.samples
               if m.name.endswith("_total") and all(m.labels.get(k) == v for k, v in labels.items()))


def _engine_and_solo(arch: str, max_tokens: int, n: int = 2):
    """The tiny ``arch`` model (freshly loaded), ``n`` prompts, their cold solo answers
    (``max_tokens``, EOS ignored: :func:`_solo_answers`), and the room of two first grants
    beside one 16-token prefill chunk."""
    model, tok = load(model_path(arch))
    prompts = _prompts(tok, n, 120)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    want = [list(a) for a in _solo_answers(arch, max_tokens, n)]
    gate = gate_for(model, make_prompt_cache(model), 16)
    n_tokens = max(len(p) for p in prompts)
    return model, tok, prompts, params, want, _room(gate, n_tokens, 2)


@functools.lru_cache(maxsize=None)
def _solo_answers(arch: str, max_tokens: int, n: int) -> tuple[tuple[int, ...], ...]:
    """The greedy answers (``max_tokens``, EOS ignored) of a cold engine of its own, one
    request at a time, to the ``n`` prompts of :func:`_engine_and_solo`, on a model loaded
    for them alone. Computed once per run: they depend only on the model's files and the
    prompts, and three tests compare their preempted rows with the same ones."""
    model, tok = load(model_path(arch))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    solo = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=1,
                  decode_concurrency=1)
    solo.start()
    try:
        return tuple(tuple(engine_tokens(solo, [p], [params])[0]) for p in _prompts(tok, n, 120))
    finally:
        solo.stop()


def _tight_engine(model, tok, room: int, prompts: int, decodes: int) -> Engine:
    """A started engine whose memory room is ``room`` bytes (16-token prefill chunks)."""
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=prompts,
                    decode_concurrency=decodes, prefill_step_size=16)
    engine.set_memory_room(lambda: room)
    engine.start()
    return engine


def _room(gate, n: int, rows: int) -> int:
    """Bytes ``gate`` reserves for ``rows`` first grants of ``n``-token prompts in one batch,
    one of them prefilling a chunk."""
    return gate.held([(n, QUANTUM, 0)] * (rows - 1) + [(n, QUANTUM, gate.prefill_need(n))])


def test_a_preempted_row_resumes_from_its_own_snapshot():
    """Two rows that cannot both grow: the later is preempted and, readmitted when the
    other ends, restores its KV from the prefix cache (it is not evicted while the request
    waits: a request that cannot fit leaves the cache alone) instead of recomputing it."""
    model, tok, prompts, params, want, room = _engine_and_solo("qwen3", 572)
    engine = _tight_engine(model, tok, room, prompts=2, decodes=2)
    try:
        got = engine_tokens(engine, prompts, [params] * 2, timeout=600)
    finally:
        engine.stop()
    assert _preemptions(engine) > 0
    assert _count(engine.metrics.preemption_resumes, how="cache") >= 1
    assert _count(engine.metrics.preemption_resumes, how="recompute") == 0
    assert got == want


def test_a_preempted_request_does_not_count_toward_its_tenants_max_queued():
    """A preempted request waiting again was admitted once: a request of its tenant with
    ``max_queued=1`` submitted meanwhile is queued, not refused with ``TenantQueueFull``."""
    import uuid

    from conftest import EventSink
    from scheduler import EngineRequest

    model, tok, prompts, params, want, room = _engine_and_solo("qwen3", 572)
    engine = _tight_engine(model, tok, room, prompts=2, decodes=2)
    try:
        sinks = [EventSink() for _ in prompts]
        with engine.arrivals.prepare():
            for p, sink in zip(prompts, sinks):
                engine.submit(EngineRequest(f"q-{uuid.uuid4().hex[:8]}", p, params, sink, tenant="t"))
        deadline = time.monotonic() + 300
        while not (_preemptions(engine) and engine.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _preemptions(engine) and engine.num_waiting  # the preempted request waits again
        late = EventSink()
        engine.submit(EngineRequest(f"q-{uuid.uuid4().hex[:8]}", prompts[0][:40], SamplingParams(max_tokens=4),
                                    late, tenant="t", max_queued=1))
        assert all(s.done.wait(600) for s in [*sinks, late])
    finally:
        engine.stop()
    assert [s.tokens for s in sinks] == want and len(late.tokens) == 4


def test_a_row_paused_for_a_better_class_is_preempted_before_that_class_is_cut():
    """A batch-class row paused for an interactive one (one decode slot) still holds its
    reservation; when the interactive row cannot grow, the paused row is preempted (its
    KV to the prefix cache) and the interactive answer runs to its ``max_tokens``, not cut
    with ``length``; both answers are those of cold solo runs."""
    import uuid

    from conftest import EventSink
    from scheduler import EngineRequest

    model, tok, prompts, params, want, room = _engine_and_solo("qwen3", 572)
    engine = _tight_engine(model, tok, room, prompts=1, decodes=1)
    try:
        batch, interactive = EventSink(), EventSink()
        engine.submit(EngineRequest(f"b-{uuid.uuid4().hex[:8]}", prompts[0], params, batch, priority=2))
        deadline = time.monotonic() + 300
        while len(batch.tokens) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.submit(EngineRequest(f"i-{uuid.uuid4().hex[:8]}", prompts[1], params, interactive, priority=0))
        assert interactive.done.wait(600) and batch.done.wait(600)
    finally:
        engine.stop()
    assert _count(engine.metrics.decode_pauses) >= 1
    assert _count(engine.metrics.preemptions, outcome="length") == 0
    assert _count(engine.metrics.preemptions, priority="2", outcome="requeued") >= 1
    assert interactive.tokens == want[1]
    assert batch.tokens == want[0]


LIMIT = 600  # tokens a request without max_tokens gets here (--max-tokens-limit: a short context's end)
BURST, ROWS = 16, 8  # requests at once; first grants the budget holds
WORDS = 60  # a short prompt: its prefill reservation (attention scores on the CPU) is small beside the answers


def _budget(path, rows: int, whole: bool = False, draft: int = 8) -> tuple[int, str]:
    """A memory budget for ``rows`` first grants of a short prompt beside one prefill
    chunk (``whole``: for one row's whole answer and the prefill chunk that recomputes it),
    above the weights and one chunk's transient, for a server drafting ``draft`` tokens
    (its default: ngram, 8 drafts); and the prompt's words."""
    model, tok = load(path)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    gate = gate_for(model, make_prompt_cache(model), CHUNK, draft=draft)
    words = " ".join(f"w{i % 97}" for i in range(WORDS))
    n = len(tok.apply_chat_template([{"role": "user", "content": f"11 {words}"}], add_generation_prompt=True))
    budget = weights + gate.transient + _room(gate, n, rows)
    if whole:
        budget = weights + gate.transient + gate.held([(n + LIMIT, 0, gate.prefill_need(n + LIMIT))])
    del model
    mx.clear_cache()
    return budget, words


def _chat(i: int, words: str, stream: bool = False) -> dict:
    body = {"model": "test-model", "messages": [{"role": "user", "content": f"{i} {words}"}], "ignore_eos": True,
            "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_a_burst_without_max_tokens_is_answered_under_a_small_budget(speculative, record_property):
    """Sixteen chat requests without ``max_tokens`` (each may run to 600 tokens, EOS
    ignored) under a budget that holds eight first grants: reserving their whole answers
    they would run one at a time or get a 503; now they run together, are preempted when
    they outgrow the budget, and every answer is a 200 with all its tokens and
    ``finish_reason: length``; MLX's active memory (the prefix cache's included) stays
    under the budget (+10 % here, the goal +5 %), with speculative decoding (8 drafts) and without."""
    path = model_path("qwen3")
    budget, words = _budget(path, ROWS, draft=8 if speculative == "ngram" else 0)
    gc.collect()  # an earlier test's arrays freed later would hide this one's
    base = mx.get_active_memory()
    with live_server(path, default_max_tokens=None, memory_budget=budget, prefill_step_size=CHUNK,
                     max_tokens_limit=LIMIT, speculative=speculative, num_draft_tokens=8) as s:
        peak, stop = [0], threading.Event()

        def watch():
            while not stop.is_set():
                peak[0] = max(peak[0], mx.get_active_memory() - base)
                time.sleep(0.002)

        def ask(i):
            with s.client() as c:
                r = c.post("/v1/chat/completions", json=_chat(i, words), timeout=600)
            return r.status_code, r.headers.get("retry-after"), r.json()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with ThreadPoolExecutor(BURST) as pool:
            answers = list(pool.map(ask, range(BURST)))
        stop.set()
        watcher.join()
        preempted = _preemptions(s.engine)
    for status, retry, body in answers:
        assert status == 200, (status, body)
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == LIMIT, body["usage"]
    assert preempted > 0
    record_property("peak_over_budget", round(peak[0] / budget, 3))
    # The goal is 1.05 x. Sampled every 2 ms on a shared 2-core machine, the peak was 0.86-0.96 x
    # without speculation over 20 runs and 0.69-0.73 x with n-gram speculation over 4, once the
    # CPU's compiled attention kernels held 2.25 copies of a call's scores instead of 7-8 (the
    # reservation's 2): before, the same runs gave 0.85-0.95 x with 1 in 8 at 1.17 x (2 in some
    # 17 over 1.10 x earlier), and with n-gram speculation up to 1.08 x. The bound allows for
    # sampling on a loaded machine and catches a return of the uncounted copies (1.8-2.9 x)
    # (benchmarks/results/memory_burst.md).
    assert peak[0] <= 1.10 * budget, (peak[0], budget)


def test_a_streamed_answer_goes_on_through_a_preemption():
    """A streamed answer preempted halfway (the later of two rows that cannot both grow to
    their answers' end, under a budget for one) goes on at readmission: its text and usage
    are those of the same request alone."""
    import httpx

    path = model_path("qwen3")
    budget, words = _budget(path, 1, whole=True, draft=0)
    with live_server(path, default_max_tokens=None, memory_budget=budget, prefill_step_size=CHUNK,
                     max_tokens_limit=LIMIT, speculative="off") as s:  # (drafts would end the first first)
        def streamed():
            text, usage = [], None
            with httpx.Client(base_url=s.url, timeout=600) as c:
                with c.stream("POST", "/v1/chat/completions", json=_chat(2, words, stream=True)) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            usage = chunk.get("usage") or usage
                            for ch in chunk["choices"]:
                                text.append(ch["delta"].get("content") or "")
            return "".join(text), usage

        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(lambda: httpx.post(s.url + "/v1/chat/completions", json=_chat(1, words), timeout=600))
            deadline = time.monotonic() + 300  # the streamed one arrives once the first decodes: it is preempted
            while not s.engine.stats.generated_by_request and time.monotonic() < deadline:
                time.sleep(0.01)
            stream = pool.submit(streamed)
            assert first.result().status_code == 200
            text, usage = stream.result()
        assert _preemptions(s.engine) > 0
        with s.client() as c:  # the same request alone
            alone = c.post("/v1/chat/completions", json=_chat(2, words), timeout=600).json()
    assert text == alone["choices"][0]["message"]["content"]
    assert usage["completion_tokens"] == alone["usage"]["completion_tokens"] == LIMIT
    assert usage["prompt_tokens"] == alone["usage"]["prompt_tokens"]
