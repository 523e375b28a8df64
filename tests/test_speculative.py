"""Speculative decoding (prompt lookup) inside continuous batching: the same greedy tokens
as plain decoding, per architecture, with batching, prefix-cache hits, checkpoints,
grammars, stop strings and ``max_tokens`` crossing a draft; rolled-back caches never
longer than their tokens; the rejection sampler's distribution; the settings."""

from __future__ import annotations

import asyncio
import random

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from cache import PromptCacheManager
from cache.quantized import BatchQuantizedKVCache, QuantizedKVRow
from conftest import engine_tokens, live_server, load, load_model, model_path
from scheduler import Engine, SamplingParams
from mlx_lm.generate import StopSequences

from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.sampling import TemperatureSampler, greedy
from scheduler.speculative import SpeculationConfig, SpeculationStats, Speculator, speculation_refusal
from scheduler.speculative.acceptance import RealizedRate, RowAcceptance, StepCost, best_width
from scheduler.speculative.holes import HoledKVCache
from scheduler.speculative.lookup import PromptLookup
from scheduler.speculative.verify import accept_sampled

NGRAM = SpeculationConfig("ngram", 4)


@pytest.fixture(autouse=True)
def steady_step_cost(monkeypatch):
    """A fixed, low cost per drafted position and no check of the delivered rates (no
    measuring): whether a step verifies drafts then depends on the rows' drafts and
    acceptance alone, not on how loaded the machine running the tests is.
    ``test_width_follows_the_expected_gain`` and the ``RealizedRate`` tests cover the rules."""
    def fixed(self, beta: float = 0.05, draft: float = 0.0):
        self.beta, self.draft, self._plain, self._beta, self._extra = 0.05, 0.0, {}, {}, {}

    monkeypatch.setattr(StepCost, "__init__", fixed)
    monkeypatch.setattr(StepCost, "plain", lambda self, batch, seconds: None)
    monkeypatch.setattr(StepCost, "wide", lambda self, batch, width, seconds, draft_seconds=None: None)
    monkeypatch.setattr(RealizedRate, "record", lambda self, kind, batch, tokens, seconds: None)
    monkeypatch.setattr(RealizedRate, "probe", lambda self, batch: None)


# ----------------------------------------------------------------------------- drafting
def test_prompt_lookup_takes_the_latest_longest_match():
    lookup = PromptLookup(min_n=2, max_n=3)
    lookup.sync([1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2])
    # suffix (1, 2, 3): its only earlier occurrence is at the start, followed by 9, 7
    assert lookup.propose(3, 2) == [9, 7]
    # suffix (5, 7) never occurred; (7,) is shorter than min_n
    assert lookup.propose(7, 3) == []
    lookup.sync([1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 4, 2, 3])
    # (2, 3, x): (4, 2, 3) never occurred; (2, 3) last occurred before 8
    assert lookup.propose(6, 2) == []  # (3, 6) never occurred
    assert PromptLookup(2, 2).propose(5, 4) == []


def test_prompt_lookup_continues_a_loop_past_the_end():
    lookup = PromptLookup(min_n=2, max_n=4)
    lookup.sync([9, 4, 5, 4, 5])
    assert lookup.propose(4, 5) == [5, 4, 5, 4, 5]
    lookup = PromptLookup(min_n=2, max_n=4)
    lookup.sync([3, 3, 3])
    assert lookup.propose(3, 4) == [3, 3, 3, 3]


def test_a_prompt_indexed_at_once_drafts_as_one_indexed_token_by_token():
    """``sync`` indexes many tokens at once (a row's prompt) in bulk: the same index, so
    the same drafts, as appending them one at a time, whatever the cuts between syncs."""
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(200))]
        bulk = PromptLookup(rng.choice([1, 2]), rng.choice([2, 3, 4, 5]))
        single = PromptLookup(bulk.min_n, bulk.max_n)
        for cut in sorted(rng.sample(range(len(tokens) + 1), min(3, len(tokens) + 1))) + [len(tokens)]:
            bulk.sync(tokens[:cut])
            for t in tokens[len(single.tokens):cut]:
                single.sync(single.tokens + [t])  # one new token: the token-by-token path
            assert bulk.tokens == single.tokens and bulk._follow == single._follow
            assert [bulk.propose(t, 5) for t in range(6)] == [single.propose(t, 5) for t in range(6)]


def test_width_follows_the_expected_gain():
    good, bad = RowAcceptance(), RowAcceptance()
    for _ in range(10):
        good.record(4, 4)
        bad.record(4, 1)
    assert best_width([4], [good], 0.15) == 5
    assert best_width([0, 0, 0, 0], [RowAcceptance()] * 4, 0.15) == 1
    # one row of eight drafting does not pay for widening the other seven
    assert best_width([4] + [0] * 7, [good] + [bad] * 7, 0.15) == 1
    # a low acceptance rate stops a row drafting for a while, then it tries again
    low = RowAcceptance()
    low.record(4, 0)
    low.record(4, 0)
    assert not low.may_draft()
    for _ in range(20):
        low.may_draft()
    assert low.may_draft()


