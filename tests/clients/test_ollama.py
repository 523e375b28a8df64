"""Ollama's clients against the gateway's Ollama API: the official ``ollama`` package,
LangChain's ``ChatOllama`` and ``OllamaEmbeddings`` (``langchain-ollama``) and litellm's
``ollama_chat/`` provider.

One gateway serves a chat model (the tiny random-weight qwen3) and an embedding model
(qwen3 embedding), in this process. Answers are random text, so the tests assert
protocol facts: shapes, counts, nanosecond durations, done reasons, a ``format`` schema
followed (a grammar holds the answer), embeddings batched equal to alone, error statuses,
and what the prefix cache saves: ``prompt_eval_count`` counts the prompt tokens
evaluated, so a continued ``/api/generate`` (its ``context`` sent back) and a second
``/api/chat`` turn evaluate fewer than the first.
"""

from __future__ import annotations

import json
from datetime import datetime

import httpx
import numpy as np
import pytest

from conftest import live_server, model_path

from gateway.models.spec import ModelSpec

from .common import Forecast

ollama = pytest.importorskip("ollama")

def long_system(test: str) -> str:
    """A system prompt of 200 tokens or so, different from its first token on for each
    ``test`` (so that no other test's prompt is in the prefix cache)."""
    return f"[{test}] " + ("You are the assistant of a browser extension that summarises the page a user reads. "
                           * 12).strip()


@pytest.fixture(scope="module")
def server():
    text, emb = model_path("qwen3"), model_path("qwen3_embedding")
    specs = [ModelSpec(name="chat", path=str(text), pin=True, preload=True),
             ModelSpec(name="emb", path=str(emb), pin=True, preload=True)]
    with live_server(text, specs=specs) as srv:
        yield srv


@pytest.fixture()
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def assert_stats(r, generated: int) -> None:
    """Counts and durations as Ollama gives them: integers, nanoseconds."""
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.eval_count == generated and r.prompt_eval_count >= 1
    for d in (r.total_duration, r.load_duration, r.prompt_eval_duration, r.eval_duration):
        assert isinstance(d, int) and d >= 0
    assert 10**5 < r.total_duration < 300 * 10**9  # nanoseconds: over 0.1 ms, under 5 minutes
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    datetime.fromisoformat(r.created_at.replace("Z", "+00:00"))


