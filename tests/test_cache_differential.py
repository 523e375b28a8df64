"""Differential tests: reuse through the prefix cache == a cold single-request run.

For each architecture (cache types: KVCache, RotatingKVCache + KVCache, ArraysCache,
ArraysCache + KVCache) and each reuse path, the next-token logprobs after reuse
must match a cold run within 1e-4 and 8 greedy tokens must be identical. The cold
run cuts prefill chunks at the same offsets as the history of the reused snapshot
(recurrent state depends on chunk boundaries). Where reuse cannot be exact, the
manager must fall back, and the test asserts which length it fell back to.

Prompts run through :func:`prefill`, the manager's own fetch and insert with no engine
around them: these are the manager's promises, per cache type. The engine's reuse is held
to solo runs in ``test_scheduler.py``, ``test_chunked_prefill.py`` and ``test_next_turn.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cache import PromptCacheManager, is_trimmable, safe_copy
from cache.checkpoints import common_prefix
from cache.restore import cache_arrays
from conftest import load as load_model_and_tokenizer, model_path
from gateway.conversation.checkpoints import plan_chat_checkpoints

ARCHS = ["qwen3", "llama", "qwen3_5", "gemma3_text", "mamba2", "nemotron_h"]
QWEN3_TOKENIZER_ARCHS = {"qwen3_5", "mamba2", "nemotron_h"}
STEP = 64  # prefill_step_size: several chunks per prompt
TOL = 1e-4

_MODELS: dict[str, tuple] = {}


def load(arch):
    if arch not in _MODELS:
        _MODELS[arch] = load_model_and_tokenizer(model_path(arch))
    return _MODELS[arch]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ("model cache token prompt server batch request tenant prefix memory apple code "
             "agent stream answer question system user reason think water light house world").split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def encode(tok, s):
    return list(tok.encode(s, add_special_tokens=False))


@dataclass
class Prefill:
    """A prompt prefilled by :func:`prefill`: ``cache`` covers all its tokens, ``logits`` and
    ``logprobs`` are float32 ``[vocab]`` at its last position, ``cached_tokens`` were
    restored, ``boundaries`` are the chunk ends run (tokens, ascending)."""

    cache: list
    logits: mx.array
    logprobs: mx.array
    cached_tokens: int
    boundaries: list[int]


def prefill(model, mgr, tokens, checkpoints=(), step=STEP, namespace="default") -> Prefill:
    """Prefill ``tokens`` from the longest prefix ``mgr`` restores (None: cold, nothing
    stored), the manager's own API with no engine around it. Chunks end at every checkpoint,
    every absolute multiple of ``step`` and at ``len - 1`` (the last token runs alone), so a
    cold run cut at the same offsets computes the same recurrent state; snapshots are stored
    at the checkpoints, at ``len - 1`` when the cache cannot be trimmed, and at the end."""
    n = len(tokens)
    hit = mgr.fetch(namespace, tokens) if mgr is not None else None
    try:
        cache, start = (hit.cache, hit.cached_tokens) if hit is not None and hit.cache is not None else \
            (make_prompt_cache(model), 0)
        ckpts = {c for c in checkpoints if start < c < n}
        cuts = ckpts | set(range((start // step + 1) * step, n, step)) | {n}
        cuts |= {n - 1} if n - 1 > start else set()
        pos = start
        for end in sorted(cuts):
            out = model(mx.array(tokens[pos:end])[None], cache=cache)
            pos = end
            mx.eval(cache_arrays(cache))
            if mgr is not None and (end in ckpts or (end == n - 1 and not is_trimmable(cache))):
                mgr.insert(namespace, tokens[:end], safe_copy(cache))
        if mgr is not None:
            mgr.insert(namespace, tokens, safe_copy(cache))
    finally:
        if hit is not None:
            mgr.release(hit.lease)
    logits = out[0, -1].astype(mx.float32)
    return Prefill(cache, logits, logits - mx.logsumexp(logits, axis=-1, keepdims=True), start, sorted(cuts))


def greedy(model, result, n=8):
    cache, logits, out = result.cache, result.logits, []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


def check_equal(model, warm, tokens, cuts):
    """Compare a warm result with a cold run of ``tokens`` cut at ``cuts``."""
    cold = prefill(model, None, tokens, cuts)
    assert set(warm.boundaries) <= set(cold.boundaries)
    diff = mx.abs(warm.logprobs - cold.logprobs).max().item()
    assert diff < TOL, f"logprob diff {diff}"
    assert greedy(model, warm) == greedy(model, cold)


def lineage(*results, upto):
    """Chunk cuts (<= upto) of the runs that produced a restored snapshot, plus ``upto``."""
    cuts = {upto}
    for r in results:
        cuts.update(b for b in r.boundaries if b <= upto)
        if r.cached_tokens:
            cuts.add(r.cached_tokens)
    return cuts


def trimmable(model):
    """Whether the model's cache after a prompt longer than any window is trimmable."""
    from mlx_lm.models.cache import make_prompt_cache

    c = make_prompt_cache(model)
    model(mx.arange(1, 200)[None], cache=c)
    return is_trimmable(c)


def chat(arch, tok, turn2_edit=False):
    msgs = [
        {"role": "system", "content": "You are a careful assistant. " + text(1, 40)},
        {"role": "user", "content": text(2, 60)},
        {"role": "assistant", "content": text(3, 40)},
        {"role": "user", "content": ("Zebra " if turn2_edit else "Quick ") + text(4 + turn2_edit, 40)},
    ]
    return msgs


def render(tok, msgs, **kw):
    out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) else out)


