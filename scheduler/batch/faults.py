"""Per-row fault isolation: an exception in one request's sampler or logits processors
is recorded on that request instead of being raised inside mlx-lm's batched step,
where it would fail every request in the batch.

The engine checks :attr:`RowFault.error` after each step and fails only that request,
before the token its broken sampler produced is sent (mlx-lm samples a row's next token
one step before it returns it).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import mlx.core as mx

from scheduler.sampling import greedy


class RowFault:
    """The first error raised by one request's sampler or logits processors.

    Wrap the row's callables with :meth:`sampler` and :meth:`processors` before inserting
    it into the batch. A failing sampler returns the greedy token (``[1]``) and a failing
    processor returns its input logits ``[1, V]`` unchanged, so the batch step completes;
    the row is failed right after it.
    """

    raised = 0  # errors recorded by every row so far (engine thread): rows are scanned for one only after it grew

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None

    def mark(self, e: BaseException) -> None:
        """Keep ``e`` as the row's error unless it has one (found by the next scan,
        :meth:`RowFailures.fail_faulty <scheduler.batch.row_failures.RowFailures.fail_faulty>`)."""
        RowFault.raised += 1
        if self.error is None:
            self.error = e

    def _record(self, e: BaseException) -> None:
        self.mark(e)
        # mlx-lm's samplers are compiled with MLX's global PRNG key as state; one that
        # raises mid-trace leaves that key a placeholder without a primitive, which would
        # fail every later unseeded sample: start a fresh key.
        mx.random.seed(int.from_bytes(os.urandom(4), "little"))

    def sampler(self, sample: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        """``sample`` guarded; greedy is returned as is (it cannot fail, and mlx-lm
        samples a batch whose rows share one sampler object in one call)."""
        if sample is greedy:
            return sample

        def guarded(logprobs: mx.array) -> mx.array:
            try:
                return sample(logprobs)
            except Exception as e:
                self._record(e)
                return greedy(logprobs)

        guarded.inner = sample  # the sampler itself (speculative decoding's rejection sampling)
        return guarded

    def processors(self, processors: list) -> list:
        """Each of mlx-lm's ``processor(tokens, logits) -> logits`` guarded."""
        return [self._processor(p) for p in processors]

    def _processor(self, process):
        def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
            try:
                return process(tokens, logits)
            except Exception as e:
                self._record(e)
                return logits

        guarded.inner = process  # the processor itself (speculative decoding rewinds it)
        return guarded


# Fault injection for tests of a real gateway process (never set in production): the
# variable holds ``stall:PATH`` or ``crash:PATH``. While the file PATH exists, each turn
# of the engine loop stalls (sleeps until the file is removed) or the loop crashes (raises
# :class:`InjectedFault` outside any one engine's guard, as a bug in the loop would).
FAULT_ENV = "MLX_GATEWAY_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """The crash injected by ``MLX_GATEWAY_INJECT_FAULT=crash:PATH``."""


def _injection(value: Optional[str]) -> Optional[tuple[str, str]]:
    kind, _, path = (value or "").partition(":")
    return (kind, path) if kind in ("stall", "crash") and path else None


_INJECTION = _injection(os.environ.get(FAULT_ENV))


def inject_fault() -> None:
    """The fault ``MLX_GATEWAY_INJECT_FAULT`` asks for, when its file exists (loop thread;
    one stat per turn when the variable is set, nothing otherwise).

    Raises:
        InjectedFault: for ``crash:PATH`` while PATH exists.
    """
    if _INJECTION is None:
        return
    kind, path = _INJECTION
    if not os.path.exists(path):
        return
    if kind == "crash":
        raise InjectedFault(f"fault injected by {FAULT_ENV}")
    while os.path.exists(path):
        time.sleep(0.05)
