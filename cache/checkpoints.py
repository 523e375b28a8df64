"""Where a request's prefill is cut and snapshotted, decided when it starts (tokens only).

The offsets a prompt wants snapshots at are planned with it, above the cache, from the
chat template (:mod:`gateway.conversation.checkpoints`); here, when a request starts
prefilling, they become the cuts and snapshots the engine carries out:

- :func:`row_snapshots`: where the running request is cut into prefill segments and
  where it snapshots, from its planned offsets, the burst's extra ones and whether the
  cache can be trimmed (a cache that cannot also snapshots at ``len - 1``, for an exact
  repeat, and at ``len`` when the next turn shares the whole prompt); a next-turn
  precompute snapshots only at its end;
- :func:`divergence_snapshot`: where the leader of a cold burst snapshots for the
  followers that share its prefix (where their prompts diverge), unless one of its own
  offsets lies just before that point.

An offset can only cost reuse, never exactness: a snapshot covers the prompt's own
tokens, and the prefix tree matches tokens. All functions are pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length (tokens) of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i



def row_snapshots(n: int, cached: int, checkpoints: Iterable[int], extra: Iterable[int] = (), trimmable: bool = False,
                  precompute: bool = False, whole: bool = False) -> tuple[list[int], list[int]]:
    """Where a request starting its prefill cuts its prompt, and where it snapshots.

    Args:
        n: prompt tokens.
        cached: tokens restored from the prefix cache (prefill starts there).
        checkpoints: the offsets planned with the prompt (:func:`gateway.conversation.checkpoints.plan_chat_checkpoints`).
        extra: offsets added at admission (:func:`divergence_snapshot`).
        trimmable: the model's cache can be trimmed: the prompt + completion snapshot
            stored at the end serves ``len - 1`` and ``len``.
        precompute: a next-turn precompute, which exists for one snapshot: at ``n``.
        whole: the logits after the prompt are kept (:mod:`scheduler.first_tokens`): an
            untrimmable cache snapshots at ``n`` too, for an exact repeat to restore.

    Returns:
        ``(marks, snapshots)``: the offsets (tokens) where prefill segments end (a step
        never crosses one), and those where a snapshot is taken; both sorted, above
        ``cached``.
    """
    marks = sorted({p for p in [*checkpoints, *extra] if cached < p < n})
    if precompute:
        return marks, [n]
    snapshots = set(marks)
    if not trimmable:
        if n - 1 > cached:
            snapshots.add(n - 1)
        if (whole or n in set(checkpoints)) and n > cached:
            snapshots.add(n)
    return marks, sorted(snapshots)


def divergence_snapshot(point: int, cached: int, saved: Iterable[int], min_shared: int) -> Optional[int]:
    """Where a burst's leader snapshots for a follower whose prompt diverges from its own at
    ``point`` (tokens; both start from ``cached``): at ``point``, unless one of the
    leader's own offsets ``saved`` lies above ``cached`` and fewer than ``min_shared``
    tokens before it (e.g. the system prompt's end, when the users' messages start alike).
    The follower then restores that one and computes the few tokens after it itself, and
    the leader's prompt is not cut into one more segment: a segment end ends its prefill
    step, which would leave the leader a step behind its followers. None: no extra
    snapshot."""
    near = any(cached < p <= point and point - p < min_shared for p in saved)
    return None if near else point
