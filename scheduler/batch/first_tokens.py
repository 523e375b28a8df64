"""First tokens of exact repeats, without a forward (engine thread only).

A prompt that was answered before, token for token (a client's retry or regenerate, the
same page asked about again, a burst of the same request), has its KV in the prefix
cache, but a plain hit restores ``len - 1`` tokens and feeds the last one through a
forward to get the logits its first token is sampled from: for a burst of warm hits
that is a batch merge and a forward before any of them sees a token.

:class:`FirstTokenStore` keeps, per prompt, the log-probabilities its first token was
sampled from (``[V]`` float32, taken from the step that sampled it: mlx-lm's
``logits - logsumexp(logits)``, before any sampler). A repeat of that prompt restores
all of its tokens (:meth:`PromptCacheManager.fetch <cache.manager.PromptCacheManager.fetch>`
with ``whole``), samples its first token from them with its own sampler at admission,
and joins the decode batch with that token as its pending input
(:meth:`RowInsertion.join_ready <scheduler.batch.insertion.RowInsertion.join_ready>`): its first
token goes out before the merge and the forward that compute its second.

Only requests whose first token depends on nothing but the logits and the sampler use
it (:func:`eligible`): no logits processors (penalties, ``logit_bias``, a grammar), no
image positions, more than one token wanted. A greedy repeat gives the tokens the
first answer gave (``tests/test_first_tokens.py``); a sampled one draws from the same
distribution with its own seed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import mlx.core as mx
import numpy as np

from scheduler.batch.decode_batch import INT32_LIMIT  # a vision model's image positions are ids at or above it
from scheduler.request import EngineRequest

MAX_BYTES = 32 << 20  # bytes of kept log-probabilities and keys (about 54 prompts of a 150k vocabulary)


def eligible(r: EngineRequest) -> bool:
    """``r``'s first token depends only on the prompt's logits and its sampler."""
    p = r.params
    return (p.max_tokens > 1 and not r.processors and r.mask is None and not p.logit_bias
            and not p.repetition_penalty and not p.presence_penalty and not p.frequency_penalty
            and bool(r.tokens) and max(r.tokens) < INT32_LIMIT)


class FirstTokenStore:
    """Log-probabilities of the first token after each recent prompt, per prefix-cache
    namespace; least recently used first out, at most ``max_bytes`` (the arrays and
    their keys, 8 bytes a token).

    Args:
        max_bytes: bytes kept at most (0: keep nothing).
        metrics: the engine's :class:`scheduler.metrics.SchedulerMetrics`, whose
            ``repeat_first_tokens`` counts :meth:`count_hit` and whose
            ``first_token_store_bytes`` reads :attr:`nbytes`; None: no metrics.
    """

    def __init__(self, max_bytes: int = MAX_BYTES, metrics=None):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0  # first tokens sampled from here
        self._kept: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._hits_counter = metrics.repeat_first_tokens if metrics is not None else None
        if metrics is not None:  # read at scrape time: an int, no MLX array
            metrics.first_token_store_bytes.set_function(lambda: self.nbytes)

    def count_hit(self) -> None:
        """A first token was sampled from here (for :attr:`hits` and the metric)."""
        self.hits += 1
        if self._hits_counter is not None:
            self._hits_counter.inc()

    def __len__(self) -> int:
        return len(self._kept)

    @staticmethod
    def _key(r: EngineRequest) -> tuple:
        return (r.namespace, tuple(r.tokens))

    @staticmethod
    def _size(key: tuple, logprobs: np.ndarray) -> int:
        return logprobs.nbytes + 8 * len(key[1])

    def get(self, r: EngineRequest) -> Optional[np.ndarray]:
        """The log-probabilities ``[V]`` kept for ``r``'s prompt, or None."""
        key = self._key(r)
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
        return found

    def put(self, r: EngineRequest, logprobs) -> None:
        """Keep ``logprobs`` (``[V]``, an MLX array of any float type or a NumPy one; kept
        as a float32 copy) for ``r``'s prompt."""
        key = self._key(r)
        if key in self._kept:
            self._kept.move_to_end(key)
            return
        if isinstance(logprobs, mx.array):  # bfloat16 has no NumPy type: widen it first (exact)
            logprobs = logprobs.astype(mx.float32)
        kept = np.array(logprobs, dtype=np.float32, copy=True)
        size = self._size(key, kept)
        if kept.ndim != 1 or kept.size < 2 or size > self.max_bytes:
            return
        while self._kept and self.nbytes + size > self.max_bytes:
            old_key, old = self._kept.popitem(last=False)
            self.nbytes -= self._size(old_key, old)
        self._kept[key] = kept
        self.nbytes += size
