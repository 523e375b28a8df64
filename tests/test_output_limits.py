"""A request that gives no output limit: as on OpenAI's chat completions and Responses APIs,
vLLM and Ollama, the answer runs until the model stops or the context ends (no 512-token
default as mlx_lm.server has); ``--max-tokens`` is a default the operator may choose and
``--max-tokens-limit`` the bound. A real gateway serving a tiny model with a 640-token
context; ``ignore_eos`` keeps the random weights from ending an answer early."""

from __future__ import annotations

import json

import pytest

from conftest import live_server
from gateway.models.demo_model import build_model_dir

CONTEXT = 640  # more than the 512 tokens requests got by default before


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("models") / f"qwen3-ctx{CONTEXT}", "qwen3",
                           overrides={"max_position_embeddings": CONTEXT})


CHAT = {"messages": [{"role": "user", "content": "tell me everything"}], "temperature": 0, "ignore_eos": True}


def test_no_limit_runs_to_the_end_of_the_context_in_every_api(short_context_model):
    with live_server(short_context_model, default_max_tokens=None) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        used = body["usage"]
        assert used["prompt_tokens"] + used["completion_tokens"] == CONTEXT, used
        assert used["completion_tokens"] > 512

        # Streamed: the same answer, ended at the context's end.
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as st:
            chunks = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
        assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["total_tokens"] == CONTEXT
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert text == body["choices"][0]["message"]["content"]

        # Responses without max_output_tokens (as Codex CLI sends): incomplete only at the context's end.
        r = c.post("/v1/responses", json={"input": "tell me everything", "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        resp = r.json()
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
        assert resp["usage"]["input_tokens"] + resp["usage"]["output_tokens"] == CONTEXT, resp["usage"]

        # Legacy completions keep OpenAI's (and vLLM's) 16 tokens when none is given.
        r = c.post("/v1/completions", json={"prompt": "once upon", "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"

        # A limit the request gives still holds; Anthropic's Messages API still requires one.
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/messages", json={"model": "test-model", "messages": CHAT["messages"]})
        assert r.status_code == 400 and "max_tokens" in r.text, r.text


def test_the_operator_default_and_the_bound_hold(short_context_model):
    with live_server(short_context_model, default_max_tokens=None, max_tokens=7) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["usage"]["completion_tokens"] == 7, r.text
        r = c.post("/v1/completions", json={"prompt": "once upon", "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 7, r.text  # the operator's default over the legacy 16
    with live_server(short_context_model, default_max_tokens=None, max_tokens_limit=9) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["usage"]["completion_tokens"] == 9 and r.json()["choices"][0]["finish_reason"] == "length"
        assert c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10}).status_code == 400
