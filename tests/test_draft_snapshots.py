"""The draft model's KV in the prefix cache (``--speculative draft``): rows leaving the
draft batch are stored, a next turn or a resumed row restores the longest stored prefix
of its tokens instead of prefilling its whole context in the draft model, the restored
cache is the draft model's cold prefill of those tokens, and the served tokens stay
plain decoding's. Draft snapshots never reach the disk tier."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cache import PromptCacheManager
from cache.restore import layer_bytes
from conftest import model_path
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.sampling import greedy
from scheduler.speculative import DraftSnapshots, SpeculationStats, Speculator
from test_draft_model import JoinRecorder, _draft, _other_weights, _workload
from test_speculative import steady_step_cost  # noqa: F401 (autouse: a fixed cost per drafted position)

NAMESPACE = "tenant-a"


def _generator(model, speculator=None) -> JoiningBatchGenerator:
    return JoiningBatchGenerator(model, speculator=speculator, max_tokens=1 << 20, prefill_batch_size=4,
                                 completion_batch_size=8, prefill_step_size=64, sampler=greedy)


def _run(gen, prompt: list[int], max_tokens: int, each_step=None) -> list[int]:
    """``prompt``'s generated tokens on ``gen`` (alone), calling ``each_step(uid)`` after
    every step."""
    [uid] = gen.insert([prompt], max_tokens=[max_tokens])
    out = []
    while True:
        responses = gen.next()[1]
        if each_step is not None:
            each_step(uid)
        for r in responses:
            if r.uid == uid:
                out.append(r.token)
                if r.finish_reason:
                    return out


def _check_draft_row(spec, gen, draft, uid) -> int:
    """Compare row ``uid``'s draft cache with the draft model's (``draft``: a
    :class:`JoinRecorder`) cold prefill of the tokens it holds; 1 if the row is in the draft batch (and was compared), else 0."""
    drafter, batch = spec.drafter, gen._generation_batch
    if uid not in drafter.uids or uid not in batch.uids:
        return 0
    j = drafter.uids.index(uid)
    tokens = batch.tokens[batch.uids.index(uid)][: drafter.fed[j]]
    row = [c.extract(j) for c in drafter.cache]
    assert row[0].offset == drafter.fed[j] == len(tokens)
    cold = make_prompt_cache(draft.model)
    draft.model(mx.array(tokens)[None], cache=cold)  # not recorded as a join
    for got, want in zip(row, cold):
        assert mx.allclose(got.keys[..., : got.offset, :], want.keys[..., : want.offset, :], atol=1e-4)
        assert mx.allclose(got.values[..., : got.offset, :], want.values[..., : want.offset, :], atol=1e-4)
    return 1


@pytest.mark.parametrize("which", ["same", "other"])
def test_a_next_turn_restores_its_draft_rows_from_the_prefix_cache(which, tmp_path_factory):
    """Turn 1 leaves its draft row in the prefix cache (namespace ``<ns>/draft``); turn 2
    (turn 1's prompt and answer, then a new message) restores it: the draft model
    prefills only the tokens the stored row lacks, the restored row equals a cold
    prefill at every step, and both turns' tokens equal plain decoding's. With drafts
    mostly accepted (the target as its own draft) and mostly rejected (rows cool down
    and their draft cache lags; turn 2 then runs on a fresh batch, as after a failed
    step, so that its row drafts at all)."""
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    draft = JoinRecorder(model if which == "same" else mlx_lm.load(str(_other_weights(tmp_path_factory)))[0])
    prompts, _ = _workload(4)
    prompt = prompts[0]
    new_message = [random.Random(9).randrange(10, 500) for _ in range(20)]
    plain = _generator(model)
    want_1 = _run(plain, prompt, 40)
    want_2 = _run(plain, prompt + want_1 + new_message, 40)
    plain.close()

    manager = PromptCacheManager(1 << 30, 64)
    stats = SpeculationStats()
    spec = Speculator(_draft(model, draft, k=3), stats, snapshots=DraftSnapshots(manager, lambda uid: NAMESPACE))
    gen = _generator(model, spec)
    compared = []
    got_1 = _run(gen, prompt, 40, lambda uid: compared.append(_check_draft_row(spec, gen, draft, uid)))
    assert got_1 == want_1
    assert sum(compared) > 5
    assert stats.draft_restored == 0  # nothing stored yet
    prefilled_1, joins_1 = stats.draft_prefilled, len(draft.joins)

    if which == "other":  # its drafts failed: the row of turn 2 would not draft (recent rows' rate)
        gen.close()
        spec = Speculator(_draft(model, draft, k=3), stats, snapshots=spec.drafter.snapshots)
        gen = _generator(model, spec)
    follow = prompt + got_1 + new_message
    compared.clear()
    got_2 = _run(gen, follow, 40, lambda uid: compared.append(_check_draft_row(spec, gen, draft, uid)))
    assert got_2 == want_2
    assert sum(compared) > 5
    assert manager.namespace_tokens(NAMESPACE + "/draft") > len(prompt)  # turn 1's row, stored when it left
    assert manager.num_leases == 0
    restored, prefilled = stats.draft_restored, stats.draft_prefilled - prefilled_1
    assert restored > len(prompt), (restored, len(prompt))
    assert prefilled == sum(draft.joins[joins_1:])
    # the join covered the row's tokens at that point: turn 1's stored row, then the rest
    assert len(follow) <= restored + prefilled <= len(follow) + 10
    if which == "same":  # the stored row lags turn 1's answer by its last tokens (not fed to the draft)
        assert restored >= len(prompt) + len(got_1) - 3 and prefilled <= len(new_message) + 10
    gen.close()


def test_a_resumed_row_restores_what_it_left():
    """A decoding row taken out of the batch (paused) leaves its draft row in the prefix
    cache; put back, it restores it and prefills at most a few tokens, and its tokens
    are still plain decoding's."""
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    draft = JoinRecorder(model)
    prompt = _workload(5)[0][0]
    plain = _generator(model)
    want = _run(plain, prompt, 50)
    plain.close()

    manager = PromptCacheManager(1 << 30, 64)
    stats = SpeculationStats()
    spec = Speculator(_draft(model, draft, k=3), stats, snapshots=DraftSnapshots(manager, lambda uid: NAMESPACE))
    gen = _generator(model, spec)
    [uid] = gen.insert([prompt], max_tokens=[50])
    out, resumed, joins, prefilled = [], False, None, None
    while True:
        responses = gen.next()[1]
        mine = [r for r in responses if r.uid == uid]
        out += [r.token for r in mine]
        if mine and mine[-1].finish_reason:
            break
        if not resumed and uid in spec.drafter.uids and len(out) >= 15:
            state = gen.take_decoding(uid)  # it leaves the draft batch too, stored
            assert manager.namespace_tokens(NAMESPACE + "/draft") >= len(prompt)
            prefilled, joins = stats.draft_prefilled, len(draft.joins)
            uid = gen.put_decoding(state)
            resumed = True
        elif resumed and uid in spec.drafter.uids and joins is not None:
            assert stats.draft_restored >= len(prompt) + 10
            assert stats.draft_prefilled - prefilled == sum(draft.joins[joins:]) <= 5
            assert _check_draft_row(spec, gen, draft, uid)
            joins = None
            # the batch's KV bytes count the draft model's caches
            target = layer_bytes(gen._generation_batch.prompt_cache) + layer_bytes(gen._prompt_batch.prompt_cache or [])
            assert spec.drafter.kv_bytes() > 0 and gen.kv_bytes() == target + spec.drafter.kv_bytes()
    gen.close()
    assert resumed and joins is None
    assert out == want


def test_draft_snapshots_stay_off_the_disk_tier(tmp_path):
    """A companion namespace (a draft group) is neither written to the disk tier (evicted
    or persisted) nor looked up there, even where a file of that name exists; the
    request's own namespace still is."""
    from cache.disk import DiskTier
    from cache.tiering import DiskLink

    model, _ = mlx_lm.load(str(model_path("qwen3")))
    tokens = list(range(10, 90))
    manager = PromptCacheManager(1 << 30, 64)
    tier = DiskTier(tmp_path / "disk", 1 << 30, "ident")
    manager.attach_disk(DiskLink(tier))
    draft_ns = NAMESPACE + "/draft"

    def fill(ns, key):
        cache = make_prompt_cache(model)
        model(mx.array(key)[None], cache=cache)
        assert manager.insert(ns, key, cache)

    fill(draft_ns, tokens[:40])  # before it is a companion: a file on disk under that name
    while manager.eviction.evict_oldest("bytes"):
        pass
    assert tier.flush(30) and tier.num_entries == 1
    snapshots = DraftSnapshots(manager, lambda uid: NAMESPACE)
    assert snapshots.namespace(0) == draft_ns
    for ns in (NAMESPACE, draft_ns):
        fill(ns, tokens)
    while manager.eviction.evict_oldest("bytes"):  # spilled, if the namespace goes to disk
        pass
    assert tier.flush(30) and tier.num_entries == 2  # the request's namespace's snapshot alone
    assert snapshots.restore(draft_ns, tokens + [5], len(model.layers)) == (None, 0)  # the file is not read
    hit = manager.fetch(NAMESPACE, tokens + [5], count=False)
    assert hit.cached_tokens == len(tokens) and hit.source == "disk"
    manager.release(hit.lease)
    longer = tokens + [5, 6]  # not on disk yet, in either namespace
    for ns in (NAMESPACE, draft_ns):
        fill(ns, longer)
    assert manager.persist(30) == 1  # a graceful stop writes the request's namespace alone
    assert tier.num_entries == 3


def test_the_engine_keeps_draft_rows_per_namespace():
    """Through the engine: a conversation's second turn restores its draft row from its
    request's namespace (``<namespace>/draft``) and gives plain decoding's tokens; a
    request of another namespace restores nothing of it; flushing a group flushes its
    draft rows."""
    import uuid

    from conftest import EventSink
    from scheduler import EngineRequest, SamplingParams
    from test_draft_model import _engine, _plain_tokens

    model, tok = mlx_lm.load(str(model_path("qwen3")))
    prompt = _workload(6)[0][0]
    plain = _plain_tokens(model, tok, [prompt], [30])[0]
    follow = prompt + plain + [random.Random(3).randrange(10, 500) for _ in range(12)]
    want = _plain_tokens(model, tok, [follow], [30])[0]
    engine = _engine(model, tok, _draft(model, model))

    def run(tokens, namespace):
        sink = EventSink()
        engine.submit(EngineRequest(f"t-{uuid.uuid4().hex[:12]}", tokens, SamplingParams(max_tokens=30), sink,
                                    namespace=namespace))
        assert sink.done.wait(120)
        return sink.tokens

    try:
        stats = engine.stats.speculation
        assert run(prompt, "alice") == plain
        assert run(follow, "bob") == want and stats.draft_restored == 0  # another namespace's row
        assert run(follow, "alice") == want
        assert stats.draft_restored >= len(prompt) + len(plain) - 3, stats
        assert engine.wait_idle(60) and engine.prompt_cache.num_leases == 0
        assert engine.prompt_cache.namespace_tokens("alice/draft") >= len(follow)
        assert engine.flush_cache("alice") >= 2  # a group's flush takes its draft rows too
        assert engine.prompt_cache.namespace_tokens("alice/draft") == engine.prompt_cache.namespace_tokens("alice") == 0
        assert engine.prompt_cache.namespace_tokens("bob/draft") >= len(follow)
    finally:
        engine.stop()


def test_a_groups_quota_covers_its_draft_rows():
    """A cache group's byte quota counts its draft rows: storing one evicts the group's
    oldest snapshots (of either kind) to stay within it, a quota of 0 stores none, and a
    manager with no room stores no draft row (it is not even extracted)."""
    model, _ = mlx_lm.load(str(model_path("qwen3")))

    def snapshot(key):
        cache = make_prompt_cache(model)
        model(mx.array(key)[None], cache=cache)
        return cache

    manager = PromptCacheManager(1 << 30, 64)
    snapshots = DraftSnapshots(manager, lambda uid: NAMESPACE)
    draft_ns = snapshots.namespace(0)
    one = manager.namespace_bytes
    assert manager.insert(NAMESPACE, list(range(10, 70)), snapshot(list(range(10, 70))))
    per_snapshot = one(NAMESPACE)
    manager.eviction.set_quotas({NAMESPACE: int(1.5 * per_snapshot)})
    assert snapshots.save(draft_ns, list(range(100, 160)), lambda: snapshot(list(range(100, 160))))
    assert one(NAMESPACE) == 0 and one(draft_ns) == per_snapshot  # the group's older snapshot went
    manager.sanity_check()
    manager.eviction.set_quotas({NAMESPACE: 0})
    assert one(draft_ns) == 0
    assert not snapshots.save(draft_ns, list(range(100, 160)), lambda: snapshot(list(range(100, 160))))
    manager.sanity_check()
    with pytest.raises(ValueError):
        manager.eviction.add_companion(draft_ns, "another-group")

    def never():
        raise AssertionError("a row stored nowhere must not be extracted")

    for bounds in ((0, 64), (1 << 30, 0)):
        assert not DraftSnapshots(PromptCacheManager(*bounds), lambda uid: NAMESPACE).save(draft_ns, [1, 2], never)


def test_no_cache_group_may_be_named_as_a_draft_group(tmp_path):
    """A tenants file naming a cache group ``.../draft`` (where another group's draft rows
    are kept) is refused at load, with the reason."""
    from gateway.tenancy import tenants
    from scheduler.speculative import draft_snapshots

    assert tenants.DRAFT_GROUP == draft_snapshots.SUFFIX
    f = tmp_path / "tenants.toml"
    f.write_text('[tenants.a]\nkey_sha256 = ["%s"]\ncache_group = "b/draft"\n' % tenants.hash_key("k" * 32))
    with pytest.raises(tenants.TenantsFileError, match="must not end in '/draft'"):
        tenants.load_tenants(f)
    f.write_text('[tenants.a]\nkey_sha256 = ["%s"]\ncache_group = "b/drafts"\n' % tenants.hash_key("k" * 32))
    tenants.load_tenants(f)
