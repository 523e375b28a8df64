"""How row caches enter a decode batch: merged into one ``BatchKVCache`` per layer with
room for the next token (:func:`merge_with_room`), or written with the rows already there
into one new buffer (:func:`extend_with_rows`); the layers' copies may take turns on two
streams (:func:`spread_merges`, told each thread that merges). Engine
thread (or the thread that merges) only: MLX streams belong to the thread that made them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from cache.kinds import kind_of
from mlx_lm.models.cache import BatchKVCache

from cache.pages import PagedKVCache
from cache.quantized import BatchQuantizedKVCache
from compat.mlx_lm import merge_caches


# per thread: how many streams its merges spread over, and its extra streams (MLX streams
# belong to the thread that made them)
_here = threading.local()


def spread_merges(streams: int) -> None:
    """Let :func:`merge_with_room` and :func:`extend_with_rows`, on the calling thread, spread
    their layers' copies over ``streams`` streams of the default device (1, every thread's
    default: the calling stream alone). MLX's CPU
    backend runs each stream's work on its own thread, and a merge is copies only, so on
    two cores two streams merge about twice as fast (six rows of 900 tokens of SmolLM2-135M,
    30 layers: 58 against 102 ms on a 2-core machine). Chosen by a measurement at load
    (the gateway's CPU tuning), which tells the engine thread; each thread merges on
    streams of its own (MLX refuses a stream made on another thread)."""
    _here.spread = max(1, streams)


def extra_streams(streams: int) -> tuple:
    """``streams - 1`` new streams of the default device, for the calling thread (what
    :func:`merge_with_room` takes besides the calling stream)."""
    return tuple(mx.new_stream(mx.default_device()) for _ in range(max(0, streams - 1)))


def merge_streams() -> int:
    """How many streams a batch merge on the calling thread spreads its layers over."""
    return getattr(_here, "spread", 1)


def _extra_here() -> tuple:
    extra = getattr(_here, "streams", ())
    if len(extra) != merge_streams() - 1:
        extra = _here.streams = extra_streams(merge_streams())
    return extra


def _layer_stream(layer: int, extra: tuple):
    k = layer % (len(extra) + 1)
    return mx.stream(extra[k - 1]) if k else contextlib.nullcontext()


def settle(caches: list, rows: list[list] = ()) -> None:
    """Evaluate a batch's layer caches ``merge_streams()`` layers at a time (a filter, an
    extension or a compaction of each is lazy; call it once the old caches are dropped):
    each layer's old buffer is freed as its copy is made, instead of every layer's old and
    new buffers living together in the next forward (``MemoryGate.held`` charges the copy).
    ``rows``: per row leaving the batch, its layer caches (lazy copies out of the old
    buffers), each layer evaluated with the batch's."""
    at_once = merge_streams()
    for i in range(0, max([len(caches)] + [len(r) for r in rows]), at_once):  # (a batch emptied: rows only)
        layers = [c for layer in [caches, *rows] for c in layer[i:i + at_once]]
        mx.eval([a for c in layers for _, a in tree_flatten(vars(c)) if isinstance(a, mx.array)])


def grow(caches: list, tokens: int) -> None:
    """Before a forward of ``tokens`` positions: each float ``BatchKVCache`` layer of
    ``caches`` (holed ones too) that cannot take them grows as mlx-lm's
    ``update_and_fetch`` would (by its ``step``), here, one layer after another
    (:func:`settle`). In the forward, MLX makes every layer's larger buffer before it
    frees any old one (the concatenations do not wait for the layers below): three rows
    of 1,020 tokens of the tests' tiny model took 2.5 MB beside their 1.6 MB of KV in a
    verify step that grew them, 0.5 MB when grown first."""
    grown = []
    for c in caches:
        if (not isinstance(c, BatchKVCache) or type(c).update_and_fetch is not BatchKVCache.update_and_fetch
                or c.keys is None):
            continue
        if c._idx + tokens > c.keys.shape[2]:
            b, h, _, d = c.keys.shape
            size = -(-tokens // c.step) * c.step
            c.keys, c.values = (mx.concatenate([x[..., : c._idx, :], mx.zeros((b, h, size, x.shape[3]), x.dtype)],
                                               axis=2) for x in (c.keys, c.values))
            grown.append(c)
    if grown:  # (most steps: none)
        settle(grown)


def merge_with_room(caches: list[list], streams: Optional[tuple] = None) -> list:
    """Per layer, one batch cache of the per-sequence ``caches`` (``B`` lists, one cache
    per layer each), as the rows' ``merge`` column says (:mod:`cache.kinds`; mixed rows
    merge as ``mlx``): ``kv`` rows (``KVCache``, plain or paged) become a ``BatchKVCache``
    ``[B, H, T, D]`` and ``quantized`` rows a ``BatchQuantizedKVCache``, each with room for
    the next token, so the decode step that follows writes in place instead of
    reallocating it; ``mlx`` rows are merged by mlx-lm's merge (``compat.mlx_lm.merge_caches``). Layers take
    turns on the calling stream and ``streams`` (default: those of :func:`spread_merges`)."""
    extra = _extra_here() if streams is None else streams
    merged = []
    for layer in range(len(caches[0])):
        per_row = [c[layer] for c in caches]
        how = {kind_of(c).merge for c in per_row}
        with _layer_stream(layer, extra):
            merge = _MERGES.get(how.pop()) if len(how) == 1 else None
            merged.append(merge(per_row) if merge else merge_caches([[c] for c in per_row])[0])
    return merged


# The merge strategies of cache.kinds other than "mlx" (mlx-lm's own), each with room for one token.
_MERGES = {
    "kv": lambda rows: PagedKVCache.merge(rows, room=1),
    "quantized": lambda rows: BatchQuantizedKVCache.merge(rows, room=1),
}


def extend_with_rows(batch: list, caches: list[list]) -> list:
    """Per layer, the decode batch's layer caches ``batch`` followed by the rows of
    ``caches`` (``B`` lists, one cache per layer each), with room for the next token: what
    mlx-lm's ``_extend_cache(batch, merge_with_room(caches))`` gives, except that a float
    ``BatchKVCache`` layer and its new float rows are written into one new buffer
    (:meth:`cache.pages.PagedKVCache.merge` with ``into``), each token copied once.
    Other layers are merged and extended in place, as mlx-lm does. Layers take turns on
    the streams of :func:`spread_merges`."""
    if not batch:
        return merge_with_room(caches)
    out, extra = [], _extra_here()
    for layer, current in enumerate(batch):
        per_row = [c[layer] for c in caches]
        if PagedKVCache.can_merge_into(current, per_row):
            with _layer_stream(layer, extra):
                out.append(PagedKVCache.merge(per_row, room=1, into=current))
        else:
            current.extend(merge_with_room([[c] for c in per_row], streams=())[0])
            out.append(current)
    return out
