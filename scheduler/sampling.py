"""Per-request samplers, so requests with different settings (and seeds) batch together."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from scheduler.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    """Argmax over the vocabulary: ``[B, V] -> [B]``."""
    return mx.argmax(logprobs, axis=-1)


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler ``logprobs [1, V] -> token [1]`` for one request.

    Filters (top-p, min-p, top-k) are mlx-lm's own (``mlx_lm.sample_utils``). A request
    with a ``seed`` draws from its own PRNG key chain (one split per token), so its
    output does not depend on which other requests share its batch.
    """
    if params.temperature == 0:
        return greedy
    filters = []
    if 0 < params.top_p < 1:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    key = [mx.random.key(params.seed)] if params.seed is not None else None
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def make_processors(params: SamplingParams) -> list:
    """mlx-lm logits processors for the request's penalties and ``logit_bias`` (may be empty)."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
