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

**Images in the token stream.** The processor expands each image into ``n`` placeholder
tokens (Gemma 3: 256 ``<image_soft_token>``). In the prompt the engine sees, those ``n``
positions hold *image token ids* derived from a SHA-256 of the image's preprocessed
pixels (:func:`image_ids`): integers of at least :data:`IMAGE_ID_BASE` (2**62), far above
any vocabulary. The prefix cache keys on token ids, so two different images never share
KV (their ids differ), and the same image, sent again behind the same text, finds its
prefill in the cache (its ids are the same, in this process and after a restart:
the disk tier keys on them too).

:class:`VisionLanguageModel` is the model the engine calls. A forward whose input holds
image ids (the ids force MLX's int64 dtype, so plain decode steps skip the check) looks
each one up in the :class:`ImageTable` of images in flight, runs mlx-vlm's
``get_input_embeddings`` once per image (on the engine thread, the first time a prefill
chunk reaches it; an image whose positions come from the cache is never encoded), and
feeds mlx-lm's model the text embeddings with the image rows put in their place
(``input_embeddings``). Row by row the inputs are those of mlx-vlm's own generation, so a
batch of image and text requests gives each the tokens it gets alone.

Positions are 1-D (the image tokens take consecutive positions). Models whose language
model places image tokens on a 2-D/3-D grid (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: M-RoPE,
with a per-request position offset after each image) cannot run in this batch, whose
rows advance one position per token from their cache offset: they are refused at load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

log = logging.getLogger("mlx_gateway")

IMAGE_ID_BASE = 1 << 62  # image token ids are IMAGE_ID_BASE + (seed + i) mod IMAGE_ID_SPAN
IMAGE_ID_SPAN = 1 << 61
# Language models whose image tokens take 3-D (M-RoPE) positions: not servable in the batch.
GRID_POSITION_TYPES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "glm4v",
                       "glm4v_moe", "ernie4_5_moe_vl", "paddleocr_vl", "kimi_vl"}


class VisionUnavailable(RuntimeError):
    """mlx-vlm is not installed, or the model cannot be served with images (why is said)."""


def image_ids(digest: bytes, n: int) -> list[int]:
    """The ``n`` token ids standing for an image whose preprocessed pixels hash to
    ``digest`` (SHA-256): consecutive integers from a 61-bit seed taken from the digest,
    above :data:`IMAGE_ID_BASE`. Two images share ids only if their digests share those
    61 bits."""
    seed = int.from_bytes(digest[:8], "little") % IMAGE_ID_SPAN
    return [IMAGE_ID_BASE + (seed + i) % IMAGE_ID_SPAN for i in range(n)]


def is_image_id(token: int) -> bool:
    """``token`` stands for an image position (it is no vocabulary token)."""
    return token >= IMAGE_ID_BASE


