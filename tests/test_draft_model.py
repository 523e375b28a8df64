"""Speculative decoding with a draft model (``--speculative draft``): the draft model's own
KV cache kept in step with the decode batch, and the same greedy tokens as plain decoding
with batching, prefix-cache hits, grammars, stop strings and sampled rows beside."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import BatchKVCache

from cache import PromptCacheManager
from conftest import engine_tokens, model_path
from scheduler import Engine, SamplingParams
from scheduler.speculative import DraftModel, SpeculationConfig, SpeculationStats
from scheduler.speculative.acceptance import StepCost
from test_speculative import _workload as lookup_workload
from test_speculative import steady_step_cost  # noqa: F401 (autouse: a fixed cost per drafted position)

from gateway.models.demo_model import build_model_dir


def _other_weights(tmp_path_factory):
    """A qwen3 of the same tokenizer as ``model_path('qwen3')`` with other random weights
    (and fewer layers): a draft that is mostly wrong."""
    return build_model_dir(tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=7,
                           overrides={"num_hidden_layers": 1})


def _workload(seed: int):
    """test_speculative's prompts, and one of a single token (no tokens in its cache: it
    never drafts)."""
    prompts, max_tokens = lookup_workload(seed)
    return prompts + [[random.Random(seed).randrange(10, 500)]], max_tokens + [12]


def _plain_tokens(model, tok, prompts, params) -> list[list[int]]:
    """Each prompt's tokens alone on an engine that does not speculate (the reference)."""
    plain = _engine(model, tok, SpeculationConfig())
    try:
        return [engine_tokens(plain, [p], [q])[0] for p, q in zip(prompts, params)]
    finally:
        plain.stop()


def _engine(model, tok, spec):
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, gather_wait=30.0, speculation=spec)
    engine.start()
    return engine


def _draft(model, draft, k=4):
    return SpeculationConfig("draft", k, draft=DraftModel(draft, int(model(mx.array([[0]])).shape[-1])))


@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_tokens_equal_plain_decoding(which, tmp_path_factory):
    """The target as its own draft (drafts nearly all accepted: rows catch up a token
    after each full acceptance) and a one-layer draft of other weights (nearly all
    rejected: rows cool down and catch up many tokens): solo, batched and warm runs give
    plain decoding's tokens."""
    model, tok = mlx_lm.load(str(model_path("qwen3")))
    draft = model if which == "same" else mlx_lm.load(str(_other_weights(tmp_path_factory)))[0]
    prompts, max_tokens = _workload(1)
    want = _plain_tokens(model, tok, prompts, max_tokens)
    engine = _engine(model, tok, _draft(model, draft))
    try:
        burst = engine_tokens(engine, prompts, max_tokens)
        warm = engine_tokens(engine, prompts, max_tokens)
        solo = [engine_tokens(engine, [p], [m])[0] for p, m in zip(prompts[:2], max_tokens[:2])]
        assert engine.wait_idle(60)
        assert engine.prompt_cache.num_leases == 0
        stats = engine.stats.speculation
    finally:
        engine.stop()
    assert burst == want and warm == want and solo == want[:2]
    assert stats.verify_steps > 0 and stats.drafted > 0, stats
    if which == "same":
        assert stats.accepted > 0.8 * stats.drafted, stats
    else:
        assert stats.accepted < 0.5 * stats.drafted, stats


