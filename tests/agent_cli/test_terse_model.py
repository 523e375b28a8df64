"""The terse models the agent sessions run on end their answers after a few tokens, greedy
and sampled, with real tokenizers (Qwen3's, and the project's own BPE of ``--model
demo``), and never write a special token other than the end of the turn: the weight edit
of ``terse_weights.py`` does what its docstring says, on the model as
``mlx_lm.load`` loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from .session import terse_model
from .terse_weights import word_tokens

TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List files.",
                                           "parameters": {"type": "object", "properties": {}}}}]
PROMPTS = ["List the files in this directory.", "Which of them is the largest?", "hi", "Explain " * 40]
MOST = 12  # tokens an answer may take before its end


@pytest.fixture(scope="module", params=["qwen3", None], ids=["qwen3-tokenizer", "own-tokenizer"])
def loaded(request):
    from mlx_lm import load

    path = terse_model(request.param)
    model, tokenizer = load(str(path))
    return model, tokenizer, path


def _answer(model, tokenizer, prompt: str, temp: float, seed: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    mx.random.seed(seed)
    out = []
    sampler = make_sampler(temp, top_p=0.95 if 0 < temp < 1 else 0.0)
    for token, _ in generate_step(mx.array(ids), model, max_tokens=MOST + 1, sampler=sampler):
        out.append(int(token))
        if out[-1] in tokenizer.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("temp", [0.0, 0.6, 1.0])
def test_answers_end_after_a_few_tokens_and_hold_no_special_token(loaded, temp):
    model, tokenizer, _ = loaded
    end = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    special = set(tokenizer._tokenizer.added_tokens_decoder) - {end}
    lengths = []
    for i, prompt in enumerate(PROMPTS):
        for seed in range(3 if temp else 1):
            out = _answer(model, tokenizer, prompt, temp, seed=10 * i + seed)
            assert out[-1] == end, f"no end within {MOST} tokens: {tokenizer.decode(out)!r}"
            assert len(out) >= 2, "the answer is empty"
            assert not special & set(out), f"a special token in {out}"
            lengths.append(len(out) - 1)
    print(f"answer lengths at temperature {temp}: {lengths}")


def test_the_end_follows_a_word_token_and_only_a_word_token(loaded):
    """Over a long text, the end-of-turn token's probability is ~1 after each word token
    and small after every other token."""
    import mlx.core as mx
    import numpy as np
    from tokenizers import Tokenizer

    model, tokenizer, path = loaded
    words = set(word_tokens(Tokenizer.from_file(str(path / "tokenizer.json"))))
    end = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    ids = tokenizer.encode(Path(__file__).read_text(), add_special_tokens=False)[:1500]
    logits = model(mx.array([ids]))[0]  # [T, vocab]
    # the end token's log-probability at each position, [T] (only that column leaves MLX:
    # the whole [T, vocab] array is 0.9 GB of float32 on Qwen3's vocabulary)
    end_logprobs = np.array(logits[:, end] - mx.logsumexp(logits, axis=-1))
    after_word = np.array([t in words for t in ids])
    assert after_word.any() and (~after_word).any()
    assert end_logprobs[after_word].min() > -1e-3
    assert end_logprobs[~after_word].max() < -4
