"""Detokenizing, stop strings and the reasoning split, with the real Qwen3 tokenizer."""

from __future__ import annotations

import pytest

from conftest import TOKENIZERS, live_server, load_tokenizer, model_path
from gateway.conversation.textout import TextAssembler


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer(TOKENIZERS / "qwen3")


def run(asm: TextAssembler, tokens: list[int]) -> tuple[str, str, list[str]]:
    content, reasoning, pieces = "", "", []
    for t in tokens:
        d = asm.feed(t)
        content, reasoning = content + d.content, reasoning + d.reasoning
        pieces.append(d.content)
        if asm.stopped:
            break
    d = asm.finish()
    return content + d.content, reasoning + d.reasoning, pieces


def test_reasoning_then_answer(qwen3):
    toks = qwen3.encode("<think>\nLet me weigh it.\n</think>\n\nThe answer is 42.", add_special_tokens=False)
    asm = TextAssembler(qwen3, think=("<think>", "</think>"))
    content, reasoning, _ = run(asm, toks)
    assert reasoning.strip() == "Let me weigh it."
    assert content == "The answer is 42."


def test_prompt_opened_reasoning(qwen3):
    toks = qwen3.encode("hmm, thinking</think>\n\nDone.", add_special_tokens=False)
    asm = TextAssembler(qwen3, think=("<think>", "</think>"), in_reasoning=True)
    content, reasoning, _ = run(asm, toks)
    assert reasoning == "hmm, thinking" and content == "Done."


def test_leading_whitespace_is_not_held_for_a_think_tag(qwen3):
    """Only a think tag's possible start is held: a first token of whitespace goes out at
    once (held, it waited for the next decode step), and a think block after it is still
    split off."""
    toks = qwen3.encode("\x0bly ly", add_special_tokens=False)
    _, _, pieces = run(TextAssembler(qwen3, think=("<think>", "</think>")), toks)
    assert pieces[0] == "\x0b"
    toks = qwen3.encode("\n<think>\nLet me weigh it.\n</think>\n\nThe answer is 42.", add_special_tokens=False)
    content, reasoning, pieces = run(TextAssembler(qwen3, think=("<think>", "</think>")), toks)
    assert pieces[0] == "\n" and reasoning.strip() == "Let me weigh it." and content == "\nThe answer is 42."
    _, _, pieces = run(TextAssembler(qwen3, think=("<think>", "</think>")), qwen3.encode("<thi", add_special_tokens=False))
    assert pieces[0] == ""  # "<" could start the tag: held


def test_no_think_block_is_all_content(qwen3):
    toks = qwen3.encode("Plain answer, no thinking.", add_special_tokens=False)
    content, reasoning, _ = run(TextAssembler(qwen3, think=("<think>", "</think>")), toks)
    assert content == "Plain answer, no thinking." and reasoning == ""


def test_stop_string_is_never_half_sent(qwen3):
    toks = qwen3.encode("alpha beta STOP gamma", add_special_tokens=False)
    content, _, pieces = run(TextAssembler(qwen3, stop=["STOP"]), toks)
    assert content == "alpha beta "
    assert all("S" not in p for p in pieces)


def test_eos_is_not_text(qwen3):
    eos = next(iter(qwen3.eos_token_ids))
    toks = qwen3.encode("bye", add_special_tokens=False) + [eos]
    content, _, _ = run(TextAssembler(qwen3, skip_ids=frozenset(qwen3.eos_token_ids)), toks)
    assert content == "bye"


def test_reasoning_content_over_http():
    """Force the model to open a think block (logit_bias) and check where its text goes."""
    with live_server(model_path("qwen3_5")) as server:
        think = server.tokenizer.convert_tokens_to_ids("<think>")
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "logit_bias": {str(think): 100}}
        with server.client() as c:
            msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "<think>" * 3
        assert msg["content"] == ""


def byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level BPE token for one raw byte (GPT-2's byte map)."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    char = next(c for c, b in _byte_decoder().items() if b == byte)
    return tokenizer.convert_tokens_to_ids(char)


def test_bytes_that_can_never_be_valid_utf8_are_released_at_once(qwen3):
    # What a random-weight model emits: an invalid lead byte, a word, then lone
    # continuation bytes. Each piece is released with its token (U+FFFD for each invalid
    # byte), not held to the end of the answer, and together they are the whole decode.
    word = qwen3.encode(" word", add_special_tokens=False)
    toks = [byte_token(qwen3, 0xC0), *word] + [byte_token(qwen3, 0x86)] * 4
    content, _, pieces = run(TextAssembler(qwen3), toks)
    assert pieces == ["\ufffd", " word", "\ufffd", "\ufffd", "\ufffd", "\ufffd"]
    assert content == qwen3.decode(toks) == "\ufffd word\ufffd\ufffd\ufffd\ufffd"


def test_an_incomplete_character_is_held_until_it_completes(qwen3):
    # "中" is e4 b8 ad: its first two bytes wait for the third, after an invalid byte too.
    zhong = [byte_token(qwen3, b) for b in "中".encode()]
    content, _, pieces = run(TextAssembler(qwen3), zhong + [byte_token(qwen3, 0x86)] + zhong)
    assert pieces == ["", "", "中", "\ufffd", "", "", "中"]
    assert content == "中\ufffd中"


def test_invalid_bytes_are_released_past_the_think_and_stop_filters(qwen3):
    # With a reasoning split and stop strings, as chat requests have them.
    toks = [byte_token(qwen3, 0x86)] * 3
    asm = TextAssembler(qwen3, think=("<think>", "</think>"), stop=["STOP"])
    _, _, pieces = run(asm, toks)
    assert pieces == ["\ufffd"] * 3


def test_a_held_added_token_outside_the_byte_map_stays_held(qwen3):
    # An added token whose own characters are not byte-map characters (here U+FFFD
    # itself) is left to the detokenizer, which holds it as before, instead of failing.
    from gateway.conversation import textout

    asm = TextAssembler(qwen3)
    odd = byte_token(qwen3, 0x86)
    asm._detok.tokenmap = list(asm._detok.tokenmap)  # this assembler's own copy, changed
    asm._detok.tokenmap[odd] = "\ufffd"
    asm._token_bytes = textout._token_bytes(asm._detok)
    _, _, pieces = run(asm, [odd, *qwen3.encode(" word", add_special_tokens=False)])
    assert pieces == ["", "\ufffd word"]
