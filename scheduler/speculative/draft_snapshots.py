"""The draft model's KV in the prefix cache (``--speculative draft``): what a row leaves in
the draft batch is stored, and a row that joins the draft batch starts from the longest
stored prefix of its tokens instead of prefilling its whole context in the draft model.

A conversation's next turn, a regenerated answer and a paused row that comes back then
prefill only the draft tokens the cache lacks (for a next turn: the new user message and
the few tokens the row emitted before it drafts), as the target does.

The snapshots live in the target's :class:`cache.PromptCacheManager`, in a namespace of
their own beside each request's (``"<namespace>/draft"``, a companion of the request's:
:meth:`cache.lru.LRUEviction.add_companion`). They share the byte and entry bounds
(``--prompt-cache-bytes``, ``--prompt-cache-size``) and the least-recently-used order with
the target's snapshots, count in the request namespace's quota (a tenant's
``cache_bytes``), and appear in the ``cache_group`` metrics under their own name. They
never go to the disk tier: only this process's draft model can use them, and the disk
tier keys its files by the target alone. Their lookups are not counted in the hit-rate
metrics (``count=False``); the speculation statistics count the tokens they restore.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from cache.restore import cache_arrays

log = logging.getLogger(__name__)

SUFFIX = "/draft"  # a draft namespace is the request's namespace and this


class DraftSnapshots:
    """Store and restore draft-model rows in a prefix cache (engine thread only).

    Args:
        manager: the target's :class:`cache.PromptCacheManager`.
        namespace_of: the prefix-cache namespace of a decode-batch row, by uid (None when
            the row is not a request's: it is then neither stored nor restored).
    """

    def __init__(self, manager, namespace_of: Callable[[int], Optional[str]]):
        self.manager = manager
        self._namespace_of = namespace_of
        self._known: set[str] = set()  # draft namespaces already kept off the disk tier

    def namespace(self, uid: int) -> Optional[str]:
        """The draft namespace of row ``uid`` (None: it has none)."""
        owner = self._namespace_of(uid)
        if owner is None:
            return None
        ns = owner + SUFFIX
        if ns not in self._known:
            self.manager.eviction.add_companion(ns, owner)
            self._known.add(ns)
        return ns

    def restore(self, namespace: Optional[str], tokens: Sequence[int], layers: int) -> tuple[Optional[list], int]:
        """The draft cache of the longest stored prefix of ``tokens`` (at most
        ``len(tokens) - 1`` tokens, as every prefix-cache hit) and its length in tokens;
        ``(None, 0)`` on a miss, or when the stored row does not have ``layers`` layers.
        The caller owns the returned per-layer ``KVCache`` s (``[1, H, T, D]``)."""
        if namespace is None or len(tokens) < 2:
            return None, 0
        try:
            hit = self.manager.fetch(namespace, tokens, count=False)
        except Exception:  # the row prefills its draft cache as if nothing were stored
            log.exception("restoring a draft row from the prefix cache failed")
            return None, 0
        try:
            if hit.cache is None or len(hit.cache) != layers:
                return None, 0
            mx.eval(cache_arrays(hit.cache))  # the copy is the caller's, and holds no page
            return hit.cache, hit.cached_tokens
        finally:
            self.manager.release(hit.lease)

    def save(self, namespace: Optional[str], tokens: Sequence[int], cache: Callable[[], list[Any]]) -> bool:
        """Store ``cache()`` (one row's per-layer caches after exactly ``tokens``, built
        only if it is to be stored); False when nothing was stored (no namespace, no
        tokens, no room in the bounds, or building or inserting it failed: a draft row is
        only worth a later prefill, so nothing is raised)."""
        if namespace is None or not tokens or self.manager.max_bytes == 0 or self.manager.max_entries == 0:
            return False
        try:
            return self.manager.insert(namespace, list(tokens), cache())
        except Exception:
            log.exception("storing a draft row in the prefix cache failed")
            return False
