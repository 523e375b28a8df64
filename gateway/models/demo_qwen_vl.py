"""Tiny random-weight Qwen vision-language models (M-RoPE): Qwen2.5-VL, Qwen3-VL, Qwen3.5.

The Qwen counterpart of the Gemma 3 builder in :mod:`gateway.models.demo_multimodal`, for
the models whose language model places image tokens on a 3-D (temporal, height, width)
position grid (M-RoPE, Qwen2-VL's "multimodal rotary position embedding"). A directory
holds ``config.json`` (the layout of the real checkpoints' configs: Qwen/Qwen2.5-VL-3B-Instruct,
Qwen/Qwen3-VL-2B-Instruct and Qwen/Qwen3.5's, with a few layers and small widths),
``model.safetensors`` (float32 random weights under mlx-vlm's parameter names, as the
converted mlx-community checkpoints name them), the Qwen tokenizer files copied from a
tokenizer directory (Qwen3's has the vision tokens ``<|vision_start|>``, ``<|image_pad|>``,
``<|vision_end|>`` at the ids the configs name), a chat template that places each image as
``<|vision_start|><|image_pad|><|vision_end|>`` (in ``tokenizer_config.json`` and
``chat_template.json``, as the real checkpoints ship it), and the processor files:

* ``preprocessor_config.json`` / ``video_preprocessor_config.json``: the fields of the
  real Qwen2-VL image processor (patch 14 for Qwen2.5-VL, 16 for Qwen3-VL and Qwen3.5;
  temporal patch 2; spatial merge 2), with small pixel bounds so that an image takes
  16 to 64 tokens (``min_pixels`` = 16 merged patches, ``max_pixels`` = 64: the real bounds
  give thousands, seconds per image on a CPU);
* ``processor_config.json``: the processor class.

mlx-vlm loads the directory (``mlx_vlm.load``): its processor expands each
``<|image_pad|>`` into one token per merged 2x2 patch. The weights are random: answers
are random text.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD = 151655, 151652, 151653, 151656  # Qwen2-VL .. Qwen3 tokenizers
_VISION_IDS = {"image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD, "vision_start_token_id": VISION_START,
               "vision_end_token_id": VISION_END}
_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>

QWEN_VL_CONFIGS: dict[str, dict] = {
    "qwen2_5_vl": {  # Qwen2.5-VL: text fields at the top level; windowed vision attention
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **_VISION_IDS,
        "vision_token_id": 151654, "eos_token_id": _EOS[0], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2 (16 / 2)
        "vision_config": {
            "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
            "num_heads": 2, "out_hidden_size": 64, "patch_size": 14, "spatial_patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
            "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_channels": 3,
        },
    },
    "qwen3_vl": {  # Qwen3-VL: deepstack (vision features added into the first decoder layers)
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", **_VISION_IDS,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768, "rope_theta": 5000000.0, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [4, 2, 2]},
            "eos_token_id": _EOS[0],
        },
        "vision_config": {
            "model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1], "in_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
        },
    },
    "qwen3_5_vl": {  # Qwen3.5 with its vision tower: hybrid Gated DeltaNet / attention layers, partial M-RoPE
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", **_VISION_IDS,
        "eos_token_id": _EOS, "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2, "tie_word_embeddings": True, "eos_token_id": _EOS,
            "rope_parameters": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [2, 1, 1],
                                "rope_theta": 10000000, "partial_rotary_factor": 0.25},  # 8 of 32 dims rotate
        },
        "vision_config": {
            "model_type": "qwen3_5", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 256, "deepstack_visual_indexes": [], "in_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
        },
    },
}

# What each needs of its tokenizer (see gemma3's in demo_multimodal.TOKENIZER_NEEDS): the
# family, the image token; any number of embedding rows (mlx-vlm reads vocab_size).
QWEN_VL_TOKENIZER_NEEDS = {arch: ("Qwen (e.g. Qwen3's)", "<|image_pad|>", None) for arch in QWEN_VL_CONFIGS}

# Qwen2-VL-style ChatML: a default system turn; each image part (``{"type": "image"}``, or
# one with an ``image``/``image_url`` key) is <|vision_start|><|image_pad|><|vision_end|>,
# which the processor expands into the image's tokens; text parts are joined in order.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _processor_files(path: Path, config: dict) -> None:
    """The Qwen2-VL image processor's files, with pixel bounds of 16 to 64 image tokens."""
    vc = config["vision_config"]
    patch, merge, temporal = vc["patch_size"], vc["spatial_merge_size"], vc["temporal_patch_size"]
    unit = (patch * merge) ** 2  # pixels per image token
    qwen3 = config["model_type"] != "qwen2_5_vl"
    common = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5] if qwen3 else [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.5, 0.5, 0.5] if qwen3 else [0.26862954, 0.26130258, 0.27577711],
        "merge_size": merge, "patch_size": patch, "temporal_patch_size": temporal, "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 16 * unit, "longest_edge": 64 * unit},
        "processor_class": "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor",
    }
    pre = {**common, "image_processor_type": "Qwen2VLImageProcessorFast" if qwen3 else "Qwen2VLImageProcessor"}
    if not qwen3:
        pre.update(min_pixels=16 * unit, max_pixels=64 * unit)
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    video = {**common, "video_processor_type": "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
             "fps": 2.0, "min_frames": 4, "max_frames": 8}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": common["processor_class"]}, indent=2))