def test_step_cost_is_measured(monkeypatch):
    monkeypatch.undo()  # the real StepCost, not the fixture's fixed one
    cost = StepCost(beta=0.15)
    cost.wide(1, 5, 0.2)  # no plain step of that size measured yet: nothing learnt
    assert cost.beta == 0.15
    for _ in range(30):
        cost.plain(1, 0.1)
        cost.wide(1, 5, 0.2)  # twice a plain step for 4 drafted positions: 0.25 each
    assert abs(cost.beta - 0.25) < 0.01
    for _ in range(30):  # four rows: the verify forward costs relatively more
        cost.plain(4, 0.1)
        cost.wide(4, 5, 0.3)
    assert abs(cost.beta_at(4) - 0.5) < 0.01 and abs(cost.beta_at(1) - 0.25) < 0.01
    assert cost.beta_at(8) == cost.beta  # not measured at that size: the overall figure


def test_wide_steps_are_costed_from_the_widths_measured(monkeypatch):
    """A verify step's fixed part is not spread over its positions: widths measured at a
    batch size give a line (its slope the cost per position), one measured width that
    width's cost plus at most 0.15 per position."""
    monkeypatch.undo()
    cost = StepCost(beta=0.15)
    for _ in range(40):
        cost.plain(1, 0.100)
        cost.wide(1, 2, 0.122)  # 0.10 of fixed part + 0.12 per position
    assert cost.relative(1, 2) == pytest.approx(1.22, abs=0.01)
    assert cost.relative(1, 9) == pytest.approx(1.22 + 7 * 0.15, abs=0.02)  # one width: the prior slope
    assert cost.beta_at(1) == pytest.approx(0.22, abs=0.01)  # what beta alone would charge a position
    for _ in range(40):
        cost.wide(1, 5, 0.158)
    assert cost.relative(1, 9) == pytest.approx(1.10 + 8 * 0.12, abs=0.02)  # the line through both
    assert cost.relative(4, 3) == pytest.approx(1 + 2 * cost.beta)  # nothing measured at that size
    assert cost.relative(1, 1) == 1.0


def test_a_batch_size_whose_verify_steps_deliver_less_than_plain_ones_goes_plain(monkeypatch):
    """Four rows: plain steps give 4 tokens in 0.1 s (40/s), verify steps 5 tokens in 0.2 s
    (25/s): each loses 0.07 s, so after three (more than two plain steps' time) the size
    pauses, for 32 steps, then 64 after it loses again; one row, whose verify steps pay (3 tokens in 0.12 s), keeps
    speculating."""
    monkeypatch.undo()
    import scheduler.speculative.acceptance as acc

    r = RealizedRate()
    assert r.probe(4) is False and r.probe(4) is True  # no plain figure yet: two plain steps, the second timed
    r.record("plain", 4, 4, 0.1)
    assert r.probe(4) is None
    for _ in range(3):
        assert not r.paused(4)
        r.record("verify", 4, 5, 0.2)
    assert [r.paused(4) for _ in range(acc.BACKOFF_STEPS)] == [True] * acc.BACKOFF_STEPS
    assert not r.paused(4)
    assert r.rate("verify", 4) is None  # measured afresh after the pause
    for _ in range(3):
        r.record("verify", 4, 5, 0.2)
    assert sum(r.paused(4) for _ in range(3 * acc.BACKOFF_STEPS)) == 2 * acc.BACKOFF_STEPS
    for _ in range(5):  # losing on and on: each pause twice the last, up to the cap
        for _ in range(3):
            r.record("verify", 4, 5, 0.2)
        while r.paused(4):
            pass
    assert r._backoff[4] == acc.MAX_BACKOFF_STEPS
    r.record("plain", 1, 1, 0.08)
    for _ in range(10):
        r.record("verify", 1, 3, 0.12)
        assert not r.paused(1)
    assert r.rate("verify", 1) == pytest.approx(25.0) and r.rate("plain", 1) == pytest.approx(12.5)


