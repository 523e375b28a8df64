"""POST /v1/embeddings: a tiny random-weight Qwen3-Embedding model (real Qwen3 tokenizer)
loaded through mlx-embeddings, served beside a text model, through the official openai SDK."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_embeddings", reason="mlx-embeddings is not installed (pip install -e '.[test]')")

from conftest import live_server, model_path, sample  # noqa: E402

from gateway.models.spec import ModelSpec  # noqa: E402

TEXTS = ["hello world", "a much longer sentence about the prefix cache of a browser extension's tabs", "x",
         "Paris is the capital of France."]


@pytest.fixture(scope="module")
def server():
    emb, text = model_path("qwen3_embedding"), model_path("qwen3")
    specs = [ModelSpec(name="emb", path=str(emb), pin=True, preload=True),
             ModelSpec(name="chat", path=str(text), pin=True, preload=True)]
    with live_server(emb, specs=specs) as srv:
        yield srv


def vectors(resp) -> list[list[float]]:
    return [d.embedding for d in sorted(resp.data, key=lambda d: d.index)]


def test_single_and_batch_through_the_openai_sdk(server):
    client = server.openai()
    one = client.embeddings.create(model="emb", input=TEXTS[0])
    assert len(one.data) == 1 and one.data[0].index == 0 and one.model == "emb"
    v = one.data[0].embedding
    assert len(v) == 64 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4)
    tokens = server.handle("emb").embedder.encode(TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tokens)
    batch = client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert batch.usage.prompt_tokens == sum(len(server.handle("emb").embedder.encode(t)) for t in TEXTS)
    # different texts, different vectors
    got = np.array(vectors(batch))
    assert np.abs(got[0] - got[1]).max() > 1e-3


def test_batched_equals_alone(server):
    """Each input of a batch gets the vector it gets alone (the batch is padded and
    masked: float noise only, far below any difference between texts)."""
    client = server.openai()
    batch = np.array(vectors(client.embeddings.create(model="emb", input=TEXTS)))
    for i, t in enumerate(TEXTS):
        alone = np.array(client.embeddings.create(model="emb", input=t).data[0].embedding)
        assert np.abs(batch[i] - alone).max() < 1e-5, t
    # and the engine did batch them: one step embedded all four
    assert server.handle("emb").engine.stats.max_prefill_batch >= len(TEXTS)


def test_token_ids_input(server):
    client = server.openai()
    ids = server.handle("emb").embedder.encode(TEXTS[3])
    by_ids = client.embeddings.create(model="emb", input=[ids, ids[:3]])
    by_text = client.embeddings.create(model="emb", input=TEXTS[3])
    assert np.abs(np.array(by_ids.data[0].embedding) - np.array(by_text.data[0].embedding)).max() < 1e-6
    single = client.embeddings.create(model="emb", input=ids)  # one list of ids is one input
    assert len(single.data) == 1


def test_base64_matches_float(server):
    client = server.openai()
    f = client.embeddings.create(model="emb", input=TEXTS[:2], encoding_format="float")
    # asked for explicitly, the SDK hands back the base64 text
    b = client.embeddings.create(model="emb", input=TEXTS[:2], encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in vectors(b)]
    assert np.array_equal(np.array(vectors(f), dtype=np.float32), np.array(decoded))
    with server.client() as c:
        raw = c.post("/v1/embeddings", json={"model": "emb", "input": TEXTS[0], "encoding_format": "base64"})
    assert raw.status_code == 200
    data = raw.json()["data"][0]["embedding"]
    assert isinstance(data, str)
    decoded = np.frombuffer(base64.b64decode(data), dtype="<f4")
    alone = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    assert np.array_equal(decoded, np.array(vectors(alone)[0], dtype=np.float32))


def test_dimensions(server):
    client = server.openai()
    full = np.array(client.embeddings.create(model="emb", input=TEXTS[1]).data[0].embedding)
    cut = np.array(client.embeddings.create(model="emb", input=TEXTS[1], dimensions=16).data[0].embedding)
    assert cut.shape == (16,)
    assert math.isclose(float(np.linalg.norm(cut)), 1.0, rel_tol=1e-5)
    assert np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"model": "emb", "input": "x", "dimensions": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_errors(server):
    with server.client() as c:
        for body, param in [({"model": "emb", "input": ""}, "input"),
                            ({"model": "emb", "input": []}, "input"),
                            ({"model": "emb", "input": [[1, 2], [10 ** 9]]}, "input"),
                            ({"model": "emb", "input": "x", "encoding_format": "int8"}, "encoding_format"),
                            ({"model": "emb", "input": 3}, "input")]:
            r = c.post("/v1/embeddings", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        r = c.post("/v1/embeddings", json={"model": "chat", "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
        r = c.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        assert r.status_code == 404
        r = c.post("/v1/chat/completions", json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generating"
        # unknown fields are ignored
        r = c.post("/v1/embeddings", json={"model": "emb", "input": "x", "user": "u", "something": 1})
        assert r.status_code == 200


def test_models_list_kind_and_metrics(server):
    with server.client() as c:
        kinds = {m["id"]: m.get("kind") for m in c.get("/v1/models").json()["data"]}
        assert kinds["emb"] == "embedding" and kinds["chat"] == "text"
        before = sample(c.get("/metrics").text, "mlx_gateway_embedding_inputs_total", model="emb")
        assert c.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]}).status_code == 200
        after = sample(c.get("/metrics").text, "mlx_gateway_embedding_inputs_total", model="emb")
    assert after - before == 2


def test_prompt_token_limit_counts_embeddings(tmp_path):
    """Embedding tokens are charged to the tenant's prompt-token limit: 413 for a request
    over it, in OpenAI's error shape."""
    from gateway.tenancy.tenants import hash_key

    emb = model_path("qwen3_embedding")
    (tmp_path / "tenants.toml").write_text(
        f'[tenants.small]\nkey_sha256 = ["{hash_key("sk-small")}"]\nprompt_tokens_per_minute = 20\n')
    with live_server(emb, tenants=str(tmp_path / "tenants.toml")) as srv:
        with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": "Bearer sk-small"}) as c:
            ok = c.post("/v1/embeddings", json={"model": "test-model", "input": "hello"})
            assert ok.status_code == 200, ok.text
            r = c.post("/v1/embeddings", json={"model": "test-model", "input": "word " * 40})
            assert r.status_code in (413, 429), r.text
            assert "error" in r.json()
