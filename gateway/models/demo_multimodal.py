"""Tiny random-weight vision-language and embedding models of real architectures.

The counterpart of :mod:`gateway.models.demo_model` for the models mlx-vlm and
mlx-embeddings load: a directory with ``config.json``, ``model.safetensors`` (float32
random weights, named as the real checkpoints name them) and the real tokenizer files
of the family (copied from a tokenizer directory such as the test fixtures), plus the
files a real checkpoint ships beside them:

* ``gemma3`` (a Gemma 3 vision-language model: SigLIP vision tower, projector, Gemma 3
  text model), loaded by ``mlx_vlm``: ``preprocessor_config.json`` and
  ``processor_config.json`` with the fields of google/gemma-3-4b-it's, with the image
  size and image tokens of the tiny vision tower (224 pixels and 16 tokens instead of
  896 and 256: the real size takes seconds per image on a CPU);
* ``qwen3_embedding`` (a Qwen3-Embedding model: Qwen3 with last-token pooling), loaded
  by ``mlx_embeddings``: the sentence-transformers files ``modules.json``,
  ``config_sentence_transformers.json`` and ``1_Pooling/config.json`` of
  Qwen/Qwen3-Embedding-0.6B.

The weights are random: answers are random text and vectors carry no meaning.
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.models.demo_qwen_vl import IMAGE_PAD, QWEN_VL_CONFIGS, QWEN_VL_TOKENIZER_NEEDS

VISION_CONFIGS: dict[str, dict] = {
    "gemma3": {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "mm_tokens_per_image": 16,
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16,
            "sliding_window": 64, "sliding_window_pattern": 2, "max_position_embeddings": 32768,
            "mm_tokens_per_image": 16,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 32, "image_size": 224, "intermediate_size": 64,
            "num_attention_heads": 2, "num_hidden_layers": 2, "patch_size": 14, "vision_use_head": False,
        },
    },
}

# What a vision architecture needs of its tokenizer: the family, and the image token its
# config names (``image_token_index``), which the project's own tokenizer and other
# families lack; and the embedding rows mlx-lm's text model takes (its gemma3 ``ModelArgs``
# has ``vocab_size`` 262208 and no other).
TOKENIZER_NEEDS: dict[str, tuple[str, str, int | None]] = {"gemma3": ("Gemma 3", "<image_soft_token>", 262208),
                                                            **QWEN_VL_TOKENIZER_NEEDS}


class TokenizerNeeded(ValueError):
    """An architecture that needs a tokenizer of its own family was given none, or
    another one (the message says which; ``mlx-gateway demo-model --tokenizer DIR``)."""


def check_tokenizer(arch: str, tokenizer_json, vocab: int) -> None:
    """Check that the tokenizer at ``tokenizer_json`` (a ``tokenizer.json`` path; None:
    the project's own) and ``vocab`` embedding rows make a model of ``arch`` that loads.

    Raises:
        TokenizerNeeded: no tokenizer, or one without the architecture's image token at
            the id its config names, or other embedding rows than the architecture takes.
    """
    if arch not in TOKENIZER_NEEDS:
        return
    family, token, rows = TOKENIZER_NEEDS[arch]
    want = VISION_CONFIGS[arch]["image_token_index"] if arch in VISION_CONFIGS else IMAGE_PAD
    if tokenizer_json is None:
        raise TokenizerNeeded(f"--arch {arch} needs a {family} tokenizer (its image token {token} is id {want}): "
                              f"give a directory holding its tokenizer.json and tokenizer_config.json with "
                              f"--tokenizer DIR")
    from tokenizers import Tokenizer

    got = Tokenizer.from_file(str(tokenizer_json)).token_to_id(token)
    if got != want:
        raise TokenizerNeeded(f"--arch {arch} needs a {family} tokenizer: the one given has "
                              f"{'no ' + token if got is None else f'{token} at id {got}'}, its config wants id {want}")
    if rows is not None and vocab != rows:
        raise TokenizerNeeded(f"--arch {arch} takes {rows} embedding rows (mlx-lm's {arch} model reads no other), "
                              f"not --vocab-size {vocab}")


EMBEDDING_CONFIGS: dict[str, dict] = {
    "qwen3_embedding": {
        "architectures": ["Qwen3Model"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}


def _gemma3_processor_files(path: Path, config: dict) -> None:
    """google/gemma-3-4b-it's processor files, sized for ``config``'s vision tower."""
    size = config["vision_config"]["image_size"]
    tokens = config["mm_tokens_per_image"]
    pre = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
           "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
           "image_seq_length": tokens, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
           "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
           "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
           "size": {"height": size, "width": size}}
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": tokens,
                                                            "processor_class": "Gemma3Processor"}, indent=2))


def _qwen3_embedding_files(path: Path) -> None:
    """Qwen/Qwen3-Embedding-0.6B's sentence-transformers files (last-token pooling)."""
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2))
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
                             "query\nQuery:", "document": ""},
        "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 1024, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True},
        indent=2))


def write_multimodal(tmp: Path, arch: str, vocab: int, overrides: dict) -> None:
    """Write the config, random weights and side files of ``arch`` (a key of
    :data:`VISION_CONFIGS`, :data:`EMBEDDING_CONFIGS` or
    :data:`gateway.models.demo_qwen_vl.QWEN_VL_CONFIGS`) into ``tmp``, whose tokenizer
    files are already there.

    Raises:
        ImportError: mlx-vlm (vision) or mlx-embeddings (embedding) is not installed.
    """
    import mlx.core as mx
    import mlx.utils

    if arch in QWEN_VL_CONFIGS:
        from gateway.models.demo_qwen_vl import write_qwen_vl

        return write_qwen_vl(tmp, arch, vocab, overrides)
    if arch in VISION_CONFIGS:
        from mlx_vlm.models.gemma3 import Model, ModelConfig
        from mlx_vlm.models.gemma3.config import TextConfig, VisionConfig

        config = json.loads(json.dumps(VISION_CONFIGS[arch]))
        config.update(overrides)
        config["text_config"]["vocab_size"] = vocab
        mc = ModelConfig.from_dict(config)
        mc.text_config = TextConfig.from_dict(config["text_config"])
        mc.vision_config = VisionConfig.from_dict(config["vision_config"])
        model = Model(mc)
        _gemma3_processor_files(tmp, config)
        # Gemma 3 ties its output to its input embedding: real checkpoints have no lm_head
        skip = {"language_model.lm_head.weight"}
    else:
        from mlx_embeddings.models import qwen3

        config = dict(EMBEDDING_CONFIGS[arch], **overrides, vocab_size=vocab)
        model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
        _qwen3_embedding_files(tmp)
        skip = set()
    params = {k: v for k, v in mlx.utils.tree_flatten(model.parameters()) if k not in skip}
    params = {k: (mx.random.normal(v.shape) * v.shape[-1] ** -0.5 if v.ndim > 1 else v).astype(mx.float32)
              for k, v in params.items()}
    mx.save_safetensors(str(tmp / "model.safetensors"), params)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
