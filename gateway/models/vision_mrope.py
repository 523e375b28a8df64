"""Vision-language models whose image tokens sit on a 3-D position grid (M-RoPE: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5 with a vision tower), in the shared batch.

mlx-lm's text models of these checkpoints rotate 1-D positions only. For Qwen2-VL,
Qwen2.5-VL and Qwen3-VL the forward is mlx-vlm's own language model, given explicit
``position_ids`` ``[3, B, L]``; its attention runs on mlx-lm's caches (``KVCache``, the
engine's ``BatchKVCache``: mlx-vlm's masks come from their ``make_mask``). For Qwen3.5
(hybrid: Gated DeltaNet and attention layers) mlx-vlm's batched forward splits and
re-merges each row's caches per call, so the forward is mlx-lm's text model (same weight
arrays; its recurrent layers in mlx-lm's caches), each attention layer's rotation replaced
by mlx-vlm's M-RoPE at the forward's positions (:class:`GridRope`).

**Positions, row by row.** In mlx-vlm's ``get_rope_index`` a text token's three axes are
equal: its cache position plus the row's *delta*, which starts at 0 and changes only at
the end of each image, by ``max(t, h/merge, w/merge) - n`` for an image of patch grid
``(t, h, w)`` and ``n = t*h*w/merge**2`` tokens. Image token ``i`` (grid index
``(t_i, h_i, w_i)``) of an image whose first token is at cache position ``s`` sits at
``s + delta_before + (t_i, h_i, w_i)``. So every token's position is a function of the
row's image ids (the :class:`ImageTable` knows each image's grid and the index of each of
its ids), its cache offset and its delta before the token.

The delta is kept *in the row's cache*: :meth:`MRopeModel.make_cache` appends one more
layer cache, an mlx-lm ``KVCache`` (class :class:`MRopePositions`) whose keys hold, per
token, the delta in effect after it (int32, ``[B, 1, T, 1]``). Every forward writes one
entry per input token, so it has the text layers' offsets, and everything the engine does
to rows (left padding, right-padded prefill, merges, filters, extracts, trims, prefix-cache
pages, the disk tier, checkpoints) does the same to it. A forward reads each row's last
entry (0 for a row with no tokens yet), so a chunk may start anywhere: inside an image,
just after one, after a restore.

Speculative decoding is off for these models (as for every model that reads images).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from gateway.models.vision_images import IMAGE_ID_BASE, ImageInput, ImageTable

# model_type -> served with 3-D positions by :class:`MRopeModel`.
MROPE_TYPES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
# model_type -> served by :class:`MRopeModel` over mlx-lm's text model (its recurrent layers
# in mlx-lm's caches, which mlx-vlm's batched forward of these re-merges per row).
HYBRID_MROPE_TYPES = {"qwen3_5", "qwen3_5_moe"}


def _module_base():
    import mlx.nn as nn

    return nn.Module


def _kv_base():
    from mlx_lm.models.cache import KVCache

    return KVCache


class MRopePositions(_kv_base()):
    """The positions layer of an M-RoPE row's cache: an mlx-lm ``KVCache`` whose keys (and
    values) are the delta after each token (int32 ``[1, 1, T, 1]``); see the module
    docstring. Its own row in :mod:`cache.kinds` keeps it out of ``--kv-bits``."""


def image_grid_positions(grid: tuple[int, int, int], merge: int) -> tuple[np.ndarray, int]:
    """The grid index of each token of an image, and the delta change at its end.

    Args:
        grid: the image's patch grid ``(t, h, w)`` (the processor's ``image_grid_thw``).
        merge: the vision tower's ``spatial_merge_size``.

    Returns:
        ``(index [3, n] int64: (t_i, h_i, w_i) of token i, max(t, h', w') - n)`` with
        ``h' = h / merge``, ``w' = w / merge``, ``n = t * h' * w'`` (mlx-vlm's
        ``get_rope_index``).
    """
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    i = np.arange(t * h * w)
    index = np.stack([i // (h * w), (i // w) % h, i % w])
    return index, max(t, h, w) - t * h * w


class MRopeModel(_module_base()):
    """The model the engine runs for an M-RoPE vision-language checkpoint (module
    docstring): mlx-vlm's vision tower and language model (or ``text``), called with token
    ids ``[B, L]`` (image positions as image ids, :mod:`gateway.models.vision_images`) and
    the row caches of :meth:`make_cache`; returns logits ``[B, L, V]``.

    Args:
        vlm: mlx-vlm's model of the checkpoint.
        image_token_id: the placeholder token of an image position.
        merge: the vision tower's ``spatial_merge_size``.
        table: the images in flight.
        text: Qwen3.5: mlx-lm's text model holding the language weights (its attention
            layers' ``rope`` are replaced here); None: mlx-vlm's language model runs.

    Raises (from a forward):
        ValueError: an image of the input is no longer in the table, or the vision
            tower gives another number of rows than the image has tokens.
    """

    def __init__(self, vlm, image_token_id: int, merge: int, table: ImageTable, text=None):
        super().__init__()
        self.vision_tower = vlm.vision_tower
        if text is None:
            self.language_model = vlm.language_model
        else:  # Qwen3.5: mlx-lm's hybrid text model, its rotations given 3-D positions (GridRope)
            self.text = text
            rotary = next(m.self_attn.rotary_emb for m in vlm.language_model.model.layers if not m.is_linear)
            self._now: list = [None]  # the positions [3, B, L] of the forward in progress
            for layer in text.layers:
                if not layer.is_linear:
                    layer.self_attn.rope = GridRope(rotary, self._now)
        self.image_token_id, self.merge = image_token_id, merge
        self._vlm = [vlm]  # outside the module tree: what is used of it is above
        self._table = table
        self._features: dict[int, tuple] = {}  # first id -> (features [n, D], deepstack [k, n, D] | None)

    @property
    def layers(self):
        return self.text.layers if "text" in self else self.language_model.model.layers

    @property
    def args(self):
        return self.text.args if "text" in self else self.language_model.args

    def make_cache(self) -> list:
        """The decoder layers' mlx-lm caches (``KVCache``; Qwen3.5: its ``ArraysCache``
        and ``KVCache`` layers), then the :class:`MRopePositions` layer."""
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        layers = make_prompt_cache(self.text) if "text" in self else [KVCache() for _ in self.layers]
        return layers + [MRopePositions()]

    def _embed(self, ids):
        if "text" in self:
            return self.text.language_model.model.embed_tokens(ids)
        return self.language_model.model.embed_tokens(ids)

    def _forward(self, ids, embeddings, cache, position_ids, extra):
        if "text" not in self:
            out = self.language_model(ids, inputs_embeds=embeddings, cache=cache, position_ids=position_ids, **extra)
            return out.logits if hasattr(out, "logits") else out
        self._now[0] = position_ids
        try:
            return self.text(ids, cache=cache, input_embeddings=embeddings)
        finally:
            self._now[0] = None

    def forget_features(self) -> None:
        """Drop the features of images no longer in flight (engine thread)."""
        for first in [k for k in self._features if not self._table.live(k)]:
            del self._features[first]

    def __call__(self, inputs, cache: Optional[list] = None, **kwargs):
        import mlx.core as mx

        if cache is None:
            cache = self.make_cache()
        text, positions = cache[:-1], cache[-1]
        B, L = inputs.shape
        images = inputs.dtype == mx.int64 and mx.any(inputs >= IMAGE_ID_BASE).item()
        extra: dict[str, Any] = {}
        if images:
            rel, acc, embeddings, ids, extra = self._image_inputs(inputs)
        else:
            rel = mx.broadcast_to(mx.arange(L, dtype=mx.int32)[None, None], (3, B, L))
            acc, embeddings, ids = mx.zeros((B, L), mx.int32), None, inputs.astype(mx.int32)
        before = _last_delta(positions, B)
        offset = positions.offset
        offset = mx.array([offset] * B) if isinstance(offset, int) else offset
        position_ids = rel + (offset.astype(mx.int32) + before)[None, :, None]
        after = (before[:, None] + acc).reshape(B, 1, L, 1)
        positions.update_and_fetch(after, after)
        return self._forward(ids, embeddings, text, position_ids, extra)

    def _features_of(self, image: ImageInput):
        import mlx.core as mx

        first = image.ids[0]
        got = self._features.get(first)
        if got is None:
            n = image.tokens
            grid = mx.array([list(image.grid)])
            if "text" in self:  # Qwen3.5: its vision tower alone (no deepstack)
                dtype = self.vision_tower.patch_embed.proj.weight.dtype
                f, deep = self.vision_tower(mx.array(image.pixels).astype(dtype), grid)[0], None
            else:
                out = self._vlm[0].get_input_embeddings(mx.array([[self.image_token_id] * n]),
                                                        mx.array(image.pixels), image_grid_thw=grid,
                                                        mask=mx.ones((1, n)))
                f = out.inputs_embeds[0] if hasattr(out, "inputs_embeds") else out[0]
                deep = getattr(out, "deepstack_visual_embeds", None)
                deep = mx.stack(list(deep)) if deep is not None else None
            if f.shape[0] != n:
                raise ValueError(f"the vision model gave {f.shape[0]} rows for an image of {n} tokens")
            mx.eval(f, *([deep] if deep is not None else []))
            got = self._features[first] = (f, deep)
        return got

    def _image_inputs(self, inputs):
        """``(relative positions [3, B, L], delta change after each token [B, L], input
        embeddings [B, L, D], token ids [B, L] int32, deepstack arguments)`` of an input
        holding image ids; the positions are relative to each row's offset plus its delta
        before the input."""
        import mlx.core as mx

        self.forget_features()
        rows = inputs.tolist()
        B, L = inputs.shape
        rel = np.zeros((3, B, L), np.int64)
        acc = np.zeros((B, L), np.int64)
        used: dict[int, tuple] = {}  # first id -> (offset in the stacked features, grid index, delta)
        stacked, index, where = [], [], []
        offset = 0
        for b, row in enumerate(rows):
            change = 0
            for j, t in enumerate(row):
                if t < IMAGE_ID_BASE:
                    rel[:, b, j] = j + change
                    acc[b, j] = change
                    continue
                found = self._table.locate(t)
                if found is None:
                    raise ValueError("an image of the prompt is no longer in flight")
                image, i = found
                if image.ids[0] not in used:
                    stacked.append(self._features_of(image))
                    used[image.ids[0]] = (offset, *image_grid_positions(image.grid, self.merge))
                    offset += image.tokens
                start, grid_index, delta = used[image.ids[0]]
                rel[:, b, j] = j - i + change + grid_index[:, i]
                if i == image.tokens - 1:
                    change += delta
                acc[b, j] = change
                index.append(start + i)
                where.append(b * L + j)
        ids = mx.where(inputs >= IMAGE_ID_BASE, self.image_token_id, inputs).astype(mx.int32)
        text = self._embed(ids)
        D = text.shape[-1]
        flat = text.reshape(B * L, D)
        take = mx.array(index)
        flat[mx.array(where)] = mx.concatenate([f for f, _ in stacked])[take].astype(flat.dtype)
        extra = {}
        if stacked[0][1] is not None:  # Qwen3-VL: image features added after the first decoder layers, row-major
            mask = np.zeros((B, L), bool)
            mask.reshape(-1)[where] = True
            deep = mx.concatenate([d for _, d in stacked], axis=1)[:, take]
            extra = {"visual_pos_masks": mx.array(mask), "deepstack_visual_embeds": deep}
        return (mx.array(rel.astype(np.int32)), mx.array(acc.astype(np.int32)), flat.reshape(B, L, D), ids,
                extra)


class GridRope(_module_base()):
    """The rotation of a Qwen3.5 attention layer of mlx-lm's text model, by the 3-D positions
    of the forward in progress (``now[0]``, ``[3, B, L]``) instead of its cache offset:
    mlx-vlm's ``Qwen3_5RotaryEmbedding`` (interleaved M-RoPE, partial rotary) of the same
    checkpoint. Called as mlx-lm's rope: ``rope(x [B, H, L, D], offset=...)``."""

    def __init__(self, rotary, now: list):
        super().__init__()
        self._rotary, self._now = [rotary], now

    def __call__(self, x, offset=0):
        positions = self._now[0]
        if positions is None:
            raise RuntimeError("GridRope called outside an M-RoPE forward")
        return self._rotary[0].apply_rotary(x, x, positions, unsqueeze_dim=1)[0]


def _last_delta(positions, rows: int):
    """Each row's delta after its last token ``[B]`` int32 (0 for a row with none), read
    from the positions layer (``KVCache``: ``offset`` tokens; ``BatchKVCache``: the
    entry at ``_idx - 1``, left-padded rows aligned on it)."""
    import mlx.core as mx

    keys = getattr(positions, "keys", None)
    offset = positions.offset
    if keys is None:
        return mx.zeros((rows,), mx.int32)
    if isinstance(offset, int):
        return keys[:, 0, offset - 1, 0] if offset > 0 else mx.zeros((rows,), mx.int32)
    idx = int(positions._idx)  # a batch cache without it has no layout to read here: fail loudly
    if idx == 0:
        return mx.zeros((rows,), mx.int32)
    return mx.where(offset > 0, keys[:, 0, idx - 1, 0], 0).astype(mx.int32)
