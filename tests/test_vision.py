"""Images through the three APIs: a tiny random-weight Gemma 3 vision-language model (real
Gemma 3 tokenizer and processor files) loaded through mlx-vlm, served beside a text
model, through the official openai and anthropic SDKs, and through Ollama's ``/api/chat``.

The prefix cache keys an image's positions by its pixels: two requests identical but
for the image each get the answer they get alone, cold, whatever ran before; the same
image twice reuses the first one's prefill."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[test]')")

from conftest import live_server, model_path, sample  # noqa: E402

from gateway.models.spec import ModelSpec  # noqa: E402

QUESTION = "What does this chart say?"


def png(seed: int, size=(64, 48), noise: bool = True) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    arr = (rng.random((h, w, 3)) * 255).astype(np.uint8) if noise else np.zeros((h, w, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


A, B = data_url(png(1)), data_url(png(2))


def chat_body(url: str, question: str = QUESTION, model: str = "vlm", **kw) -> dict:
    return {"model": model, "temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": question}]}], **kw}


@pytest.fixture(scope="module")
def server():
    vlm, text = model_path("gemma3"), model_path("qwen3")
    specs = [ModelSpec(name="vlm", path=str(vlm), pin=True, preload=True),
             ModelSpec(name="chat", path=str(text), pin=True, preload=True)]
    with live_server(vlm, specs=specs, max_image_bytes=300_000, max_image_pixels=2_000_000, max_images=4) as srv:
        yield srv


def answer(r: httpx.Response) -> tuple[list, int]:
    """(token, logprob) pairs of a chat answer, and its cached prompt tokens."""
    assert r.status_code == 200, r.text
    body = r.json()
    lp = [(e["token"], e["logprob"]) for e in body["choices"][0]["logprobs"]["content"]]
    return lp, body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def same(got, want) -> bool:
    return [t for t, _ in got] == [t for t, _ in want] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want))


def flush(c: httpx.Client) -> None:
    assert c.post("/admin/cache/flush").status_code == 200


def test_openai_chat_with_an_image(server):
    client = server.openai()
    r = client.chat.completions.create(model="vlm", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Describe"},
                                     {"type": "image_url", "image_url": {"url": A, "detail": "low"}}]}])
    assert r.choices[0].finish_reason in ("stop", "length")
    # 16 image tokens (the tiny model's processor) are in the prompt
    assert r.usage.prompt_tokens > 16
    with server.client() as c:
        m = c.get("/metrics").text
    assert sample(m, "mlx_gateway_image_requests_total", model="vlm", api="chat") >= 1
    assert sample(m, "mlx_gateway_image_tokens_total", model="vlm", api="chat") >= 16


def test_two_images_behind_the_same_text_each_get_their_own_answer(server):
    """Fails if the cache key ignored the pixels: B after A would reuse A's KV."""
    with server.client() as c:
        flush(c)
        solo_a, _ = answer(c.post("/v1/chat/completions", json=chat_body(A)))
        flush(c)
        solo_b, _ = answer(c.post("/v1/chat/completions", json=chat_body(B)))
        assert not same(solo_a, solo_b), "the two images must give different answers for this test to mean anything"
        flush(c)
        after_a, _ = answer(c.post("/v1/chat/completions", json=chat_body(A)))
        b_after_a, cached = answer(c.post("/v1/chat/completions", json=chat_body(B)))
    assert same(after_a, solo_a)
    assert same(b_after_a, solo_b)
    # only the text before the image (<bos><start_of_turn>user\n<start_of_image>) may be shared
    assert cached <= 5


def test_same_image_twice_reuses_its_prefill(server):
    with server.client() as c:
        flush(c)
        first, cached0 = answer(c.post("/v1/chat/completions", json=chat_body(A)))
        again, cached1 = answer(c.post("/v1/chat/completions", json=chat_body(A)))
        # a follow-up question on the same image: its prefix (image included) is reused
        other, cached2 = answer(c.post("/v1/chat/completions", json=chat_body(A, "And the title?")))
        flush(c)
        other_cold, _ = answer(c.post("/v1/chat/completions", json=chat_body(A, "And the title?")))
    assert cached0 == 0
    assert same(again, first) and cached1 > 16
    assert cached2 > 16 and same(other, other_cold)


