"""JoiningBatchGenerator against mlx-lm's BatchGenerator: the same tokens and logprobs
for the same insertions (cold prompts cut into segments, and warm rows with only their
last token left), per architecture, with one forward less per joining row."""

from __future__ import annotations

import copy

import pytest
from mlx_lm.generate import BatchGenerator

from conftest import CountingModel, assert_same_tokens, load_model, model_path, prefilled
from scheduler.batch.generator import JoiningBatchGenerator


def run(generator_cls, model, rows, *, prefill_batch: int, decode_batch: int, step: int = 16,
        steps: list | None = None):
    """Insert ``rows`` (segments, cache or None, cached tokens, max tokens) and step until
    every row finished; per row, its (token, logprob) pairs and finish reason. ``steps``,
    if given, gets per step the row indices whose prompt ended and those given a token."""
    gen = generator_cls(model, max_tokens=1 << 20, prefill_batch_size=prefill_batch,
                        completion_batch_size=decode_batch, prefill_step_size=step)
    uids = gen.insert_segments(
        [r[0] for r in rows], max_tokens=[r[3] for r in rows],
        caches=[copy.deepcopy(r[1]) if r[1] is not None else None for r in rows],
        all_tokens=[list(r[2]) for r in rows])
    out = {u: [] for u in uids}
    finish = {}
    lengths = dict(zip(uids, (len(r[2]) + sum(len(seg) for seg in r[0]) for r in rows)))
    while len(finish) < len(uids):
        prompt_responses, responses = gen.next()
        for p in prompt_responses:  # a finished prompt's cache holds exactly the prompt
            if p.end_of_prompt:
                extracted = gen.extract_cache([p.uid]).get(p.uid)
                if extracted is None:  # stopped at its first token: it left with its cache
                    extracted = next((g.prompt_cache, g.all_tokens) for g in responses if g.uid == p.uid)
                cache, tokens = extracted
                offset = next(c.offset for c in cache if hasattr(c, "offset"))
                assert len(tokens) == lengths[p.uid] == offset, (generator_cls.__name__, p.uid)
        for g in responses:
            out[g.uid].append((g.token, g.logprobs[g.token].item()))
            if g.finish_reason:
                finish[g.uid] = g.finish_reason
        if steps is not None:
            steps.append(({uids.index(p.uid) for p in prompt_responses if p.end_of_prompt},
                          {uids.index(g.uid) for g in responses}))
    gen.close()
    return [out[u] for u in uids], [finish[u] for u in uids]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("sizes", [(4, 4), (2, 2), (1, 1)])
def test_same_tokens_as_mlx_lm(arch, sizes):
    model = load_model(model_path(arch))
    base = [(7 * i + 3) % 200 + 10 for i in range(48)]
    warm = prefilled(model, base[:40])
    rows = [
        ([base[:20], base[20:37], base[37:40]], None, [], 5),            # cold, three segments
        ([[base[40]]], warm, base[:40], 6),                             # warm: only the last token left
        ([[t + 1 for t in base[:27]]], None, [], 4),                     # cold, another length
        ([[base[40]]], warm, base[:40], 1),                             # warm, one token
        ([base[40:45], [base[45]]], warm, base[:40], 3),                 # warm with a suffix
    ]
    want = run(BatchGenerator, model, rows, prefill_batch=sizes[0], decode_batch=sizes[1])
    got = run(JoiningBatchGenerator, model, rows, prefill_batch=sizes[0], decode_batch=sizes[1])
    assert got[1] == want[1]
    for i, (g, w) in enumerate(zip(got[0], want[0])):
        assert_same_tokens(g, w, f"row {i}")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "qwen3_5", "nemotron_h"])
def test_a_long_prompt_joins_apart_with_its_first_token_from_its_own_forward(arch):
    """A 90-token prompt finishes beside a row decoding with about a dozen tokens in its
    cache (more than APART_WIDTH times fewer): the step that ends its prompt reports its
    first token from a forward of its own, and the decoding row gets no token in that
    step; both rows then decode together. Tokens and logprobs are mlx-lm's, and the
    prompt's cache at its end is exactly its prompt (``run`` checks it)."""
    from scheduler.batch.generator import APART_WIDTH

    model = load_model(model_path(arch))
    short = [(5 * i + 7) % 200 + 10 for i in range(6)]
    long = [(7 * i + 3) % 200 + 10 for i in range(90)]
    rows = [([short], None, [], 24), ([long], None, [], 6)]
    want = run(BatchGenerator, model, rows, prefill_batch=1, decode_batch=2)
    steps: list = []
    got = run(JoiningBatchGenerator, model, rows, prefill_batch=1, decode_batch=2, steps=steps)
    assert got[1] == want[1]
    for i, (g, w) in enumerate(zip(got[0], want[0])):
        assert_same_tokens(g, w, f"row {i}")
    (joined,) = [i for i, (ended, _) in enumerate(steps) if 1 in ended]
    decoded_before = sum(0 in tokens for _, tokens in steps[:joined])
    assert len(long) - 1 >= APART_WIDTH * (len(short) + decoded_before)  # long enough to join apart
    assert steps[joined][1] == {1}  # its first token; the decoding row waited
    assert steps[joined + 1][1] == {0}  # then the decoding row's token (the new row's next one comes a step later)
    assert {0, 1} <= steps[joined + 2][1]


