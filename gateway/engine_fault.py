"""What the gateway does when the engine loop stalls or dies (``--on-engine-fault``).

``serve`` (the default) keeps the process up: ``/health`` answers 503 ``stalled`` or
``dead`` (:mod:`gateway.routes.service`) and the watchdog's metrics say so
(:mod:`scheduler.engine.watchdog`); a stall that ends clears itself. ``exit`` ends the process
for the service manager to start a fresh one (the deploy/ units restart on
:data:`EXIT_CODE`): new requests get 503 at once, every request in flight ends with its
protocol's error event (503, saying why), the request log gets its lines, and then the
process exits with :data:`EXIT_CODE`. The stalled engine thread cannot be stopped from
outside, and its MLX state cannot be trusted, so nothing is written to the disk tier.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from gateway.conversation import generation
from gateway.front import Front, running_calls

log = logging.getLogger("mlx_gateway")

# sysexits.h's EX_TEMPFAIL, "a temporary failure; try again": distinct from 1 (an error at
# start, such as a bad flag, which a restart would repeat) and from the signals' codes.
EXIT_CODE = 75
# Seconds the answers of the ended requests get to go out before the process exits.
FLUSH_SECONDS = 5.0


def fault_handler(front: Front, mode: str,
                  exit_process: Callable[[int], None] = os._exit) -> Optional[Callable[[str, str], None]]:
    """The watchdog's ``on_fault`` for ``--on-engine-fault mode``: None for ``serve``; for
    ``exit``, a handler that ends the requests in flight and calls ``exit_process(EXIT_CODE)``
    (once, whatever the number of faults).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode == "serve":
        return None
    if mode != "exit":
        raise ValueError(f"--on-engine-fault must be 'serve' or 'exit', not {mode!r}")
    once = threading.Lock()

    def on_fault(kind: str, detail: str) -> None:
        if not once.acquire(blocking=False):
            return
        message = f"the model engine {'stalled' if kind == 'stalled' else 'died'} ({detail}); the server restarts"
        log.critical("%s: ending %d requests in flight and exiting with status %d (--on-engine-fault exit)",
                     message, len(running_calls()), EXIT_CODE)
        front.draining = True  # new requests: 503 with Retry-After; /health: 503
        for g in list(generation.live):
            try:
                g.fail(503, message)
            except RuntimeError:  # its event loop is closed: nobody waits for it
                pass
        deadline = time.monotonic() + FLUSH_SECONDS
        while running_calls() and time.monotonic() < deadline:
            time.sleep(0.05)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        exit_process(EXIT_CODE)

    return on_fault