def test_a_few_slow_verify_steps_do_not_pause_a_batch_size_but_a_steady_loss_does(monkeypatch):
    """Four rows, plain steps 4 tokens in 0.1 s. Two verify steps that lose (4 tokens in
    0.15 s: rows that just joined) followed by ones that pay (10 tokens in 0.15 s) never
    pause; verify steps a tenth slower than plain ones (4.5 tokens in 0.125 s) pause the
    size once they have lost two plain steps' time, some 20 steps in, not before."""
    monkeypatch.undo()
    import scheduler.speculative.acceptance as acc

    r = RealizedRate()
    r.record("plain", 4, 0, 0.1)  # a plain step that delivered nothing (its rows ended) is no yardstick
    r.record("verify", 4, 4, 0.15)
    assert r.lost(4) == 0.0
    r = RealizedRate()
    r.record("plain", 4, 4, 0.1)
    for seconds, tokens in [(0.15, 4), (0.15, 4)] + [(0.15, 10)] * 30:
        r.record("verify", 4, tokens, seconds)
        assert not r.paused(4)
    assert r.lost(4) == 0.0
    steps = 0
    while not r.paused(4):
        r.record("verify", 4, 4.5, 0.125)
        steps += 1
    loss = 0.125 - 4.5 / (40 * (1 - acc.LOSS_MARGIN))  # seconds lost per step
    assert steps == int(acc.LOSS_STEPS * 0.1 / loss) + 1
    assert 15 <= steps <= 30


def test_plain_steps_are_measured_again_while_every_row_drafts(monkeypatch):
    monkeypatch.undo()
    import scheduler.speculative.acceptance as acc

    r = RealizedRate()
    r.record("plain", 2, 2, 0.1)
    for _ in range(acc.PROBE_EVERY - 1):
        r.record("verify", 2, 4, 0.15)
        assert r.probe(2) is None
    r.record("verify", 2, 4, 0.15)
    assert [r.probe(2), r.probe(2)] == [False, True]


# ----------------------------------------------------------------------------- rollback
D = 64  # head size of the rollback tests (a quantization group of 64 must divide it)


def _row(bits):
    return KVCache() if bits is None else QuantizedKVRow(64, bits)


def _batch(lengths: list[int], seed: int = 0, bits=None):
    """Per-row caches [1, 2, L, D] of random KV (float, or quantized to ``bits``), and
    their merge as a HoledKVCache."""
    mx.random.seed(seed)
    rows = []
    for n in lengths:
        c = _row(bits)
        c.update_and_fetch(mx.random.normal((1, 2, n, D)), mx.random.normal((1, 2, n, D)))
        rows.append(c)
    merged = BatchKVCache.merge(rows) if bits is None else BatchQuantizedKVCache.merge(rows)
    return rows, HoledKVCache.adopt(merged)


def _append(batch: HoledKVCache, width: int, seed: int):
    mx.random.seed(seed)
    B = batch.offset.shape[0]
    k, v = mx.random.normal((B, 2, width, D)), mx.random.normal((B, 2, width, D))
    batch.update_and_fetch(k, v)
    return k, v


def _same(got, want) -> bool:
    """Two row caches hold the same KV (every array, float or packed, up to offset)."""
    leaves = lambda c: [*c.keys, *c.values] if isinstance(c.keys, tuple) else [c.keys, c.values]  # noqa: E731
    return got.offset == want.offset and all(
        mx.array_equal(a[..., : got.offset, :], b[..., : want.offset, :]) for a, b in zip(leaves(got), leaves(want)))


@pytest.mark.parametrize("bits", [None, 8], ids=["float", "8-bit"])
@pytest.mark.parametrize("compact", [False, True])
def test_rejected_positions_leave_each_row_exactly_its_tokens(compact, bits):
    rows, batch = _batch([5, 9, 3], bits=bits)
    want = rows  # each row fed the kept positions alone
    for step, accepted in enumerate([[2, 0, 1], [0, 0, 0], [3, 1, 3]]):
        k, v = _append(batch, 4, seed=step + 1)
        batch.reject([3 - a for a in accepted])
        for i, a in enumerate(accepted):
            want[i].update_and_fetch(k[i: i + 1, :, : 1 + a], v[i: i + 1, :, : 1 + a])
        if compact:
            batch.compact()
            assert batch.holes is None
    assert batch.offset.tolist() == [w.offset for w in want]
    for i, w in enumerate(want):
        assert _same(batch.extract(i), w)
    # the mask hides exactly the holes and the left padding: real positions = offset
    mask = batch.make_mask(1)
    assert mask[:, 0, 0, :-1].sum(axis=1).tolist() == batch.offset.tolist()


@pytest.mark.parametrize("bits", [None, 8], ids=["float", "8-bit"])
def test_holes_survive_filter_and_extend(bits):
    rows, batch = _batch([4, 6], bits=bits)
    _append(batch, 3, seed=1)
    batch.reject([2, 0])  # row 0 keeps 1 of 3, row 1 all 3: two holes in row 0
    want0 = batch.extract(0)
    others, more = _batch([2], seed=7, bits=bits)
    batch.extend(more)
    assert [batch.extract(i).offset for i in range(3)] == [5, 9, 2]
    assert _same(batch.extract(0), want0)
    assert _same(batch.extract(2), others[0])
    batch.filter([0, 2])
    assert _same(batch.extract(0), want0)
    assert batch.make_mask(1)[:, 0, 0, :-1].sum(axis=1).tolist() == [5, 2]


