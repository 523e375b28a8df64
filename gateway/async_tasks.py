"""Ending an asyncio task for sure.

On Python 3.11, :func:`asyncio.wait_for` returns the inner result instead of raising
``CancelledError`` when the task awaiting it is cancelled in the same loop iteration as
the inner awaitable completes (CPython gh-86296; fixed in 3.12, whose ``wait_for`` is built
on ``asyncio.timeout``). A background loop that catches its calls' errors then carries on
as if it had never been cancelled, and ``task.cancel(); await task`` waits forever.
"""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task, timeout: float = 5.0, every: float = 0.05) -> bool:
    """Cancel ``task`` and wait until it has ended, cancelling it again every ``every``
    seconds (a cancellation may be lost, see the module's docstring), for ``timeout`` seconds
    at most. The task's own result or exception is discarded.

    Returns:
        True when the task ended; False when it still runs after ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(every, left))
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
    return True
