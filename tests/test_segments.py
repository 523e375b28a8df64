"""Chats tokenized in pieces between special tokens, the pieces kept: the same tokens and
offsets as tokenizing the whole chat, for each fixture tokenizer family; a tokenizer whose
pieces do not add up is caught and tokenized whole."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest
from mlx_lm.utils import load_tokenizer

from conftest import TOKENIZERS, live_server, model_path, require_tokenizers
from gateway.conversation import segments
from gateway.conversation.prepare import warm_up
from gateway.conversation.segments import VERIFY_FIRST, SegmentEncoder
from gateway.conversation.templates import encode_with_ends, render_text

WORDS = ("the model cache token prompt  server\nbatch request tenant prefix memory apple code agent "
         "browser extension stream answer question system user assistant reason think water é ü 漢字 "
         "def f(x):\n    return x  # done\n\n").split(" ")


def _chats(seed: int, n: int) -> list[list[dict]]:
    """Conversations that grow turn by turn (an agent's), sharing a system prompt."""
    rng = random.Random(seed)
    system = {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(300))}
    chats, turns = [], []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 80)))})
        if role == "user":
            chats.append([system, *turns])
    return chats


def _tokenizer(family):
    if family is None:
        return load_tokenizer(model_path("qwen3"))
    require_tokenizers(family)
    return load_tokenizer(TOKENIZERS / family)


@pytest.mark.parametrize("family", [None, "qwen3", "llama3", "gemma3"])
def test_pieces_give_the_whole_chats_tokens(family):
    tok = _tokenizer(family)
    enc = SegmentEncoder(tok)
    assert enc.exact, "no special tokens to cut after"
    chats = _chats(1, 40)
    for messages in chats + chats[:5]:  # the repeats come wholly from kept pieces
        text = render_text(tok, messages, True, {})
        assert enc.encode(text) == encode_with_ends(tok, text)
    assert enc.exact and enc.checked > VERIFY_FIRST
    assert enc.hit_chars > 3 * enc.miss_chars  # the system prompt and earlier turns were not tokenized again


def test_a_tokenizer_whose_pieces_differ_is_tokenized_whole():
    """Cutting inside words (not after special tokens) changes the tokens: the check of the
    first chats notices, the request gets the whole chat's tokens, and segments stay off."""
    import re

    tok = _tokenizer(None)
    enc = SegmentEncoder(tok)
    enc._cut = re.compile("e")
    for messages in _chats(2, 12):
        text = render_text(tok, messages, True, {})
        assert enc.encode(text) == encode_with_ends(tok, text)
    assert not enc.exact
    tokenized = enc.hit_chars + enc.miss_chars
    text = render_text(tok, _chats(3, 2)[0], True, {})
    assert enc.encode(text) == encode_with_ends(tok, text) and enc.hit_chars + enc.miss_chars == tokenized


def test_kept_pieces_are_bounded():
    tok = _tokenizer(None)
    enc = SegmentEncoder(tok, max_chars=20_000)
    for messages in _chats(4, 60):
        enc.encode(render_text(tok, messages, True, {}))
    assert 0 < enc._chars <= 20_000
    assert sum(len(p) for p in enc._kept) == enc._chars


def test_a_tokenizer_that_treats_an_inputs_start_specially_is_caught_before_any_chat():
    """SentencePiece's Metaspace with ``prepend_scheme="first"`` adds its space only to an
    input's first piece, so "x" after a special token is one token inside a chat and
    another alone: the probe when the encoder is made finds it."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gateway.conversation.segments import encode_chat

    vocab = {"[UNK]": 0, "▁a": 1, "▁b": 2, "x": 3, "▁x": 4, "▁y": 5, "y": 6}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    hf.add_special_tokens({"additional_special_tokens": ["<s>"]})
    tok = TokenizerWrapper(hf)
    assert not SegmentEncoder(tok).exact
    text = "a b<s>x y<s>x"
    assert encode_chat(tok, text) == encode_with_ends(tok, text)


def test_the_encoders_do_not_keep_a_tokenizer_alive():
    """A model unloaded and loaded again brings a new tokenizer: the old one's encoder (and
    its kept pieces) go with it."""
    import gc

    from gateway.conversation import segments

    tok = load_tokenizer(model_path("qwen3"))
    segments.encode_chat(tok, render_text(tok, _chats(5, 2)[0], True, {}))
    before = len(segments._encoders)
    del tok
    gc.collect()
    assert len(segments._encoders) == before - 1


def test_a_started_server_has_prepared_a_chat_before_any_request(tmp_path):
    """The template, the tokenizer and its segment encoder (probes and a first check) are
    ready before the first request (``gateway.conversation.prepare.warm_up``, run at load);
    a template that rejects every chat, or none, makes the warm-up return False, not raise."""
    # a copy whose tokenizer files differ: a tokenizer of its own (the loader reuses an
    # earlier load's made of the same files)
    shutil.copytree(model_path("qwen3"), tmp_path / "qwen3")
    config = tmp_path / "qwen3" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 32768 + 1}))
    with live_server(tmp_path / "qwen3") as server:
        model = server.model
        encoder = segments._encoders.get(model.tokenizer)
        assert encoder is not None and encoder.exact and encoder.verified == 1

        rejecting = _tokenizer(None)
        rejecting.chat_template = "{{ raise_exception('no chat here') }}"
        assert not warm_up(replace(model, tokenizer=rejecting))

        class NoTemplate:
            has_chat_template = False

        assert not warm_up(replace(model, tokenizer=NoTemplate()))
        assert warm_up(model)