# ----------------------------------------------------------------------------- greedy identity
def _workload(seed: int):
    """Prompts that repeat themselves (so drafts exist, some right, some wrong), of
    different lengths, two sharing a prefix."""
    rng = random.Random(seed)
    loop = [rng.randrange(10, 500) for _ in range(12)]
    shared = [rng.randrange(10, 500) for _ in range(40)]
    prompts = [loop * 5, shared + loop * 2, shared + [rng.randrange(10, 500) for _ in range(30)],
               [rng.randrange(10, 500) for _ in range(25)] * 3, [7, 8, 9] * 9]
    return prompts, [48, 40, 33, 45, 20]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_tokens_equal_plain_decoding(arch):
    model, tok = load(model_path(arch))
    prompts, max_tokens = _workload(1)
    outputs, stats = {}, {}
    for name, spec in (("plain", SpeculationConfig()), ("ngram", NGRAM)):
        engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                        decode_concurrency=8, gather_wait=30.0, speculation=spec)
        engine.start()
        try:
            solo = [engine_tokens(engine, [p], [m])[0] for p, m in zip(prompts, max_tokens)]  # one at a time, cold
            engine.flush_cache()
            burst = engine_tokens(engine, prompts, max_tokens)  # batched, cold
            warm = engine_tokens(engine, prompts, max_tokens)  # batched, every prompt (and answer) cached
            assert engine.wait_idle(60)
            assert engine.prompt_cache.num_leases == 0
            outputs[name], stats[name] = (solo, burst, warm), engine.stats.speculation
        finally:
            engine.stop()
    reference = outputs["plain"][0]
    for name, runs in outputs.items():
        for what, got in zip(("solo", "burst", "warm"), runs):
            assert got == reference, f"{arch} {name} {what}"
    s = stats["ngram"]
    assert s.verify_steps > 0 and 0 < s.accepted < s.drafted, s  # drafts were taken and refused
    assert stats["plain"].drafted == 0


def _generate(model, prompts, max_tokens, stops, speculator=None):
    """Rows through the batch generator; per row its tokens, finish reason, and the
    length of the tokens and of the cache it left with."""
    gen = JoiningBatchGenerator(model, speculator=speculator, max_tokens=1 << 20, prefill_batch_size=4,
                                completion_batch_size=8, prefill_step_size=64, sampler=greedy)
    uids = gen.insert(prompts, max_tokens=max_tokens, stop_sequences=[StopSequences([s]) for s in stops])
    out, ends = {u: [] for u in uids}, {}
    while len(ends) < len(uids):
        for g in gen.next()[1]:
            out[g.uid].append(g.token)
            if g.finish_reason:
                ends[g.uid] = (g.finish_reason, len(g.all_tokens), g.prompt_cache[0].offset)
    gen.close()
    return [(out[u], ends[u]) for u in uids]


def test_stop_inside_an_accepted_draft():
    """A row whose stop sequence completes inside an accepted draft ends there, with the
    tokens plain decoding gives and a cache holding exactly its tokens up to the stop."""
    model = load_model(model_path("qwen3"))
    prompts, max_tokens = _workload(1)
    free = _generate(model, prompts, max_tokens, [[10 ** 6]] * len(prompts))
    # per row, the first run of four equal tokens (the demo model's answers fall into
    # loops): it completes while drafts, which by then repeat the loop, are verified
    stops = []
    for out, _ in free:
        j = next((j for j in range(1, len(out) - 4) if len(set(out[j:j + 4])) == 1), None)
        stops.append(out[j:j + 4] if j is not None else [10 ** 6])
    plain = _generate(model, prompts, max_tokens, stops)
    stats = SpeculationStats()
    spec = _generate(model, prompts, max_tokens, stops, Speculator(NGRAM, stats))
    assert spec == plain
    assert all(end[1] == end[2] for _, end in spec)
    assert sum(end[0] == "stop" for _, end in spec) >= 2
    assert stats.ended_inside_draft > 0, stats


def test_drafts_not_verified_are_scored_so_a_row_drafts_again_when_its_text_repeats(monkeypatch):
    """A row whose acceptance rate fell to where no width pays, yet not below the cool-down
    rate, runs plain steps; the drafts it finds there are scored against the tokens it
    decodes, so when its answer falls into a loop its rate rises and it drafts again.
    Rows here start from a prior of 0.05 (no width pays; before the scoring they never
    drafted at all)."""
    import scheduler.speculative.step as step

    model = load_model(model_path("qwen3"))
    prompts, max_tokens = _workload(1)
    stops = [[10 ** 6]] * len(prompts)
    plain = _generate(model, prompts, max_tokens, stops)
    monkeypatch.setattr(step, "RowAcceptance", lambda prior=0.5: RowAcceptance(0.05))
    probe = RowAcceptance(0.05)
    assert best_width([4], [probe], 0.05) == 1  # such a row alone would never verify
    stats = SpeculationStats()
    spec = _generate(model, prompts, max_tokens, stops, Speculator(NGRAM, stats))
    assert spec == plain
    assert stats.verify_steps > 0 and stats.accepted > 0, stats


