"""Speculative decoding on models whose layers cannot mask a rejected draft out: recurrent
layers (Qwen 3.5's gated delta nets, Mamba 2) and sliding windows (Gemma 3). They go back
to their state before the step and take the kept tokens again
(:mod:`scheduler.speculative.rewind`). Greedy tokens equal plain decoding's, solo,
batched and on prefix-cache hits, with stops inside accepted drafts; snapshots left
behind are exact; a model whose layers do not honour right padding does not speculate.

Random weights rarely repeat themselves, so prompt lookup finds few drafts here. The
drafts come instead from :class:`ScriptedDrafter`: each row's plain greedy answer (the
reference, computed first) with one token changed at a place that moves from step to
step, so rows accept anything from none to all of their drafts. Only the drafts are
scripted; the model, its caches, the verification and the rollback are the real ones.
"""

from __future__ import annotations

import logging
import random

import httpx
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from cache import PromptCacheManager
from conftest import engine_tokens, live_server, load, load_model, model_path
from scheduler import Engine
from scheduler.speculative import SpeculationConfig, speculation_refusal
from scheduler.speculative import step as step_module
from scheduler.speculative.rewind import right_padding_refusal
from test_speculative import _workload
from test_speculative import steady_step_cost  # noqa: F401 (autouse: a fixed cost per drafted position)

NGRAM = SpeculationConfig("ngram", 4)
LAYERS = {  # architecture -> the layer kinds it brings
    "qwen3_5": "gated delta nets and full attention",
    "mamba2": "Mamba 2 only",
    "gemma3_text": "sliding windows (64 tokens) and full attention",
}


class ScriptedDrafter:
    """The drafter interface of :class:`scheduler.speculative.step.Speculator`, drafting
    each row's reference answer with one token changed: at draft index
    ``(7 * position + len(prompt)) % (room + 2)``, so none when that is past the draft."""

    costly = False
    forward_seconds = None
    answers: dict[tuple, list[int]] = {}  # prompt -> its plain greedy answer (set by the test)

    def __init__(self, *args):
        pass

    def _find(self, tokens: list[int]):
        for prompt, answer in self.answers.items():
            if len(tokens) >= len(prompt) - 1 and tuple(tokens[: len(prompt)]) == prompt[: len(tokens)]:
                return prompt, answer
        return None

    def hint(self, batch, i: int) -> bool:
        found = self._find(list(batch.tokens[i]))
        return found is not None and len(batch.tokens[i]) + 1 - len(found[0]) < len(found[1])

    def propose(self, batch, candidates, inputs, rooms) -> list[list[int]]:
        drafts = []
        for i, (c, room) in enumerate(zip(candidates, rooms)):
            found = self._find(list(batch.tokens[i])) if c else None
            if found is None or room <= 0:
                drafts.append([])
                continue
            prompt, answer = found
            emitted = len(batch.tokens[i]) + 1 - len(prompt)  # the pending input is answer[emitted - 1]
            draft = list(answer[emitted: emitted + room])
            wrong = (7 * emitted + len(prompt)) % (room + 2)
            if wrong < len(draft):
                draft[wrong] = 10 + (draft[wrong] + 1) % 400
            drafts.append(draft)
        return drafts

    def settle(self, uids, accepted) -> None:
        pass

    def forget(self, uids) -> None:
        pass

    def kv_bytes(self) -> int:
        return 0


@pytest.fixture
def scripted(monkeypatch):
    """The engine's ``ngram`` speculator drafts with :class:`ScriptedDrafter`."""
    monkeypatch.setattr(step_module, "LookupDrafter", ScriptedDrafter)
    monkeypatch.setattr(ScriptedDrafter, "answers", {})
    return ScriptedDrafter


def _engine(model, tok, spec, eos=None, **kw) -> Engine:
    """An engine of ``model`` ending rows on ``eos`` (default: the tokenizer's end tokens)."""
    kw = {"prompt_concurrency": 4, "decode_concurrency": 8, "gather_wait": 30.0, **kw}
    engine = Engine(model, eos or tok.eos_token_ids, PromptCacheManager(1 << 30, 64), speculation=spec, **kw)
    engine.start()
    return engine


