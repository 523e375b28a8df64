"""The measurements at load (gateway/cpu/measure.py): a race that the path being replaced
wins is run again, so that a spell of noise covering one race does not decide."""

from __future__ import annotations

import time
from types import SimpleNamespace

from gateway.cpu.measure import confirmed_race, pick


def _sleeper(times: list[float]):
    """A candidate whose n-th call sleeps times[n] seconds (the last one after that)."""
    calls = []

    def call():
        time.sleep(times[min(len(calls), len(times) - 1)])
        calls.append(1)

    call.calls = calls
    return call


def test_a_replacement_slowed_through_one_race_wins_the_next():
    """The replacement is slow through its first race's warm-up and rounds (a spell of
    noise), then fast: one race alone keeps the default, the confirmed race picks it."""
    default, fast = _sleeper([0.010]), _sleeper([0.030] * 4 + [0.002])
    seconds = confirmed_race({"mlx": default, "compiled": fast}, "mlx", rounds=3, pause=0.0)
    assert pick(seconds, "mlx") == "compiled"
    assert len(fast.calls) == 8  # two races of a warm-up and three rounds: the second decided
    assert seconds["compiled"] < 0.005 <= 0.010 <= seconds["mlx"]


def test_a_replacement_that_keeps_losing_is_raced_at_most_again_plus_one_times_and_a_winner_once(monkeypatch):
    from gateway.cpu import measure

    pauses: list[float] = []  # the module's pauses, recorded instead of slept
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=pauses.append))
    slow = _sleeper([0.012])
    seconds = confirmed_race({"mlx": _sleeper([0.004]), "compiled": slow}, "mlx", rounds=2)
    assert pick(seconds, "mlx") == "mlx" and len(slow.calls) == (measure.AGAIN + 1) * 3
    assert pauses == [measure.PAUSE * 2 ** i for i in range(measure.AGAIN)]  # growing: a long spell of noise ends
    monkeypatch.undo()
    quick = _sleeper([0.001])
    seconds = confirmed_race({"mlx": _sleeper([0.006]), "compiled": quick}, "mlx", rounds=2, pause=0.0)
    assert pick(seconds, "mlx") == "compiled" and len(quick.calls) == 3