def test_snapshots_after_speculation_are_exact():
    """The prefix cache holds, for each finished answer, KV equal to a cold prefill of its
    tokens (a rolled-back row never leaves extra positions in a snapshot), so that a later
    request continuing that answer gets the plain tokens."""
    model, tok = load(model_path("qwen3"))
    prompts, max_tokens = _workload(2)
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, gather_wait=30.0, speculation=NGRAM)
    plain = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=1,
                   decode_concurrency=1)
    engine.start()
    plain.start()
    try:
        answers = engine_tokens(engine, prompts, max_tokens)
        assert engine.stats.speculation.accepted > 0
        follow = [p + a + [5, 6, 7] for p, a in zip(prompts, answers)]
        cached_before = engine.stats.cached_tokens
        got = engine_tokens(engine, follow, [12] * len(follow))
        assert engine.stats.cached_tokens - cached_before >= sum(len(p) + len(a) - 1 for p, a in zip(prompts, answers))
        want = [engine_tokens(plain, [f], [12])[0] for f in follow]
        assert got == want
    finally:
        engine.stop()
        plain.stop()


def test_other_cache_kinds_do_not_speculate(caplog):
    """A layer cache that is neither full attention, a window nor recurrent state (here
    mlx-lm's ``ChunkedKVCache``, as Llama 4's chunked attention keeps) cannot take a
    draft back: the load turns speculation off and says why."""
    from mlx_lm.models.cache import ChunkedKVCache

    from gateway.models.loader import _speculation
    from gateway.models.spec import ModelSpec

    model = load_model(model_path("qwen3"))
    assert speculation_refusal(model) is None
    model.make_cache = lambda: [ChunkedKVCache(64) for _ in model.layers]
    assert "ChunkedKVCache" in speculation_refusal(model)
    with caplog.at_level("WARNING"):
        config = _speculation(ModelSpec(name="m", path="p", speculative="ngram"), speculation_refusal(model))
    assert not config.enabled and "ChunkedKVCache" in caplog.text


def test_the_default_speculates_where_it_can_and_quietly_not_elsewhere(caplog):
    """``auto``, the default: prompt lookup for a model that can take a draft back, and
    for one that cannot, off with the reason at info level (a warning is for a setting
    somebody asked for)."""
    from gateway.config import ServeConfig
    from gateway.models.loader import _speculation
    from gateway.models.spec import ModelSpec, model_specs

    (spec,) = model_specs(ServeConfig(model="demo"))
    assert spec.speculative == "auto" and ModelSpec(name="m", path="p").speculative == "auto"
    with caplog.at_level("INFO"):
        config = _speculation(spec, None)
    assert (config.method, config.num_draft_tokens) == ("ngram", spec.num_draft_tokens)
    assert "speculative decoding: ngram" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        config = _speculation(spec, "it runs split across ranks")
    assert not config.enabled and "split across ranks" in caplog.text
    assert all(r.levelname == "INFO" for r in caplog.records)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_cache_speculates_with_the_same_tokens(bits):
    """With ``--kv-bits`` the decode batch's quantized cache takes rejected drafts back as
    holes too: greedy tokens equal plain decoding's with the same bits, solo, batched,
    from quantized snapshots, and continuing each answer from the snapshot its row left."""
    from cache.quantized import quantize_kv
    from test_kv_quant import wide_head_model

    model, tok = load(wide_head_model("qwen3"))
    quantize_kv(model, bits, 64)
    assert speculation_refusal(model) is None
    prompts, max_tokens = _workload(1)
    outputs, stats = {}, None
    for name, spec in (("plain", SpeculationConfig()), ("ngram", NGRAM)):
        engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                        decode_concurrency=8, gather_wait=30.0, speculation=spec)
        engine.start()
        try:
            solo = [engine_tokens(engine, [p], [m])[0] for p, m in zip(prompts, max_tokens)]
            engine.flush_cache()
            burst = engine_tokens(engine, prompts, max_tokens)
            # continuing each answer: from the snapshot its finished row left (holes squeezed out)
            cached = engine.stats.cached_tokens
            follow = engine_tokens(engine, [p + a + [5, 6, 7] for p, a in zip(prompts, burst)], [12] * len(prompts))
            assert engine.stats.cached_tokens - cached >= sum(len(p) + len(a) - 1 for p, a in zip(prompts, burst))
            outputs[name] = (solo, burst, engine_tokens(engine, prompts, max_tokens), follow)
            assert engine.wait_idle(60) and engine.prompt_cache.num_leases == 0
            stats = engine.stats.speculation
        finally:
            engine.stop()
    for what, got in zip(("solo", "burst", "warm"), outputs["ngram"]):
        assert got == outputs["plain"][0], f"{bits} bits, {what}"
    assert outputs["ngram"][3] == outputs["plain"][3]
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats


