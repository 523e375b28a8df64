"""Prefix cache for mlx-gateway: snapshots of mlx-lm prompt caches in a token radix tree.

Public API::

    from cache import PromptCacheManager, CacheHit
    mgr = PromptCacheManager(max_bytes=2**30, max_entries=256)
    hit = mgr.fetch("tenant-a", tokens)       # hit.cache, hit.cached_tokens, hit.lease, hit.timings
    ...
    mgr.release(hit.lease)
    mgr.insert("tenant-a", tokens, cache)     # -> bool

Modules: ``tree`` (radix tree), ``manager`` (leases, LRU, bounds), ``budget`` (one
bound over several models' managers), ``restore``
(what each cache type can be restored to), ``checkpoints`` (where to snapshot),
``metrics`` (prometheus), ``session`` (library prefill with caching).
"""

from .budget import CacheBudget
from .checkpoints import (
    DEFAULT_INTERVAL,
    encode_with_ends,
    periodic_checkpoints,
    plan_chat_checkpoints,
    plan_completion_checkpoints,
    render_text,
)
from .entries import CacheHit, Lease
from .manager import PromptCacheManager
from .metrics import CacheMetrics
from .restore import RULES, can_restore, is_trimmable, safe_copy
from .session import PrefillResult, PrefillSession, chunk_boundaries

__all__ = [
    "CacheBudget",
    "CacheHit",
    "CacheMetrics",
    "DEFAULT_INTERVAL",
    "Lease",
    "PrefillResult",
    "PrefillSession",
    "PromptCacheManager",
    "RULES",
    "can_restore",
    "chunk_boundaries",
    "encode_with_ends",
    "is_trimmable",
    "periodic_checkpoints",
    "plan_chat_checkpoints",
    "plan_completion_checkpoints",
    "render_text",
    "safe_copy",
]
