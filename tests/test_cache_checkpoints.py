"""Checkpoint planning with real chat templates (Qwen3 with and without thinking,
Llama 3, Gemma 3) and the project's own ChatML: every offset is checked against an
independent rendering of the conversation it is meant to serve."""

from __future__ import annotations

import pytest

from cache.checkpoints import common_prefix
from gateway.conversation.checkpoints import (periodic_checkpoints, plan_chat_checkpoints, plan_completion_checkpoints,
                                              thin_boundaries)
from gateway.conversation.templates import common_chars, encode_with_ends, render_text
from conftest import TOKENIZERS, load_tokenizer, model_path

SYSTEM = "You are a helpful assistant who answers briefly."
U1 = "What is a prefix cache?"
A1 = "<think>\nThe user asks about caching.\n</think>\n\nIt stores computed prompt state."
U2 = "And how does eviction work in it?"
THINKING = [None, True, False]


@pytest.fixture(scope="module")
def qwen3_tok():
    return load_tokenizer(TOKENIZERS / "qwen3")


def render(tok, msgs, gen=True, **kw):
    return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, **kw))


def conversation():
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": U2},
    ]


def long_conversation(turns=30):
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: " + "tell me about the cache " * (3 + i % 5)})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + "it stores state " * (2 + i % 4)})
    msgs.append({"role": "user", "content": "Summarise."})
    return msgs


def content_start(tok, msgs, prompt, k, **kw):
    """Where message ``k``'s content starts in ``prompt``, found independently: render
    messages[:k] plus message k with other content and compare tokens."""
    alt = [*msgs[:k], {**msgs[k], "content": "\u2063other\u2063"}]
    return common_prefix(render(tok, alt, gen=False, **kw), prompt)


def kwargs(thinking):
    return {} if thinking is None else {"enable_thinking": thinking}


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma3", None])
def test_text_then_tokens_equals_the_template_tokenizing(family):
    tok = load_tokenizer(TOKENIZERS / family) if family else load_tokenizer(model_path("qwen3"))
    for kw in ({}, {"enable_thinking": False}):
        text = render_text(tok, long_conversation(5), True, kw)
        ids, ends = encode_with_ends(tok, text)
        assert ids == render(tok, long_conversation(5), **kw)
        assert ends is not None and len(ends) == len(ids) and ends[-1] == len(text)


@pytest.mark.parametrize("thinking", THINKING)
def test_qwen3_offsets_land_on_boundaries(qwen3_tok, thinking):
    tok, kw = qwen3_tok, kwargs(thinking)
    msgs = conversation()
    prompt = render(tok, msgs, **kw)
    cps = plan_chat_checkpoints(tok, msgs, prompt, kw)
    assert cps == sorted(set(cps)) and all(0 < c <= len(prompt) for c in cps)
    assert len(cps) == 3
    sys_end, user_start, next_turn = cps
    dec = lambda a, b=None: tok.decode(prompt[a:b])  # noqa: E731
    assert dec(0, sys_end) == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    assert dec(0, user_start).endswith("<|im_start|>user\n")
    assert dec(user_start).startswith(U2)
    assert dec(0, next_turn).endswith(U2 + "<|im_end|>\n<|im_start|>assistant\n")
    # thinking on: the next turn shares the whole prompt; off: all but the empty think block
    assert dec(next_turn) == ("<think>\n\n</think>\n\n" if thinking is False else "")
    assert "<think>\nThe user" not in dec(0)  # the old <think> block is dropped by the template
    for c in cps:  # each prefix is what the tokenizer makes of its text
        assert list(tok.encode(dec(0, c), add_special_tokens=False)) == prompt[:c]


@pytest.mark.parametrize("thinking", THINKING)
def test_next_turn_checkpoint_is_where_the_next_turn_diverges(qwen3_tok, thinking):
    """The checkpoint sits exactly at the longest prefix turn 2 shares with turn 1's
    prompt + reply, not before the generation prompt."""
    tok, kw = qwen3_tok, kwargs(thinking)
    msgs1 = conversation()[:2]
    p1 = render(tok, msgs1, **kw)
    next_turn = max(plan_chat_checkpoints(tok, msgs1, p1, kw))
    reply = ("" if thinking is False else "<think>\nI should define it.\n</think>\n\n") + "It stores state."
    completion = tok.encode(reply, add_special_tokens=False)
    p2 = render(tok, msgs1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": U2}], **kw)
    assert common_prefix(p1 + completion, p2) == next_turn
    assert next_turn == (len(p1) - 4 if thinking is False else len(p1))


def test_next_turn_found_when_a_marker_changes_an_earlier_message(qwen3_tok):
    """Qwen3 strips a reply's leading newlines: with a marker in front they stay, so the
    marked rendering stops agreeing there; the next-turn point is still found."""
    tok = qwen3_tok
    msgs = conversation()
    msgs[2] = {"role": "assistant", "content": "\n\nIt stores computed prompt state."}
    prompt = render(tok, msgs)
    cps = plan_chat_checkpoints(tok, msgs, prompt)
    p2 = render(tok, msgs + [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "More?"}])
    assert max(cps) == common_prefix(prompt, p2) == len(prompt)