def _plain(model, tok, prompts, params, eos=None) -> list[list[int]]:
    """Each prompt alone, cold, without speculation: the reference."""
    engine = _engine(model, tok, SpeculationConfig(), eos, prompt_concurrency=1, decode_concurrency=1)
    try:
        return [engine_tokens(engine, [p], [q])[0] for p, q in zip(prompts, params)]
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", sorted(LAYERS))
@pytest.mark.parametrize("mode", ["one-width", "padded", "rejected"])
def test_verify_and_rollback_match_token_by_token_decoding(arch, mode):
    """A batch of three rows (70, 50 and 30 prompt tokens: past, near and under Gemma's
    64-token window, so left padding outlives the window's first rotations) goes through
    30 verify steps, each row feeding 1 to 4 positions and keeping some of them:
    ``one-width``: every row the same number, all kept; ``padded``: each row its own
    number (the rest padding), all kept; ``rejected``: some not kept (replays). At every
    step, and for one more token after the last, each row's logits at its last kept
    position equal those of the same tokens fed one at a time to the row alone."""
    import mlx.core as mx
    from mlx_lm.generate import _merge_caches

    from scheduler.speculative.rewind import Rewind, holed, needs_replay, replay, take_back

    model = load_model(model_path(arch))
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (70, 50, 30)]
    plan = []  # per step: tokens fed and how many each row keeps
    for _ in range(30):
        fed = [rng.choice([1, 1, 2, 3, 4]) for _ in prompts]
        if mode == "one-width":
            fed = [fed[0]] * len(prompts)
        kept = [rng.randint(1, f) for f in fed] if mode == "rejected" else list(fed)
        plan.append(([[rng.randrange(10, 500) for _ in range(f)] for f in fed], kept))
    plan.append(([[11]] * len(prompts), [1] * len(prompts)))  # one more token: the state the last step left

    def prefilled(prompt):
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        return cache

    want = []
    for b, prompt in enumerate(prompts):
        cache, logits = prefilled(prompt), []
        for rows, kept in plan:
            for t in rows[b][: kept[b]]:
                last = model(mx.array([[t]]), cache=cache)[0, -1]
            logits.append(last)
        want.append(logits)
    batch = holed(_merge_caches([prefilled(p) for p in prompts]))
    replays = padded = 0
    for step, (rows, kept) in enumerate(plan):
        fed = [len(r) for r in rows]
        width = max(fed)
        padded += min(fed) < width
        saved = Rewind(batch)
        saved.pad(fed, width)
        out = model(mx.array([r + [r[0]] * (width - len(r)) for r in rows]), cache=batch)
        saved.unpad()
        if needs_replay(saved, fed, kept):
            replay(model, batch, saved, [r[:k] for r, k in zip(rows, kept)], width)
            replays += 1
        else:
            take_back(batch, [width - k for k in kept])
        for b, k in enumerate(kept):
            gap = mx.abs(out[b, k - 1] - want[b][step]).max().item()
            assert gap < 1e-3, f"{arch}: step {step}, row {b} (fed {fed}, kept {kept}): logits off by {gap}"
    assert (replays > 0) == (mode == "rejected") and (padded > 0) == (mode != "one-width"), (replays, padded)


@pytest.mark.parametrize("arch", sorted(LAYERS))
def test_greedy_tokens_equal_plain_decoding(arch, scripted):
    model, tok = load(model_path(arch))
    assert speculation_refusal(model) is None and right_padding_refusal(model) is None
    prompts, max_tokens = _workload(1)
    reference = _plain(model, tok, prompts, max_tokens)
    scripted.answers.update({tuple(p): a for p, a in zip(prompts, reference)})
    engine = _engine(model, tok, NGRAM)
    try:
        solo = [engine_tokens(engine, [p], [m])[0] for p, m in zip(prompts, max_tokens)]
        engine.flush_cache()
        burst = engine_tokens(engine, prompts, max_tokens)  # batched, cold
        warm = engine_tokens(engine, prompts, max_tokens)  # batched, every prompt (and answer) cached
        assert engine.wait_idle(60)
        assert engine.prompt_cache.num_leases == 0
        stats = engine.stats.speculation
    finally:
        engine.stop()
    for what, got in (("solo", solo), ("burst", burst), ("warm", warm)):
        assert got == reference, f"{arch} ({LAYERS[arch]}) {what}"
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
    assert stats.replays > 0, stats  # rejected drafts went back out of the recurrent or window layers


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_ends_inside_drafts_leave_exact_snapshots(arch, scripted):
    """Rows that end on a token inside an accepted draft, with drafts accepted after it,
    end with the plain tokens; the prefix cache then holds their conversations as a
    cold prefill would: a request continuing each one gets the plain tokens, from the
    cache. (End tokens are picked from the answers; the drafts go on past them.)"""
    model, tok = load(model_path(arch))
    prompts, max_tokens = _workload(2)
    free = _plain(model, tok, prompts, max_tokens)
    scripted.answers.update({tuple(p): a for p, a in zip(prompts, free)})
    ends = {a[j] for a, j in zip(free, (9, 14, 6, 20, 11))} - set(free[0][:5])
    reference = _plain(model, tok, prompts, max_tokens, eos=ends)
    assert any(len(r) < m for r, m in zip(reference, max_tokens))
    engine = _engine(model, tok, NGRAM, eos=ends)
    try:
        answers = engine_tokens(engine, prompts, max_tokens)
        assert answers == reference
        stats = engine.stats.speculation
        assert stats.ended_inside_draft > 0 and stats.replays > 0, stats
        follow = [p + a + [5, 6, 7] for p, a in zip(prompts, answers)]
        cached_before = engine.stats.cached_tokens
        got = engine_tokens(engine, follow, [12] * len(follow))
        assert engine.stats.cached_tokens - cached_before >= sum(len(p) + len(a) - 1 for p, a in zip(prompts, answers))
    finally:
        engine.stop()
    assert got == _plain(model, tok, follow, [12] * len(follow), eos=ends)