class JoinRecorder:
    """A real draft model that records the tokens of each forward a joining row's prefill
    runs (those on a row's own cache, not the draft batch's)."""

    def __init__(self, model):
        self.model, self.joins, self.batched = model, [], []

    def __call__(self, inputs, cache=None):
        if cache is not None and not isinstance(cache[0], BatchKVCache):
            self.joins.append(inputs.shape[1])
        elif cache is not None:
            self.batched.append(inputs.shape[1])  # the draft batch's: catch-ups and drafts
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("chunk", [512, 16])
@pytest.mark.parametrize("which", ["same", "other"])
def test_the_draft_cache_holds_exactly_each_rows_tokens(which, chunk, tmp_path_factory, monkeypatch):
    """After every step, each draft row's cache is the draft model's cold prefill of the
    row's emitted tokens (up to the last draft fed): compared position by position, with
    drafts mostly accepted (rows lag a token) and mostly rejected (rows cool down and lag
    by different numbers of tokens). With 16-token chunks, rows join over several steps
    (emitting tokens meanwhile), each step prefilling one chunk's tokens at most; with
    512-token chunks, the two rows that start together join in one step. For 20 steps
    the rows decode plainly, as beside a prompt in prefill: with 16-token chunks they fall
    more than a chunk behind, leave the draft batch and join again, so that no forward of
    the draft batch feeds a row more than a chunk."""
    from scheduler.batch.generator import JoiningBatchGenerator
    from scheduler.sampling import greedy
    from scheduler.speculative import Speculator, draft_model

    monkeypatch.setattr(draft_model, "PREFILL_CHUNK", chunk)
    model, _ = mlx_lm.load(str(model_path("qwen3")))
    other = JoinRecorder(model if which == "same" else mlx_lm.load(str(_other_weights(tmp_path_factory)))[0])
    prompts, max_tokens = _workload(2)
    spec = Speculator(_draft(model, other, k=3), SpeculationStats())
    gen = JoiningBatchGenerator(model, speculator=spec, max_tokens=1 << 20, prefill_batch_size=4,
                                completion_batch_size=8, prefill_step_size=64, sampler=greedy)
    uids = gen.insert(prompts[:2], max_tokens=[m + 40 for m in max_tokens[:2]])
    checked, ended, steps = 0, set(), 0
    rejoining = 0  # steps after the plain ones that ended with a row joining again
    joining = 0  # steps that ended with a row still joining
    most = 0  # rows that joined in one step
    while len(ended) < len(uids):
        before = len(other.joins)
        gen.prompts_waiting = 12 <= steps < 32
        ended |= {g.uid for g in gen.next()[1] if g.finish_reason}
        assert sum(other.joins[before:]) <= chunk  # joins prefill one chunk's tokens per step at most
        most = max(most, len(other.joins) - before)
        joining += bool(spec.drafter._joining)
        rejoining += steps >= 32 and bool(spec.drafter._joining)
        steps += 1
        if steps in (5, 9):  # rows that join later lag, cool down and catch up out of step
            uids += gen.insert(prompts[steps // 4: steps // 4 + 1], max_tokens=[80])
        drafter, batch = spec.drafter, gen._generation_batch
        for j, uid in enumerate(drafter.uids):
            if uid not in batch.uids:
                continue
            tokens = batch.tokens[batch.uids.index(uid)][: drafter.fed[j]]
            assert drafter.fed[j] <= len(batch.tokens[batch.uids.index(uid)]) + 1
            row = [c.extract(j) for c in drafter.cache]
            assert row[0].offset == drafter.fed[j]
            cold = mlx_lm.models.cache.make_prompt_cache(other)
            other(mx.array(tokens)[None], cache=cold)
            for got, want in zip(row, cold):
                assert mx.allclose(got.keys[..., : got.offset, :], want.keys[..., : want.offset, :], atol=1e-4)
            checked += 1
    gen.close()
    stats = spec.stats
    assert checked > 10 and stats.verify_steps > 0, stats
    assert joining >= (6 if chunk == 16 else 0), joining  # 60-75 token contexts: 4-5 chunks each
    assert max(other.batched) <= chunk, other.batched  # a catch-up feeds a row a chunk at most
    assert rejoining >= (1 if chunk == 16 else 0), rejoining  # 20 tokens behind: more than a chunk
    assert most >= (2 if chunk == 512 else 1), most  # rows that fit in one chunk join in one step
    assert (stats.accepted > 0.8 * stats.drafted) if which == "same" else (stats.accepted < 0.5 * stats.drafted)


def test_processors_and_sampled_rows_beside():
    """Rows with penalties and a logit_bias give their plain tokens beside a sampled row
    (which drafts too); a seeded row (which does not) gives its tokens alone."""
    model, tok = mlx_lm.load(str(model_path("qwen3")))
    prompts, max_tokens = _workload(3)
    kinds = [dict(repetition_penalty=1.05), dict(logit_bias=((11, 2.0),)), dict(presence_penalty=0.3), {}, {}, {}]
    params = [SamplingParams(max_tokens=m, **k) for m, k in zip(max_tokens, kinds)]
    want = _plain_tokens(model, tok, prompts, params)
    engine = _engine(model, tok, _draft(model, model))
    try:
        sampled = SamplingParams(max_tokens=30, temperature=0.8)
        got = engine_tokens(engine, prompts + [prompts[0]], params + [sampled])
        seeded = SamplingParams(max_tokens=20, temperature=0.7, seed=3)
        alone = engine_tokens(engine, [prompts[1]], [seeded])[0]
        beside = engine_tokens(engine, [prompts[1], prompts[0], prompts[2]], [seeded, params[0], params[2]])[0]
        assert engine.stats.speculation.accepted > 0
    finally:
        engine.stop()
    assert got[:-1] == want
    assert len(got[-1]) > 0
    assert alone == beside


# ----------------------------------------------------------------------------- cost
def test_the_draft_models_cost_is_learnt_and_decides_before_drafting(monkeypatch):
    """The draft model's cost per drafted position is measured from the steps; a draft as
    costly as the served model (itself) does not pay at the prior acceptance rate, so the
    step stays plain without running the draft model at all."""
    from scheduler.batch.generator import JoiningBatchGenerator
    from scheduler.sampling import greedy
    from scheduler.speculative import Speculator

    monkeypatch.undo()  # the real StepCost
    cost = StepCost(beta=0.1, draft=0.5)
    cost.wide(2, 5, 0.3, draft_seconds=0.05)  # no plain step measured: estimated from this one
    assert abs(cost.draft - (0.8 * 0.5 + 0.2 * 0.05 / (0.3 / 1.4))) < 1e-9
    for _ in range(40):
        cost.plain(2, 0.1)
        cost.wide(2, 5, 0.14, draft_seconds=0.01)  # 0.01 s per draft: a tenth of a plain step
    assert abs(cost.beta - 0.1) < 0.01 and abs(cost.draft - 0.1) < 0.01

    model, _ = mlx_lm.load(str(model_path("qwen3")))
    prompts, max_tokens = _workload(1)
    config = SpeculationConfig("draft", 4, draft=DraftModel(model, int(model(mx.array([[0]])).shape[-1]), 1.0))
    spec = Speculator(config, SpeculationStats())
    gen = JoiningBatchGenerator(model, speculator=spec, max_tokens=1 << 20, prefill_batch_size=4,
                                completion_batch_size=8, prefill_step_size=64, sampler=greedy)
    uids = gen.insert(prompts[:3], max_tokens=max_tokens[:3])
    ended = set()
    while len(ended) < len(uids):
        ended |= {g.uid for g in gen.next()[1] if g.finish_reason}
    gen.close()
    assert spec.stats.verify_steps == 0 and spec.stats.plain_steps > 20
    assert spec.drafter.cache is None  # the draft model never ran


def test_new_rows_start_from_what_recent_rows_accepted():
    """Once a draft model's drafts fail for every row, a new row does not widen the step
    (its prior is the overall rate), except one row in eight, which tries afresh."""
    from scheduler.speculative.acceptance import EXPLORE_EVERY, PRIOR_RATE, BatchAcceptance, best_width

    overall = BatchAcceptance()
    assert overall.new_row().rate == PRIOR_RATE
    for _ in range(30):
        overall.record(4, 0)
    rows = [overall.new_row() for _ in range(2 * EXPLORE_EVERY)]
    tries = [best_width([4], [r], 0.15) > 1 for r in rows]
    assert sum(tries) == 2 and tries[EXPLORE_EVERY - 2] and tries[2 * EXPLORE_EVERY - 2], tries
    for _ in range(30):
        overall.record(4, 4)
    assert best_width([4], [overall.new_row()], 0.15) == 5


# ----------------------------------------------------------------------------- settings
def test_draft_settings_are_checked(tmp_path):
    """``--draft-model`` implies ``--speculative draft`` unless ``off`` is given (``auto``, the default, is
    ``draft`` with a draft model, else ``ngram`` where the model can); ``draft`` without a draft model and
    a draft with ``ngram`` are refused, as are bad models-file values."""
    from gateway.config import ServeConfig
    from gateway.models.spec import ModelsFileError, defaults, load_models_file, model_specs

    (spec,) = model_specs(ServeConfig(model="demo", draft_model="small"))
    assert (spec.speculative, spec.draft_model) == ("draft", "small")
    (spec,) = model_specs(ServeConfig(model="demo", draft_model="small", speculative="off"))
    assert spec.speculative == "off"  # said outright, off wins over the draft model
    for bad in (dict(speculative="draft"), dict(speculative="ngram", draft_model="small")):
        with pytest.raises(ModelsFileError):
            model_specs(ServeConfig(model="demo", **bad))
    good = tmp_path / "good.toml"
    good.write_text('[models.a]\npath = "demo"\ndraft_model = "small"\n[models.b]\npath = "demo"\n')
    a, b = load_models_file(good, defaults(ServeConfig()))
    assert (a.speculative, a.draft_model, b.speculative) == ("draft", "small", "auto")
    (spec,) = model_specs(ServeConfig(model="demo", draft_model="small", speculative="auto"))
    assert spec.speculative == "draft"  # auto with a draft model drafts with it
    inherited = tmp_path / "inherited.toml"
    inherited.write_text('[models.a]\npath = "demo"\nspeculative = "auto"\n')
    (a,) = load_models_file(inherited, defaults(ServeConfig(draft_model="small")))
    assert (a.draft_model, a.speculation_method) == ("small", "draft")
    for bad in ('draft_model = 3', 'speculative = "draft"', 'speculative = "ngram"\ndraft_model = "small"'):
        f = tmp_path / "bad.toml"
        f.write_text(f'[models.a]\npath = "demo"\n{bad}\n')
        with pytest.raises(ModelsFileError):
            model_specs(ServeConfig(models_file=str(f)))


def test_a_draft_of_another_tokenizer_is_refused_and_a_good_one_serves(tmp_path_factory):
    """A draft model with another vocabulary fails the load with a message saying so; a
    draft of the same tokenizer serves, drafting (its weights counted in the model's)."""
    import httpx

    from conftest import free_port, live_server, start_gateway
    from gateway.config import ServeConfig

    cfg = ServeConfig(model=str(model_path("qwen3")), port=free_port(),
                      draft_model=str(model_path("llama")))  # the Llama 3 tokenizer
    gw = start_gateway(cfg, wait=False)
    try:
        from conftest import wait_until

        status, why = wait_until(lambda: gw.models.startup()[0] != "loading" and gw.models.startup(), 120,
                                 "the load to end")
        assert status == "error" and "tokenizer is not the served model's" in why, why
    finally:
        gw.stop()
    draft = _other_weights(tmp_path_factory)
    with live_server(model_path("qwen3"), draft_model=str(draft)) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": "test-model", "prompt": "one two three " * 20, "max_tokens": 30, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert server.engine.stats.speculation.drafted > 0
        from mlx.utils import tree_flatten

        def nbytes(m):
            return sum(p.nbytes for _, p in tree_flatten(m.parameters()))

        engine = server.engine
        assert server.handle("test-model").weights_bytes == (
            nbytes(engine.core.batch.model) + nbytes(engine.core.batch.speculation.draft.model))


def test_a_quantized_cache_takes_a_draft_model():
    """With --kv-bits the served model's quantized cache takes drafts back like a float
    one; its draft model (float KV) is read and counted."""
    from mlx.utils import tree_flatten

    from conftest import live_server

    from test_kv_quant import wide_head_model

    path = wide_head_model("qwen3")
    with live_server(path, kv_bits=8, draft_model=str(path)) as server:
        engine = server.engine
        assert engine.core.batch.speculation.method == "draft"
        assert server.handle("test-model").weights_bytes == 2 * sum(
            p.nbytes for _, p in tree_flatten(engine.core.batch.model.parameters()))