def _chat_template_files(path: Path) -> None:
    """The image-placing chat template, where the tokenizer and the processor read it."""
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))
    (path / "chat_template.jinja").unlink(missing_ok=True)


def _model(arch: str, config: dict):
    """mlx-vlm's model of ``arch`` for ``config`` (random initial weights)."""
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    conf = importlib.import_module(f"mlx_vlm.models.{config['model_type']}.config")
    mc = conf.ModelConfig.from_dict(json.loads(json.dumps(config)))
    if isinstance(mc.text_config, dict):
        mc.text_config = conf.TextConfig.from_dict(mc.text_config)
    if isinstance(mc.vision_config, dict):
        mc.vision_config = conf.VisionConfig.from_dict(mc.vision_config)
    return module.Model(mc)


def write_qwen_vl(tmp: Path, arch: str, vocab: int, overrides: dict) -> None:
    """Write the config, random weights, chat template and processor files of ``arch`` (a
    key of :data:`QWEN_VL_CONFIGS`) into ``tmp``, whose tokenizer files are already there.

    Args:
        vocab: the embedding rows (at least the tokenizer's size).
        overrides: top-level config entries replacing the defaults.

    Raises:
        ImportError: mlx-vlm is not installed.
    """
    import mlx.core as mx
    import mlx.utils

    config = json.loads(json.dumps(QWEN_VL_CONFIGS[arch]))
    config.update(overrides)
    config["vocab_size"] = vocab
    if "text_config" in config:
        config["text_config"]["vocab_size"] = vocab
    model = _model(arch, config)
    # tied output embedding (tie_word_embeddings): real checkpoints of these sizes have no lm_head
    params = {k: v for k, v in mlx.utils.tree_flatten(model.parameters()) if not k.endswith("lm_head.weight")}
    # Matrices ~ N(0, 1/fan_in) as in demo_model; vectors (norms, biases) keep their initial values.
    params = {k: (mx.random.normal(v.shape) * v.shape[-1] ** -0.5 if v.ndim > 1 else v).astype(mx.float32)
              for k, v in params.items()}
    mx.save_safetensors(str(tmp / "model.safetensors"), params)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _processor_files(tmp, config)
    _chat_template_files(tmp)
    gen = tmp / "generation_config.json"
    g = json.loads(gen.read_text()) if gen.exists() else {}
    g.update(eos_token_id=_EOS, pad_token_id=_EOS[1])
    gen.write_text(json.dumps(g, indent=2))
