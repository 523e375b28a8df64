"""SSE comments during long waits: prefill progress and keep-alives (real model, real HTTP)."""

from __future__ import annotations

import re
import threading

from conftest import live_server, model_path


def stream_lines(client, body):
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return list(r.iter_lines())


def test_prefill_progress_comments_count_up_to_the_prompt():
    with live_server(model_path("qwen3"), prefill_step_size=32, checkpoint_every=100000) as s:
        body = {"messages": [{"role": "user", "content": "count " * 300}], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        with s.client() as c:
            lines = stream_lines(c, body)
    progress = [tuple(map(int, m.groups())) for m in (re.fullmatch(r": prefill (\d+)/(\d+)", x) for x in lines) if m]
    usage = [x for x in lines if '"usage": {' in x and '"prompt_tokens"' in x][-1]
    total = int(re.search(r'"prompt_tokens": (\d+)', usage).group(1))
    assert len(progress) >= 5, lines[:10]
    assert all(t == total for _, t in progress)
    done = [d for d, _ in progress]
    assert done == sorted(done) and done[-1] < total  # monotonic, and the last token is decode's
    # The comments come before the first content chunk, never inside the JSON events.
    first_content = next(i for i, x in enumerate(lines) if '"content": "' in x and '"role"' not in x)
    assert max(i for i, x in enumerate(lines) if x.startswith(": prefill")) < first_content
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


def test_keepalive_comments_while_queued():
    with live_server(model_path("qwen3"), prompt_concurrency=1, decode_concurrency=1, sse_keepalive=0.05) as s:
        bias = {str(t): -100 for t in s.tokenizer.eos_token_ids}
        first = {"messages": [{"role": "user", "content": "first"}], "max_tokens": 400, "logit_bias": bias}
        second = {"messages": [{"role": "user", "content": "second"}], "max_tokens": 2, "stream": True}
        with s.client() as c:
            t = threading.Thread(target=lambda: c.post("/v1/chat/completions", json=first))
            t.start()
            while s.engine.num_running == 0:
                pass
            with s.client() as c2:
                lines = stream_lines(c2, second)
            t.join()
    keepalives = [x for x in lines if x == ": keep-alive"]
    assert len(keepalives) >= 2, lines[:8]
    assert [x for x in lines if x][-1] == "data: [DONE]"
