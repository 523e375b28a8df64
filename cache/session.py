"""PrefillSession: prefix-cached prefill for library callers (no server needed).

Chunking rule (deterministic, so that a cold run and a cached run of recurrent
models see the same chunk boundaries): chunks end at every checkpoint, at every
absolute multiple of ``prefill_step_size``, and at ``len(tokens) - 1``; the last
token is always run alone, so the vocabulary projection is computed for one
position only. Snapshots are stored at each checkpoint, at the end, and, when the
model's cache cannot be trimmed (recurrent or rotated layers), also at
``len(tokens) - 1`` so that an exact repeat of the prompt still hits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import restore as rules
from .manager import PromptCacheManager


@dataclass
class PrefillResult:
    """Output of :meth:`PrefillSession.prefill`.

    Attributes:
        cache: list of layer caches covering all ``num_tokens`` tokens (owned by
            the caller: continue decoding with it).
        logits: float32 ``[vocab]`` logits at the last position.
        logprobs: ``[vocab]`` log-softmax of ``logits``.
        cached_tokens: tokens reused from the prefix cache (0 when cold).
        num_tokens: prompt length (tokens).
        boundaries: the chunk end offsets that were run (tokens), ascending.
        timings: fetch phase seconds (``lookup``, ``copy``, ``restore``) plus
            ``prefill`` (seconds spent running the model).
    """

    cache: list[Any]
    logits: mx.array
    logprobs: mx.array
    cached_tokens: int
    num_tokens: int
    boundaries: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def chunk_boundaries(start: int, num_tokens: int, checkpoints: Iterable[int], step: int) -> list[int]:
    """Chunk end offsets for a prefill of tokens ``start .. num_tokens`` (see module doc)."""
    cuts = {c for c in checkpoints if start < c < num_tokens}
    cuts.update(range((start // step + 1) * step, num_tokens, step))
    if num_tokens - 1 > start:
        cuts.add(num_tokens - 1)
    cuts.add(num_tokens)
    return sorted(cuts)


class PrefillSession:
    """Run prompts through ``model`` reusing and feeding a :class:`PromptCacheManager`.

    Args:
        model: an mlx-lm model (from ``mlx_lm.load``).
        manager: the prefix cache; None runs every prompt cold and stores nothing.
        namespace: the cache group of this session's entries.
        prefill_step_size: maximum tokens per forward pass (chunks also end at
            absolute multiples of it).

    Not thread-safe (one session per thread); the manager may be shared.
    """

    def __init__(self, model: Any, manager: PromptCacheManager | None = None, namespace: str = "default",
                 prefill_step_size: int = 2048):
        if prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        self.model = model
        self.manager = manager
        self.namespace = namespace
        self.prefill_step_size = prefill_step_size

    def prefill(self, tokens: Sequence[int], checkpoints: Iterable[int] = ()) -> PrefillResult:
        """Prefill ``tokens`` (at least 1), reusing the longest usable cached prefix.

        Args:
            tokens: prompt token ids.
            checkpoints: offsets (tokens) at which to store snapshots, e.g. from
                :func:`cache.plan_chat_checkpoints`; offsets outside
                ``1 .. len(tokens) - 1`` are ignored.

        Returns:
            A :class:`PrefillResult`.

        Raises:
            ValueError: for an empty prompt.
        """
        import time

        tokens = [int(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        ckpts = {c for c in checkpoints if 0 < c < n}
        mgr = self.manager
        hit = mgr.fetch(self.namespace, tokens) if mgr is not None else None
        try:
            if hit is not None and hit.cache is not None:
                cache, start = hit.cache, hit.cached_tokens
            else:
                cache, start = make_prompt_cache(self.model), 0
            bounds = chunk_boundaries(start, n, ckpts, self.prefill_step_size)
            t0 = time.perf_counter()
            pos = start
            logits = None
            for end in bounds:
                out = self.model(mx.array(tokens[pos:end])[None], cache=cache)
                pos = end
                if end == n:
                    logits = out[0, -1].astype(mx.float32)
                    mx.eval(logits, rules.cache_arrays(cache))
                    break
                mx.eval(rules.cache_arrays(cache))
                if mgr is None:
                    continue
                if end in ckpts or (end == n - 1 and not rules.is_trimmable(cache)):
                    mgr.insert(self.namespace, tokens[:end], rules.safe_copy(cache))
            if mgr is not None:
                mgr.insert(self.namespace, tokens, rules.safe_copy(cache))
            elapsed = time.perf_counter() - t0
        finally:
            if hit is not None:
                mgr.release(hit.lease)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)
        timings = dict(hit.timings) if hit is not None else {}
        timings["prefill"] = elapsed
        return PrefillResult(cache, logits, logprobs, start, n, bounds, timings)
