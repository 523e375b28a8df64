"""Disk-tier reads off the engine thread: a request's disk entry is read when it arrives.

Without this, a request whose prefix is on disk (and not in memory) had its file read and
verified on the engine thread at admission: every other row's step waited for the disk.
Now :meth:`DiskPrefetch.start` (called by :meth:`Engine.submit
<scheduler.engine.Engine.submit>`, on the caller's thread) finds, from the indexes alone,
whether the disk would restore at least ``cache.tiering.MIN_GAIN`` more tokens than memory;
if so the request is handed to the engine only once a prefetch thread has read and
verified the file (``DiskLink.prefetch``). The engine's lookup then only turns those numpy
arrays into MLX arrays (MLX stays on the engine thread) and inserts them. A request
cancelled while its file is read is cancelled as soon as it reaches the engine.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from cache import PromptCacheManager
from scheduler.request import EngineRequest

log = logging.getLogger("mlx_gateway.engine")


class DiskPrefetch:
    """Reads requests' disk entries on one thread of its own (thread-safe).

    Args:
        prompt_cache: the engine's prefix cache (its ``disk`` link, if any, is read).
        hand_over: called with ``(request, cancel_reason)`` once the read is done
            (``cancel_reason`` None unless the request was cancelled meanwhile).
    """

    def __init__(self, prompt_cache: PromptCacheManager, hand_over: Callable[[EngineRequest, Optional[str]], None]):
        self._cache = prompt_cache
        self._hand_over = hand_over
        self._pool: Optional[ThreadPoolExecutor] = None
        self._closed = False
        self._lock = threading.Lock()
        self._reading: dict[str, Optional[str]] = {}  # request id -> cancel reason

    def start(self, request: EngineRequest) -> bool:
        """Read ``request``'s disk entry in the background and hand it over when done;
        False (nothing started) when memory serves it as well as the disk would."""
        link = self._cache.disk
        if link is None or self._closed:
            return False
        try:
            have = self._cache.match_length(request.namespace, request.tokens)
            if link.worth_reading(request.namespace, request.tokens, have) is None:
                return False
        except Exception:  # the engine looks it up itself
            log.exception("looking up the disk entry of request %s failed", request.id)
            return False
        with self._lock:
            if self._closed:
                return False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-prefetch")
            self._reading[request.id] = None
            self._pool.submit(self._read, request)
        return True

    def _read(self, request: EngineRequest) -> None:
        try:
            link = self._cache.disk
            if link is not None:
                link.prefetch(request.namespace, request.tokens,
                              self._cache.match_length(request.namespace, request.tokens))
        except Exception:  # the engine reads it again, or computes the prefix
            log.exception("reading ahead the disk entry of request %s failed", request.id)
        finally:
            with self._lock:  # a cancel lands before the hand-over (and is passed on) or after it
                reason = self._reading.pop(request.id, None)
                self._hand_over(request, reason)

    def cancel(self, request_id: str, reason: str) -> None:
        """Remember that ``request_id`` was cancelled, if its file is being read."""
        with self._lock:
            if request_id in self._reading:
                self._reading[request_id] = reason

    def close(self) -> None:
        """Stop taking reads; those under way still hand their request over."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False)