def test_own_chatml_tokenizer():
    tok = load_tokenizer(model_path("qwen3"))
    msgs = conversation()
    prompt = render(tok, msgs)
    cps = plan_chat_checkpoints(tok, msgs, prompt)
    text = lambda a, b=None: tok.decode(prompt[a:b])  # noqa: E731
    assert len(cps) == 3
    assert text(0, cps[0]).endswith(SYSTEM + "<|im_end|>\n<|im_start|>user\n")
    assert text(cps[1]).startswith(U2)
    assert cps[2] == len(prompt) and text(0).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma3"])
def test_message_starts_for_untrimmable_caches(family):
    """boundaries=True adds the thinned message starts (assistant ones one token early);
    each is checked against an independent rendering, and regenerating a kept earlier
    turn finds a checkpoint one token short of its whole prompt."""
    tok = load_tokenizer(TOKENIZERS / family)
    msgs = long_conversation(12)
    prompt = render(tok, msgs)
    base = set(plan_chat_checkpoints(tok, msgs, prompt))
    cps = plan_chat_checkpoints(tok, msgs, prompt, boundaries=True)
    kept = thin_boundaries(range(1, len(msgs)))
    expected = {content_start(tok, msgs, prompt, k) - (msgs[k]["role"] == "assistant") for k in kept}
    assert set(cps) == base | expected
    for k in kept:
        if msgs[k]["role"] != "assistant":
            continue
        regen = render(tok, msgs[:k])  # the prompt that regenerates reply k
        assert regen[:-1] == prompt[:len(regen) - 1] and len(regen) - 1 in cps


def test_thinning_rule():
    assert thin_boundaries(range(1, 30)) == [4, 8, 12, 16, 20, *range(22, 30)]
    assert thin_boundaries([3, 1, 2]) == [1, 2, 3]
    assert thin_boundaries(range(20), keep_last=2, keep_every=10) == [0, 10, 18, 19]


def test_periodic_snaps_to_message_starts(qwen3_tok):
    tok = qwen3_tok
    msgs = long_conversation()
    prompt = render(tok, msgs)
    N = 128
    cps = plan_chat_checkpoints(tok, msgs, prompt, interval=N)
    assert cps == sorted(set(cps)) and all(0 < c <= len(prompt) for c in cps)
    starts = {content_start(tok, msgs, prompt, k) for k in range(1, len(msgs))}
    periodic = [c for c in cps if c not in set(plan_chat_checkpoints(tok, msgs, prompt, interval=10**6))]
    assert len(periodic) >= len(prompt) // N - 1
    last = 0
    for c in periodic:
        assert c - last <= N  # never more than N tokens without a checkpoint
        assert c - last == N or (c in starts and c - last > N - N // 4)
        last = c
    assert sum(c in starts for c in periodic) >= len(periodic) // 2  # most snapped


def test_periodic_and_completion_variants():
    assert plan_completion_checkpoints(list(range(10000))) == [4096, 8192]
    assert plan_completion_checkpoints(list(range(4096))) == []
    assert plan_completion_checkpoints(list(range(4097))) == [4096]
    # 190 is in (175, 200]; 260 is not in (265, 290]
    assert periodic_checkpoints(1000, 100, boundaries=[180, 190, 260]) == [100, 190, *range(290, 1000, 100)]
    assert periodic_checkpoints(1000, 400, boundaries=[250]) == [400, 800]  # 250 is not in the last quarter
    with pytest.raises(ValueError):
        periodic_checkpoints(10, 0)


def test_common_chars():
    assert common_chars("abcdef", "abcxyz") == 3
    assert common_chars("", "abc") == 0 and common_chars("abc", "abc") == 3 and common_chars("ab", "abc") == 2


def test_trimmable_caches_keep_the_system_end_and_periodic_ones(qwen3_tok):
    """A trimmable cache's prompt + completion snapshot serves every shorter prefix: only
    the system end (a burst's shared prefix) and the periodic offsets remain."""
    tok = qwen3_tok
    msgs = conversation()
    prompt = render(tok, msgs)
    full = plan_chat_checkpoints(tok, msgs, prompt)
    assert plan_chat_checkpoints(tok, msgs, prompt, trimmable=True) == full[:1]
    msgs = long_conversation()
    prompt = render(tok, msgs)
    cps = plan_chat_checkpoints(tok, msgs, prompt, interval=128, trimmable=True)
    assert cps[0] == plan_chat_checkpoints(tok, msgs, prompt)[0]  # the system end
    assert len(prompt) not in cps  # no next-turn point
    assert all(b - a <= 128 for a, b in zip([0, *cps], cps)) and len(prompt) - cps[-1] <= 128
