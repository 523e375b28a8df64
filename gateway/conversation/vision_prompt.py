"""A chat with images as prompt tokens for a vision-language model (worker thread).

The conversation is rendered by the model's chat template with each image as a
``{"type": "image"}`` content part where it sat in the turn (its
:data:`~gateway.conversation.form.IMAGE_MARK`), as Hugging Face's multimodal templates
expect. mlx-vlm's processor then does what the model needs: it preprocesses the images
(resize, rescale, normalize) and expands each image's marker into the model's run of
placeholder tokens (Gemma 3: ``<start_of_image>`` + 256 ``<image_soft_token>`` +
``<end_of_image>``), and tokenizes. Each run of placeholders becomes the image's own token
ids, derived from its preprocessed pixels (:func:`gateway.models.vision_images.image_ids`): the
prefix cache then keys the image's positions by its content.

Checkpoints are the periodic ones of long prompts and one right after each image, so a
follow-up question about the same image (new text after it) restores its prefill even
on a model whose cache cannot be trimmed.
"""

from __future__ import annotations

import numpy as np

from gateway.conversation.checkpoints import plan_completion_checkpoints
from gateway.conversation.templates import render_text
from gateway.conversation.form import IMAGE_MARK, Conversation
from gateway.conversation.prompts import Prompt
from gateway.conversation.tools import ToolPlan, template_messages
from gateway.http.errors import APIError
from gateway.models.vision_images import ImageInput, VisionModel, image_ids, pixel_digest


def with_image_parts(messages: list[dict]) -> list[dict]:
    """Template messages whose text holds image marks, with their content as a list of
    ``text`` and ``image`` parts."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and IMAGE_MARK in content:
            parts = []
            for k, piece in enumerate(content.split(IMAGE_MARK)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
        out.append(m)
    return out


def image_runs(ids: list[int], placeholder: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of ``placeholder`` tokens in ``ids``."""
    runs, start = [], None
    for i, t in enumerate(ids):
        if t == placeholder and start is None:
            start = i
        elif t != placeholder and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def render_vision_chat(tokenizer, vision: VisionModel, conv: Conversation, images: list, template_args: dict,
                       checkpoint_every: int, plan: ToolPlan | None = None) -> Prompt:
    """Render, preprocess and tokenize a conversation with ``images`` (Pillow images, in
    the order of the turns' marks); see the module docstring.

    Raises:
        APIError: 400 when the template rejects the conversation, or the processor does
            not give one run of placeholders per image.
    """
    prefill = conv.continue_final and bool(conv.turns) and conv.turns[-1].role == "assistant" \
        and bool(conv.turns[-1].text)
    messages = with_image_parts(template_messages(conv.turns, plan))
    kwargs = {**template_args, **conv.template_kwargs}
    if plan is not None and plan.in_template:
        kwargs["tools"] = plan.tools
    try:
        text = render_text(tokenizer, messages, not prefill, kwargs)
    except Exception as e:
        raise APIError(400, f"the chat template rejected the conversation: {e}", param="messages")
    if prefill:
        last = conv.turns[-1].text.replace(IMAGE_MARK, "")
        at = text.rfind(last)
        if at < 0:
            raise APIError(400, "the chat template does not show the last assistant message as given, so it "
                           "cannot be continued", param="messages")
        text = text[: at + len(last)]
    with vision.lock:  # a processor keeps state between calls in some families
        try:
            out = vision.processor(text=[text], images=images, add_special_tokens=False)
        except Exception as e:
            raise APIError(400, f"the model's processor refused the images: {e}", param="messages")
        ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1).tolist()]
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = out.get("image_grid_thw") if hasattr(out, "get") else None
    runs = image_runs(ids, vision.image_token_id)
    if grids is not None:  # Qwen: one [t*h*w, patch values] block per image, by its grid
        grids = [tuple(int(x) for x in g) for g in np.asarray(grids).reshape(-1, 3)]
        ends = np.cumsum([0] + [t * h * w for t, h, w in grids])
        pixels = [pixels[a:b] for a, b in zip(ends[:-1], ends[1:])] if ends[-1] == len(pixels) else []
    if len(runs) != len(images) or len(pixels) != len(images):
        raise APIError(400, f"the chat template and processor placed {len(runs)} images for the "
                       f"{len(images)} given (this model's template may not show images in every role)",
                       param="messages", code="invalid_image")
    tokens = list(ids)
    inputs = []
    for k, ((a, b), px, img) in enumerate(zip(runs, pixels, images)):
        grid = grids[k] if grids is not None else ()
        digest = pixel_digest(px, grid)
        im = ImageInput(px, digest, tuple(image_ids(digest, b - a)), tuple(img.size), grid)
        tokens[a:b] = im.ids
        inputs.append(im)
    if not tokens or tokens[-1] >= 1 << 31:
        raise APIError(400, "the prompt must not end with an image", param="messages")
    marks = set(plan_completion_checkpoints(tokens, interval=checkpoint_every))
    marks |= {b for _, b in runs if 0 < b < len(tokens)}
    prompt = Prompt(tokens, sorted(marks), False, None, kwargs)
    prompt.images = inputs
    return prompt
