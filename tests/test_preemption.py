"""Growing reservations and preemption (scheduler/admission/preemption.py): under a budget
too small for every row's answer at once, rows that cannot grow are preempted to the
waiting queue, their KV in the prefix cache, and go on where they stopped: the same
greedy tokens as a cold solo run, no token duplicated or lost, usage as if uninterrupted."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from cache import PromptCacheManager
from conftest import engine_tokens, live_server, model_path, sample
from scheduler import Engine, SamplingParams
from scheduler.admission.memory import QUANTUM, gate_for


CHUNK = 16  # prefill tokens a step: a small prefill reservation, so that the KV decides


def _prompts(tok, n: int, words: int) -> list[list[int]]:
    return [tok.encode(f"{i} " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words))) for i in range(n)]


def _preemptions(engine) -> float:
    return sum(m.value for metric in engine.core.metrics.preemptions.collect() for m in metric.samples
               if m.name.endswith("_total") and m.labels.get("outcome") == "requeued")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_preempted_rows_give_the_tokens_of_cold_solo_runs(arch):
    """Four rows whose answers (856 tokens, EOS ignored) outgrow a room that holds two
    rows' first grants and one prefill chunk (16 tokens): rows are preempted and
    readmitted, and every answer is the one a cold engine gives the prompt alone."""
    model, tok = mlx_lm.load(str(model_path(arch)))
    prompts = _prompts(tok, 4, 120)
    max_tokens = 3 * QUANTUM + 88
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    solo = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=1,
                  decode_concurrency=1)
    solo.start()
    try:
        want = [engine_tokens(solo, [p], [params])[0] for p in prompts]
    finally:
        solo.stop()
    gate = gate_for(model, make_prompt_cache(model), CHUNK)
    n = max(len(p) for p in prompts)
    room = 2 * gate.need(n, QUANTUM) + gate.prefill_need(n)
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=4,
                    decode_concurrency=8, prefill_step_size=CHUNK)
    engine.set_memory_room(lambda: room)
    engine.start()
    try:
        got = engine_tokens(engine, prompts, [params] * len(prompts), timeout=600)
    finally:
        engine.stop()
    assert _preemptions(engine) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == max_tokens, (i, len(g))
        assert g == w, (i, next(k for k, (a, b) in enumerate(zip(g, w)) if a != b))
