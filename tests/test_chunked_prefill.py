"""Chunked prefill under a time budget: a long prompt that arrives while other requests
decode is prefilled in small chunks between their decode steps, and every request still
gets exactly its solo tokens (greedy; logprobs within 1e-4): dense attention (qwen3), a
hybrid with linear attention (qwen3_5), sliding window (gemma3_text) and a Mamba-2 hybrid
(nemotron_h)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import assert_same_tokens, live_server, model_path, stream_completion_logprobs

WORDS = "the model cache token prompt server batch request tenant prefix memory apple code agent".split()


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 5 + k * k + k) % len(WORDS)] for k in range(n))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma3_text", "nemotron_h"])
def test_long_prompt_chunked_between_decode_steps_matches_solo(arch):
    long_prompt = text(300, 1)
    shorts = [text(12 + 3 * i, 10 + i) for i in range(3)]
    # A budget far below one chunk's time: every prefill step under decode is one
    # 32-token chunk, and decode-only steps come between the chunks.
    with live_server(model_path(arch), prefill_budget=1e-4, prompt_concurrency=4, decode_concurrency=8) as server:
        engine = server.engine
        no_eos = {str(t): -100 for t in server.tokenizer.eos_token_ids}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                solo_long = await stream_completion_logprobs(c, long_prompt, 6, {})
                solo_short = [await stream_completion_logprobs(c, s, 60, no_eos) for s in shorts]
                engine.call(engine.prompt_cache.flush)
                before = engine.chunks.budgeted_steps
                started = [asyncio.Event() for _ in shorts]
                tasks = [asyncio.create_task(stream_completion_logprobs(c, s, 60, no_eos, e)) for s, e in zip(shorts, started)]
                for e in started:
                    await e.wait()
                together_long = await stream_completion_logprobs(c, long_prompt, 6, {})
                together_short = await asyncio.gather(*tasks)
                return solo_long, solo_short, together_long, together_short, engine.chunks.budgeted_steps - before

        solo_long, solo_short, together_long, together_short, chunked = asyncio.run(run())
    n_long = len(server.tokenizer.encode(long_prompt))
    assert chunked >= n_long // 32 - 2, (chunked, n_long)  # it really was chunked under decode
    assert engine.chunks.decode_only_steps > 0
    assert_same_tokens(together_long, solo_long, f"{arch}: long prompt chunked under decode")
    for i, (got, want) in enumerate(zip(together_short, solo_short)):
        assert_same_tokens(got, want, f"{arch}: decoding request {i}")