# ----------------------------------------------------------------------------- logits processors
def _plain_and_ngram(arch: str, prompts, params) -> tuple[list, list, SpeculationStats]:
    """Each prompt's tokens one at a time without speculation, then as one burst with it."""
    model, tok = load(model_path(arch))
    out = []
    for spec in (SpeculationConfig(), NGRAM):
        engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                        decode_concurrency=8, gather_wait=30.0, speculation=spec)
        engine.start()
        try:
            if spec.method == "off":
                out.append([engine_tokens(engine, [p], [q()])[0] for p, q in zip(prompts, params)])
            else:
                out.append(engine_tokens(engine, prompts, [q() for q in params]))
                out.append(engine.stats.speculation)
        finally:
            engine.stop()
    return out[0], out[1], out[2]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_rows_with_penalties_and_logit_bias_draft_and_keep_their_tokens(arch):
    """Penalties and ``logit_bias`` apply at every verified position, with the context of
    that position: greedy rows with them give the tokens plain decoding gives."""
    prompts, max_tokens = _workload(3)
    kinds = [dict(logit_bias=((11, 2.0), (12, -1.0))), dict(repetition_penalty=1.05),
             dict(presence_penalty=0.3, frequency_penalty=0.2), dict(logit_bias=((7, 1.5),)), {}]
    params = [lambda m=m, k=k: SamplingParams(max_tokens=m, **k) for m, k in zip(max_tokens, kinds)]
    plain, spec, stats = _plain_and_ngram(arch, prompts, params)
    assert spec == plain
    assert stats.verify_steps > 0 and stats.accepted > 0, stats


def test_a_rejected_end_token_after_a_complete_grammar_leaves_it_complete():
    """A tool call's grammar is complete after its closing tag; a draft of the end token
    is fed to it along the verify forward, then rejected and rolled back. The grammar
    must stay complete (only the end token allowed), not lose the closing tag: the
    matcher took the end token without counting it (before the fix, the next token was
    refused and the request failed with "constrained decoding failed")."""
    import llguidance

    from scheduler.grammar import Grammars

    model, tok = load(model_path("qwen3"))
    grammars = Grammars(tok._tokenizer, model.args.vocab_size, tok.eos_token_ids)
    open_tag, close_tag = tok.encode("<tool_call>")[0], tok.encode("</tool_call>")[0]
    (eos,) = tok.eos_token_ids
    mask = grammars.mask(llguidance.LLMatcher.grammar_from_lark(
        f'start: <[{open_tag}]> "\\n" "{{}}" "\\n" <[{close_tag}]>'), strict=False)
    zeros = mx.zeros((1, model.args.vocab_size))
    tokens = tok.encode("x")  # the prompt: the first call feeds nothing
    mask(mx.array(tokens), zeros)
    for t in [open_tag, *tok.encode("\n{}\n"), close_tag]:
        tokens.append(t)
        out = mask(mx.array(tokens), zeros)
    assert mx.isfinite(out[0]).tolist().count(True) == 1 and mx.isfinite(out[0, eos]).item()
    mask(mx.array(tokens + [eos]), zeros)  # a drafted end token, fed at the next position
    mask.rollback(1)  # ... and rejected
    assert mask.validate([close_tag]) == 0  # the closing tag is still in
    mask(mx.array(tokens + [eos]), zeros)  # the end token, as the next step feeds it
    assert mask.error is None
    mask.rollback(1)
    mask.rollback(1)  # the closing tag itself
    assert mask.validate([close_tag]) == 1 and mask.error is None

    # a grammar that may end or go on (not stopped): the end token counts, and goes back alone
    mask = grammars.mask(llguidance.LLMatcher.grammar_from_lark('start: "q" /[0-9]+/'), strict=False)
    tokens = tok.encode("x")
    mask(mx.array(tokens), zeros)
    for t in [tok.encode("q")[0], tok.encode("7")[0], eos]:
        tokens.append(t)
        mask(mx.array(tokens), zeros)
    mask.rollback(1)
    assert mask.validate([eos]) == 1 and mask.error is None  # after "q7", not "q"


