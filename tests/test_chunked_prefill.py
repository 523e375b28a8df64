"""Chunked prefill under a time budget: a long prompt that arrives while other requests
decode is prefilled in small chunks between their decode steps, and every request still
gets exactly its solo tokens (greedy; logprobs within 1e-4): dense attention (qwen3), a
hybrid with linear attention (qwen3_5), sliding window (gemma3_text) and a Mamba-2 hybrid
(nemotron_h)."""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx
import mlx_lm
import pytest

from cache import PromptCacheManager
from conftest import (EventSink, assert_same_tokens, engine_tokens, live_server, model_path,
                      stream_completion_logprobs, wait_until)
from scheduler import Engine, EngineRequest, SamplingParams
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.speculative import SpeculationConfig

WORDS = "the model cache token prompt server batch request tenant prefix memory apple code agent".split()


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 5 + k * k + k) % len(WORDS)] for k in range(n))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma3_text", "nemotron_h"])
def test_long_prompt_chunked_between_decode_steps_matches_solo(arch):
    """The long prompt, four times longer than the decoding rows or more at its end, also
    joins them apart (``scheduler/batch/generator.py``), beside prompt-lookup speculation where
    the model allows it."""
    chunked_beside_streams_matches_solo(arch)


def test_long_prompt_chunked_beside_streams_matches_solo_with_a_draft_model():
    """The same with a draft model: the long prompt joins apart, and the draft model's
    batch takes it in through its joining path."""
    chunked_beside_streams_matches_solo("qwen3", draft_model=str(model_path("qwen3")))


def chunked_beside_streams_matches_solo(arch: str, **server_args) -> None:
    """Three short requests decode while a ~300-token prompt prefills in 32-token chunks:
    every request gets the tokens and logprobs of its solo run. Every request bans EOS with
    ``logit_bias``, so each row runs logits processors, the long prompt's in the forward of
    its own when it joins apart."""
    long_prompt = text(300, 1)
    shorts = [text(12 + 3 * i, 10 + i) for i in range(3)]
    # A budget far below one chunk's time: every prefill step under decode is one
    # 32-token chunk, and decode-only steps come between the chunks.
    with live_server(model_path(arch), prefill_budget=1e-4, prompt_concurrency=4, decode_concurrency=8,
                     **server_args) as server:
        engine = server.engine
        engine.chunks.cost = None  # no efficiency floor (below): 32-token chunks, many steps to check
        no_eos = {str(t): -100 for t in server.tokenizer.eos_token_ids}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                solo_long = await stream_completion_logprobs(c, long_prompt, 6, no_eos)
                solo_short = [await stream_completion_logprobs(c, s, 60, no_eos) for s in shorts]
                engine.flush_cache()
                before = engine.chunks.budgeted_steps
                started = [asyncio.Event() for _ in shorts]
                tasks = [asyncio.create_task(stream_completion_logprobs(c, s, 60, no_eos, e)) for s, e in zip(shorts, started)]
                for e in started:
                    await e.wait()
                together_long = await stream_completion_logprobs(c, long_prompt, 6, no_eos)
                together_short = await asyncio.gather(*tasks)
                return solo_long, solo_short, together_long, together_short, engine.chunks.budgeted_steps - before

        solo_long, solo_short, together_long, together_short, chunked = asyncio.run(run())
    n_long = len(server.tokenizer.encode(long_prompt))
    assert chunked >= n_long // 32 - 2, (chunked, n_long)  # it really was chunked under decode
    assert engine.chunks.decode_only_steps > 0
    assert_same_tokens(together_long, solo_long, f"{arch}: long prompt chunked under decode")
    for i, (got, want) in enumerate(zip(together_short, solo_short)):
        assert_same_tokens(got, want, f"{arch}: decoding request {i}")


# ---------------------------------------------------------------------- the efficiency floor


def test_the_forward_cost_is_the_line_through_two_timings():
    from scheduler.batch.forward_cost import solve

    cost = solve((16, 0.0043), (64, 0.0091))
    assert abs(cost.per_token - 1e-4) < 1e-12 and abs(cost.fixed - 0.0027) < 1e-12
    assert solve((16, 0.010), (64, 0.008)).per_token == 0.0  # noise: never a negative part


@pytest.mark.parametrize("fixed,per_token,best", [(0.0025, 1.1e-4, 2048), (0.070, 0.002, 2048), (0.01, 1e-3, 256)])
def test_the_floor_is_the_smallest_chunk_within_20_percent_of_the_best(fixed, per_token, best):
    from scheduler.batch.forward_cost import ForwardCost

    cost = ForwardCost(fixed, per_token)
    n = cost.floor(best)

    def per_token_at(k):
        return fixed / k + per_token

    assert per_token_at(n) <= 1.2 * per_token_at(best) + 1e-12
    assert n == 1 or per_token_at(n - 1) > 1.2 * per_token_at(best)
    assert cost.floor(best, per_token=10 * per_token) < n  # costlier tokens (a long context): a smaller floor


