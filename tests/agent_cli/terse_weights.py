"""Make a random-weight model end its answers: a weight edit for agent tests.

A model with random weights never chooses its end-of-turn token, so it answers until
``max_tokens``, and agent clients treat such a turn as cut short (Claude Code asks it to
continue, then fails with "response exceeded the N output token maximum"). The edit below
makes the end-of-turn token win right after the model writes a word, while the model
stays a real architecture, loaded by ``mlx_lm.load`` and served through the real path.
Two hidden dimensions are taken out of the layers and used as flags:

- every layer's projections that read the residual stream (q, k, v, gate, up) have a zero
  input column there, and those that write it (o_proj, down_proj) a zero output row, so at
  each position those two dimensions of the residual stream hold exactly the input
  embedding's values for that position's token, and the layers compute as if they were not
  there (save for the final RMSNorm's scale);
- ``D`` (the last dimension) is ``FEATURE`` in the input embedding of every *word token*
  (one ASCII word, with or without a leading space) and 0 in every other token's (special
  tokens, whitespace, punctuation, pieces of multi-byte characters, the generation
  prompt's last token ``\\n``); the output head's weight on ``D`` is ``END_WEIGHT`` for the
  end-of-turn token and 0 for the others;
- ``D2`` (the one before) is ``ALWAYS`` in every token's input embedding; the output
  head's weight on ``D2`` is ``-SUPPRESS`` for the special tokens other than the
  end-of-turn token (``<think>``, ``<tool_call>``, ...), 0 for the others, so the model
  never opens a reasoning block or a tool call by chance.

The output head is therefore untied from the input embedding (``tie_word_embeddings:
false``, ``lm_head`` = the random embedding with those two columns edited). So after a word
token the end-of-turn logit exceeds every other by a wide margin (greedy and sampled
decoding both stop), and after any other token the next token is the random model's own
choice among ordinary tokens. An answer is a few random tokens ending with a word, e.g.
" abl" or "埙ertino". The text is still random; only its end (and the special tokens) are
edited.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

# Architectures whose residual stream is h += o_proj(...) + down_proj(...) with no norm
# after either projection, so zeroing a row keeps a dimension out of every layer's output.
TERSE_ARCHS = ("qwen3", "llama")
FEATURE = 0.5  # the word tokens' value in dimension D (other dimensions are ~N(0, 1/hidden))
END_WEIGHT = 100.0  # the end-of-turn token's output weight on dimension D
ALWAYS = 0.5  # every token's value in dimension D2
SUPPRESS = 100.0  # minus the other special tokens' output weight on dimension D2
_WORD = re.compile(r" ?[A-Za-z]+")
# Goes into the model directory's build stamp, so a changed edit rebuilds the models.
TERSE_STAMP = f"{FEATURE}:{END_WEIGHT}:{ALWAYS}:{SUPPRESS}:{_WORD.pattern}:untied"
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


def make_terse(params: dict, config: dict, tokenizer_dir: Path) -> tuple[dict, dict]:
    """Edit random ``params`` (mlx arrays by mlx-lm parameter name) of a ``config`` model
    so that it ends its answer right after a word token and never writes another special
    token (see the module docstring).

    Args:
        params: flat parameter dict (``model.embed_tokens.weight`` [vocab, hidden],
            ``model.layers.N.self_attn.{q,k,v}_proj.weight`` [out, hidden],
            ``model.layers.N.self_attn.o_proj.weight`` [hidden, heads*head_dim],
            ``model.layers.N.mlp.{gate,up}_proj.weight`` [intermediate, hidden],
            ``model.layers.N.mlp.down_proj.weight`` [hidden, intermediate], optional
            ``lm_head.weight`` [vocab, hidden]).
        config: the model's config.json entries (``model_type``, ``hidden_size``,
            ``tie_word_embeddings``).
        tokenizer_dir: the directory holding the model's ``tokenizer.json`` and
            ``tokenizer_config.json``.

    Returns:
        The edited parameters (float32, with an ``lm_head.weight``) and the config with
        ``tie_word_embeddings`` false.

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
    special = [i for i in tokenizer.get_added_tokens_decoder() if i != end]
    d, d2 = config["hidden_size"] - 1, config["hidden_size"] - 2
    embed = np.array(params["model.embed_tokens.weight"], dtype=np.float32)
    head = np.array(params.get("lm_head.weight", params["model.embed_tokens.weight"]), dtype=np.float32)
    embed[:, d], embed[:, d2] = 0.0, ALWAYS
    embed[word_tokens(tokenizer), d] = FEATURE
    head[:, d], head[:, d2] = 0.0, 0.0
    head[end, d] = END_WEIGHT
    head[special, d2] = -SUPPRESS
    out = dict(params, **{"model.embed_tokens.weight": mx.array(embed), "lm_head.weight": mx.array(head)})
    for name, value in params.items():
        if name.endswith(_READ) or name.endswith(_WRITE):
            w = np.array(value, dtype=np.float32)
            if name.endswith(_READ):
                w[:, [d, d2]] = 0.0
            else:
                w[[d, d2], :] = 0.0
            out[name] = mx.array(w)
    return out, dict(config, tie_word_embeddings=False)


def terse_copy(base: Path, path: Path) -> Path:
    """A copy at ``path`` of the random-weight model directory ``base`` (of
    :data:`TERSE_ARCHS`, built by ``gateway.models.demo_model.build_model_dir``) with the
    edit of :func:`make_terse`; kept while ``base`` and the edit are unchanged.

    Raises:
        ValueError: as :func:`make_terse`.
    """
    import mlx.core as mx

    stamp = {"base": json.loads((base / ".mlx-gateway-demo.json").read_text()), "terse": TERSE_STAMP}
    done = path / ".terse.json"
    if done.exists() and json.loads(done.read_text()) == stamp:
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    params, config = make_terse(mx.load(str(tmp / "model.safetensors")),
                                json.loads((tmp / "config.json").read_text()), tmp)
    mx.save_safetensors(str(tmp / "model.safetensors"), params)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / ".terse.json").write_text(json.dumps(stamp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
