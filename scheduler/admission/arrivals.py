"""Requests on their way to the engine, so that a burst starts in one batch.

The gateway renders and tokenizes a request (worker thread) before it submits it. When
several requests arrive together at an idle engine, the first one submitted would start
a step alone, and the others, submitted a few milliseconds later, would wait for that
whole step and then take one of their own: their TTFT is two steps instead of one (the
warm burst of ``benchmarks/bench_serve.py``: a step of one warm row, then a joining
step of five).

:class:`Arrivals` counts the requests the gateway has accepted and is still preparing.
An idle engine (no row prefilling or decoding) with a request to start waits at most
``gather_wait`` seconds (``--gather-wait``) for them, then starts them all in one step
(:meth:`scheduler.engine.loop.EngineLoop._gather`). A request that arrives alone waits for
nothing: its own count has dropped by the time it is submitted. An engine with rows
running never waits; new requests join at its next step, as in vLLM's and SGLang's
continuous batching, which have no such wait. Triton's dynamic batcher bounds a similar
wait (``max_queue_delay_microseconds``) but waits for requests that may never come;
this waits only for requests already inside the gateway.

The same count, by class, lets a loop that is about to start a step of lower-class work
wait the few milliseconds an interactive request needs to be tokenized instead
(:meth:`scheduler.engine.loop.EngineLoop._await_interactive`): it then starts at that step rather
than after it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator


class Arrivals:
    """A thread-safe count of requests being prepared (template, tokenizer).

    Args:
        wake: called (from the preparing thread) each time a preparation ends, so that an
            engine waiting for arrivals notices; must be thread-safe and not block.
    """

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._lock = threading.Lock()
        self._preparing = 0
        self._interactive = 0
        self.interactive_entered = 0  # interactive preparations begun so far (a loop waits once for each)

    @property
    def preparing(self) -> int:
        """Requests announced by :meth:`prepare` whose preparation has not ended."""
        return self._preparing

    @property
    def interactive(self) -> int:
        """Of those, the interactive ones (latency class 0)."""
        return self._interactive

    @contextlib.contextmanager
    def prepare(self, priority: int = 1) -> Iterator[None]:
        """Count one request (of latency class ``priority``) as being prepared for the
        duration of the block; submit it inside the block, so that the engine sees it
        before the count drops."""
        interactive = int(priority == 0)
        with self._lock:
            self._preparing += 1
            self._interactive += interactive
            self.interactive_entered += interactive
        if interactive:
            self._wake()  # a loop between steps may hold lower-class work for it
        try:
            yield
        finally:
            with self._lock:
                self._preparing -= 1
                self._interactive -= interactive
            self._wake()


def gather(preparing: Callable[[], int], inbox: queue.SimpleQueue, handle: Callable[[object], None], wait: float,
           stopping: Callable[[], bool]) -> float:
    """Handle ``inbox`` items until no request is being prepared (``preparing()``, the
    :attr:`Arrivals.preparing` of every engine on the loop, reads 0), ``wait`` seconds have
    passed or ``stopping()``; then every item already queued. A request is submitted
    before its count drops, so once the count reads 0 its submission is in ``inbox``.

    Returns:
        seconds waited.
    """
    start = time.monotonic()
    deadline = start + wait
    while preparing() and not stopping():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            handle(inbox.get(timeout=left))
        except queue.Empty:
            break
    while True:
        try:
            handle(inbox.get_nowait())
        except queue.Empty:
            return time.monotonic() - start
