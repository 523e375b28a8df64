"""Qwen's M-RoPE vision-language models in the shared batch: every answer is mlx-vlm's own.

Each tiny random-weight model (``mlx-gateway demo-model --arch qwen2_5_vl``, ``qwen3_vl``,
``qwen3_5_vl``: real Qwen tokenizer and Qwen2-VL processor files) is served beside a text
model, over real HTTP. Every greedy answer (tokens and log-probabilities) must equal
mlx-vlm's generation of that request alone (:mod:`vision_reference`): alone; beside other
image and text rows (images of different sizes, so each row's position delta differs: a
delta leaking into another row changes that row's answer); from the prefix cache (the
same image again); after a different image behind the same text; in a text-only turn
after an image turn; and through the Anthropic, Responses and Ollama APIs.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[test]')")

from conftest import live_server, model_path  # noqa: E402
from test_vision import data_url, png  # noqa: E402
from vision_reference import reference  # noqa: E402

from gateway.models.spec import ModelSpec  # noqa: E402

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vl")
QUESTION = "What does this chart say?"
N = 8  # tokens per answer
TOLERANCE = 1e-3  # |logprob difference| allowed between the gateway and mlx-vlm (float32, other kernels)
# Images of three sizes: grids of 4x5, 6x3 and 3x7 image tokens, so three position deltas
RAW = {"A": png(1), "B": png(2, size=(48, 96)), "C": png(3, size=(160, 64))}
IMAGE_PAD = 151655  # <|image_pad|>, the processor's placeholder of one image token
URL = {k: data_url(v) for k, v in RAW.items()}


@pytest.fixture(scope="module", params=ARCHS)
def served(request):
    """``(server, model dir)`` of one tiny Qwen VL model served as ``vlm`` beside ``chat``."""
    vlm, text = model_path(request.param), model_path("qwen3")
    specs = [ModelSpec(name="vlm", path=str(vlm), pin=True, preload=True),
             ModelSpec(name="chat", path=str(text), pin=True, preload=True)]
    with live_server(vlm, specs=specs, max_image_bytes=300_000, max_image_pixels=2_000_000, max_images=4) as srv:
        yield srv, vlm


def user(image: str | None = None, question: str = QUESTION) -> dict:
    """A user message: ``image`` (a key of :data:`URL`) then ``question``; text only without one."""
    if image is None:
        return {"role": "user", "content": question}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL[image]}},
                                        {"type": "text", "text": question}]}


def body(messages: list[dict], model: str = "vlm") -> dict:
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": N, "logprobs": True}


def check(r: httpx.Response, ref) -> int:
    """Assert that a chat answer is ``ref`` (mlx-vlm's), token by token; its cached prompt tokens."""
    assert r.status_code == 200, r.text
    out = r.json()
    entries = out["choices"][0]["logprobs"]["content"]
    got = [bytes(e["bytes"]) for e in entries]
    assert got == list(ref.shown), f"gateway {got} != mlx-vlm {list(ref.shown)}"
    diffs = [abs(e["logprob"] - lp) for e, lp in zip(entries, ref.logprobs)]
    assert max(diffs, default=0) <= TOLERANCE, diffs
    assert out["choices"][0]["finish_reason"] == ref.finish
    assert out["usage"]["prompt_tokens"] == len(ref.prompt_ids)
    return out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def flush(c: httpx.Client) -> None:
    assert c.post("/admin/cache/flush").status_code == 200


def same_text(got: str, ref) -> bool:
    """Whether an API's text is the reference's (a partial character at the end and the
    leading whitespace the gateway drops from an answer's first piece aside)."""
    return got.rstrip("\ufffd").lstrip() == ref.text.rstrip("\ufffd").lstrip()


def test_alone(served):
    srv, model = served
    with srv.client() as c:
        for messages in ([user("A")], [user("B")], [user(None, "Just text, no image.")]):
            flush(c)
            check(c.post("/v1/chat/completions", json=body(messages)), reference(model, messages, N))


def test_five_image_and_text_requests_at_once(served):
    srv, model = served
    chats = [[user("A")], [user("B", "Read this form.")], [user(None, "Just text, no image.")],
             [user("C")], [user(None, "A longer question without any picture at all, to prefill beside them.")]]
    refs = [reference(model, m, N) for m in chats]
    text_body = body([user(None, "A text model beside them.")], model="chat")
    with srv.client() as c:
        flush(c)
        text_solo = c.post("/v1/chat/completions", json=text_body).json()["choices"][0]["logprobs"]["content"]
        flush(c)

    async def together():
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
            return await asyncio.gather(*(ac.post("/v1/chat/completions", json=b)
                                          for b in [*map(body, chats), text_body]))

    *answers, text_r = asyncio.run(together())
    for messages, r, ref in zip(chats, answers, refs):
        check(r, ref)
    got = text_r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in text_solo]


def test_same_image_again_from_the_cache(served):
    srv, model = served
    ref = reference(model, [user("A")], N)
    other = [user("A", "And the title?")]
    with srv.client() as c:
        flush(c)
        # (not asserted cold: an earlier test's next-turn precompute may land after the flush)
        check(c.post("/v1/chat/completions", json=body([user("A")])), ref)
        cached = check(c.post("/v1/chat/completions", json=body([user("A")])), ref)
        image_end = max(i for i, t in enumerate(ref.prompt_ids) if t == IMAGE_PAD) + 1
        assert cached >= image_end  # the text before the image and the image at least
        # a new question behind the same image reuses its prefill, and answers as mlx-vlm does
        assert check(c.post("/v1/chat/completions", json=body(other)), reference(model, other, N)) >= image_end