def test_a_model_ignoring_right_padding_does_not_speculate(scripted):
    """mlx-lm 0.32.2's Nemotron-H drops a padded row's token from its SSM state: its cache
    types allow rollback, the probe on the model itself refuses it, and it decodes plainly
    (the same tokens, no verify step)."""
    model, tok = load(model_path("nemotron_h"))
    assert any(isinstance(c, ArraysCache) for c in make_prompt_cache(model))
    assert speculation_refusal(model) is None
    assert "right padding" in right_padding_refusal(model)
    prompts, max_tokens = _workload(1)
    reference = _plain(model, tok, prompts, max_tokens)
    scripted.answers.update({tuple(p): a for p, a in zip(prompts, reference)})
    engine = _engine(model, tok, NGRAM)
    try:  # one at a time: its padded batches are not exact either (scheduler.batch.equivalence)
        assert [engine_tokens(engine, [p], [m])[0] for p, m in zip(prompts, max_tokens)] == reference
        assert engine.stats.speculation.verify_steps == 0 and engine.stats.speculation.plain_steps > 0
    finally:
        engine.stop()


def test_a_model_refused_at_load_never_reads_its_draft(caplog, monkeypatch):
    """Served with a draft model, Nemotron-H fails the rollback check at load: the log
    says why, its speculation is off, the draft model's weights are neither read nor
    reserved (the load makes room for the model's own bytes alone, and they are its
    bytes), and it serves."""
    from mlx.utils import tree_flatten

    from gateway.cpu import weights as cpu_weights
    from gateway.models.registry import ModelRegistry

    converted, reserved = [], []
    real_convert, real_reserve = cpu_weights.float32_weights_for_cpu_backend, ModelRegistry._reserve
    monkeypatch.setattr(cpu_weights, "float32_weights_for_cpu_backend",
                        lambda m, **kw: converted.append(m) or real_convert(m, **kw))
    monkeypatch.setattr(ModelRegistry, "_reserve",
                        lambda self, slot, need, evict: reserved.append(need) or real_reserve(self, slot, need, evict))
    draft = model_path("qwen3", tokenizer="qwen3")  # Nemotron-H's tokenizer, full attention
    with caplog.at_level(logging.WARNING), live_server(model_path("nemotron_h"), draft_model=str(draft)) as server:
        engine = server.engine
        assert not engine.core.batch.speculation.enabled
        own = sum(p.nbytes for _, p in tree_flatten(engine.core.batch.model.parameters()))
        assert server.handle("test-model").weights_bytes == own
        assert reserved == [own] and converted == [engine.core.batch.model]  # the draft: never
        body = {"model": "test-model", "prompt": "one two three " * 10, "max_tokens": 10, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    assert "speculative decoding is off" in caplog.text and "right padding" in caplog.text


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_served_with_a_speculator(arch):
    """Over HTTP, ``--speculative ngram`` gives these models a speculator (its steps are
    counted), and their answers are those of ``--speculative off``."""
    body = {"model": "test-model", "prompt": "one two three " * 30, "max_tokens": 40, "temperature": 0}
    answers = {}
    for method in ("off", "ngram"):
        with live_server(model_path(arch), speculative=method) as server:
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers[method] = r.json()["choices"][0]["text"]
            steps = server.engine.stats.speculation.plain_steps + server.engine.stats.speculation.verify_steps
            assert (steps > 0) == (method == "ngram")
    assert answers["ngram"] == answers["off"]
