"""Vision-language models: mlx-vlm's vision side on mlx-lm's text model, in the shared engine.

A vision-language checkpoint is loaded by mlx-vlm (PyPI ``mlx-vlm``, the ``[vision]``
extra): its model (vision tower, projector, language model) and its processor (image
preprocessing and the expansion of each image into its placeholder tokens). The engine
batches mlx-lm models with mlx-lm's caches (``BatchKVCache``, ``BatchRotatingKVCache``, the
restore rules of :mod:`cache`); mlx-vlm's language models keep caches of their own
classes. So the text side that the engine runs is mlx-lm's model of the same checkpoint
(``mlx_lm.models.<model_type>``, e.g. ``gemma3``, which mlx-lm loads as a text model),
holding *the same weight arrays* as mlx-vlm's language model (nothing is read twice).
A load-time probe checks that the two agree on a prompt with an image
(:func:`check_agreement`): a model for which they do not is refused.

Positions are 1-D (the image tokens take consecutive positions) on that path. Models
whose language model places image tokens on a 3-D grid (M-RoPE: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, :data:`MROPE_TYPES`) run mlx-vlm's own language model with each row's positions
kept in its cache (:mod:`gateway.models.vision_mrope`), Qwen3.5 (:data:`HYBRID_MROPE_TYPES`)
mlx-lm's hybrid text model with mlx-vlm's M-RoPE rotations; the other grid models
(:data:`GRID_POSITION_TYPES`) are refused at load, with the reason.

The image ids and the table of images in flight are in :mod:`gateway.models.vision_images`,
the model the engine calls in :mod:`gateway.models.vision_model`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from gateway.models.vision_images import ImageInput, ImageTable, VisionModel, image_ids, pixel_digest
from gateway.models.vision_model import VisionLanguageModel
from gateway.models.vision_mrope import HYBRID_MROPE_TYPES, MROPE_TYPES, MRopeModel

# Vision-language models refused at load, and why. Those of MROPE_TYPES are served
# (gateway.models.vision_mrope); these place image tokens on a position grid too.
_GRID = "places image tokens on a position grid by rules of its own, which the gateway's M-RoPE positions " \
        "(those of Qwen2-VL, Qwen2.5-VL and Qwen3-VL) do not reproduce"
GRID_POSITION_TYPES = {"qwen3_omni_moe": _GRID, "glm4v": _GRID, "glm4v_moe": _GRID, "ernie4_5_moe_vl": _GRID,
                       "paddleocr_vl": _GRID, "kimi_vl": _GRID}


class VisionUnavailable(RuntimeError):
    """mlx-vlm is not installed, or the model cannot be served with images (why is said)."""


def _text_class(config: dict):
    """mlx-lm's model class and arguments for the checkpoint's ``model_type``."""
    from compat.mlx_lm import get_classes

    return get_classes(config)


def load_vision_model(model_path: Path, config: dict):
    """Build the served model of a vision-language checkpoint, its weights not yet read.

    Returns:
        ``(VisionLanguageModel, VisionModel)``, or ``(MRopeModel, VisionModel)`` for an
        M-RoPE checkpoint (:data:`MROPE_TYPES`).

    Raises:
        VisionUnavailable: mlx-vlm is not installed; mlx-lm has no text model for the
            ``model_type``, or it takes no ``input_embeddings``; the language model places
            image tokens on a grid it cannot serve (:data:`GRID_POSITION_TYPES`); the
            weights do not fit.
    """
    import inspect

    from mlx.utils import tree_flatten

    model_type = str(config.get("model_type", ""))
    if model_type in GRID_POSITION_TYPES:
        raise VisionUnavailable(f"{model_type} cannot be served with images: {GRID_POSITION_TYPES[model_type]}")
    try:
        from mlx_vlm.utils import load_model as vlm_load, load_processor
    except ImportError as e:
        raise VisionUnavailable("vision-language models need mlx-vlm: pip install 'mlx-gateway[vision]'") from e
    if model_type in MROPE_TYPES:
        return _load_mrope(model_path, config, vlm_load(model_path, lazy=True), load_processor)
    try:
        model_class, args_class = _text_class(config)
    except ValueError as e:
        raise VisionUnavailable(f"mlx-lm has no text model for {model_type}: {e}") from None
    if "input_embeddings" not in inspect.signature(model_class.__call__).parameters:
        raise VisionUnavailable(f"mlx-lm's {model_type} model takes no input_embeddings")
    vlm = vlm_load(model_path, lazy=True)
    text = model_class(args_class.from_dict(config))
    weights = {k: v for k, v in tree_flatten(vlm.language_model.parameters())}
    weights = {f"language_model.{k}": v for k, v in weights.items()}
    if "lm_head.weight" not in _own_keys(model_path):  # mlx-vlm added it: tie it as mlx-lm does
        weights.pop("language_model.lm_head.weight", None)
    if hasattr(text, "sanitize"):
        weights = text.sanitize(weights)
    if "quantization" in config:
        import mlx.nn as nn

        q = config["quantization"]
        nn.quantize(text, group_size=q["group_size"], bits=q["bits"],
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights)
    try:
        text.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise VisionUnavailable(f"mlx-lm's {model_type} model does not take mlx-vlm's language weights: {e}"
                                ) from None
    if model_type in HYBRID_MROPE_TYPES:  # the same arrays in both language models
        return _load_mrope(model_path, config, vlm, load_processor, text)
    original = vlm.language_model  # mlx-vlm's, kept for the load-time probe only (check_agreement)
    vlm.language_model = text.language_model if hasattr(text, "language_model") else text
    image_token_id = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(image_token_id, int):
        raise VisionUnavailable(f"{model_type}: its config names no image token (image_token_index)")
    table = ImageTable()
    model = VisionLanguageModel(text, vlm, image_token_id, table)
    model._parts.original = original
    processor = load_processor(model_path, add_detokenizer=False)
    return model, VisionModel(processor, image_token_id, table, model_type)


def _load_mrope(model_path: Path, config: dict, vlm, load_processor, text=None):
    """``(MRopeModel, VisionModel)`` of an M-RoPE checkpoint (mlx-vlm's model, lazy; ``text``:
    mlx-lm's text model holding its language weights, for Qwen3.5)."""
    image_token_id = config.get("image_token_id", config.get("image_token_index"))
    if not isinstance(image_token_id, int):
        raise VisionUnavailable(f"{config.get('model_type')}: its config names no image token (image_token_id)")
    merge = int((config.get("vision_config") or {}).get("spatial_merge_size", 2))
    table = ImageTable()
    model = MRopeModel(vlm, image_token_id, merge, table, text)
    processor = load_processor(model_path, add_detokenizer=False)
    return model, VisionModel(processor, image_token_id, table, str(config["model_type"]))


def _own_keys(model_path: Path) -> str:
    """The weight names of the checkpoint, joined (to see whether it has an lm_head)."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return " ".join(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    names = []
    for f in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(f), "np") as fh:
            names.extend(fh.keys())
    return " ".join(names)


def check_agreement(model: VisionLanguageModel, vision: VisionModel, tolerance: float = 1e-3) -> Optional[str]:
    """Why ``model`` cannot serve images, or None: the last logits of a short prompt with
    a random image, through mlx-vlm's own path (``get_input_embeddings`` then its
    language model, as ``mlx_vlm.generate`` runs it) and through ``model`` (image ids,
    features, mlx-lm's text model), must agree within ``tolerance`` (relative)."""
    import mlx.core as mx

    if isinstance(model, MRopeModel):
        return _check_mrope(model, vision, tolerance)
    vlm, original = model._parts.vlm, model._parts.original
    model._parts.original = None  # its arrays (unread unless compared here) go after the probe
    size = _pixel_shape(vision)
    if size is None or original is None:
        return None  # nothing to compare with
    n = _image_tokens(vision)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal(size).astype(np.float32)
    digest = pixel_digest(pixels)
    image = ImageInput(pixels, digest, tuple(image_ids(digest, n)))
    text_ids = [1, 2, 3]
    ids = mx.array([[text_ids[0], *([vision.image_token_id] * n), *text_ids[1:]]])
    try:
        emb = vlm.get_input_embeddings(ids, mx.array(pixels[None]), mask=mx.ones(ids.shape))
        emb = emb.inputs_embeds if hasattr(emb, "inputs_embeds") else emb
        want = original(ids, inputs_embeds=emb)
        want = (want.logits if hasattr(want, "logits") else want)[0, -1]
        vision.table.add([image])
        try:
            got = model(mx.array([[text_ids[0], *image.ids, *text_ids[1:]]]))[0, -1]
        finally:
            vision.table.release([image])
            model.forget_features()
        return _differs(got, want, tolerance)
    except Exception as e:
        return f"the image path failed on a probe: {e!r}"


def _differs(got, want, tolerance: float) -> Optional[str]:
    """Why the probe's logits ``got`` are not mlx-vlm's ``want`` (both ``[V]``) within
    ``tolerance`` of its largest magnitude, or None."""
    import mlx.core as mx

    scale = float(mx.abs(want).max().item()) or 1.0
    diff = float(mx.abs(got - want).max().item())
    if diff > tolerance * scale:
        return f"the image path differs from mlx-vlm's by {diff:.3g} on a probe"
    return None


def _pixel_shape(vision: VisionModel) -> Optional[tuple[int, ...]]:
    ip = getattr(vision.processor, "image_processor", None)
    size = getattr(ip, "size", None)
    if isinstance(size, dict) and "height" in size and "width" in size:
        return (3, int(size["height"]), int(size["width"]))
    return None


def _image_tokens(vision: VisionModel) -> int:
    return int(getattr(vision.processor, "image_seq_length", 0) or 1)


def _check_mrope(model: MRopeModel, vision: VisionModel, tolerance: float) -> Optional[str]:
    """:func:`check_agreement` for an M-RoPE model: mlx-vlm's own forward of a prompt with a
    random 1 x 4 x 6 patch image (its ``get_rope_index`` positions) against ``model``'s
    (positions from the positions layer), fed in chunks of 5 tokens, one cut inside the image."""
    import mlx.core as mx

    vlm = model._vlm[0]
    vc = getattr(vlm.config, "vision_config", None)
    grid = (1, 2 * model.merge, 3 * model.merge)
    try:
        dim = int(getattr(vc, "in_channels", getattr(vc, "in_chans", 3))) * int(vc.temporal_patch_size) * int(
            vc.patch_size) ** 2
    except (AttributeError, TypeError):
        return None  # no patch layout to build a probe image from: nothing to compare
    pixels = np.random.default_rng(0).standard_normal((grid[1] * grid[2], dim)).astype(np.float32)
    digest = pixel_digest(pixels, grid)
    n = grid[1] * grid[2] // model.merge ** 2
    image = ImageInput(pixels, digest, tuple(image_ids(digest, n)), grid=grid)
    start = int(getattr(vlm.config, "vision_start_token_id", 1))
    head, tail = [1, start], [2, 3, 4]
    try:
        want = vlm(mx.array([head + [vision.image_token_id] * n + tail]), mx.array(pixels),
                   mask=None, image_grid_thw=mx.array([list(grid)]))
        want = (want.logits if hasattr(want, "logits") else want)[0, -1]
        vlm.language_model._rope_deltas = vlm.language_model._position_ids = None
        ids = head + list(image.ids) + tail
        vision.table.add([image])
        try:
            cache = model.make_cache()
            for k in range(0, len(ids), 5):
                got = model(mx.array([ids[k:k + 5]], dtype=mx.int64), cache=cache)
            got = got[0, -1]
        finally:
            vision.table.release([image])
            model.forget_features()
        return _differs(got, want, tolerance)
    except Exception as e:
        return f"the image path failed on a probe: {e!r}"
