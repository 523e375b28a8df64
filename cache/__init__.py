"""Prefix cache for mlx-gateway: snapshots of mlx-lm prompt caches in a token radix tree.

Public API::

    from cache import PromptCacheManager, CacheHit
    mgr = PromptCacheManager(max_bytes=2**30, max_entries=256)
    hit = mgr.fetch("tenant-a", tokens)       # hit.cache, hit.cached_tokens, hit.lease, hit.timings
    ...
    mgr.release(hit.lease)
    mgr.insert("tenant-a", tokens, cache)     # -> bool

Modules: ``tree`` (radix tree), ``manager`` (leases, LRU, bounds), ``budget`` (one
bound over several models' managers), ``kinds`` (one row per layer-cache class),
``restore`` (what each cache type can be restored to), ``checkpoints`` (where a starting
request snapshots), ``metrics`` (prometheus). Prefill runs in the engine
(``scheduler.Engine``), over this cache.
"""

from .budget import CacheBudget
from .leases import CacheHit
from .manager import PromptCacheManager
from .restore import is_trimmable, safe_copy

__all__ = ["CacheBudget", "CacheHit", "PromptCacheManager", "is_trimmable", "safe_copy"]