def pixel_digest(pixels: np.ndarray) -> bytes:
    """SHA-256 of an image's preprocessed pixels: their float32 bytes and shape."""
    a = np.ascontiguousarray(pixels, dtype=np.float32)
    h = hashlib.sha256(json.dumps(list(a.shape)).encode())
    h.update(a.tobytes())
    return h.digest()


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image of a prompt.

    Attributes:
        pixels: what the processor made of it (e.g. ``[3, H, W]`` float32).
        digest: :func:`pixel_digest` of ``pixels``.
        ids: the token ids of its positions in the prompt (:func:`image_ids`).
        size: its decoded size ``(width, height)`` in pixels, before preprocessing.
    """

    pixels: np.ndarray
    digest: bytes
    ids: tuple[int, ...]
    size: tuple[int, int] = (0, 0)

    @property
    def tokens(self) -> int:
        return len(self.ids)


class ImageTable:
    """The images of the requests in flight, by image token id (thread-safe).

    The gateway adds a request's images before it submits it and releases them when the
    request's last event has been sent (:meth:`releasing`), so an image is here for
    every forward that can reach it. Only numpy arrays are held here; the MLX features
    computed from them live on the engine thread (:class:`VisionLanguageModel`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_first: dict[int, list] = {}  # first id -> [image, references]
        self._where: dict[int, tuple[int, int]] = {}  # id -> (first id, index in the image)

    def add(self, images: list[ImageInput]) -> None:
        with self._lock:
            for im in images:
                entry = self._by_first.get(im.ids[0])
                if entry is None:
                    self._by_first[im.ids[0]] = [im, 1]
                    for i, t in enumerate(im.ids):
                        self._where[t] = (im.ids[0], i)
                else:
                    entry[1] += 1

    def release(self, images: list[ImageInput]) -> None:
        with self._lock:
            for im in images:
                entry = self._by_first.get(im.ids[0])
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._by_first[im.ids[0]]
                    for t in im.ids:
                        self._where.pop(t, None)

    def releasing(self, sink, images: list[ImageInput]):
        """``sink`` (an engine request's) that releases ``images`` once it has passed on
        the request's last event (a done or error event)."""
        from scheduler.request import DoneEvent, ErrorEvent

        released = []

        def wrapped(events) -> None:
            try:
                sink(events)
            finally:
                if not released and any(isinstance(e, (DoneEvent, ErrorEvent)) for e in events):
                    released.append(True)
                    self.release(images)

        return wrapped

    def locate(self, token: int) -> Optional[tuple[ImageInput, int]]:
        """The image holding position ``token``, and the position's index in it."""
        with self._lock:
            where = self._where.get(token)
            if where is None:
                return None
            return self._by_first[where[0]][0], where[1]

    def live(self, first: int) -> bool:
        with self._lock:
            return first in self._by_first

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_first)


def _module_base():
    import mlx.nn as nn

    return nn.Module


class VisionLanguageModel(_module_base()):
    """The model the engine runs for a vision-language checkpoint (see the module
    docstring): mlx-lm's text model ``text`` for the forward, mlx-vlm's model for the
    image features. Its parameters are the text model's and mlx-vlm's vision tower and
    projector (each array once).

    Args:
        text: mlx-lm's model of the checkpoint (accepts ``input_embeddings``).
        vlm: mlx-vlm's model; its ``language_model`` is replaced by ``text``'s so that
            its text embeddings read the same arrays.
        image_token_id: the placeholder token of an image position.
        table: the images in flight.
    """

    def __init__(self, text, vlm, image_token_id: int, table: ImageTable):
        super().__init__()
        self.text = text
        self.image_token_id = image_token_id
        for name in ("vision_tower", "multi_modal_projector"):
            if name in vlm:
                setattr(self, name, vlm[name])
        self._parts = _Parts(vlm, image_token_id, table)

    @property
    def layers(self):
        return self.text.layers

    @property
    def args(self):
        return getattr(self.text, "args", None)

    def make_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.text)

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        if inputs.dtype != mx.int64 or not mx.any(inputs >= IMAGE_ID_BASE).item():
            if inputs.dtype == mx.int64:
                inputs = inputs.astype(mx.int32)
            return self.text(inputs, cache=cache, **kwargs)
        embeddings, ids = self._parts.embed(inputs)
        return self.text(ids, cache=cache, input_embeddings=embeddings)

    def image_features(self, image: ImageInput):
        """The language-model input rows of ``image``'s positions, ``[n, D]`` (engine thread)."""
        return self._parts.features(image)

    def forget_features(self) -> None:
        """Drop the features of images no longer in flight (engine thread)."""
        self._parts.purge()


