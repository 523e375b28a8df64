"""Make a random-weight model end its answers: a weight edit for agent tests.

A model with random weights never chooses its end-of-turn token, so it answers until
``max_tokens``, and agent clients treat such a turn as cut short (Claude Code asks it to
continue, then fails with "response exceeded the N output token maximum"). The edit below
makes the end-of-turn token win right after the model writes a word, while the model
stays a real architecture, loaded by ``mlx_lm.load`` and served through the real path:

- one hidden dimension ``D`` (the last) of every *word token*'s input embedding holds a
  constant ``feature``; other tokens (special tokens, whitespace, punctuation, pieces of
  multi-byte characters, the generation prompt's last token) hold 0 there;
- every layer's attention output projection and MLP down projection write nothing into
  ``D`` (their row ``D`` is zeroed), so the residual stream keeps, at each position, the
  feature of that position's own token and nothing else;
- the end-of-turn token's output weight on ``D`` is ``end_weight`` (its embedding row when
  input and output embeddings are tied, which also sets that dimension in the prompt's
  end-of-turn tokens: harmless, they are never the last position).

So after a word token the end-of-turn logit exceeds every other by a wide margin (greedy
and sampled decoding both stop), and after any other token the next token is the random
model's own choice. An answer is therefore a few random tokens ending with a word, e.g.
"ĠHamilton" or "Ã©rieur"+"ĠLag". The text is still random; only its end is edited.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Architectures whose residual stream is h += o_proj(...) + down_proj(...) with no norm
# after either projection, so zeroing a row keeps a dimension out of every layer's output.
TERSE_ARCHS = ("qwen3", "llama")
FEATURE = 0.5  # the word tokens' value in dimension D (other dimensions are ~N(0, 1/hidden))
END_WEIGHT = 100.0  # the end-of-turn token's output weight on dimension D
_WORD = re.compile(r" ?[A-Za-z]+")
# Goes into the model directory's build stamp, so a changed edit rebuilds the models.
TERSE_STAMP = f"{FEATURE}:{END_WEIGHT}:{_WORD.pattern}:reads-and-writes-zeroed"
# A layer's projections that read the residual stream (input columns) and write it (output rows).
_READ = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
_WRITE = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _end_token(tokenizer_dir: Path, tokenizer) -> int:
    """The id of the tokenizer's end-of-turn token (``eos_token`` of tokenizer_config.json)."""
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    end = tokenizer.token_to_id(eos) if eos else None
    if end is None:
        raise ValueError(f"{tokenizer_dir}: no eos_token in tokenizer_config.json to end answers with")
    return end


def word_tokens(tokenizer) -> list[int]:
    """Ids of the tokens that decode to one ASCII word, with or without a leading space
    (added and special tokens excluded)."""
    special = set(tokenizer.get_added_tokens_decoder())
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return [i for i, t in enumerate(texts) if i not in special and _WORD.fullmatch(t)]


def make_terse(params: dict, config: dict, tokenizer_dir: Path) -> dict:
    """Edit random ``params`` (mlx arrays by mlx-lm parameter name) of a ``config`` model
    so that it ends its answer right after a word token (see the module docstring).

    Args:
        params: flat parameter dict (``model.embed_tokens.weight`` [vocab, hidden],
            ``model.layers.N.self_attn.o_proj.weight`` [hidden, heads*head_dim],
            ``model.layers.N.mlp.down_proj.weight`` [hidden, intermediate], optional
            ``lm_head.weight`` [vocab, hidden]).
        config: the model's config.json entries (``model_type``, ``hidden_size``,
            ``tie_word_embeddings``).
        tokenizer_dir: the directory holding the model's ``tokenizer.json`` and
            ``tokenizer_config.json``.

    Returns:
        A new dict with the edited arrays (float32).

    Raises:
        ValueError: for an architecture outside :data:`TERSE_ARCHS`, or a tokenizer with
            no end-of-turn token.
    """
    import mlx.core as mx
    import numpy as np
    from tokenizers import Tokenizer

    if config["model_type"] not in TERSE_ARCHS:
        raise ValueError(f"terse weights are defined for {TERSE_ARCHS}, not {config['model_type']!r}")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    end = _end_token(tokenizer_dir, tokenizer)
    d = config["hidden_size"] - 1
    out = dict(params)
    embed = np.array(params["model.embed_tokens.weight"], dtype=np.float32)
    embed[:, d] = 0.0
    embed[word_tokens(tokenizer), d] = FEATURE
    if "lm_head.weight" in params and not config.get("tie_word_embeddings", True):
        head = np.array(params["lm_head.weight"], dtype=np.float32)
        head[:, d] = 0.0
        head[end, d] = END_WEIGHT
        out["lm_head.weight"] = mx.array(head)
    else:
        embed[end, d] = END_WEIGHT
    out["model.embed_tokens.weight"] = mx.array(embed)
    for name, value in params.items():
        if name.endswith(_READ) or name.endswith(_WRITE):
            w = np.array(value, dtype=np.float32)
            if name.endswith(_READ):
                w[:, d] = 0.0
            else:
                w[d, :] = 0.0
            out[name] = mx.array(w)
    return out
