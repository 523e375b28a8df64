"""The batch-equivalence guard: is a padded batch exact for this model?

mlx-lm's batching is exact (logprobs within 1e-5) for most architectures, but not for
all: in mlx-lm 0.32.2 ``nemotron_h`` padded rows differ by up to 3.8 because its SSM
ignores ``cache.lengths``. So when a model loads, two prompts of different lengths
are run batched (with padding) and alone, and their logprobs are compared.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from scheduler.sampling import greedy

# Summation order alone moves logprobs by up to about 2e-4 on a real 30-layer model with a
# 49k vocabulary in float32 (SmolLM2-135M-Instruct: 2.1e-4), where broken padding moves them
# by tenths or more (nemotron_h: 3.8); greedy tokens must match exactly in any case.
TOLERANCE = 1e-3


def _run(model, prompts: list[list[int]], steps: int) -> list[list[mx.array]]:
    # A stream of the calling thread's own: mlx-lm's default generation stream is the
    # engine loop's, and a model is probed on its load thread while the loop runs.
    stream = mx.new_stream(mx.default_device())
    gen = BatchGenerator(model, max_tokens=steps, sampler=greedy, prefill_batch_size=len(prompts),
                         completion_batch_size=len(prompts), stream=stream)
    uids = gen.insert(prompts)
    out: dict[int, list[mx.array]] = {u: [] for u in uids}
    try:
        while any(len(v) < steps for v in out.values()):
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                out[r.uid].append(r.logprobs)
    finally:
        gen.close()
        # The step mlx-lm computes ahead is still running: let it end here (a split model's
        # collectives must not overlap the next ones; scheduler.distributed).
        mx.synchronize(stream)
    return [out[u] for u in uids]


def max_batch_deviation(model, steps: int = 3) -> float:
    """Largest absolute logprob difference between batched and single runs.

    Runs prompts of 5 and 11 tokens (ids 1..16, present in any vocabulary) for
    ``steps`` greedy tokens. Returns ``inf`` if the greedy tokens differ.
    """
    prompts = [[(7 * i) % 16 + 1 for i in range(5)], [(3 * i) % 16 + 1 for i in range(11)]]
    batched = _run(model, prompts, steps)
    worst = 0.0
    for prompt, lps in zip(prompts, batched):
        (single,) = _run(model, [prompt], steps)
        if len(single) != len(lps):
            return float("inf")
        for a, b in zip(single, lps):
            if int(mx.argmax(a).item()) != int(mx.argmax(b).item()):
                return float("inf")
            worst = max(worst, float(mx.max(mx.abs(a - b)).item()))
    return worst


def batch_is_exact(model, tolerance: float = TOLERANCE) -> bool:
    """True when padded batches match single requests within ``tolerance`` (logprobs)."""
    return max_batch_deviation(model) <= tolerance