def test_a_different_image_behind_the_same_text(served):
    """Fails if the cache key ignored the pixels (B after A would reuse A's KV), or if B's
    rows took A's position delta (A and B have the same grid here)."""
    srv, model = served
    b_same_grid = [{"role": "user", "content": [
        {"type": "image", "data": png(7)}, {"type": "text", "text": QUESTION}]}]
    ref_a, ref_b = reference(model, [user("A")], N), reference(model, b_same_grid, N)
    assert ref_a.tokens != ref_b.tokens, "the two images must give different answers for this test to mean anything"
    b_body = body([user("A")])
    b_body["messages"][0]["content"][0]["image_url"]["url"] = data_url(png(7))
    with srv.client() as c:
        flush(c)
        check(c.post("/v1/chat/completions", json=body([user("A")])), ref_a)
        cached = check(c.post("/v1/chat/completions", json=b_body), ref_b)
        # the second image, of another size, after A: other positions after it
        c_ref = reference(model, [user("C")], N)
        check(c.post("/v1/chat/completions", json=body([user("C")])), c_ref)
    # only the text before the image (system turn, "<|im_start|>user\n<|vision_start|>") may be shared
    assert cached <= ref_a.prompt_ids.index(IMAGE_PAD)


def test_text_follow_up_after_an_image_turn(served):
    srv, model = served
    first = [user("B")]
    with srv.client() as c:
        flush(c)
        r = c.post("/v1/chat/completions", json=body(first))
        check(r, reference(model, first, N))
        said = r.json()["choices"][0]["message"]["content"]
        follow = [*first, {"role": "assistant", "content": said}, user(None, "And what colour is it?")]
        ref = reference(model, follow, N)
        cached = check(c.post("/v1/chat/completions", json=body(follow)), ref)
        assert cached > max(i for i, t in enumerate(ref.prompt_ids) if t == IMAGE_PAD)  # the image came from the cache
        flush(c)
        check(c.post("/v1/chat/completions", json=body(follow)), ref)


def test_anthropic_image_block(served):
    srv, model = served
    ref = reference(model, [user("A")], N)
    raw = base64.b64encode(RAW["A"]).decode()
    with srv.client() as c:
        flush(c)
        r = c.post("/v1/messages", headers={"anthropic-version": "2023-06-01"}, json={
            "model": "vlm", "max_tokens": N, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": raw}},
                {"type": "text", "text": QUESTION}]}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert same_text("".join(b["text"] for b in out["content"] if b["type"] == "text"), ref), (out, ref.text)
    use = out["usage"]
    assert use["input_tokens"] + use.get("cache_read_input_tokens", 0) == len(ref.prompt_ids)


def test_responses_input_image(served):
    srv, model = served
    ref = reference(model, [user("C")], N)
    with srv.client() as c:
        flush(c)
        r = c.post("/v1/responses", json={"model": "vlm", "max_output_tokens": N, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": URL["C"]},
                                         {"type": "input_text", "text": QUESTION}]}]})
    assert r.status_code == 200, r.text
    out = r.json()
    text = "".join(p["text"] for item in out["output"] if item["type"] == "message"
                   for p in item["content"] if p["type"] == "output_text")
    assert same_text(text, ref), (text, ref.text)
    assert out["usage"]["input_tokens"] == len(ref.prompt_ids)


def test_ollama_images(served):
    srv, model = served
    ref = reference(model, [user("B")], N)  # Ollama's images go before the message's text
    with srv.client() as c:
        flush(c)
        r = c.post("/api/chat", json={"model": "vlm", "stream": False, "options": {"num_predict": N, "temperature": 0},
                                      "messages": [{"role": "user", "content": QUESTION,
                                                    "images": [base64.b64encode(RAW["B"]).decode()]}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert same_text(out["message"]["content"], ref), (out, ref.text)
    assert out["prompt_eval_count"] == len(ref.prompt_ids)


@pytest.fixture(scope="module", params=ARCHS)
def chunked(request):
    """``(server, model dir, prefill step)`` of one tiny Qwen VL model whose prefill chunks end right after
    image A's last token (and so one token before the end of image C, a token longer)."""
    vlm = model_path(request.param)
    ids = reference(vlm, [user("A")], N).prompt_ids
    step = max(i for i, t in enumerate(ids) if t == IMAGE_PAD) + 1
    specs = [ModelSpec(name="vlm", path=str(vlm), pin=True, preload=True)]
    with live_server(vlm, specs=specs, prefill_step_size=step, max_image_bytes=300_000,
                     max_image_pixels=2_000_000) as srv:
        yield srv, vlm, step


def test_a_prefill_chunk_boundary_just_after_and_inside_an_image(chunked):
    srv, model, step = chunked
    chats = [[user("A")], [user("C")], [user(None, "Just text, no image.")]]
    refs = [reference(model, m, N) for m in chats]
    pads = [i for i, t in enumerate(refs[1].prompt_ids) if t == IMAGE_PAD]
    assert pads[0] < step == pads[-1]  # a boundary inside C's image
    with srv.client() as c:
        for messages, ref in zip(chats, refs):
            flush(c)
            check(c.post("/v1/chat/completions", json=body(messages)), ref)
        flush(c)

    async def together():
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
            return await asyncio.gather(*(ac.post("/v1/chat/completions", json=body(m)) for m in chats))

    for r, ref in zip(asyncio.run(together()), refs):
        check(r, ref)
