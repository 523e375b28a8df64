"""Concurrent requests decode together and each gets exactly its solo tokens (greedy)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import assert_same_tokens, live_server, model_path, stream_completion_logprobs

WORDS = "the model cache token prompt server batch request tenant prefix memory apple".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + 9 * i))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_eight_concurrent_streams_match_solo(arch):
    texts = [prompt(i) for i in range(8)]
    with live_server(model_path(arch), prompt_concurrency=8, decode_concurrency=8) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                solo = [await stream_completion_logprobs(c, t, 12) for t in texts]
                server.engine.prompt_cache.eviction.flush()
                together = await asyncio.gather(*(stream_completion_logprobs(c, t, 12) for t in texts))
                return solo, together

        solo, together = asyncio.run(run())
        stats = server.engine.stats
    for i, (s, t) in enumerate(zip(solo, together)):
        assert_same_tokens(t, s, f"{arch}: stream {i}")
    assert stats.max_decode_batch >= 4  # they really were decoded together
    assert stats.max_prefill_batch >= 2
