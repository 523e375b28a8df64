"""One table of layer-cache kinds: what every part of the gateway does with each class.

A model's prompt cache is one mlx-lm layer cache per layer (``make_prompt_cache``). Each
class the gateway meets has one row in :data:`KINDS`, and every part that treats kinds
differently reads its column instead of testing classes:

==========  ==================================================================  ==========================
column      what it says                                                        read by
==========  ==================================================================  ==========================
restore     to how many tokens a snapshot of ``L`` can be brought: ``any``       ``cache/restore.py``
            ``T <= L`` (``trim`` lowers ``offset``), ``window`` (any while the
            layer's own ``is_trimmable()``, i.e. nothing rotated out), ``exact``
            (``T == L``: recurrent state cannot be "un-run"), ``members``
            (``CacheList``: as its members)
paged       its keys and values are stored as pages on the prefix tree's edges  ``cache/pages.py``
disk        how the disk tier writes it: ``state`` (its own mlx-lm state),       ``cache/disk_codec.py``
            ``quantized`` (as mlx-lm's ``QuantizedKVCache``, read back as a
            ``QuantizedKVRow``), ``kv`` (as mlx-lm's ``KVCache``, pages joined)
merge       how rows enter a decode batch: ``kv`` (into one ``BatchKVCache``     ``scheduler/batch_merge.py``
            with room for the next token), ``quantized`` (a
            ``BatchQuantizedKVCache``), ``mlx`` (the class's own mlx-lm merge)
quantize    ``--kv-bits`` may replace it by a ``QuantizedKVRow``                 ``cache/quantized.py``
rollback    how a rejected draft is taken back: ``mask`` (its positions become  ``scheduler/speculative/``
            holes), ``recurrent`` (state saved before the step, kept tokens      (``config.py``,
            replayed with ``lengths``), ``window`` (the same with right          ``rewind.py``)
            padding, ``prepare`` / ``finalize``); None: the model cannot
            speculate
batch       the class a decode batch holds it as                                :func:`batch_kind_of`
==========  ==================================================================  ==========================

The scheduler implements each ``merge`` and ``rollback`` strategy once; a new mlx-lm
cache class is one row here (and its tests: ``tests/test_cache_kinds.py`` fails for a
class of the test architectures without a row). A class with no row is looked up by its
bases, and failing that gets :data:`UNKNOWN`: restored exactly only, merged by mlx-lm, no
speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class CacheKind:
    """One layer-cache class (see the module docstring for the columns).

    Attributes:
        name: the class name (in ``mlx_lm.models.cache``, or this package's).
        restore: ``"any"``, ``"window"``, ``"exact"`` or ``"members"``.
        paged: stored as pages (``cache/pages.py``).
        disk: ``"state"``, ``"quantized"`` or ``"kv"``.
        merge: ``"kv"``, ``"quantized"`` or ``"mlx"``.
        quantize: ``--kv-bits`` quantizes it.
        rollback: ``"mask"``, ``"recurrent"``, ``"window"`` or None.
        batch: the name of its batch form in a decode batch, or None.
    """

    name: str
    restore: str = "exact"
    paged: bool = False
    disk: str = "state"
    merge: str = "mlx"
    quantize: bool = False
    rollback: Optional[str] = None
    batch: Optional[str] = None


KINDS: dict[str, CacheKind] = {k.name: k for k in (
    CacheKind("KVCache", "any", paged=True, merge="kv", quantize=True, rollback="mask", batch="BatchKVCache"),
    CacheKind("PagedKVCache", "any", paged=True, disk="kv", merge="kv", rollback="mask"),  # pages.py
    CacheKind("QuantizedKVRow", "any", paged=True, disk="quantized", merge="quantized", rollback="mask",
              batch="BatchQuantizedKVCache"),  # quantized.py: trim lowers offset, like KVCache
    CacheKind("QuantizedKVCache", disk="quantized"),  # mlx-lm's own: read back from disk as a row
    CacheKind("ConcatenateKVCache", "any"),
    CacheKind("RotatingKVCache", "window", rollback="window", batch="BatchRotatingKVCache"),
    CacheKind("ArraysCache", rollback="recurrent", batch="ArraysCache"),
    CacheKind("CacheList", "members", batch="CacheList"),
    CacheKind("ChunkedKVCache"),
    # gateway/models/vision_mrope.py: an M-RoPE row's delta per token, a KVCache that --kv-bits leaves alone
    CacheKind("MRopePositions", "any", paged=True, disk="kv", merge="kv", rollback="mask", batch="BatchKVCache"),
)}
UNKNOWN = CacheKind("unknown")
_BY_BATCH = {k.batch: k for k in reversed(KINDS.values()) if k.batch}  # the first row naming a batch wins


def kind_of(layer: Any) -> CacheKind:
    """The row of ``layer``, one sequence's layer cache (what the prefix cache stores): by
    its class name, or else the nearest base class that has a row; :data:`UNKNOWN` if none
    does."""
    return _lookup(layer, KINDS)


def batch_kind_of(layer: Any) -> CacheKind:
    """The row whose ``batch`` form ``layer`` (a decode batch's layer cache) is: by its class
    name, or else the nearest base class that is one; :data:`UNKNOWN` if none is."""
    return _lookup(layer, _BY_BATCH)


def _lookup(layer: Any, rows: dict[str, CacheKind]) -> CacheKind:
    return next((rows[c.__name__] for c in type(layer).__mro__ if c.__name__ in rows), UNKNOWN)
