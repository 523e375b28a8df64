"""Qwen2.5-VL and Qwen3-VL (M-RoPE: image tokens on a 3-D position grid) in the shared
batch, against mlx-vlm's own generation of each request alone (``mlx_vlm.stream_generate``,
same weights, same prompt text, same images): greedy tokens and their logprobs.

Each row keeps its own position delta (``gateway/models/vision_mrope.py``); these tests
fail if a row's delta is lost in a chunked prefill (a chunk boundary inside an image),
a restore from the prefix cache, a batch merge, or leaks into another row."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[test]')")

from conftest import live_server, model_path  # noqa: E402

from gateway.models.spec import ModelSpec  # noqa: E402

MAX_TOKENS = 8
ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_5_vl"]


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(raw).decode()


# Not square: the image tokens' height and width axes differ, so the delta is not 0
IMG_A, IMG_B = png(1, (96, 64)), png(2, (64, 112))


def user(text: str, *images: bytes) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def body(messages: list[dict], model: str = "vlm") -> dict:
    return {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True, "messages": messages}


class Reference:
    """mlx-vlm's own greedy generation of one conversation alone (its ``stream_generate``
    over the prompt the chat template renders)."""

    def __init__(self, path):
        from mlx_vlm import load

        self.model, self.processor = load(str(path))

    def __call__(self, messages: list[dict]) -> list[tuple[int, float]]:
        from mlx_vlm import stream_generate
        from PIL import Image

        images, rendered = [], []
        for m in messages:
            if isinstance(m["content"], str):
                rendered.append(m)
                continue
            parts = []
            for p in m["content"]:
                if p["type"] == "image_url":
                    import base64

                    raw = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
                    images.append(Image.open(io.BytesIO(raw)).convert("RGB"))
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            rendered.append({"role": m["role"], "content": parts})
        tok = self.processor.tokenizer if hasattr(self.processor, "tokenizer") else self.processor
        prompt = tok.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        out = []
        for r in stream_generate(self.model, self.processor, prompt, image=images or None, max_tokens=MAX_TOKENS,
                                 temperature=0.0):
            out.append((int(r.token), float(r.logprobs[r.token])))
            if len(out) == MAX_TOKENS:
                break
        self.model.language_model._rope_deltas = self.model.language_model._position_ids = None
        return out


def answer(r: httpx.Response) -> tuple[tuple, int]:
    """((answer text, its logprobs), cached prompt tokens) of a chat answer."""
    assert r.status_code == 200, r.text
    b = r.json()
    lp = [e["logprob"] for e in b["choices"][0]["logprobs"]["content"]]
    return (b["choices"][0]["message"]["content"], lp), b["usage"].get("prompt_tokens_details", {}).get(
        "cached_tokens", 0)


def same(got: tuple, want: list[tuple[int, float]], tokenizer) -> bool:
    """The gateway's ``(text, logprobs)`` is mlx-vlm's ``[(token id, logprob)]``: the text
    its tokens decode to (stops excluded), logprobs within 1e-3."""
    text, lps = got
    ids = [t for t, _ in want]
    eos = set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    ids = ids[: next((k for k, t in enumerate(ids) if t in eos), len(ids))]
    return text.strip() == tokenizer.decode(ids).strip() and len(lps) >= len(ids) and all(
        abs(a - b) < 1e-3 for a, (_, b) in zip(lps, want))


@pytest.fixture(scope="module", params=ARCHS)
def served(request):
    """(server, reference, tokenizer) for one architecture; prefill steps of 5 tokens, so
    every image (16+ tokens) is cut by chunk boundaries."""
    path = model_path(request.param)
    specs = [ModelSpec(name="vlm", path=str(path), pin=True, preload=True)]
    ref = Reference(path)
    tok = ref.processor.tokenizer
    with live_server(path, specs=specs, prefill_step_size=5, prefill_budget=0, max_image_bytes=300_000,
                     max_image_pixels=2_000_000, max_images=4) as srv:
        yield srv, ref, tok


def flush(c: httpx.Client) -> None:
    assert c.post("/admin/cache/flush").status_code == 200


def test_alone_and_chunked_inside_images(served):
    srv, ref, tok = served
    convs = [[user("What is this?", IMG_A)], [user("Compare them.", IMG_A, IMG_B)]]
    with srv.client() as c:
        for conv in convs:
            flush(c)
            got, cached = answer(c.post("/v1/chat/completions", json=body(conv)))
            assert cached == 0
            assert same(got, ref(conv), tok), conv[0]["content"][-1]


def test_five_at_once_each_equal_alone(served):
    """Rows with different deltas (two image sizes, two images, none) prefill in chunks and
    decode together: each equals its own reference, so no delta leaks into another row."""
    srv, ref, tok = served
    convs = [[user("What is this?", IMG_A)], [user("What is this?", IMG_B)], [user("Read it.", IMG_A, IMG_B)],
             [{"role": "user", "content": "Only text here."}], [user("Describe the picture in detail.", IMG_B)]]
    want = [ref(conv) for conv in convs]
    with srv.client() as c:
        flush(c)

    async def together():
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
            return await asyncio.gather(*(ac.post("/v1/chat/completions", json=body(conv)) for conv in convs))

    for k, (r, w) in enumerate(zip(asyncio.run(together()), want)):
        assert same(answer(r)[0], w, tok), k


def test_same_image_from_the_cache_and_another_behind_the_same_text(served):
    srv, ref, tok = served
    a, b = [user("What is this?", IMG_A)], [user("What is this?", IMG_B)]
    want_a, want_b = ref(a), ref(b)
    with srv.client() as c:
        flush(c)
        first, _ = answer(c.post("/v1/chat/completions", json=body(a)))
        again, cached = answer(c.post("/v1/chat/completions", json=body(a)))
        other, cached_b = answer(c.post("/v1/chat/completions", json=body(b)))
        follow = [user("And its colours?", IMG_A)]
        asked, cached_f = answer(c.post("/v1/chat/completions", json=body(follow)))
    assert cached > 16 and same(first, want_a, tok) and same(again, want_a, tok)
    assert cached_b < cached - 16 and same(other, want_b, tok)  # only the text before the image is shared
    assert cached_f > 16 and same(asked, ref(follow), tok)  # restored just after the image


def test_image_turn_then_a_text_follow_up(served):
    srv, ref, tok = served
    first = [user("What is this?", IMG_A)]
    with srv.client() as c:
        flush(c)
        r = c.post("/v1/chat/completions", json=body(first))
        said = answer(r)[0][0]
        convo = first + [{"role": "assistant", "content": said}, {"role": "user", "content": "Say more."}]
        got, cached = answer(c.post("/v1/chat/completions", json=body(convo)))
    assert cached > 16
    assert same(got, ref(convo), tok)


def test_anthropic_and_responses_images_answer_as_chat_does(served):
    import base64

    srv, ref, tok = served
    conv = [user("What is this?", IMG_A)]
    want = ref(conv)
    with srv.client() as c:
        r = c.post("/v1/messages", json={"model": "vlm", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": base64.b64encode(IMG_A).decode()}},
                {"type": "text", "text": "What is this?"}]}]})
        assert r.status_code == 200, r.text
        anthropic_text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
        r = c.post("/v1/responses", json={"model": "vlm", "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMG_A)},
                                         {"type": "input_text", "text": "What is this?"}]}]})
        assert r.status_code == 200, r.text
        responses_text = "".join(p["text"] for o in r.json()["output"] if o["type"] == "message"
                                 for p in o["content"] if p["type"] == "output_text")
    expected = tok.decode([t for t, _ in want if t not in tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])])
    assert anthropic_text.strip() == expected.strip() and responses_text.strip() == expected.strip()


def test_an_image_prefix_from_the_disk_tier(tmp_path):
    """A row restored from disk (a fresh server) keeps its positions layer: same answer."""
    path = model_path("qwen2_5_vl")
    ref, conv = Reference(path), [user("What is this?", IMG_A)]
    tok = ref.processor.tokenizer
    specs = [ModelSpec(name="vlm", path=str(path), pin=True, preload=True)]
    for k in range(2):
        with live_server(path, specs=specs, prompt_cache_dir=str(tmp_path / "pc"), prefill_step_size=5,
                         prefill_budget=0) as srv, srv.client() as c:
            got, cached = answer(c.post("/v1/chat/completions", json=body([user("What is this?", IMG_A)])))
        assert same(got, ref(conv), tok)
        assert (cached > 16) == (k == 1), cached
