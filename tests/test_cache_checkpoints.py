"""Checkpoint planning with the real Qwen3 chat template (thinking) and the project's ChatML."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from cache import periodic_checkpoints, plan_chat_checkpoints, plan_completion_checkpoints
from cache.checkpoints import message_boundaries
from conftest import TOKENIZERS, model_path

SYSTEM = "You are a helpful assistant who answers briefly."
U1 = "What is a prefix cache?"
A1 = "<think>\nThe user asks about caching.\n</think>\n\nIt stores computed prompt state."
U2 = "And how does eviction work in it?"


@pytest.fixture(scope="module")
def qwen3_tok():
    return load_tokenizer(TOKENIZERS / "qwen3")


def render(tok, msgs, **kw):
    out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kw)
    return list(out)


def conversation():
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": U2},
    ]


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_offsets_land_on_boundaries(qwen3_tok, thinking):
    tok = qwen3_tok
    kw = {} if thinking is None else {"enable_thinking": thinking}
    msgs = conversation()
    prompt = render(tok, msgs, **kw)
    cps = plan_chat_checkpoints(tok, msgs, prompt, kw)
    assert cps == sorted(set(cps)) and all(0 < c < len(prompt) for c in cps)
    assert len(cps) == 3
    sys_end, user_start, before_suffix = cps
    dec = lambda a, b=None: tok.decode(prompt[a:b])  # noqa: E731
    assert dec(0, sys_end) == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    assert dec(0, user_start).endswith("<|im_start|>user\n")
    assert dec(user_start).startswith(U2)
    suffix = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else "")
    assert dec(before_suffix) == suffix
    assert dec(0, before_suffix).endswith(U2 + "<|im_end|>\n")
    # the old <think> block is dropped by the template
    assert "<think>\nThe user" not in dec(0)
    # decoding/encoding round trip: each prefix is what the tokenizer makes of its text
    for c in cps:
        assert list(tok.encode(dec(0, c), add_special_tokens=False)) == prompt[:c]


def test_next_turn_shares_before_suffix_checkpoint(qwen3_tok):
    """Turn 1's checkpoint before the generation suffix prefixes turn 2 (thinking off)."""
    tok = qwen3_tok
    kw = {"enable_thinking": False}
    msgs1 = conversation()[:2]
    p1 = render(tok, msgs1, **kw)
    before_suffix = max(plan_chat_checkpoints(tok, msgs1, p1, kw))
    msgs2 = msgs1 + [{"role": "assistant", "content": "<think>\n\n</think>\n\nIt stores state."},
                     {"role": "user", "content": U2}]
    p2 = render(tok, msgs2, **kw)
    assert p2[:before_suffix] == p1[:before_suffix]
    assert p2[:len(p1)] != p1  # the stored full prompt does not prefix turn 2


def test_own_chatml_tokenizer():
    tok = load_tokenizer(model_path("qwen3"))
    msgs = conversation()
    prompt = render(tok, msgs)
    cps = plan_chat_checkpoints(tok, msgs, prompt)
    text = lambda a, b=None: tok.decode(prompt[a:b])  # noqa: E731
    assert len(cps) == 3
    assert text(0, cps[0]).endswith(SYSTEM + "<|im_end|>\n")
    assert text(cps[1]).startswith(U2)
    assert text(cps[2]).startswith("<|im_start|>assistant")


def test_periodic_snaps_to_message_boundaries(qwen3_tok):
    tok = qwen3_tok
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(30):
        msgs.append({"role": "user", "content": f"Question {i}: " + "tell me about the cache " * (3 + i % 5)})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + "it stores state " * (2 + i % 4)})
    msgs.append({"role": "user", "content": "Summarise."})
    prompt = render(tok, msgs)
    N = 128
    cps = plan_chat_checkpoints(tok, msgs, prompt, interval=N)
    assert cps == sorted(set(cps)) and all(0 < c < len(prompt) for c in cps)
    bounds = set(message_boundaries(tok, msgs, prompt))
    periodic = periodic_checkpoints(len(prompt), N, bounds | set(cps[:1]))
    assert set(periodic) <= set(cps)
    assert len(periodic) >= len(prompt) // N - 1
    last = 0
    for c in periodic:
        assert c - last <= N  # never more than N tokens without a checkpoint
        assert c - last == N or (c in bounds and c - last > N - N // 4)
        last = c
    assert sum(c in bounds for c in periodic) >= len(periodic) // 2  # most snapped


def test_periodic_and_completion_variants():
    assert plan_completion_checkpoints(list(range(10000))) == [4096, 8192]
    assert plan_completion_checkpoints(list(range(4096))) == []
    assert plan_completion_checkpoints(list(range(4097))) == [4096]
    assert periodic_checkpoints(1000, 100, boundaries=[180, 190, 260])  # 260 not in (265, 290] == [100, 190, 290, 390, 490, 590, 690, 790, 890, 990]
    assert periodic_checkpoints(1000, 400, boundaries=[250]) == [400, 800]  # 250 is not in the last quarter
    with pytest.raises(ValueError):
        periodic_checkpoints(10, 0)
