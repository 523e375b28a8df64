"""Fault injection: a failure in one row of the batch (its sampler, a logits processor,
extracting its cache at a checkpoint) fails that request alone with a clear error; the
other rows keep exactly their solo tokens and the engine thread never dies."""

from __future__ import annotations

from conftest import EventSink, live_server, model_path
from scheduler import EngineRequest, SamplingParams
from scheduler.request import DoneEvent, ErrorEvent

GOOD = [list(range(5 + i, 40 + 3 * i)) for i in range(3)]


def run(engine, requests: list[tuple[str, list[int], SamplingParams, dict]]) -> dict[str, EventSink]:
    """Submit all requests at once (they share a batch) and wait for each to end."""
    out = {}
    for rid, tokens, params, extra in requests:
        out[rid] = EventSink()
        engine.submit(EngineRequest(rid, tokens, params, out[rid], **extra))
    for c in out.values():
        assert c.done.wait(120)
    return out


def solo(engine, n: int = 24) -> list[list[int]]:
    refs = []
    for i, tokens in enumerate(GOOD):
        engine.flush_cache()
        refs.append(run(engine, [(f"solo{i}", tokens, SamplingParams(max_tokens=n), {})])[f"solo{i}"].tokens)
    engine.flush_cache()
    return refs


def check_good_rows(engine, got: dict, refs: list) -> None:
    for i, ref in enumerate(refs):
        c = got[f"good{i}"]
        assert isinstance(c.events[-1], DoneEvent) and c.events[-1].finish_reason == "length", c.events[-1]
        assert c.tokens == ref, f"row {i} changed"
    assert engine.alive
    assert engine.metrics.engine_errors._value.get() == 0  # no batch step failed
    assert engine.call(lambda: engine.prompt_cache.num_leases) == 0


def good_rows(n: int = 24) -> list:
    return [(f"good{i}", t, SamplingParams(max_tokens=n), {}) for i, t in enumerate(GOOD)]


class RaisingProcessor:
    """A logits processor that raises once the row has generated ``after`` tokens."""

    error = None  # the mask interface: a grammar mask records its own errors here

    def __init__(self, after: int):
        self.after, self.calls = after, 0

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("injected processor fault")
        return logits


def test_a_raising_sampler_fails_its_row_alone():
    with live_server(model_path("qwen3")) as server:
        engine = server.engine
        refs = solo(engine)
        vocab = server.model.vocab_size
        # top_k equal to the vocabulary makes mlx-lm's top-k filter raise (the gateway
        # itself never sends it): the failure happens inside the batched decode step.
        bad = ("bad", list(range(7, 30)), SamplingParams(max_tokens=24, temperature=1.0, top_k=vocab), {})
        got = run(engine, good_rows() + [bad])
        err = got["bad"].events[-1]
        assert isinstance(err, ErrorEvent) and err.status == 500 and "sampling failed" in err.message
        check_good_rows(engine, got, refs)


def test_a_raising_logits_processor_fails_its_row_alone_mid_generation():
    with live_server(model_path("qwen3")) as server:
        engine = server.engine
        refs = solo(engine)
        bad = ("bad", list(range(7, 30)), SamplingParams(max_tokens=24), {"mask": RaisingProcessor(after=5)})
        got = run(engine, good_rows() + [bad])
        err = got["bad"].events[-1]
        assert isinstance(err, ErrorEvent) and "injected processor fault" in err.message
        assert 0 < len(got["bad"].tokens) <= 5  # tokens before the fault were sent, none after
        check_good_rows(engine, got, refs)


def test_a_failing_cache_extraction_fails_its_row_alone():
    with live_server(model_path("qwen3")) as server:
        engine = server.engine
        refs = solo(engine)
        real = engine.core.batch.gen.extract_cache

        def extract(uids):
            victim = engine.core.batch.by_id.get("bad")
            if victim is not None and victim.uid in uids:
                raise RuntimeError("injected extraction fault")
            return real(uids)

        engine.call(lambda: setattr(engine.core.batch.gen, "extract_cache", extract))
        bad = ("bad", list(range(3, 80)), SamplingParams(max_tokens=24), {"checkpoints": [40]})
        got = run(engine, good_rows() + [bad])
        err = got["bad"].events[-1]
        assert isinstance(err, ErrorEvent) and "injected extraction fault" in err.message
        check_good_rows(engine, got, refs)
        # The engine goes on serving.
        again = run(engine, [("after", GOOD[0], SamplingParams(max_tokens=24), {})])["after"]
        assert again.tokens == refs[0]


def test_a_fault_a_follower_marks_from_rank_0_fails_its_row_at_that_step():
    """A follower's sampler never runs: rank 0's fault flag for a row (synced with its
    tokens) marks the row's fault, and the follower's scan after the step must find it,
    as rank 0's does (else the follower goes on with a row rank 0 failed, e.g. stores the
    snapshot of one that also ends then, and the ranks are out of step)."""
    from types import SimpleNamespace

    import mlx.core as mx

    from scheduler.batch.row_failures import RowFailures
    from scheduler.batch.rows import EngineStats, Row
    from scheduler.distributed.follower import FollowerGenerator

    rows = {uid: Row(SimpleNamespace(id=f"r{uid}", mask=None), uid, None, 0, [], decoding=True) for uid in (1, 2)}
    failures = RowFailures(EngineStats(), None, None, lambda a, e: None)
    failures.fail_faulty(rows.values(), lambda a, why: None)  # a scan before: none failed
    cluster = SimpleNamespace(broadcast=lambda: ([5, 6], [0, 1]))  # rank 0: row 2's sampler raised
    follower = SimpleNamespace(_ops=SimpleNamespace(cluster=cluster), _owner=SimpleNamespace(active=rows))
    FollowerGenerator._sync(follower, SimpleNamespace(uids=[1, 2], _next_tokens=mx.array([0, 0], dtype=mx.uint32)))
    failed = []
    failures.fail_faulty(rows.values(), lambda a, why: failed.append((a.request.id, why)))
    assert failed == [("r2", "sampling failed: its sampler or logits processors failed on rank 0")]
