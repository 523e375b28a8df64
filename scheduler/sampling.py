"""Per-request samplers, so requests with different settings (and seeds) batch together."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from scheduler.logit_bias import LogitBias
from scheduler.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    """Argmax over the vocabulary: ``[B, V] -> [B]``."""
    return mx.argmax(logprobs, axis=-1)


def token_logprobs(logprobs: mx.array, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]] | None]:
    """The log-probability of ``token`` under ``logprobs [V]``, and the ``top`` most likely
    tokens with theirs, best first (None when ``top`` is 0)."""
    chosen = logprobs[token].item()
    if not top:
        return chosen, None
    k = min(top, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    return chosen, list(zip(idx[order].tolist(), vals[order].tolist()))


class TemperatureSampler:
    """Samples ``logprobs [n, V] -> tokens [n]`` at a temperature, after mlx-lm's filters
    (top-p, min-p, top-k, ``mlx_lm.sample_utils``). With a ``seed`` it draws from its own
    PRNG key chain (one split per draw), so a request's output does not depend on which
    other requests share its batch.

    :meth:`scaled` and :meth:`draw` are the two halves of a call, for speculative
    decoding's rejection sampling (:mod:`scheduler.speculative.verify`), which needs the
    distribution itself and draws from an adjusted one.
    """

    def __init__(self, params: SamplingParams):
        self._filters = []
        if 0 < params.top_p < 1:
            self._filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0:
            self._filters.append(lambda x: apply_min_p(x, params.min_p))
        if params.top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, params.top_k))
        self._key = mx.random.key(params.seed) if params.seed is not None else None
        self._inv_temp = 1.0 / params.temperature

    def scaled(self, logprobs: mx.array) -> mx.array:
        """The logits sampled from: filtered (``-inf`` outside), over the temperature ``[n, V]``."""
        for f in self._filters:
            logprobs = f(logprobs)
        return logprobs * self._inv_temp

    def _subkey(self):
        if self._key is None:
            return None
        self._key, sub = mx.random.split(self._key)
        return sub

    def draw(self, logits: mx.array) -> mx.array:
        """One token per row of ``logits [n, V]`` from ``softmax(logits)``: ``[n]``."""
        return mx.random.categorical(logits, key=self._subkey())

    @property
    def seeded(self) -> bool:
        """Draws come from the request's own key chain (its ``seed``)."""
        return self._key is not None

    def uniform(self, n: int) -> mx.array:
        """``n`` draws from U[0, 1), from the same key chain: ``[n]``."""
        return mx.random.uniform(shape=(n,), key=self._subkey())

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.draw(self.scaled(logprobs))


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler ``logprobs [1, V] -> token [1]`` for one request: :func:`greedy` at
    temperature 0, else a :class:`TemperatureSampler`."""
    if params.temperature == 0:
        return greedy
    return TemperatureSampler(params)


def make_processors(params: SamplingParams) -> list:
    """mlx-lm logits processors for the request's ``logit_bias`` (first, as mlx-lm orders
    them; a :class:`LogitBias`) and penalties (may be empty)."""
    bias = [LogitBias(dict(params.logit_bias))] if params.logit_bias else []
    return bias + make_logits_processors(repetition_penalty=params.repetition_penalty or None,
                                         presence_penalty=params.presence_penalty or None,
                                         frequency_penalty=params.frequency_penalty or None)
