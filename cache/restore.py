"""Restore rules for mlx-lm layer caches: the ONE place that says what can be reused.

A *snapshot* is a list of mlx-lm layer caches (one per model layer) holding the
state after exactly ``L`` tokens. A request that wants ``T`` tokens of it
(``T <= L``) can use it only if every layer can be brought to exactly ``T``: the
``restore`` column of each layer's row in :data:`cache.kinds.KINDS` says when (``KVCache``
and quantized rows: any ``T <= L``; ``RotatingKVCache``: while nothing was rotated out;
``ArraysCache``, recurrent state: ``T == L`` only; ``CacheList``: as its members; a class
with no row: ``T == L`` only).

Paged layers (float ``KVCache``, quantized ``QuantizedKVRow``) are handed out as new
objects over the pages (``pages.py``: a ``PagedKVCache``, or a ``QuantizedKVRow`` of the
pages joined; a single page as a new handle on its buffer); every other layer is a :func:`safe_copy`: ``copy.deepcopy`` of the layer
caches. MLX arrays are immutable values with shared buffers, so a deep copy gives
every array a *new handle* on the same buffer (no memory is duplicated up front);
the first write through ``update_and_fetch`` then copies the buffer and leaves the
stored snapshot intact. A shallow copy (two cache objects holding the *same*
``mx.array`` object) is NOT safe: ``KVCache.update_and_fetch`` assigns
``self.keys[..., a:b, :] = k`` in place and the write shows through every holder of
that array object (see mlx-lm issue #965, KV cross-contamination).

Recurrent state also depends on where prefill chunks were cut; an exact snapshot
is exact only relative to a cold run that cuts chunks at the same offsets.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .kinds import kind_of


def layer_trimmable(layer: Any) -> bool:
    """True if this one layer cache can be trimmed to any shorter prefix (its kind's ``restore``)."""
    rule = kind_of(layer).restore
    if rule == "any":
        return True
    if rule == "window":
        return bool(layer.is_trimmable())
    if rule == "members":
        return all(layer_trimmable(c) for c in layer.caches)
    return False


def is_trimmable(cache: Sequence[Any]) -> bool:
    """True if every layer of ``cache`` (a list of layer caches) can be trimmed."""
    return all(layer_trimmable(c) for c in cache)


def always_trimmable(cache: Sequence[Any]) -> bool:
    """True if every layer of ``cache`` can be trimmed whatever it holds (rule ``any``, or a
    ``CacheList`` of such): a model whose caches need no checkpoint at a boundary, because
    any longer snapshot serves it. A sliding window is not (it stops being trimmable once
    it rotates), nor is recurrent state."""
    def rule_any(layer: Any) -> bool:
        rule = kind_of(layer).restore
        return rule == "any" or (rule == "members" and all(rule_any(c) for c in layer.caches))

    return all(rule_any(c) for c in cache)


def can_restore(cache: Sequence[Any], stored_tokens: int, wanted_tokens: int) -> bool:
    """Can a snapshot of ``stored_tokens`` tokens be brought to exactly ``wanted_tokens``?

    Args:
        cache: the stored snapshot (list of layer caches); only inspected.
        stored_tokens: tokens the snapshot covers.
        wanted_tokens: tokens wanted (``0 < wanted_tokens``).
    """
    return restorable(stored_tokens, wanted_tokens, wanted_tokens == stored_tokens or is_trimmable(cache))


def restorable(stored_tokens: int, wanted_tokens: int, trimmable: bool) -> bool:
    """The rule of :func:`can_restore` for a snapshot already known to be ``trimmable``
    or not: ``0 < wanted <= stored``, and ``wanted == stored`` unless trimmable."""
    return 0 < wanted_tokens <= stored_tokens and (wanted_tokens == stored_tokens or trimmable)


def safe_copy(cache: Sequence[Any]) -> list[Any]:
    """A private copy of a snapshot that its receiver may write freely.

    ``copy.deepcopy`` gives each array a new handle on the shared buffer: O(layers)
    time, no array memory until the copy is written (copy-on-write by MLX).
    """
    return copy.deepcopy(list(cache))


def restore(cache: list[Any], stored_tokens: int, wanted_tokens: int) -> list[Any]:
    """Trim a *private copy* in place from ``stored_tokens`` to ``wanted_tokens`` tokens.

    Raises:
        ValueError: if :func:`can_restore` says no.
    """
    if not can_restore(cache, stored_tokens, wanted_tokens):
        raise ValueError(
            f"cannot restore a {stored_tokens}-token snapshot to {wanted_tokens} tokens"
        )
    n = stored_tokens - wanted_tokens
    if n:
        for c in cache:
            c.trim(n)
    return cache


def cache_arrays(cache: Sequence[Any]) -> list[mx.array]:
    """All ``mx.array`` leaves of a list of layer caches (for ``mx.eval`` or comparison)."""
    out = []
    for c in cache:
        for _, v in tree_flatten(c.state):
            if isinstance(v, mx.array):
                out.append(v)
    return out


def nbytes_by_type(cache: Sequence[Any]) -> dict[str, int]:
    """Bytes held by a snapshot, per layer cache class name (``.nbytes`` of each layer).

    Counts whole buffers (a ``KVCache`` grows in 256-token steps), and counts a
    buffer shared with another snapshot once per snapshot (an upper bound).
    """
    out: dict[str, int] = {}
    for c in cache:
        name = type(c).__name__
        out[name] = out.get(name, 0) + int(c.nbytes)
    return out


def layer_bytes(caches: Sequence[Any]) -> int:
    """Bytes of the layer caches' buffers (``.nbytes``; nothing is evaluated; a layer
    with no arrays yet counts 0)."""
    total = 0
    for c in caches:
        try:
            total += int(c.nbytes)
        except Exception:  # an empty layer cache has no arrays yet
            pass
    return total


def token_count(cache: Sequence[Any]) -> int | None:
    """Tokens covered according to the layers that track an integer ``offset``, or None."""
    for c in cache:
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    return None
