"""``logit_bias`` for a whole decode batch in one add: mlx-lm's step runs each row's
logits processors on its own slice of the logits (a slice, the processor's scatter, its
token context and a concatenation per row and step); a request's bias is the same add
every step, so the rows' biases are kept as one ``[B, V]`` matrix, made once per set of
rows, and added to the forward's logits before the other processors run (mlx-lm
applies the bias first too: ``mlx_lm.sample_utils.make_logits_processors``)."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx


class LogitBias:
    """A request's ``logit_bias`` (token id -> additive bias) as an mlx-lm logits
    processor ``(tokens, logits [n, V]) -> logits [n, V]``, as mlx-lm's own
    (``logits.at[:, ids].add(values)``); a decode step adds it for all rows at once
    (:func:`folded_step`), the other paths (speculative verification) call it per row."""

    def __init__(self, bias: dict[int, float]):
        self.ids = mx.array(list(bias))
        self.values = mx.array(list(bias.values()))

    def __call__(self, tokens, logits: mx.array) -> mx.array:
        return logits.at[:, self.ids].add(self.values)


def _leading_bias(processors: list) -> Optional[LogitBias]:
    """The row's first processor when it is a :class:`LogitBias` (maybe fault-guarded:
    ``inner``, :class:`scheduler.batch.faults.RowFault`), else None."""
    if not processors:
        return None
    first = getattr(processors[0], "inner", processors[0])
    return first if isinstance(first, LogitBias) else None


class _BiasMatrix:
    """The rows' biases as one ``[B, V]`` matrix in the logits' dtype (zeros in a row
    without one), made at the first step that uses it."""

    def __init__(self, biases: list[Optional[LogitBias]]):
        self.biases = biases
        self.matrix: Optional[mx.array] = None

    def add(self, logits: mx.array) -> mx.array:
        """``logits [B, 1, V]`` plus each row's bias."""
        m = self.matrix
        if m is None or m.dtype != logits.dtype or m.shape[-1] != logits.shape[-1]:
            rows = [(i, b) for i, b in enumerate(self.biases) if b is not None]
            at = mx.concatenate([mx.full(b.ids.shape, i, dtype=mx.int32) for i, b in rows])
            ids = mx.concatenate([b.ids for _, b in rows])
            values = mx.concatenate([b.values for _, b in rows]).astype(logits.dtype)
            m = mx.zeros((len(self.biases), logits.shape[-1]), dtype=logits.dtype).at[at, ids].add(values)
            self.matrix = m = m[:, None, :]
        return logits + m


def folded_step(batch, step: Callable[[], tuple]) -> tuple:
    """``step()`` (mlx-lm's ``GenerationBatch._step`` of ``batch``) with each row's
    leading :class:`LogitBias` taken out of its processors and added for all rows in one
    ``[B, V]`` add on the forward's logits; the same logits as mlx-lm's per-row add (an
    add of zero elsewhere). A row left with no processors gets no token context for them
    (a bias reads none). The batch's model and processors are put back after the step."""
    processors = batch.logits_processors
    biases = [_leading_bias(p) for p in processors] if any(processors) else ()  # (most rows: none)
    if not any(biases):
        return step()
    cached = getattr(batch, "_bias_matrix", None)
    if cached is None or cached.biases != biases:
        cached = batch._bias_matrix = _BiasMatrix(biases)
    model = batch.model
    batch.model = lambda inputs, cache=None: cached.add(model(inputs, cache=cache))
    batch.logits_processors = [p[1:] if b is not None else p for p, b in zip(processors, biases)]
    try:
        return step()
    finally:
        batch.model, batch.logits_processors = model, processors
