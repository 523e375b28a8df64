"""The scheduler under bursts: shared prefixes computed once, per-request checkpoints,
exact repeats, and the batch-equivalence guard. Real servers, real models."""

from __future__ import annotations

import asyncio
import random

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cache import PromptCacheManager
from conftest import EventSink, live_server, load, model_path
from scheduler import Engine, EngineRequest, SamplingParams
from scheduler.request import PromptEvent
from gateway.conversation.prompts import render_chat
from gateway.protocols.openai_chat import to_conversation
from gateway.protocols.openai_schemas import ChatRequest

WORDS = ("the model cache token prompt server batch request tenant prefix memory apple code agent "
         "browser extension stream answer question system user assistant reason think water light").split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


SYSTEM = "You are a careful assistant. " + words(560, 0)
USERS = [f"Page {i}: " + words(280, 100 + i) for i in range(6)]


def body(user: str, system: str = SYSTEM, max_tokens: int = 6) -> dict:
    return {"model": "test-model", "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


async def ask(client: httpx.AsyncClient, b: dict) -> dict:
    r = await client.post("/v1/chat/completions", json=b)
    assert r.status_code == 200, r.text
    return r.json()


def answer(r: dict) -> tuple[str, list[float]]:
    msg = r["choices"][0]["message"]
    lps = [e["logprob"] for e in r["choices"][0]["logprobs"]["content"]]
    return msg["content"] + (msg.get("reasoning_content") or ""), lps


def same(a: dict, b: dict) -> bool:
    (ta, la), (tb, lb) = answer(a), answer(b)
    return ta == tb and len(la) == len(lb) and all(abs(x - y) < 1e-4 for x, y in zip(la, lb))


def solo_answers(arch: str, bodies: list[dict]) -> list[dict]:
    """Each request alone on a cold server (cache flushed before each)."""
    with live_server(model_path(arch), prompt_concurrency=1, decode_concurrency=1) as server:

        async def run():
            out = []
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                for b in bodies:
                    server.engine.flush_cache()
                    out.append(await ask(c, b))
            return out

        return asyncio.run(run())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_burst_shares_the_system_prompt(arch):
    bodies = [body(u) for u in USERS]
    reference = solo_answers(arch, bodies)
    for concurrency in (1, 2, 6):
        with live_server(model_path(arch), prompt_concurrency=concurrency, decode_concurrency=8) as server:
            tok = server.tokenizer
            prompts = [render_chat(tok, to_conversation(ChatRequest.model_validate(b)), {}, 4096) for b in bodies]
            sys_len = len(render_chat(tok, to_conversation(ChatRequest.model_validate(
                {"messages": [{"role": "system", "content": SYSTEM}]})), {}, 4096).tokens) - 4
            total = sum(len(p.tokens) for p in prompts)
            for round_ in range(3):
                before = server.engine.stats.prefill_tokens

                async def burst():
                    async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                        return await asyncio.gather(*(ask(c, b) for b in bodies))

                results = asyncio.run(burst())
                computed = server.engine.stats.prefill_tokens - before
                for i, (got, want) in enumerate(zip(results, reference)):
                    assert same(got, want), f"{arch} concurrency={concurrency} round={round_} request {i} differs"
                if round_ == 0:
                    # The ~600-token system prompt was computed once, not six times.
                    assert computed <= total - 5 * sys_len + 6 * 8, (computed, total, sys_len)
                else:
                    for r in results:
                        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= sys_len
            assert server.engine.wait_idle(60)  # next-turn precomputes hold a lease while they prefill
            assert server.engine.prompt_cache.num_leases == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_burst_leader_keeps_step_with_its_followers(arch):
    """Prompts share a 100-token "system prompt" (their checkpoint) and 4 more tokens. The
    leader is not cut again at 104, so it prefills the rest of its prompt in the same step
    as the followers that restored its 100-token snapshot, and all rows start decoding
    together; each row's tokens are those it gets alone on a cold engine."""
    model, tok = load(model_path(arch))
    rng = random.Random(5)
    system = [rng.randrange(10, 900) for _ in range(100)]
    head = [rng.randrange(10, 900) for _ in range(4)]
    prompts = [system + head + [rng.randrange(10, 900) for _ in range(40)] for _ in range(4)]

    def request(i: int) -> tuple[EngineRequest, EventSink]:
        sink = EventSink()
        return EngineRequest(f"r{i}", prompts[i], SamplingParams(max_tokens=5), sink, checkpoints=[100]), sink

    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, gather_wait=30.0)
    engine.start()
    try:
        solo = []
        for i in range(len(prompts)):
            engine.flush_cache()
            r, sink = request(i)
            engine.submit(r)
            assert sink.done.wait(60)
            solo.append(sink.tokens)
        engine.flush_cache()
        burst = [request(i) for i in range(len(prompts))]
        with engine.arrivals.prepare():  # one pick admits the leader, the others wait for it
            for r, _ in burst:
                engine.submit(r)
        for _, sink in burst:
            assert sink.done.wait(60)
    finally:
        engine.stop()
    assert [sink.tokens for _, sink in burst] == solo
    cached = [next(e.cached_tokens for e in sink.events if isinstance(e, PromptEvent)) for _, sink in burst]
    assert sorted(cached) == [0, 100, 100, 100]
    prefilled = {r.timings["engine_prefilled"] for r, _ in burst}
    assert len(prefilled) == 1, "the leader finished its prompt in a step of its own"


