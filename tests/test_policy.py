"""The admission policy on its own: longest cached prefix first, FCFS when the queue is
long, and requests sharing an uncached prefix wait for one leader."""

from __future__ import annotations

import pytest

from scheduler.admission.policy import LPM_MAX_WAITING, MIN_SHARED_PREFIX, InFlight, WaitingQueue
from scheduler.request import EngineRequest, SamplingParams


def req(rid: str, tokens: list[int], ns: str = "default") -> EngineRequest:
    return EngineRequest(rid, tokens, SamplingParams(), sink=lambda e: None, namespace=ns)


def test_longest_cached_prefix_first():
    q = WaitingQueue()
    for rid, n in [("a", 0), ("b", 50), ("c", 10)]:
        q.add(req(rid, [n] * 3 + [ord(rid)]))
    cached = {"a": 0, "b": 50, "c": 10}
    picked = [a.request.id for a in q.pick(3, lambda r: cached[r.id], [])]
    assert picked == ["b", "c", "a"]


def test_fcfs_when_queue_is_long():
    q = WaitingQueue()
    n = LPM_MAX_WAITING + 1
    for i in range(n):
        q.add(req(f"r{i}", [i, i + 1]))
    picked = [a.request.id for a in q.pick(3, lambda r: int(r.id[1:]), [])]
    assert picked == ["r0", "r1", "r2"]


def test_shared_prefix_waits_for_leader():
    shared = list(range(100, 200))
    q = WaitingQueue()
    for i in range(4):
        q.add(req(f"r{i}", shared + [i] * 10))
    q.add(req("other", list(range(500, 600))))
    q.add(req("elsewhere", shared + [9] * 10, ns="other-group"))
    first = q.pick(6, lambda r: 0, [])
    ids = [a.request.id for a in first]
    assert ids == ["r0", "other", "elsewhere"]
    assert first[0].extra_checkpoints == [100]  # the leader snapshots the shared prefix
    # While the leader has not passed offset 100, the followers keep waiting.
    leader = InFlight(first[0].request, [100])
    assert q.pick(6, lambda r: 0, [leader]) == []
    # Once the snapshot exists the followers are admitted, flagged as having waited.
    later = q.pick(6, lambda r: 100, [InFlight(first[0].request, [])])
    assert [a.request.id for a in later] == ["r1", "r2", "r3"]
    assert all(a.waited_for_prefix for a in later)


def test_short_shared_prefix_does_not_wait():
    q = WaitingQueue()
    q.add(req("a", list(range(20)) + [1, 2, 3]))
    q.add(req("b", list(range(20)) + [4, 5, 6]))
    assert [a.request.id for a in q.pick(2, lambda r: 0, [])] == ["a", "b"]


def test_leader_checkpoint_just_before_the_divergence_serves_the_followers():
    # The prompts share a "system prompt" (checkpoint at 100) plus 4 more tokens.
    shared = list(range(100, 204))
    q = WaitingQueue()
    for i in range(3):
        r = req(f"r{i}", shared + [i] * 20)
        r.checkpoints = [100]
        q.add(r)
    first = q.pick(3, lambda r: 0, [])
    assert [a.request.id for a in first] == ["r0"]
    # No snapshot at 104: the leader's prompt keeps the cuts its followers' prompts have.
    assert first[0].extra_checkpoints == []
    assert q.pick(3, lambda r: 0, [InFlight(first[0].request, [100])]) == []  # they wait for 100
    later = q.pick(3, lambda r: 100, [InFlight(first[0].request, [])])
    assert [a.request.id for a in later] == ["r1", "r2"]


@pytest.mark.parametrize("checkpoint,extra", [(50, [100]), (68, [100]), (69, []), (100, [])])
def test_leader_checkpoint_far_from_the_divergence_gets_one_there(checkpoint, extra):
    """A snapshot where the prompts diverge (100) unless the leader's own checkpoint lies
    fewer than MIN_SHARED_PREFIX (32) tokens before it."""
    assert MIN_SHARED_PREFIX == 32
    shared = list(range(100, 200))
    q = WaitingQueue()
    for i in range(2):
        r = req(f"r{i}", shared + [i] * 20)
        r.checkpoints = [checkpoint]
        q.add(r)
    first = q.pick(2, lambda r: 0, [])
    assert [a.request.id for a in first] == ["r0"]
    assert first[0].extra_checkpoints == extra



def test_row_snapshots_are_decided_in_one_place():
    from cache.checkpoints import row_snapshots

    # Segments end at the planned and the extra offsets above what is cached.
    assert row_snapshots(100, 10, [5, 50, 100], [70]) == ([50, 70], [50, 70, 99, 100])
    # A cache that can be trimmed needs neither len-1 nor len: the final snapshot serves both.
    assert row_snapshots(100, 10, [5, 50, 100], [70], trimmable=True) == ([50, 70], [50, 70])
    # Nothing at or below the cached length; a one-token suffix has no len-1 to save.
    assert row_snapshots(100, 99, [50, 100], []) == ([], [100])
    # A next-turn precompute snapshots only at its end.
    assert row_snapshots(100, 10, [100], [], precompute=True) == ([], [100])
