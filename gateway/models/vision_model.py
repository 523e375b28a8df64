"""The model the engine runs for a vision-language checkpoint (built by
:func:`gateway.models.vision_load.load_vision_model`).

:class:`VisionLanguageModel` is the model the engine calls. A forward whose input holds
image ids (the ids force MLX's int64 dtype, so plain decode steps skip the check) looks
each one up in the :class:`ImageTable` of images in flight, runs mlx-vlm's
``get_input_embeddings`` once per image (on the engine thread, the first time a prefill
chunk reaches it; an image whose positions come from the cache is never encoded), and
feeds mlx-lm's model the text embeddings with the image rows put in their place
(``input_embeddings``). Row by row the inputs are those of mlx-vlm's own generation, so a
batch of image and text requests gives each the tokens it gets alone.
"""

from __future__ import annotations

from typing import Any

from gateway.models.vision_images import IMAGE_ID_BASE, ImageInput, ImageTable


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