def test_grammar_rows_draft_within_their_grammar():
    """A json_schema row drafts: its drafts are cut at the first token the grammar forbids,
    its mask applies at every position, and its matcher takes back rejected tokens; the
    answer is the one plain decoding gives and stays valid JSON."""
    import json

    from scheduler.grammar import Grammars, json_schema_grammar

    model, tok = load(model_path("qwen3"))
    grammars = Grammars(tok._tokenizer, model.args.vocab_size, tok.eos_token_ids)
    schema = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 12, "maxItems": 12}
    grammar = json_schema_grammar(schema)
    echo = tok.encode(json.dumps(["alpha", "beta", "gamma"] * 4, separators=(",", ":")))
    prompts = [echo * 2, tok.encode("list the words please ") + echo]

    def run(spec):
        engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                        decode_concurrency=8, gather_wait=30.0, speculation=spec)
        engine.start()
        try:
            from conftest import EventSink
            from scheduler import EngineRequest

            sinks = [EventSink() for _ in prompts]
            with engine.arrivals.prepare():
                for i, (p, s) in enumerate(zip(prompts, sinks)):
                    engine.submit(EngineRequest(f"g{i}", p, SamplingParams(max_tokens=400), s,
                                                mask=grammars.mask(grammar)))
            for s in sinks:
                assert s.done.wait(120)
            return [s.tokens for s in sinks], engine.stats.speculation
        finally:
            engine.stop()

    plain, _ = run(SpeculationConfig())
    spec, stats = run(NGRAM)
    assert spec == plain
    assert stats.accepted > 0 and stats.accepted < stats.drafted, stats
    for tokens in spec:
        text = tok.decode([t for t in tokens if t not in tok.eos_token_ids])
        assert len(json.loads(text)) == 12


def test_stateful_processors_take_back_rejected_tokens():
    """A thinking budget and a grammar mask rewound after a rejected draft are where they
    were after the accepted tokens alone."""
    from scheduler.grammar import Grammars, json_schema_grammar
    from scheduler.speculative.processors import draftable, grammar_prefix
    from scheduler.thinking import ThinkingBudget

    logits = mx.zeros((1, 16))
    budget = ThinkingBudget(start_id=1, end_id=2, budget=3, inside=True)
    budget(mx.array([0]), logits)  # its first call sees the prompt
    for t in (5, 6):
        budget(mx.array([t]), logits)
    state = (budget.inside, budget.spent, budget.closed)
    for t in (7, 8, 9):
        budget(mx.array([t]), logits)
    assert budget.spent == 3 + 2  # went on, then takes those three back
    budget.rollback(3)
    assert (budget.inside, budget.spent, budget.closed) == state

    model, tok = load(model_path("qwen3"))
    grammars = Grammars(tok._tokenizer, model.args.vocab_size, tok.eos_token_ids)
    mask = grammars.mask(json_schema_grammar({"type": "array", "items": {"enum": ["alpha", "beta"]}}))
    ids = tok.encode('["alpha","beta","alpha"]')
    wide = mx.zeros((1, model.args.vocab_size))
    mask(mx.array([0]), wide)  # the prompt
    assert grammar_prefix([mask], ids[0], ids[1:] + [ids[1]]) == len(ids) - 1  # cut at the second "["
    for t in ids[:3]:
        mask(mx.array([t]), wide)
    mask.rollback(2)
    assert mask.validate(ids[1:]) == len(ids) - 1  # as if only ids[0] had been fed
    assert draftable([mask, budget, lambda tokens, logits: logits])
    assert not draftable([object()])


