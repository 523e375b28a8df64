"""Hugging Face tokenizer files from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two tokenizer models are rebuilt with the ``tokenizers`` library:

- ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``,
  with the pre-tokenizer named by ``tokenizer.ggml.pre`` (SmolLM, Llama 3, Qwen2, GPT-2...).
- ``llama``: SentencePiece-style BPE with byte fallback; merges are recovered from
  ``tokenizer.ggml.scores`` (a higher score merges first).

Token types (``tokenizer.ggml.token_type``) follow llama.cpp: 3 (control) tokens become
special added tokens, 4 (user-defined) tokens become non-special added tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("mlx_gateway.models.gguf")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns (as in the models' own tokenizer.json files).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_GPT2, _PRE_DIGITS, _PRE_LLAMA3, _PRE_QWEN2 = "gpt2", "digits", "llama3", "qwen2"
PRE_TOKENIZERS = {"default": _PRE_GPT2, "gpt2": _PRE_GPT2, "gpt-2": _PRE_GPT2, "smollm": _PRE_DIGITS,
                  "starcoder": _PRE_DIGITS, "refact": _PRE_DIGITS, "llama-bpe": _PRE_LLAMA3, "llama3": _PRE_LLAMA3,
                  "smaug-bpe": _PRE_LLAMA3, "qwen2": _PRE_QWEN2, "deepseek-r1-qwen": _PRE_QWEN2}


class GGUFTokenizerError(ValueError):
    """The GGUF file's tokenizer cannot be rebuilt (unsupported model, missing metadata)."""


def _meta_list(meta: dict, key: str) -> list | None:
    value = meta.get(key)
    if value is None:
        return None
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _meta_int(meta: dict, key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value.item() if hasattr(value, "item") else value)


def _meta_bool(meta: dict, key: str, default: bool) -> bool:
    value = meta.get(key)
    return default if value is None else bool(value.item() if hasattr(value, "item") else value)


def _byte_level_pre(pre: str):
    from tokenizers import Regex, pre_tokenizers

    kind = PRE_TOKENIZERS.get(pre)
    if kind is None:
        log.warning("GGUF pre-tokenizer %r is not known here; using GPT-2's split rules", pre)
        kind = _PRE_GPT2
    if kind in (_PRE_LLAMA3, _PRE_QWEN2):
        split = pre_tokenizers.Split(Regex(_LLAMA3 if kind == _PRE_LLAMA3 else _QWEN2), "isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == _PRE_DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges of a SentencePiece BPE vocabulary: every split of a piece into two pieces,
    ordered by the merged piece's score (highest first), then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    found = []
    for piece, pid in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[pid], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_tokenizer(meta: dict):
    """The ``tokenizers.Tokenizer`` and the ``tokenizer_config.json`` entries for ``meta``.

    Args:
        meta: the GGUF metadata as ``mx.load(path, return_metadata=True)`` returns it.

    Returns:
        ``(tokenizer, config)``: ``config`` holds ``bos_token``, ``eos_token``, ``pad_token``,
        ``unk_token`` (token strings or None) and ``chat_template`` (or None).

    Raises:
        GGUFTokenizerError: no vocabulary, or a tokenizer model other than ``gpt2``/``llama``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = _meta_list(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = _meta_list(meta, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token keeps its first id

    def token_at(key: str) -> str | None:
        i = _meta_int(meta, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    unk, pad = token_at("tokenizer.ggml.unknown_token_id"), token_at("tokenizer.ggml.padding_token_id")
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in _meta_list(meta, "tokenizer.ggml.merges") or []]
        pre = meta.get("tokenizer.ggml.pre", "default")
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=PRE_TOKENIZERS.get(pre) == _PRE_LLAMA3))
        tok.pre_tokenizer = _byte_level_pre(pre)
        tok.decoder = decoders.ByteLevel()
        add_bos_default, unk = False, None
    elif kind == "llama":
        scores = _meta_list(meta, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = unk or ("<unk>" if "<unk>" in vocab else None)
        tok = Tokenizer(models.BPE(vocab, _spm_merges(tokens, scores, types), unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
        # As SentencePiece: spaces become "▁", and each text piece gets one in front.
        prefix = _meta_bool(meta, "tokenizer.ggml.add_space_prefix", True)
        tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                              + [normalizers.Replace(" ", "▁")])
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True
    else:
        raise GGUFTokenizerError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")

    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for i, t in enumerate(tokens) if types[i] == USER_DEFINED and vocab[t] == i])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, t in enumerate(tokens) if types[i] == CONTROL and vocab[t] == i])
    add_bos = _meta_bool(meta, "tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None
    add_eos = _meta_bool(meta, "tokenizer.ggml.add_eos_token", False) and eos is not None
    if add_bos or add_eos:
        def template(seq: str, type_id: int) -> list[str]:
            return ([f"{bos}:{type_id}"] if add_bos else []) + [f"${seq}:{type_id}"] + (
                [f"{eos}:{type_id}"] if add_eos else [])

        specials = {t: vocab[t] for t, on in ((bos, add_bos), (eos, add_eos)) if on}
        tok.post_processor = processors.TemplateProcessing(
            single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=list(specials.items()))
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
              "chat_template": meta.get("tokenizer.chat_template")}
    return tok, config


def write_tokenizer(meta: dict, out_dir: str | Path, context_length: int | None = None) -> dict:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``meta`` into ``out_dir``.

    Args:
        meta: GGUF metadata (see :func:`build_tokenizer`).
        out_dir: an existing directory.
        context_length: the ``model_max_length`` to record, in tokens.

    Returns:
        The ``tokenizer_config.json`` content.

    Raises:
        GGUFTokenizerError: see :func:`build_tokenizer`.
    """
    tok, special = build_tokenizer(meta)
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              **{k: v for k, v in special.items() if k != "chat_template"},
              "model_max_length": context_length or 32768, "clean_up_tokenization_spaces": False}
    if special["chat_template"]:
        config["chat_template"] = special["chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return config
