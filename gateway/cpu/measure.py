"""Short measurements at load that decide which code path runs on this machine.

Every replacement of MLX's own path on the CPU (:mod:`gateway.cpu.attention`,
:mod:`gateway.cpu.allocator`, :mod:`gateway.cpu.weights`, :mod:`gateway.cpu.blas`) wins
on some machines and loses on others: a compiled ``exp`` that is 3x faster where BLAS is
fast was 4x slower end to end on a machine with a slower BLAS. So each is used only
where a measurement on the served model's own shapes, taken when it loads, finds it
faster, and the log says what was chosen and with which figures.

:func:`race` times candidates against each other, interleaved (A B C A B C ...), and keeps
each one's fastest run: other processes on a shared machine only ever make a run slower,
so the minimum is the figure least moved by them. :func:`pick` turns such timings into a
choice; it is a pure function, so tests give it timings instead of measuring.
:func:`confirmed_race` races again where the path replaced won, so that a spell of noise
that covered a whole race does not decide.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

log = logging.getLogger("mlx_gateway")

# A replacement must beat the path it replaces by this fraction to be used: a tie keeps
# MLX's own path (fewer surprises, and noise cannot flip a tie into a switch).
MARGIN = 0.05


@dataclass
class Choice:
    """What a measurement decided.

    Attributes:
        what: the decision, e.g. ``"attention, prefill [9/3 heads of 64]"``.
        chosen: the name of the candidate used.
        seconds: each candidate's fastest run (seconds); empty when nothing was measured.
        reason: why nothing was measured, when so (a setting, not on the CPU, ...).
    """

    what: str
    chosen: str
    seconds: dict[str, float] = field(default_factory=dict)
    reason: Optional[str] = None

    def describe(self) -> str:
        """One line for the log: the choice and every candidate's time (ms)."""
        if not self.seconds:
            return f"{self.what}: {self.chosen} ({self.reason or 'not measured'})"
        figures = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in self.seconds.items())
        return f"{self.what}: {self.chosen} (measured: {figures})"

    def log(self) -> "Choice":
        log.info("chosen by measurement on this machine: %s", self.describe())
        return self


def pick(seconds: Mapping[str, float], default: str, margin: float = MARGIN) -> str:
    """The candidate to use, given each one's time: the fastest, unless it beats
    ``default`` by less than ``margin`` (a fraction of ``default``'s time), in which case
    ``default``. A candidate without a figure (it failed) is never picked.

    Raises:
        KeyError: ``default`` has no figure.
    """
    base = seconds[default]
    best = min(seconds, key=lambda name: seconds[name])
    return best if seconds[best] < base * (1.0 - margin) else default


def race(candidates: Mapping[str, Callable[[], object]], rounds: int = 3, budget: Optional[float] = None,
         sync: Optional[Callable[[object], None]] = None, warmup: int = 1) -> dict[str, float]:
    """Each candidate's fastest run, in seconds, after ``warmup`` untimed calls each (a
    fresh process's first calls also pay for growing the heap and loading kernels).

    Args:
        candidates: name -> a call that does the work; what it returns is passed to
            ``sync`` (for MLX: ``mx.eval``) inside the timing.
        rounds: timed runs of each candidate, interleaved.
        budget: seconds after which no new round starts (at least one timed round runs).
        sync: waits for the work the call returned (None: the call does its own).

    Returns:
        name -> seconds. A candidate that raises is left out (its error is logged).
    """
    sync = sync or (lambda _: None)
    live = {}
    for name, fn in candidates.items():
        try:
            for _ in range(max(1, warmup)):
                sync(fn())
            live[name] = fn
        except Exception as e:  # a candidate that cannot run here is simply not chosen
            log.warning("measuring %s failed: %r", name, e)
    best = {name: float("inf") for name in live}
    start = time.perf_counter()
    for r in range(rounds):
        if r and budget is not None and time.perf_counter() - start > budget:
            break
        for name, fn in live.items():
            tic = time.perf_counter()
            sync(fn())
            best[name] = min(best[name], time.perf_counter() - tic)
    return best


AGAIN = 3  # races run again, at most, while the path replaced wins (confirmed_race)
PAUSE = 0.1  # seconds before the first of them; each pause after is twice the one before


def confirmed_race(candidates: Mapping[str, Callable[[], object]], default: str, rounds: int = 3,
                   sync: Optional[Callable[[object], None]] = None, warmup: int = 1,
                   again: int = AGAIN, pause: float = PAUSE) -> dict[str, float]:
    """:func:`race`, run again (up to ``again`` times, after pauses of ``pause``, then twice
    and four times that, seconds) while :func:`pick` keeps ``default``, each candidate
    keeping its best figure over the races.

    Why: a spell of noise of 100-200 ms can cover a whole race, and it slows a kernel of
    many small operations far more than one of a few large ones; noise only slows, so the
    best figure over more races is the nearer one, and a replacement that wins is not
    raced again. The figures (a server in 16 that kept MLX's own and prefilled 3x slower
    for its life; why the pauses grow): docs/deployment.md.
    """
    seconds = race(candidates, rounds, sync=sync, warmup=warmup)
    for i in range(again):
        if default not in seconds or len(seconds) < 2 or pick(seconds, default) != default:
            break
        time.sleep(pause * 2 ** i)
        more = race(candidates, rounds, sync=sync, warmup=warmup)
        seconds = {name: min(s, more.get(name, s)) for name, s in seconds.items()}
    return seconds
