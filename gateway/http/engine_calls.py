"""Work that must run on the engine thread, asked for from the event loop or another thread.

MLX is used by the engine thread only (on Metal, MLX from several threads at once is a
crash class). The prefix cache's snapshots are MLX arrays, so whatever may free them
(an admin flush, a quota that shrinks on a tenants reload) runs there too, between two
engine steps, through :meth:`scheduler.Engine.call`. These helpers wait for it without
blocking the event loop.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable

import anyio

from gateway.http.errors import APIError
from scheduler import Engine, EngineDead

log = logging.getLogger("mlx_gateway.engine_calls")

# Seconds to wait for the engine to take a call: it does so between two steps.
CALL_TIMEOUT = 60.0


async def on_engine(engine: Engine, fn: Callable[[], Any], timeout: float = CALL_TIMEOUT) -> Any:
    """Run ``fn()`` on the engine thread between two steps and return its result; a worker
    thread waits for the answer, so the event loop keeps serving meanwhile.

    Raises:
        APIError: 503 when the engine is not running or did not take the call within
            ``timeout`` seconds (it may still run it later).
        Exception: whatever ``fn`` raised.
    """
    try:
        return await anyio.to_thread.run_sync(engine.call, fn, timeout)
    except EngineDead as e:
        raise APIError(503, f"the model engine is not available: {e}", code="engine_unavailable")
    except TimeoutError:
        raise APIError(503, f"the model engine did not answer within {timeout:g} s", code="engine_busy",
                       headers={"Retry-After": "1"})


def post_to_engine(engine: Engine, fn: Callable[[], Any], timeout: float = CALL_TIMEOUT) -> Future:
    """Run ``fn()`` on the engine thread without waiting for it: for callers that must not
    block, such as a signal handler on the event loop's thread.

    Returns a :class:`concurrent.futures.Future` holding ``fn``'s result, or the error:
    :class:`scheduler.EngineDead` (the engine is not running), :class:`TimeoutError` (no
    answer within ``timeout`` seconds) or what ``fn`` raised, which is also logged.
    Two posts may reach the engine in either order: ``fn`` should read the state to
    apply when it runs rather than capture it when posted.
    """
    done: Future = Future()

    def wait() -> None:
        try:
            done.set_result(engine.call(fn, timeout))
        except BaseException as e:
            log.warning("a call posted to the engine failed: %r", e)
            done.set_exception(e)

    threading.Thread(target=wait, name="engine-call-waiter", daemon=True).start()
    return done