# ----------------------------------------------------------------------------- through the API
def _chat(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "test-model", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_api_answers_equal_with_grammar_stop_strings_and_max_tokens(method):
    """Over HTTP, concurrently: plain chat, a json_schema answer (its drafts checked against
    its grammar), stop strings that fall inside an accepted draft,
    and short ``max_tokens``; every answer the same with ``--speculative ngram`` (or
    ``draft``, the served model drafting for itself) as without."""
    text = "alpha beta gamma delta " * 12
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
              "additionalProperties": False}
    bodies = [
        {"messages": [{"role": "user", "content": text}], "max_tokens": 60},
        {"messages": [{"role": "user", "content": "repeat " + text}], "max_tokens": 7},
        {"messages": [{"role": "user", "content": text + " json"}], "max_tokens": 30,
         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
    ]

    def answers(speculative: str, stops=None) -> list[str]:
        draft = str(model_path("qwen3")) if speculative == "draft" else None
        with live_server(model_path("qwen3"), speculative=speculative, draft_model=draft,
                         decode_concurrency=8) as server:
            async def burst():
                async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                    rs = await asyncio.gather(*(c.post("/v1/chat/completions", json={
                        "model": "test-model", "temperature": 0, **b, **({"stop": stops[i]} if stops else {})})
                        for i, b in enumerate(bodies)))
                return [r.json()["choices"][0]["message"]["content"] for r in rs]

            out = asyncio.run(burst())
            return out, server.engine.stats.speculation

    plain, _ = answers("off")
    spec, stats = answers(method)
    assert spec == plain
    assert stats.accepted > 0
    # stop strings cut from the middle of each plain answer
    stops = [[a[len(a) // 2: len(a) // 2 + 4]] if len(a) > 8 else None for a in plain]
    stops = [s if s and s[0].strip() else None for s in stops]
    plain_stopped, _ = answers("off", stops)
    spec_stopped, _ = answers(method, stops)
    assert spec_stopped == plain_stopped


# ----------------------------------------------------------------------------- sampling
def test_rejection_sampling_keeps_the_distribution():
    """Chi-square test of the first token emitted after a verified draft: whether the draft
    is accepted or the residual is drawn, it must be distributed as ``p`` itself."""
    V, draws = 8, 4000
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.2], [0.0] * V])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.softmax(logits[0]).tolist()
    for draft in (0, 3):  # a likely and an unlikely draft
        sampler = TemperatureSampler(SamplingParams(temperature=1.0, seed=draft + 1))
        counts = [0] * V
        for _ in range(draws):
            accepted, following = accept_sampled(sampler, logprobs, [draft])
            counts[draft if accepted else following] += 1
        chi2 = sum((c - draws * q) ** 2 / (draws * q) for c, q in zip(counts, p))
        assert chi2 < 24.32, (draft, counts, chi2)  # df 7, p = 0.001


def test_sampled_requests_speculate():
    mx.random.seed(0)
    model = load_model(model_path("qwen3"))
    prompts, _ = _workload(3)
    engine = Engine(model, set(),  # no end token: every sampled row runs its full length
                    PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, speculation=NGRAM)
    engine.start()
    try:
        for tokens in engine_tokens(engine, prompts, [SamplingParams(max_tokens=30, temperature=0.1)] * len(prompts)):
            assert len(tokens) == 30
        assert engine.stats.speculation.accepted > 0
        # a seeded request never drafts: its tokens do not depend on the rows beside it
        seeded = SamplingParams(max_tokens=30, temperature=0.7, seed=11)
        alone = engine_tokens(engine, [prompts[0]], [seeded])[0]
        beside = engine_tokens(engine, prompts, [seeded] + [SamplingParams(max_tokens=30)] * (len(prompts) - 1))[0]
        assert alone == beside
    finally:
        engine.stop()



# ----------------------------------------------------------------------------- settings
def test_settings_are_checked(tmp_path):
    import argparse

    from gateway.config import ServeConfig, add_serve_arguments
    from gateway.models.spec import ModelsFileError, defaults, load_models_file

    with pytest.raises(ValueError):
        SpeculationConfig("draft")
    with pytest.raises(ValueError):
        SpeculationConfig("ngram", 0)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--speculative", "ngram", "--num-draft-tokens", "6"]).num_draft_tokens == 6
    for bad in (["--speculative", "medusa"], ["--num-draft-tokens", "0"], ["--num-draft-tokens", "17"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    base = defaults(ServeConfig(speculative="ngram"))
    good = tmp_path / "good.toml"
    good.write_text('[models.a]\npath = "demo"\n[models.b]\npath = "demo"\nspeculative = "off"\nnum_draft_tokens = 2\n')
    a, b = load_models_file(good, base)
    assert (a.speculative, a.num_draft_tokens, b.speculative, b.num_draft_tokens) == ("ngram", 8, "off", 2)
    for bad in ('speculative = "eagle"', "num_draft_tokens = 0", "num_draft_tokens = 40"):
        f = tmp_path / "bad.toml"
        f.write_text(f'[models.a]\npath = "demo"\n{bad}\n')
        with pytest.raises(ModelsFileError):
            load_models_file(f, base)


def test_a_failing_rejection_sampler_fails_nobody(monkeypatch):
    """An error inside one row's speculative sampling does not fail the batch step: that row
    samples as a plain step would (its guarded sampler), the other rows go on."""
    def broken(self, n):
        raise RuntimeError("no uniform draws today")

    monkeypatch.setattr(TemperatureSampler, "uniform", broken)
    model = load_model(model_path("qwen3"))
    prompts, _ = _workload(4)
    engine = Engine(model, set(),  # no end token: every sampled row runs its full length
                    PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, gather_wait=30.0, speculation=NGRAM)
    engine.start()
    try:
        params = [SamplingParams(max_tokens=24, temperature=0.5) if i % 2 else 24 for i in range(len(prompts))]
        for tokens in engine_tokens(engine, prompts, params):
            assert len(tokens) == 24
        assert engine.stats.failed == 0 and engine.stats.speculation.verify_steps > 0
    finally:
        engine.stop()