def test_image_and_text_requests_together_equal_their_solo_runs(server):
    bodies = [chat_body(A), chat_body(B), chat_body(A, "Read this form."),
              {"model": "vlm", "temperature": 0, "max_tokens": 6, "logprobs": True,
               "messages": [{"role": "user", "content": "Just text, no image."}]},
              {"model": "chat", "temperature": 0, "max_tokens": 6, "logprobs": True,
               "messages": [{"role": "user", "content": "A text model beside them."}]}]
    solos = []
    with server.client() as c:
        for b in bodies:
            flush(c)
            solos.append(answer(c.post("/v1/chat/completions", json=b))[0])
        flush(c)

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            return await asyncio.gather(*(ac.post("/v1/chat/completions", json=b) for b in bodies))

    results = asyncio.run(together())
    for b, r, solo in zip(bodies, results, solos):
        assert same(answer(r)[0], solo), b["messages"][0]["content"]


def test_anthropic_image_block(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    raw = base64.b64encode(png(1)).decode()
    m = client.messages.create(model="vlm", max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": raw}},
            {"type": "text", "text": QUESTION}]}])
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 16  # (Anthropic counts cache reads apart)
    # the same image through the chat API gives the same answer
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**chat_body(A), "max_tokens": 6})
    assert r.json()["choices"][0]["message"]["content"] == "".join(b.text for b in m.content if b.type == "text")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}, {"type": "text", "text": "x"}]}])


def test_responses_input_image(server):
    client = server.openai()
    r = client.responses.create(model="vlm", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": A},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert r.status == "completed" or r.status == "incomplete"
    assert r.usage.input_tokens > 16
    with server.client() as c:
        chat = c.post("/v1/chat/completions", json={**chat_body(A), "max_tokens": 6}).json()
    assert r.output_text == chat["choices"][0]["message"]["content"]


def test_image_to_a_text_model_is_a_clear_400(server):
    import anthropic
    import openai

    client = server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="chat", messages=chat_body(A)["messages"], max_tokens=4)
    assert "does not accept images" in str(e.value)
    ac = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e2:
        ac.messages.create(model="chat", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}}]}])
    assert "does not accept images" in str(e2.value)


@pytest.mark.parametrize("url, status, code", [
    ("data:image/png;base64,not-base64-at-all!!", 400, "invalid_image"),
    ("data:image/png;base64," + base64.b64encode(b"this is not a picture").decode(), 400, "invalid_image"),
    ("data:image/png;base64," + base64.b64encode(png(3)[:60]).decode(), 400, "invalid_image"),  # truncated
    (data_url(png(4, size=(400, 300))), 413, "image_too_large"),  # 360 KB of noise > 300 KB
    (data_url(png(5, size=(2000, 1200), noise=False)), 400, "image_too_large"),  # 2.4 Mpixels > 2 M
    ("https://example.invalid/chart.png", 400, "image_url_not_allowed"),
    ("ftp://example.invalid/chart.png", 400, "invalid_image"),
])
def test_bad_images_are_refused_before_the_engine(server, url, status, code):
    engine = server.handle("vlm").engine
    admitted = engine.stats.admitted
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=chat_body(url))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == "messages.0.content.0.image_url"
    assert engine.stats.admitted == admitted
    assert len(server.handle("vlm").vision.table) == 0


def test_too_many_images(server):
    parts = [{"type": "image_url", "image_url": {"url": A}}] * 5 + [{"type": "text", "text": "compare"}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "vlm", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"


def test_models_list_kind(server):
    with server.client() as c:
        kinds = {m["id"]: m.get("kind") for m in c.get("/v1/models").json()["data"]}
    assert kinds["vlm"] == "vision" and kinds["chat"] == "text"


def test_ollama_chat_image_on_a_vision_model(server):
    image = base64.b64encode(png(1)).decode()
    msg = {"role": "user", "content": "What is in this picture?"}
    opts = {"num_predict": 3, "temperature": 0}
    with server.client() as c:
        flush(c)  # as cold as a server of its own: nothing of the earlier tests' prompts cached
        show = c.post("/api/show", json={"model": "vlm"}).json()
        assert "vision" in show["capabilities"]
        plain = c.post("/api/chat", json={"model": "vlm", "stream": False, "messages": [msg], "options": opts})
        pictured = c.post("/api/chat", json={"model": "vlm", "stream": False, "options": opts,
                                             "messages": [{**msg, "images": [image]}]})
        assert plain.status_code == 200 and pictured.status_code == 200, pictured.text
        assert pictured.json()["prompt_eval_count"] >= plain.json()["prompt_eval_count"] + 8  # the image's tokens
        bad = c.post("/api/chat", json={"model": "vlm", "stream": False, "messages": [{**msg, "images": ["%%%"]}]})
        assert bad.status_code == 400 and set(bad.json()) == {"error"}
        # a text model takes no images
        r = c.post("/api/chat", json={"model": "chat", "stream": False, "messages": [{**msg, "images": [image]}]})
        assert r.status_code == 400 and set(r.json()) == {"error"}