def test_chunks_beside_decoding_are_never_cut_below_the_floor():
    """A budget that would allow 32-token chunks gets chunks of the floor instead; two prompts
    share it; under a latency-class cap (a promise to an interactive request) chunks may
    still be smaller."""
    from scheduler.batch.chunking import ALIGN, ChunkPlanner
    from scheduler.batch.forward_cost import ForwardCost

    cost = ForwardCost(fixed=0.070, per_token=0.002)  # SmolLM2-135M on the 2-core machine
    p = ChunkPlanner(2048, 0.2, cost=cost)
    p.record(0, 0, 1, 0.1)  # a decode-only step of one row
    p.record(128, 128, 1, 0.070 + 0.002 * 128 + 0.1)  # a chunk beside that row
    assert p._marginal[()] == pytest.approx(0.002)
    floor = p.floor(1)
    assert floor % ALIGN == 0 and floor >= cost.floor(2048)
    p.share.clear()  # the decode-only time that chunk owed is paid
    assert p.next_chunk(1, 4) == floor  # the budget alone gives 32: (0.85 * 0.2) / 0.0033 // 32 * 32
    p.share.clear()
    two = p.next_chunk(2, 4)
    assert two >= -(-cost.floor(4096, p._marginal[()]) // 2) and two % ALIGN == 0
    p.share.clear()
    assert p.next_chunk(1, 4, cap=0.005) < floor
    assert ChunkPlanner(2048, 0.2).floor(1) == ALIGN  # no measured cost: no floor


def test_a_prompt_joins_before_owed_decode_steps_and_its_last_chunk_takes_a_short_tail():
    """After a chunk, decode-only steps are owed, unless all that is left of the prompt is
    its last token: the step that moves it to the decoding rows decodes them too, so it
    goes first. A chunk that would leave at most TAIL of itself for one more step takes
    that tail; a longer rest waits for the next chunk."""
    from scheduler.batch.chunking import TAIL, ChunkPlanner

    p = ChunkPlanner(2048, 0.2)
    p.record(0, 0, 4, 0.01)  # a decode-only step of four rows
    p.share.clear()
    chunk = p.next_chunk(1, 4, left=3000)
    assert 0 < chunk < 3000
    p.record(chunk, chunk, 4, 0.2)  # the chunk beside them: it owes them decode-only steps
    assert p.next_chunk(1, 4, left=100) == 0
    assert p.next_chunk(1, 4, left=0) > 0  # only the join is left: it goes first
    assert p.share.owed()  # ... and the steps are still owed after it
    p.share.clear()
    sized = p.next_chunk(1, 4, left=3000)
    tail = int(TAIL * sized)
    assert p.next_chunk(1, 4, left=sized + tail) == sized + tail
    assert p.next_chunk(1, 4, left=sized + tail + 1) == sized
    assert p.next_chunk(1, 4, left=sized // 2) == sized  # (the generator takes what is left)


def test_decode_only_steps_pay_the_share_net_of_the_chunks_own_decode_and_at_least_two():
    """After a chunk, the decoding rows are owed DECODE_SHARE of the chunk step's time less
    the decode step the chunk step ran for them, in decode-only steps, and never fewer than
    MEDIAN_STEPS of them (so two of every three gaps of a stream stay decoding's)."""
    from scheduler.batch.chunking import DECODE_SHARE, MEDIAN_STEPS, ChunkPlanner

    def owed_steps(decode: float, chunk_seconds: float) -> int:
        p = ChunkPlanner(2048, 0.2)
        p.record(0, 0, 4, decode)  # a decode-only step: its time is the in-chunk decode's too
        p.share.clear()
        n = p.next_chunk(1, 4, left=10_000)
        p.record(n, n, 4, chunk_seconds)
        steps = 0
        while p.next_chunk(1, 4, left=10_000) == 0:
            p.record(0, 0, 4, decode)
            steps += 1
            assert steps < 1000
        return steps

    # a 0.18 s chunk step beside decode steps of 7 ms: 18 ms owed less the 7 in the chunk
    # step is two decode-only steps (three when the in-chunk decode was not counted)
    assert owed_steps(0.007, 0.18) == 2
    # decode steps too long for the share: still the two the median needs
    assert owed_steps(0.05, 0.18) == MEDIAN_STEPS == 2
    # fast decode steps: the share in time, net of the one in the chunk step
    assert abs(owed_steps(0.001, 0.2) - (DECODE_SHARE * 0.2 - 0.001) / 0.001) <= 1


def test_chunks_are_sized_for_a_cost_per_token_that_grows_with_the_context():
    """A prompt token attending to ``c`` others costs ``a + b c`` (attention): chunks sized
    from the cost per token of the chunk before (at a smaller context) overshoot the budget
    more the further the prompt has got; with the context given, the planner fits the
    line to the chunks it timed and every chunk's step stays within the budget."""
    from scheduler.batch.chunking import ChunkPlanner
    from scheduler.batch.forward_cost import ForwardCost

    fixed, a, b, decode = 0.004, 6e-5, 1.2e-7, 0.008  # the medium benchmark model, roughly

    def step(n: int, context: float) -> float:  # one chunk of n tokens beside decoding rows
        return fixed + decode + n * (a + b * (context + n / 2))

    def run(with_context: bool) -> list[float]:
        p = ChunkPlanner(2048, 0.2, cost=ForwardCost(fixed=fixed, per_token=a))
        p.record(0, 0, 4, decode)  # a decode-only step of the four streams
        done, seconds = 0, []
        while done < 6000:
            p.share.clear()
            n = min(p.next_chunk(1, 4, context=done if with_context else None), 6000 - done)
            seconds.append(step(n, done))
            p.record(n, n, 4, seconds[-1], (), done if with_context else None, 1)
            done += n
        return seconds

    fitted, plain = run(True), run(False)
    assert max(fitted[1:]) <= 0.2 * 1.02  # after the first (FIRST_CHUNK) chunk, none over the budget
    assert max(plain) > 0.2 * 1.15  # as before: the cost per token of the chunk before undervalues the next
    assert len(fitted) <= 1.3 * len(plain)  # and not by cutting chunks needlessly small


def test_the_floor_follows_the_marginal_cost_measured_as_the_prompt_advances():
    from scheduler.batch.chunking import ChunkPlanner
    from scheduler.batch.forward_cost import ForwardCost

    p = ChunkPlanner(2048, 0.2, cost=ForwardCost(fixed=0.010, per_token=1e-4))
    early = p.floor(1)
    p.record(512, 512, 0, 0.010 + 512 * 1e-3)  # attention over a long context: 10x the cost per token
    assert p._marginal[()] == pytest.approx(1e-3)
    assert p.floor(1) < early


# ---------------------------------------------------------------------- beside speculative decoding

def test_decoding_rows_verify_no_drafts_while_a_prompt_prefills_beside_them(monkeypatch):
    """A stream whose answer loops verifies drafts; while a long prompt prefills in chunks
    beside it, its steps are plain (a verify step's extra time would be the prompt's), and
    once the prompt decodes too it verifies drafts again. Both get their solo tokens."""
    model, tok = mlx_lm.load(str(model_path("qwen3")))
    rng = random.Random(3)
    stream = [rng.randrange(10, 500) for _ in range(12)] * 5  # the demo model's answer to it loops
    long_prompt = [rng.randrange(10, 500) for _ in range(320)]
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, prefill_budget=1e-4, speculation=SpeculationConfig("ngram", 4))
    engine.chunks.cost = None  # no efficiency floor: 32-token chunks, many steps beside the stream
    steps = []  # per generator step: (a prompt waited in it, verify steps it ran)
    plain_next = JoiningBatchGenerator._next

    def spy(gen):
        waited = len(gen._prompt_batch) > 0 or len(gen._unprocessed_sequences) > 0
        verified = engine.stats.speculation.verify_steps
        out = plain_next(gen)
        steps.append((waited or len(gen._prompt_batch) > 0, engine.stats.speculation.verify_steps - verified))
        return out

    def submit(tokens, max_tokens):
        sink = EventSink()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.submit(EngineRequest(f"t-{uuid.uuid4().hex[:12]}", tokens, params, sink))
        return sink

    plain = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=1,
                   decode_concurrency=1)
    plain.start()
    try:
        solo = [engine_tokens(plain, [p], [SamplingParams(max_tokens=n, ignore_eos=True)])[0]
                for p, n in ((stream, 160), (long_prompt, 4))]
    finally:
        plain.stop()
    engine.start()
    try:
        monkeypatch.setattr(JoiningBatchGenerator, "_next", spy)
        first = submit(stream, 160)
        wait_until(lambda: engine.stats.speculation.verify_steps, 60, "the looping stream's first verify step",
                   interval=0.005)
        second = submit(long_prompt, 4)
        assert first.done.wait(120) and second.done.wait(120)
    finally:
        engine.stop()
    assert [first.tokens, second.tokens] == solo
    beside = [v for waited, v in steps if waited]
    last_wait = max(i for i, (waited, _) in enumerate(steps) if waited)
    assert len(beside) >= 320 // 32, steps  # the prompt took turns with the stream, chunk by chunk
    assert sum(beside) == 0, steps
    assert sum(v for _, v in steps[last_wait + 1:]) > 0, steps  # drafts again after the prompt joined
