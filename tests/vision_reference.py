"""mlx-vlm's own greedy generation of one chat request alone: the reference a served
vision-language model's answers are held to.

:func:`reference` takes a model directory, a chat (OpenAI chat messages; images as
``image_url`` parts holding ``data:`` URLs, or raw PNG/JPEG bytes as ``{"type": "image",
"data": bytes}``) and ``max_tokens``, renders the chat as the gateway renders it (the
model's chat template on ``{"type": "image"}`` parts where the images sit, mlx-lm's
tokenizer of the directory, the served models' default ``enable_thinking=False``), has
mlx-vlm's processor expand each image into its placeholder tokens, and runs
``mlx_vlm.stream_generate`` at temperature 0 on those tensors, with nothing cached (a
fresh model state per call, no prompt cache). It checks first that the prompt token ids
mlx-vlm generates from are the ones the gateway's own rendering functions give
(:func:`gateway_prompt_ids`), so a difference in the answers is the serving path's.

A result holds the greedy tokens, their log-probabilities (natural log, of the full
softmax), the text, and each token as the gateway's chat ``logprobs`` entries show it
(:func:`shown_bytes`), so a test compares answers entry by entry.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_lock = threading.Lock()
_models: dict[str, tuple] = {}  # model dir -> (model, processor, gateway tokenizer)
_answers: dict[str, "Reference"] = {}


@dataclass(frozen=True)
class Reference:
    """mlx-vlm's greedy answer to one chat.

    Attributes:
        prompt_ids: the prompt mlx-vlm generated from (placeholders expanded).
        tokens: the answer's token ids; a closing end token is not included.
        logprobs: each token's log-probability (natural log).
        text: the tokens decoded together.
        finish: ``"stop"`` (an end token came) or ``"length"`` (``max_tokens`` tokens).
        shown: each token as the gateway's chat logprobs ``bytes`` field shows it.
    """

    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish: str
    shown: tuple[bytes, ...]


def _loaded(model_dir) -> tuple:
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm import load

    key = str(Path(model_dir).resolve())
    if key not in _models:
        config = json.loads((Path(key) / "config.json").read_text())
        model, processor = load(key)
        tokenizer = load_tokenizer(Path(key), eos_token_ids=config.get("eos_token_id", None))
        _models[key] = (model, processor, tokenizer)
    return _models[key]


def decode_image(raw: bytes):
    """An image's bytes as the RGB Pillow image the gateway decodes them into."""
    from PIL import Image

    img = Image.open(io.BytesIO(raw))
    img.load()
    return img.convert("RGB")


def _image_bytes(part: dict) -> bytes:
    if part.get("type") == "image":
        return part["data"]
    url = part["image_url"]
    url = url["url"] if isinstance(url, dict) else url
    head, _, payload = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError(f"only base64 data: URLs are taken here, not {head[:40]!r}")
    return base64.b64decode(payload)


def split_chat(messages: list[dict]) -> tuple[list[dict], list]:
    """Chat messages as Hugging Face multimodal template messages (content a list of
    ``text`` and ``image`` parts where an image sits, a string otherwise), and the
    images in order (Pillow)."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") in ("image_url", "image"):
                    images.append(decode_image(_image_bytes(p)))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": p["text"]})
            content = parts if any(p["type"] == "image" for p in parts) else "".join(p["text"] for p in parts)
        out.append({"role": m["role"], "content": content if content is not None else ""})
    return out, images


def gateway_prompt_ids(model_dir, messages: list[dict], template_args: dict | None = None) -> list[int]:
    """The prompt token ids the gateway makes of ``messages`` for the model at
    ``model_dir``, before it replaces each image's placeholders by the image's own ids:
    its turns (:func:`gateway.conversation.form.join_parts`), template messages
    (:func:`gateway.conversation.tools.template_messages`, then
    :func:`gateway.conversation.vision_prompt.with_image_parts`), chat template
    (:func:`gateway.conversation.templates.render_text` on mlx-lm's tokenizer, with the
    served default ``enable_thinking=False``), and mlx-vlm's processor."""
    from gateway.conversation.form import ImageRef, Turn, join_parts
    from gateway.conversation.templates import render_text
    from gateway.conversation.tools import template_messages
    from gateway.conversation.vision_prompt import with_image_parts

    _, processor, tokenizer = _loaded(model_dir)
    turns, images = [], []
    for m in messages:
        content = m.get("content")
        parts = [content] if isinstance(content, str) else []
        for p in content if isinstance(content, list) else []:
            if p.get("type") in ("image_url", "image"):
                parts.append(ImageRef(param="messages"))
                images.append(decode_image(_image_bytes(p)))
            else:
                parts.append(p["text"])
        text, refs = join_parts(parts)
        turns.append(Turn(m["role"], text, images=refs))
    rendered = with_image_parts(template_messages(turns, None))
    text = render_text(tokenizer, rendered, True, {"enable_thinking": False, **(template_args or {})})
    out = processor(text=[text], images=images or None, add_special_tokens=False)
    return [int(t) for t in np.asarray(out["input_ids"]).reshape(-1).tolist()]