PATHS = ["cold", "exact_repeat", "prefix_suffix", "longer_trimmed", "last_user"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_matches_cold(arch, path):
    model, tok = load(arch)
    mgr = PromptCacheManager(max_bytes=1 << 30, max_entries=64)
    A = encode(tok, text(10, 120))[:150]  # longer than gemma3's 64-token window
    B = encode(tok, " " + text(11, 60))[:60]
    C = encode(tok, " " + text(12, 60))[:60]
    assert len(A) > 100 and B[0] != C[0]

    if path == "cold":
        r = prefill(model, mgr, A + B, [40])
        assert r.cached_tokens == 0
        check_equal(model, r, A + B, [40])
        assert mgr.match_length("default", A + B) == len(A + B) - 1
        assert mgr.match_length("other", A + B) == 0

    elif path == "exact_repeat":
        r1 = prefill(model, mgr, A + B)
        r2 = prefill(model, mgr, A + B)
        n = len(A + B)
        assert r2.cached_tokens == n - 1
        check_equal(model, r2, A + B, lineage(r1, upto=n - 1))

    elif path == "prefix_suffix":
        r1 = prefill(model, mgr, A)
        r2 = prefill(model, mgr, A + B)
        assert r2.cached_tokens == len(A)
        check_equal(model, r2, A + B, lineage(r1, upto=len(A)))

    elif path == "longer_trimmed":
        k = 40
        r1 = prefill(model, mgr, A + B, [k])
        can_trim = trimmable(model)
        assert can_trim == (arch in ("qwen3", "llama"))
        # a different continuation, and a shorter query
        for query in (A + C, A):
            want = min(len(A), len(query) - 1) if can_trim else k
            assert mgr.match_length("default", query) == want, (arch, len(query))
            r2 = prefill(model, mgr, query)
            assert r2.cached_tokens == want
            check_equal(model, r2, query, lineage(r1, upto=want))
            # drop what this query stored so the next one sees r1's entries only
            mgr.eviction.flush()
            r1 = prefill(model, mgr, A + B, [k])

    elif path == "last_user":
        msgs = chat(arch, tok)
        p1 = render(tok, msgs)
        ck = plan_chat_checkpoints(tok, msgs, p1)
        r1 = prefill(model, mgr, p1, ck)
        msgs2 = chat(arch, tok, turn2_edit=True)
        p2 = render(tok, msgs2)
        shared = common_prefix(p1, p2)
        user_start = max(c for c in ck if c <= shared)
        assert shared - user_start <= 2, (shared, ck)  # the checkpoint is the last user message start
        r2 = prefill(model, mgr, p2)
        if trimmable(model):
            assert r2.cached_tokens == shared
        else:
            assert r2.cached_tokens == user_start
        check_equal(model, r2, p2, lineage(r1, upto=r2.cached_tokens))
    mgr.sanity_check()
    assert mgr.num_leases == 0


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
@pytest.mark.parametrize("arch", sorted(QWEN3_TOKENIZER_ARCHS))
def test_thinking_next_turn(arch, thinking):
    """Turn 2 of a Qwen3 thinking conversation reuses turn 1's prompt although the
    template drops the old <think> block (real Qwen3 tokenizer and template)."""
    model, tok = load(arch)
    mgr = PromptCacheManager(max_bytes=1 << 30, max_entries=64)
    kw = {"enable_thinking": thinking}
    msgs1 = [
        {"role": "system", "content": "You are terse. " + text(20, 30)},
        {"role": "user", "content": text(21, 50)},
    ]
    p1 = render(tok, msgs1, **kw)
    ck1 = plan_chat_checkpoints(tok, msgs1, p1, kw)
    r1 = prefill(model, mgr, p1, ck1)
    # the engine stores prompt + completion after decoding
    reply = ("<think>\nLet me reason about it.\n</think>\n\n" if thinking else "") + "Answer " + text(22, 10)
    completion = encode(tok, reply + "<|im_end|>")
    prefill(model, mgr, p1 + completion)
    # turn 2 renders the reply without its <think> block
    content = reply if thinking else "<think>\n\n</think>\n\n" + reply
    msgs2 = msgs1 + [{"role": "assistant", "content": content}, {"role": "user", "content": text(23, 20)}]
    p2 = render(tok, msgs2, **kw)
    # the old <think> block is gone (thinking off: only the new generation prompt has one)
    assert tok.decode(p2).count("<think>") == (0 if thinking else 1)
    next_turn = max(ck1)  # where turn 2 diverges: after "<|im_start|>assistant\n"
    assert tok.decode(p1[:next_turn]).endswith("<|im_start|>assistant\n")
    r2 = prefill(model, mgr, p2)
    # thinking on: turn 1's whole prompt prefixes turn 2; off: all but its empty think block
    want = len(p1) if thinking else len(p1) - 4
    assert next_turn == want == common_prefix(p1 + completion, p2)
    assert r2.cached_tokens == want
    check_equal(model, r2, p2, lineage(r1, upto=want))
    mgr.sanity_check()


def test_gemma_window_trim_rule():
    """RotatingKVCache: a longer entry is trimmed while nothing rotated out (< 64
    tokens), and refused once it has rotated."""
    model, tok = load("gemma3_text")
    toks = encode(tok, text(30, 200))
    for total, expect_trim in ((50, True), (120, False)):
        mgr = PromptCacheManager(max_bytes=1 << 30, max_entries=16)
        r1 = prefill(model, mgr, toks[:total], [20])
        query = toks[:30] + [toks[total + 5]]
        r2 = prefill(model, mgr, query)
        assert r2.cached_tokens == (30 if expect_trim else 20)
        check_equal(model, r2, query, lineage(r1, upto=r2.cached_tokens))
