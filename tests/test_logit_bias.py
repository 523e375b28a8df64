"""``logit_bias`` added for the whole decode batch at once (scheduler/logit_bias.py)
gives the tokens and logprobs of mlx-lm's own per-row processors, rows with and without
a bias, with penalties after it, joining and leaving the batch at different steps."""

from __future__ import annotations

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors

from conftest import load_model, model_path
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.logit_bias import LogitBias, folded_step
from scheduler.request import SamplingParams
from scheduler.sampling import make_processors

BIASES = [{11: 1.0, 12: -100.0}, None, {7: 0.8}, {11: 1.0, 12: -100.0}]


def mlx_lm_processors(bias, penalty):
    return make_logits_processors(logit_bias=bias, repetition_penalty=penalty)


def ours(bias, penalty):
    return make_processors(SamplingParams(logit_bias=tuple((bias or {}).items()), repetition_penalty=penalty or 0.0))


def run(generator_cls, processors, prompts, max_tokens):
    gen = generator_cls(load_model(model_path("qwen3")), max_tokens=64, completion_batch_size=8,
                        prefill_batch_size=8)
    kw = dict(max_tokens=max_tokens, logits_processors=processors)
    uids = (gen.insert_segments([[p] for p in prompts], **kw) if generator_cls is JoiningBatchGenerator
            else gen.insert(prompts, **kw))
    out = {u: [] for u in uids}
    while True:
        step = gen.next()
        responses = step[1] if isinstance(step, tuple) else step
        if not responses and all(len(out[u]) == m for u, m in zip(uids, max_tokens)):
            break
        for g in responses:
            out[g.uid].append((g.token, round(g.logprobs[g.token].item(), 5)))
    gen.close()
    return [out[u] for u in uids]


@pytest.mark.parametrize("penalty", [None, 1.3])
def test_batched_bias_gives_mlx_lm_tokens_and_logprobs(penalty):
    prompts = [[(5 * i + 3 * r) % 180 + 10 for i in range(9 + r)] for r in range(len(BIASES))]
    max_tokens = [12, 7, 10, 4]
    want = run(BatchGenerator, [mlx_lm_processors(b, penalty) for b in BIASES], prompts, max_tokens)
    got = run(JoiningBatchGenerator, [ours(b, penalty) for b in BIASES], prompts, max_tokens)
    assert got == want
    banned = [t for row, b in zip(got, BIASES) if b and 12 in b for t, _ in row]
    assert 12 not in banned and banned  # the bias did act


def test_folded_step_restores_the_batch_and_caches_its_matrix():
    class Batch:
        def __init__(self):
            self.model = lambda inputs, cache=None: inputs
            self.logits_processors = [[LogitBias({1: 2.0})], [], [LogitBias({0: -1.0}), len]]

    import mlx.core as mx

    b = Batch()
    model, procs = b.model, b.logits_processors
    seen = []

    def step():
        seen.append(([len(p) for p in b.logits_processors], b.model(mx.zeros((3, 1, 4))).tolist()))
        return "done"

    assert folded_step(b, step) == "done" and folded_step(b, step) == "done"
    assert seen[0] == ([0, 0, 1], [[[0, 2, 0, 0]], [[0, 0, 0, 0]], [[-1, 0, 0, 0]]]) and seen[1] == seen[0]
    assert b.model is model and b.logits_processors is procs
    matrix = b._bias_matrix
    folded_step(b, step)
    assert b._bias_matrix is matrix  # the same rows: the same matrix