def shown_bytes(tokenizer, token: int) -> bytes:
    """``token`` as the bytes of the gateway's chat ``logprobs`` entry (``bytes``): its
    text, or its raw bytes when it decodes to part of a character."""
    from gateway.protocols.openai_format import token_bytes

    text = tokenizer.decode([token])
    if "\ufffd" in text:
        raw = token_bytes(tokenizer, token)
        if raw is not None:
            return raw
    return text.encode()


def _fresh(model) -> None:
    """Forget the position state a Qwen language model keeps between calls (its
    ``_rope_deltas`` / ``_position_ids``), so each request runs as if alone."""
    lm = getattr(model, "language_model", None)
    for name in ("_rope_deltas", "_position_ids"):
        if lm is not None and hasattr(lm, name):
            setattr(lm, name, None)


def reference(model_dir, messages: list[dict], max_tokens: int) -> Reference:
    """mlx-vlm's greedy answer to ``messages`` alone (see the module docstring); memoized
    per (model, chat, max_tokens).

    Raises:
        AssertionError: the prompt ids mlx-vlm would generate from differ from the
            gateway's (:func:`gateway_prompt_ids`).
    """
    import mlx.core as mx
    from mlx_vlm import stream_generate

    key = json.dumps([str(Path(model_dir).resolve()), _digestible(messages), max_tokens])
    with _lock:
        if key in _answers:
            return _answers[key]
        model, processor, tokenizer = _loaded(model_dir)
        hf_messages, images = split_chat(messages)
        # the processor's template (chat_template.json), else its tokenizer's
        templater = processor if getattr(processor, "chat_template", None) else processor.tokenizer
        text = templater.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
        # mlx-vlm's processor, called as the gateway calls it (mlx-vlm's prepare_inputs adds a
        # second <bos> to Gemma 3's rendered prompt; for Qwen it gives these same tensors)
        out = processor(text=[text], images=images or None, add_special_tokens=False)
        inputs = {k: mx.array(np.asarray(v)) for k, v in out.items() if v is not None}
        ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1).tolist()]
        want = gateway_prompt_ids(model_dir, messages)
        assert ids == want, f"mlx-vlm's prompt ({len(ids)} tokens) is not the gateway's ({len(want)})"
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        stop = set(tokenizer.eos_token_ids)
        _fresh(model)
        tokens, lps, finish = [], [], "length"
        for r in stream_generate(model, processor, text, input_ids=inputs["input_ids"],
                                 pixel_values=inputs.get("pixel_values"), mask=inputs.get("attention_mask"),
                                 max_tokens=max_tokens, temperature=0.0, **extra):
            if r.token in stop:
                finish = "stop"
                break
            tokens.append(int(r.token))
            lps.append(float(mx.array(r.logprobs).reshape(-1)[r.token].item()))
            if len(tokens) == max_tokens:
                break
        _fresh(model)
        ans = Reference(tuple(ids), tuple(tokens), tuple(lps), tokenizer.decode(tokens), finish,
                        tuple(shown_bytes(tokenizer, t) for t in tokens))
        _answers[key] = ans
        return ans


def _digestible(messages: list[dict]):
    """``messages`` with raw image bytes as their hex SHA-256 (a JSON-able memo key)."""
    import hashlib

    def fix(v):
        if isinstance(v, bytes):
            return hashlib.sha256(v).hexdigest()
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return fix(messages)