def join_step_calls(generator_cls, model, warm, base) -> tuple[int, list, int]:
    """Forward calls of the step in which a warm row joins a decoding one, the warm row's
    tokens, and how many of them that step reported."""
    gen = generator_cls(model, max_tokens=1 << 20, prefill_batch_size=4, completion_batch_size=4)
    gen.insert([[5, 6, 7, 8, 9]], max_tokens=[8])
    while not gen.next()[1]:  # until the cold row decodes
        pass
    (uid,) = gen.insert_segments([[[base[-1]]]], max_tokens=[3], caches=[copy.deepcopy(warm)],
                                 all_tokens=[base[:-1]])
    model.calls = 0
    prompt_responses, responses = gen.next()
    calls = model.calls
    assert [(p.uid, p.end_of_prompt) for p in prompt_responses if p.uid == uid] == [(uid, True)]
    tokens = [g.token for g in responses if g.uid == uid]
    reported = len(tokens)
    while len(tokens) < 3:
        tokens += [g.token for g in gen.next()[1] if g.uid == uid]
    gen.close()
    return calls, tokens, reported


def test_warm_row_joins_the_decode_forward():
    """A row with only its last prompt token left goes straight into the decode batch:
    its first token comes from the batch's next forward (one model call for the step),
    where mlx-lm runs a forward of its own for it (two calls), and that step reports it
    (mlx-lm reports it a step later)."""
    model = CountingModel(load_model(model_path("qwen3")))
    base = list(range(10, 50))
    warm = prefilled(model.model, base[:-1])
    mlx_lm_calls, want, mlx_lm_reported = join_step_calls(BatchGenerator, model, warm, base)
    calls, got, reported = join_step_calls(JoiningBatchGenerator, model, warm, base)
    assert got == want
    assert (calls, mlx_lm_calls) == (1, 2)
    assert (reported, mlx_lm_reported) == (1, 0)

    gen = JoiningBatchGenerator(model, max_tokens=8, prefill_batch_size=4, completion_batch_size=4)
    (uid,) = gen.insert_segments([[[base[-1]]]], caches=[copy.deepcopy(warm)], all_tokens=[base[:-1]])
    gen.next()
    assert gen._prompt_batch.uids == [] and gen._generation_batch.uids == [uid]  # never in the prompt batch
    gen.close()


def test_a_chunked_prompt_gets_its_whole_room_at_once_and_the_decode_batch_its_usual_step():
    """A 600-token prompt prefilled 64 tokens a step: its plain KV caches grow once, at the
    first chunk, to room for the whole prompt (mlx-lm grows 256 tokens at a time, copying
    the cache each time); once it decodes, its caches grow 256 at a time again. The tokens
    are mlx-lm's (test_same_tokens_as_mlx_lm)."""
    from mlx_lm.models.cache import BatchKVCache

    model = load_model(model_path("qwen3"))
    prompt = [(7 * i + 3) % 200 + 10 for i in range(600)]
    gen = JoiningBatchGenerator(model, max_tokens=1 << 20, prefill_batch_size=1, completion_batch_size=1,
                                prefill_step_size=64)
    gen.insert([prompt], max_tokens=[4])
    sizes = []
    while not gen._generation_batch.uids:
        gen.next()
        layers = [c for c in gen._prompt_batch.prompt_cache if type(c) is BatchKVCache and c.keys is not None]
        if layers:
            sizes.append({c.keys.shape[2] for c in layers})
    assert len(sizes) >= 9 and all(s == sizes[0] for s in sizes), sizes  # one growth, at the first chunk
    (size,) = sizes[0]
    assert len(prompt) - 1 <= size < len(prompt) + BatchKVCache.step
    decoding = [c for c in gen._generation_batch.prompt_cache if type(c) is BatchKVCache]
    assert decoding and all(c.step == BatchKVCache.step for c in decoding)
    gen.close()