def test_mixed_lengths_checkpoint_their_own_prefix():
    systems = ["Short system. " + words(40, 7), "A longer system prompt. " + words(300, 8),
               "Medium system prompt. " + words(150, 9), "Tiny."]
    users = [words(n, 50 + n) for n in (200, 35, 120, 310)]
    bodies = [body(u, s, max_tokens=2) for s, u in zip(systems, users)]
    with live_server(model_path("qwen3_5"), prompt_concurrency=4, prefill_step_size=64) as server:

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                return await asyncio.gather(*(ask(c, b) for b in bodies))

        asyncio.run(burst())
        assert server.engine.stats.max_prefill_batch >= 2
        tok, engine = server.tokenizer, server.engine
        model, manager = engine.model, engine.prompt_cache
        checked = 0
        for b in bodies:
            prompt = render_chat(tok, to_conversation(ChatRequest.model_validate(b)), {}, 4096,
                                 trimmable=engine.trimmable)
            assert prompt.checkpoints, "chat prompts have checkpoints"
            assert not engine.trimmable and len(prompt.tokens) in prompt.checkpoints  # the next-turn point
            for p in prompt.checkpoints:
                toks = prompt.tokens + prompt.tokens[-1:]  # one more token, so that p = len(prompt) is checked too

                def check(p=p, toks=toks):
                    hit = manager.fetch("default", toks[: p + 1])
                    try:
                        assert hit.cached_tokens == p, (p, hit.cached_tokens)
                        warm = model(mx.array([toks[p: p + 1]]), cache=hit.cache)[0, -1]
                    finally:
                        manager.release(hit.lease)
                    # cold, with the same chunk cuts the engine used (recurrent layers)
                    cache = make_prompt_cache(model)
                    cuts = sorted({0, *[c for c in prompt.checkpoints if c < p], p})
                    for a, z in zip(cuts, cuts[1:]):
                        for s in range(a, z, 64):
                            model(mx.array([toks[s: min(z, s + 64)]]), cache=cache)
                    cold = model(mx.array([toks[p: p + 1]]), cache=cache)[0, -1]
                    lw = warm - mx.logsumexp(warm)
                    lc = cold - mx.logsumexp(cold)
                    return float(mx.max(mx.abs(lw - lc)).item())

                assert engine.call(check) < 1e-4
                checked += 1
        assert checked >= 8


def test_exact_repeats_and_full_hits_are_answered():
    with live_server(model_path("qwen3")) as server, server.client() as c:
        first = c.post("/v1/completions", json={"model": "test-model", "prompt": "the cache of the apple model",
                                                "max_tokens": 8, "temperature": 0}).json()
        extended = "the cache of the apple model" + first["choices"][0]["text"]
        for prompt in (extended, extended, "the cache of the apple model", extended + " more"):
            r = c.post("/v1/completions", json={"model": "test-model", "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
        again = c.post("/v1/completions", json={"model": "test-model", "prompt": extended, "max_tokens": 4}).json()
        # an exact repeat of a prompt answered before: all of it restored, its first token
        # sampled from the kept logits (scheduler.batch.first_tokens)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]
        assert server.engine.alive and server.engine.prompt_cache.num_leases == 0


@pytest.mark.parametrize("arch,exact", [("qwen3", True), ("nemotron_h", False)])
def test_batch_equivalence_guard(arch, exact):
    texts = [words(n, n) for n in (5, 40, 90, 17)]
    with live_server(model_path(arch), prompt_concurrency=4) as server:
        assert server.engine.pad_free_prefill is (not exact)

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                solo = []
                for t in texts:
                    server.engine.flush_cache()
                    solo.append(await ask(c, body(t, "sys", 6)))
                server.engine.flush_cache()
                together = await asyncio.gather(*(ask(c, body(t, "sys", 6)) for t in texts))
                return solo, together

        solo, together = asyncio.run(run())
        for a, b in zip(solo, together):
            assert same(a, b)


def test_mixed_sampling_settings_batch_together():
    """Seeds, temperatures, top-p/top-k, stop strings and logprobs in one batch: each
    request gets what it gets alone, and they really decode together."""
    variants = [dict(temperature=0.9, seed=7), dict(temperature=0.7, top_p=0.8, seed=11),
                dict(temperature=1.2, top_k=20, seed=3), dict(temperature=0, stop=["e"])]
    bodies = [{**body(words(30 + 10 * i, i), "sys", 10), **v} for i, v in enumerate(variants)]
    with live_server(model_path("qwen3"), prompt_concurrency=4) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                solo = [await ask(c, b) for b in bodies]
                together = await asyncio.gather(*(ask(c, b) for b in bodies))
                return solo, together

        solo, together = asyncio.run(run())
        assert server.engine.stats.max_decode_batch >= 3
    for a, b in zip(solo, together):
        assert answer(a)[0] == answer(b)[0]


def test_recent_requests_stay_bounded_when_a_long_row_comes_back(monkeypatch):
    """``stats.generated_by_request`` keeps the last RECENT requests: a long generation
    pushed out by newer first tokens comes back with its next token, and the dict must
    not keep one more entry for each time that happens."""
    from types import SimpleNamespace

    import scheduler.batch as batch_mod
    from scheduler.batch import Batch

    def row(rid):
        req = SimpleNamespace(id=rid, timings={}, params=SimpleNamespace(logprobs=False))
        return SimpleNamespace(generated=0, request=req, share_key=("t", 1.0))

    monkeypatch.setattr(batch_mod, "RECENT", 4)
    book = SimpleNamespace(stats=SimpleNamespace(generated_by_request={}))
    long_running, gr = row("long"), SimpleNamespace(token=1, logprobs=None)
    for i in range(100):
        Batch._token_event(book, row(f"short{i}"), gr, {})
        Batch._token_event(book, long_running, gr, {})
    assert len(book.stats.generated_by_request) <= 4
