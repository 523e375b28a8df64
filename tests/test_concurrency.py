"""Concurrent requests decode together and each gets exactly its solo tokens (greedy)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import live_server, model_path

WORDS = "the model cache token prompt server batch request tenant prefix memory apple".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + 9 * i))


async def stream_tokens(client: httpx.AsyncClient, text: str, max_tokens: int) -> list[int]:
    body = {"model": "test-model", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": 0}
    out = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                chunk = json.loads(line[6:])
                lp = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
                if lp:
                    out.extend(zip(lp["tokens"], lp["token_logprobs"]))
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_eight_concurrent_streams_match_solo(arch):
    texts = [prompt(i) for i in range(8)]
    with live_server(model_path(arch), prompt_concurrency=8, decode_concurrency=8) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                solo = [await stream_tokens(c, t, 12) for t in texts]
                server.state.engine.prompt_cache.flush()
                together = await asyncio.gather(*(stream_tokens(c, t, 12) for t in texts))
                return solo, together

        solo, together = asyncio.run(run())
        stats = server.engine.stats
    for s, t in zip(solo, together):
        assert [tok for tok, _ in s] == [tok for tok, _ in t]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(s, t))
    assert stats.max_decode_batch >= 4  # they really were decoded together
    assert stats.max_prefill_batch >= 2