def test_chat_whole_and_streamed(client):
    msgs = [{"role": "user", "content": "Say something."}]
    opts = {"num_predict": 6, "temperature": 0, "num_ctx": 4096}
    whole = client.chat(model="chat", messages=msgs, options=opts)
    assert whole.message.role == "assistant" and whole.done_reason == "length"
    assert_stats(whole, 6)
    parts = list(client.chat(model="chat", messages=msgs, options=opts, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert_stats(parts[-1], 6)


def test_generate_context_round_trip(client):
    first = client.generate(model="chat", system=long_system("generate"), prompt="Summarise the page.",
                            options={"num_predict": 5, "temperature": 0})
    assert_stats(first, 5)
    assert len(first.context) - 5 >= first.prompt_eval_count > 150  # its prompt, new to the cache, evaluated
    second = client.generate(model="chat", prompt="And in one word?", context=first.context,
                             options={"num_predict": 5, "temperature": 0})
    assert_stats(second, 5)
    assert second.context[:len(first.context)] == first.context
    # the context came from the prefix cache: only the new turn was evaluated
    assert second.prompt_eval_count < 30 < first.prompt_eval_count
    assert second.prompt_eval_count <= len(second.context) - len(first.context) - 5


def test_generate_streamed(client):
    opts = {"num_predict": 5, "temperature": 0}
    whole = client.generate(model="chat", prompt="Tell me more.", options=opts)
    parts = list(client.generate(model="chat", prompt="Tell me more.", options=opts, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].context == whole.context and all(p.context is None for p in parts[:-1])
    assert_stats(parts[-1], 5)


def test_management_calls(client):
    assert client.pull("chat").status == "success"
    assert [p.status for p in client.pull("chat", stream=True)][-1] == "success"
    assert client.copy("chat", "chat-copy").status == "success"
    assert "chat-copy" in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("no-such-model")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("chat")
    assert e.value.status_code == 400 and "deletes no models" in e.value.error


def test_second_chat_turn_evaluates_less(client):
    msgs = [{"role": "system", "content": long_system("chat turns")}, {"role": "user", "content": "Hello?"}]
    opts = {"num_predict": 4, "temperature": 0}
    first = client.chat(model="chat", messages=msgs, options=opts)
    msgs += [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "More?"}]
    second = client.chat(model="chat", messages=msgs, options=opts)
    assert second.prompt_eval_count < first.prompt_eval_count / 2, (first.prompt_eval_count,
                                                                    second.prompt_eval_count)


def test_tools_offered_and_results_sent_back(client):
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
            city: the city
        """
        return "sunny"

    opts = {"num_predict": 4, "temperature": 0}
    first = client.chat(model="chat", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                        tools=[get_weather], options=opts)
    assert first.done
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "sunny, 18 degrees"}]
    again = client.chat(model="chat", messages=history, tools=[get_weather], options=opts)
    assert again.done and again.eval_count == 4


def test_format_json_and_schema(client):
    schema = Forecast.model_json_schema()
    r = client.chat(model="chat", messages=[{"role": "user", "content": "Forecast?"}], format=schema,
                    options={"num_predict": 60, "temperature": 0})
    assert r.done_reason == "stop"
    Forecast.model_validate_json(r.message.content)
    g = client.generate(model="chat", prompt="Forecast?", format=schema, options={"num_predict": 60})
    Forecast.model_validate_json(g.response)
    j = client.generate(model="chat", prompt="JSON please", format="json", options={"num_predict": 8})
    assert j.response.lstrip().startswith("{")  # held to a JSON object from its first token


def test_embeddings_batch_equals_alone(client):
    texts = ["hello world", "a much longer sentence about the tabs of a browser", "x"]
    batch = client.embed(model="emb", input=texts)
    assert len(batch.embeddings) == 3 and batch.prompt_eval_count > 0 and batch.total_duration > 0
    for text, vector in zip(texts, batch.embeddings):
        alone = client.embed(model="emb", input=text).embeddings[0]
        np.testing.assert_allclose(vector, alone, atol=1e-4)
    legacy = client.embeddings(model="emb", prompt=texts[0]).embedding
    np.testing.assert_allclose(legacy, batch.embeddings[0], atol=1e-4)


def test_errors(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="chat", input="hi")  # not an embedding model
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="emb", messages=[{"role": "user", "content": "hi"}])  # an embedding model
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="chat", prompt="hi", options={"temperature": "warm"})
    assert e.value.status_code == 400 and "temperature" in e.value.error


def test_show_ps_list_version(client, server):
    show = client.show("chat")
    assert {"completion", "tools"} <= set(show.capabilities) and "embedding" not in show.capabilities
    assert show.modelinfo["general.architecture"] == "qwen3"
    assert show.modelinfo["qwen3.context_length"] == server.handle("chat").context_length
    assert show.details.family == "qwen3"
    assert client.show("emb").capabilities == ["embedding"]
    assert {"chat", "emb"} <= {m.model for m in client.list().models}
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {"chat", "emb"} and running["chat"].context_length == server.handle("chat").context_length
    assert running["chat"].size_vram > 0
    assert httpx.get(server.url + "/api/version").json()["version"].count(".") == 2


# ---------------------------------------------------------------------- langchain-ollama
def test_langchain_chat_ollama(server):
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    llm = ChatOllama(model="chat", base_url=server.url, num_predict=5, temperature=0)
    whole = llm.invoke("Say something.")
    assert isinstance(whole.content, str) and whole.response_metadata["done_reason"] == "length"
    assert whole.usage_metadata["output_tokens"] == 5
    streamed = "".join(c.content for c in llm.stream("Say something."))
    assert streamed == whole.content
    structured = ChatOllama(model="chat", base_url=server.url, num_predict=60, temperature=0) \
        .with_structured_output(Forecast, method="json_schema").invoke("Forecast?")
    assert isinstance(structured, Forecast)
    emb = OllamaEmbeddings(model="emb", base_url=server.url)
    docs = emb.embed_documents(["hello world", "x"])
    np.testing.assert_allclose(docs[1], emb.embed_query("x"), atol=1e-4)


# ---------------------------------------------------------------------- litellm ollama_chat/
def test_litellm_ollama_chat(server):
    import litellm

    kw = dict(model="ollama_chat/chat", api_base=server.url, max_tokens=5, temperature=0, num_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Say something."}]
    whole = litellm.completion(messages=messages, **kw)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 5
    chunks = list(litellm.completion(messages=messages, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    with pytest.raises(litellm.NotFoundError) as e:  # the 404, mapped by litellm
        litellm.completion(messages=messages, **{**kw, "model": "ollama_chat/no-such-model"})
    assert "no-such-model" in str(e.value)
    structured = litellm.completion(messages=[{"role": "user", "content": "Forecast?"}], response_format=Forecast,
                                    **{**kw, "max_tokens": 60})
    Forecast.model_validate(json.loads(structured.choices[0].message.content))
