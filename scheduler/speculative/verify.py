"""Verifying a row's drafts against the model's own distribution.

Greedy rows accept the longest run of drafts equal to the argmax at each position, so
their output is the tokens plain decoding gives. Sampled rows use speculative sampling
(Leviathan et al., 2023; Chen et al., 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", algorithm 2): draft ``d`` at a position whose target
distribution is ``p`` is accepted with probability ``min(1, p(d) / q(d))``, and on
rejection the token is drawn from ``max(0, p - q)`` renormalized. Prompt lookup drafts
are deterministic (``q`` is one-hot on ``d``), so that is: accept with probability
``p(d)``, else draw from ``p`` with ``d`` removed. Every emitted token is then
distributed exactly as plain sampling would give it.
"""

from __future__ import annotations

import mlx.core as mx

from scheduler.sampling import TemperatureSampler


def accept_greedy(targets: list[int], draft: list[int]) -> int:
    """Drafts accepted: the leading ``draft[j] == targets[j]`` (``targets`` are the argmax
    tokens at the row's ``len(draft) + 1`` verified positions)."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a


def accept_sampled(sampler: TemperatureSampler, logprobs: mx.array, draft: list[int]) -> tuple[int, int]:
    """Speculative sampling of one row.

    Args:
        sampler: the row's sampler (its filters, temperature and key chain).
        logprobs: ``[len(draft) + 1, V]``, the model's log-probabilities at each verified
            position (position ``j`` predicts the token after ``draft[j - 1]``).
        draft: the drafted tokens.

    Returns:
        ``(accepted, token)``: how many drafts were accepted, and the token that follows
        them (drawn from the residual distribution at a rejection, else from the
        position after the last draft).
    """
    k = len(draft)
    logits = sampler.scaled(logprobs)  # [k + 1, V]
    probs = mx.softmax(logits[:k], axis=-1)
    p_draft = mx.take_along_axis(probs, mx.array(draft)[:, None], axis=1)[:, 0]
    u = sampler.uniform(k)
    mx.eval(p_draft, u)
    for j, (p, x) in enumerate(zip(p_draft.tolist(), u.tolist())):
        if x >= p:  # rejected: draw from p without draft[j]
            residual = logits[j:j + 1]
            residual = mx.where(mx.arange(residual.shape[-1]) == draft[j], -mx.inf, residual)
            return j, int(sampler.draw(residual).item())
    return k, int(sampler.draw(logits[k:k + 1]).item())