class _Parts:
    """What :class:`VisionLanguageModel` holds outside its module tree: mlx-vlm's model, the
    image table and the features computed on the engine thread."""

    def __init__(self, vlm, image_token_id: int, table: ImageTable):
        self.vlm, self.image_token_id, self.table = vlm, image_token_id, table
        self.original = None  # mlx-vlm's own language model, until the load-time probe
        self._features: dict[int, Any] = {}  # first id -> mx.array [n, D] (engine thread)

    def features(self, image: ImageInput):
        import mlx.core as mx

        first = image.ids[0]
        f = self._features.get(first)
        if f is None:
            n = image.tokens
            ids = mx.array([[self.image_token_id] * n])
            out = self.vlm.get_input_embeddings(ids, mx.array(image.pixels[None]), mask=mx.ones((1, n)))
            f = out.inputs_embeds[0] if hasattr(out, "inputs_embeds") else out[0]
            if f.shape[0] != n:
                raise ValueError(f"the vision model gave {f.shape[0]} rows for an image of {n} tokens")
            mx.eval(f)
            self._features[first] = f
        return f

    def purge(self) -> None:
        for first in [k for k in self._features if not self.table.live(k)]:
            del self._features[first]

    def embed(self, inputs):
        """``(input embeddings [B, L, D], token ids [B, L] with image positions as the
        placeholder token)`` of an input holding image ids."""
        import mlx.core as mx

        self.purge()
        rows = inputs.tolist()
        used: dict[int, int] = {}  # first id -> offset in the stacked features
        stacked, index, where = [], [], []
        offset = 0
        for b, row in enumerate(rows):
            for p, t in enumerate(row):
                if t < IMAGE_ID_BASE:
                    continue
                found = self.table.locate(t)
                if found is None:
                    raise ValueError("an image of the prompt is no longer in flight")
                image, i = found
                first = image.ids[0]
                if first not in used:
                    used[first] = offset
                    f = self.features(image)
                    stacked.append(f)
                    offset += f.shape[0]
                index.append(used[first] + i)
                where.append(b * len(row) + p)
        mask = inputs >= IMAGE_ID_BASE
        ids = mx.where(mask, self.image_token_id, inputs).astype(mx.int32)
        text = self.vlm.get_input_embeddings(ids)
        text = text.inputs_embeds if hasattr(text, "inputs_embeds") else text
        B, L, D = text.shape
        flat = text.reshape(B * L, D)
        feats = mx.concatenate(stacked, axis=0).astype(flat.dtype)
        flat[mx.array(where)] = feats[mx.array(index)]
        return flat.reshape(B, L, D), ids


@dataclass
class VisionModel:
    """The vision side of a served model, as request code sees it (no MLX here).

    Attributes:
        processor: mlx-vlm's processor (image preprocessing, placeholder expansion).
        image_token_id: the placeholder token of an image position.
        table: the images in flight (shared with the engine's model).
        model_type: the checkpoint's ``model_type``.
    """

    processor: Any
    image_token_id: int
    table: ImageTable
    model_type: str
    lock: threading.Lock = field(default_factory=threading.Lock)


def _text_class(config: dict):
    """mlx-lm's model class and arguments for the checkpoint's ``model_type``."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def load_vision_model(model_path: Path, config: dict):
    """Build the served model of a vision-language checkpoint, its weights not yet read.

    Returns:
        ``(VisionLanguageModel, VisionModel)``.

    Raises:
        VisionUnavailable: mlx-vlm is not installed; mlx-lm has no text model for the
            ``model_type``, or it takes no ``input_embeddings``; the language model places
            image tokens on a grid (M-RoPE); the weights do not fit.
    """
    import inspect

    from mlx.utils import tree_flatten

    model_type = str(config.get("model_type", ""))
    if model_type in GRID_POSITION_TYPES:
        raise VisionUnavailable(f"{model_type} places image tokens on a 2-D/3-D position grid (M-RoPE), which "
                                "the shared batch (1-D positions from each row's cache offset) cannot run")
    try:
        from mlx_vlm.utils import load_model as vlm_load, load_processor
    except ImportError as e:
        raise VisionUnavailable("vision-language models need mlx-vlm: pip install 'mlx-gateway[vision]'") from e
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
        scale = float(mx.abs(want).max().item()) or 1.0
        diff = float(mx.abs(got - want).max().item())
    except Exception as e:
        return f"the image path failed on a probe: {e!r}"
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
