"""The tiny Qwen vision-language models of ``mlx-gateway demo-model`` (qwen2_5_vl, qwen3_vl,
qwen3_5_vl) are real to mlx-vlm: it loads them, its processor expands an image into the
tokens its grid says, and its generation depends on the image."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[test]')")

from conftest import TOKENIZERS, model_path, require_tokenizers  # noqa: E402
from test_vision import png  # noqa: E402
from vision_reference import decode_image, reference  # noqa: E402

from gateway.models.demo_model import build_model_dir  # noqa: E402
from gateway.models.demo_multimodal import TokenizerNeeded  # noqa: E402

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vl")
IMAGE_PAD = 151655


def chat(raw: bytes, question: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "data": raw}, {"type": "text", "text": question}]}]


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_vlm_loads_and_generates(arch):
    from mlx_vlm import generate, load

    path = model_path(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == {"qwen3_5_vl": "qwen3_5"}.get(arch, arch)
    model, processor = load(str(path))
    image = decode_image(png(1))  # 64x48: a 4x5 grid of merged patches
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>" in text
    out = processor(text=[text], images=[image], add_special_tokens=False)
    ids = np.asarray(out["input_ids"]).reshape(-1).tolist()
    assert ids.count(IMAGE_PAD) == 20 and np.asarray(out["image_grid_thw"]).tolist() == [[1, 8, 10]]
    r = generate(model, processor, text, image=[image], max_tokens=4, temperature=0.0, verbose=False)
    assert r.generation_tokens == 4 and r.prompt_tokens == len(ids)
    # the answer depends on the image (the tests of the served models need that)
    a, b = reference(path, chat(png(1)), 6), reference(path, chat(png(7)), 6)
    assert a.tokens != b.tokens and len(a.tokens) == 6


def test_a_qwen_vl_model_needs_a_qwen_tokenizer(tmp_path):
    require_tokenizers("gemma3")
    with pytest.raises(TokenizerNeeded, match="<\\|image_pad\\|>"):
        build_model_dir(tmp_path / "none", "qwen3_vl")
    with pytest.raises(TokenizerNeeded, match="<\\|image_pad\\|>"):
        build_model_dir(tmp_path / "gemma", "qwen3_vl", tokenizer_dir=TOKENIZERS / "gemma3")
    assert list(tmp_path.iterdir()) == []
