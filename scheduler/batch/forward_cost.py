"""What a prefill forward costs, as ``fixed + per_token * tokens``, and the smallest
chunk worth running.

Every forward pays a fixed part whatever its size: reading every weight once (a decode
step is little else), the per-layer op dispatch, the cache writes. A chunk of ``n``
tokens then costs ``fixed / n + per_token`` per token, so cutting chunks small to keep
decoding streams moving makes the prompt pay the fixed part more often. On the 2-core
machine of ``benchmarks/bench_serve.py`` the medium benchmark model's fixed part is about
2.5 ms and its per-token part about 0.11 ms (a 32-token chunk costs 0.19 ms a token, a
256-token one 0.12); SmolLM2-135M's are about 70 ms and 2 ms.

:func:`measure_forward_cost` times two forwards of the model at load (:data:`SIZES`
tokens, from an empty cache, where attention is negligible) and solves for the two
parts. :meth:`ForwardCost.floor` is the smallest chunk whose cost per token is at most
:data:`RISE` above the best chunk's (the largest one allowed, ``--prefill-step-size``):
``fixed / n + b <= (1 + RISE) (fixed / best + b)``. ``b`` there is the per-token cost
measured on the running prompt's recent chunks (it grows with the context the chunk
attends to, which makes the floor smaller as a long prompt advances), else the one
measured at load. :mod:`scheduler.batch.chunking` never sizes a chunk below it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("mlx_gateway.engine")

SIZES = (16, 64)  # tokens of the two timed forwards
RISE = 0.2  # a chunk may cost at most this much more per token than the best one


@dataclass(frozen=True)
class ForwardCost:
    """A prefill forward of ``n`` tokens takes about ``fixed + per_token * n`` seconds."""

    fixed: float
    per_token: float

    def floor(self, best: int, per_token: Optional[float] = None, rise: float = RISE) -> int:
        """The fewest tokens a forward may have (at most ``best``) for its cost per token to
        stay within ``rise`` of a forward of ``best`` tokens; ``per_token``: the marginal
        cost per token now (default: :attr:`per_token`)."""
        b = self.per_token if per_token is None else per_token
        if self.fixed <= 0:
            return 1
        denominator = rise * max(b, 0.0) + (1.0 + rise) * self.fixed / best
        return min(best, max(1, math.ceil(self.fixed / denominator)))

    def describe(self) -> str:
        return f"{1e3 * self.fixed:.2f} ms per forward + {1e3 * self.per_token:.3f} ms per token"


def solve(small: tuple[int, float], large: tuple[int, float]) -> ForwardCost:
    """The line through two ``(tokens, seconds)`` timings (its parts kept >= 0)."""
    (n1, t1), (n2, t2) = small, large
    per_token = max(0.0, (t2 - t1) / (n2 - n1))
    return ForwardCost(max(0.0, t1 - per_token * n1), per_token)


def _time_forward(model, n: int) -> float:
    """Seconds of one prefill forward of ``n`` tokens from an empty cache (cache evaluated,
    logits not, as mlx-lm's prefill does)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[(7 * i) % 500 + 3 for i in range(n)]])
    cache = make_prompt_cache(model)
    mx.eval(tokens)
    tic = time.perf_counter()
    model(tokens, cache=cache)
    mx.eval([c.state for c in cache])
    return time.perf_counter() - tic


def measure_forward_cost(model, sizes: tuple[int, int] = SIZES, rounds: int = 2) -> Optional[ForwardCost]:
    """Time forwards of each of ``sizes`` tokens from an empty cache (the fastest of
    ``rounds``, taking turns, after one untimed one each) and :func:`solve`; None if the
    model cannot run them here. They run on a stream of the calling thread's own (a model
    loads while the engine loop steps the others)."""
    import mlx.core as mx

    stream = mx.new_stream(mx.default_device())
    try:
        with mx.stream(stream):
            return _measure(model, sizes, rounds)
    finally:
        mx.synchronize(stream)


def _measure(model, sizes: tuple[int, int], rounds: int) -> Optional[ForwardCost]:
    try:
        for n in sizes:
            _time_forward(model, n)
        best = {n: _time_forward(model, n) for n in sizes}
        for _ in range(rounds - 1):
            for n in sizes:
                best[n] = min(best[n], _time_forward(model, n))
    except Exception as e:  # a model this cannot drive on its own (vision inputs, ...): no floor
        log.warning("measuring the prefill cost failed (%r): chunks have no floor", e)
        return None
    return solve(*((n, best[n]) for n in sizes))
