"""How many streams a decode batch's merge of row caches spreads its layers over,
chosen by a short measurement at load (:mod:`gateway.cpu.measure`).

A row joining the decode batch has its cached prefix copied into the batch's buffer, every
layer's keys and values (:func:`scheduler.batch_merge.merge_with_room`), on one core where
MLX's CPU backend runs one stream; spread over two streams the copies took about half the
time on a 2-core machine (:func:`scheduler.batch_merge.spread_merges`). Whether a second
stream pays depends on the machine, so it is timed here on the model's own KV shape (a
merge of :data:`ROWS` rows of :data:`TOKENS` tokens, in two pages each, over every layer)
against one stream, and kept only if it wins by :data:`gateway.cpu.measure.MARGIN`.
"""

from __future__ import annotations

import mlx.core as mx

from cache.pages import PagedKVCache
from gateway.cpu.measure import Choice, pick, race
from scheduler.batch_merge import extra_streams, merge_with_room

ROWS = 4  # rows of the timed merge
TOKENS = 384  # cached tokens of each, in two pages
CANDIDATES = {"one stream": 1, "two streams": 2}

def choose(model, shapes: set[tuple], rounds: int = 3) -> Choice:
    """Time a merge of :data:`ROWS` rows shaped as ``model``'s KV cache (its layer count,
    the first float32 attention shape of ``shapes``: ``(query heads, KV heads, head size,
    dtype)``) on one stream and on two, and return the choice (logged): the faster, whose
    stream count (:data:`CANDIDATES`) the CPU tuning gives the engine thread
    (:func:`scheduler.batch_merge.spread_merges`)."""
    floats = sorted(s for s in shapes if s[3] == mx.float32)
    layers = len(getattr(model, "layers", None) or ())
    if not floats or not layers:
        return Choice("batch merges (CPU streams)", "one stream", reason="no float32 attention to merge").log()
    _, hk, d, dtype = floats[0]
    half = TOKENS // 2
    pages = [mx.ones((1, hk, half, d), dtype=dtype), mx.full((1, hk, TOKENS - half, d), 2.0, dtype=dtype)]
    mx.eval(pages)

    def merge(extra: tuple):
        rows = [[PagedKVCache(list(pages), list(pages)) for _ in range(layers)] for _ in range(ROWS)]
        return [(c.keys, c.values) for c in merge_with_room(rows, streams=extra)]

    times = race({name: (lambda e=extra_streams(n): merge(e)) for name, n in CANDIDATES.items()}, rounds,
                 sync=mx.eval)
    return Choice("batch merges (CPU streams)", pick(times, "one stream"), times).log()
