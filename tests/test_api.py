"""The OpenAI-compatible endpoints over real HTTP, with the official ``openai`` client."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import live_server, load_tokenizer, model_path

SYSTEM = "You are a helpful assistant that answers briefly."


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3"), max_tokens_limit=4096) as s:
        yield s


def chat(server, content, **kw):
    body = {"model": "test-model", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0}
    body.update(kw)
    with server.client() as c:
        return c.post("/v1/chat/completions", json=body)


def test_models_and_health(server):
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "test-model"
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"


def test_chat_with_openai_client(server):
    client = server.openai()
    r = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0 or u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_stream_equals_non_stream_and_reports_usage(server):
    client = server.openai()
    messages = [{"role": "user", "content": "Tell me about the apple model cache"}]
    full = client.chat.completions.create(model="test-model", messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(
        (c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None) or "")
        for c in chunks if c.choices
    )
    full_text = full.choices[0].message.content + (getattr(full.choices[0].message, "reasoning_content", None) or "")
    assert text == full_text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    # The second identical request reuses the cached prompt.
    assert stream and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_sse_ends_with_done(server):
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_completions_with_logprobs(server):
    client = server.openai()
    r = client.completions.create(model="test-model", prompt="The cache of the model", max_tokens=6,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) >= chosen - 1e-5  # greedy: chosen is the best


def test_chat_logprobs(server):
    r = chat(server, "What is a prefix cache?", logprobs=True, top_logprobs=2).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_stop_string_truncates(server):
    first = chat(server, "Write something about memory", max_tokens=20).json()
    text = first["choices"][0]["message"]["content"]
    if len(text) < 4:
        pytest.skip("the random model ended at once")  # pragma: no cover
    stop = text[len(text) // 2: len(text) // 2 + 3]
    second = chat(server, "Write something about memory", max_tokens=20, stop=[stop]).json()
    out = second["choices"][0]["message"]["content"]
    assert stop not in out and text.startswith(out)
    assert second["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(server):
    kw = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    a = chat(server, "Pick random words", **kw).json()["choices"][0]["message"]["content"]
    b = chat(server, "Pick random words", **kw).json()["choices"][0]["message"]["content"]
    assert a == b


def test_text_parts_and_template_kwargs(server):
    r = chat(server, [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
             chat_template_kwargs={"enable_thinking": False}, tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.status_code == 200, r.text


def test_metrics_exposed(server):
    chat(server, "count me")
    with server.client() as c:
        text = c.get("/metrics").text
    assert 'endpoint="/v1/chat/completions"' in text and "mlx_gateway_requests_total{" in text
    assert "mlx_gateway_time_to_first_token_seconds_bucket" in text
    assert "mlx_gateway_completion_tokens_total" in text
    assert "mlx_gateway_prefix_cache_hits_tokens_total" in text
    if sys.platform.startswith("linux"):  # the process collector reads /proc
        resident = re.search(r"^mlx_gateway_process_resident_memory_bytes (\S+)$", text, re.M)
        assert resident and float(resident.group(1)) > 0


def test_a_token_that_is_part_of_a_character_is_written_as_its_bytes():
    """As OpenAI writes such tokens: ``bytes:\\xe4\\xb8`` with their real bytes, so that
    two of them never share one text (a completions ``top_logprobs`` object is keyed by
    it); a token that is a whole character, U+FFFD itself included, keeps its text."""
    from gateway.protocols.openai_format import LogprobFormatter

    tok = load_tokenizer(model_path("qwen3", "qwen3"))
    f = LogprobFormatter(tok)
    halves = [i for i in range(20000, 30000) if "\ufffd" in tok.decode([i])][:20]
    shown = [f._text(i) for i in halves]
    assert len(halves) == 20 and len(set(shown)) == 20 and all(s.startswith("bytes:\\x") for s in shown)
    for i, s in zip(halves, shown):
        raw = bytes(f._bytes(i, s))
        assert s == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert b"".join(bytes(f._bytes(j, f._text(j))) for j in tok.encode("中文", add_special_tokens=False)) == \
            "中文".encode()
    replacement = tok.encode("\ufffd", add_special_tokens=False)
    assert len(replacement) == 1 and f._text(replacement[0]) == "\ufffd"
