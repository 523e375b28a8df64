"""Constrained decoding: a per-row token mask from a grammar, applied to the logits.

The grammar engine is llguidance (microsoft/llguidance): it takes JSON schemas and Lark
grammars, compiles lazily and computes the set of allowed next tokens for one row in
tens of microseconds. xgrammar, the other maintained engine, needs torch (gigabytes)
and precompiles; ``benchmarks/bench_grammar.py`` compares the two.

A :class:`TokenMask` is an mlx-lm logits processor: the engine passes it to
``BatchGenerator`` with the row's other processors, so constrained and free rows share
one batch and only the constrained rows pay for the mask. The matcher itself is plain
CPU work; the only MLX call is the ``where`` on the row's logits, on the engine thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import weakref
from collections import OrderedDict
from copy import copy
from typing import Optional

import llguidance
import mlx.core as mx
import numpy as np

log = logging.getLogger("mlx_gateway.grammar")

# Compact JSON (``{"a":1}``): with flexible whitespace a model can emit blank space
# forever, which random-weight models and small models do.
JSON_DEFAULTS = {"whitespace_flexible": False}
# For schemas that describe rather than promise (non-strict tools and formats): ``oneOf``
# is enforced as ``anyOf`` and keywords llguidance does not implement (``uniqueItems``,
# ``not``, unknown ``format`` s, ...) are left unenforced instead of failing the grammar.
JSON_RELAXED = {**JSON_DEFAULTS, "coerce_one_of": True, "lenient": True}
_ADD = np.array([0.0, -np.inf], dtype=np.float32)  # allowed -> 0, forbidden -> -inf


# (hash of a tokenizer's JSON serialization, n_vocab, eos ids) -> a live Grammars holding
# that vocabulary index: the index lives as long as one of the models using it
_indexes: "weakref.WeakValueDictionary[tuple, Grammars]" = weakref.WeakValueDictionary()
_indexes_lock = threading.Lock()


class GrammarError(ValueError):
    """The grammar or JSON schema cannot be compiled (an HTTP 400 for the request)."""


def vocabulary_index(hf_tokenizer, n_vocab: int, eos_token_ids, owner: "Grammars") -> "llguidance.LLTokenizer":
    """llguidance's index of a fast Hugging Face tokenizer's vocabulary, as
    ``llguidance.hf.from_tokenizer`` builds it (from the tokenizer's JSON serialization,
    padding and truncation off), with ``n_vocab`` logits and ``eos_token_ids`` (none: the
    tokenizer's own eos), for ``owner``. An index is a function of those alone, so it is
    shared: while a :class:`Grammars` (a loaded model) holds the index of a tokenizer that
    serializes to the same JSON, with the same ``n_vocab`` and eos ids, that one is returned.

    The serialization skips ``from_tokenizer``'s copy of the tokenizer when padding and
    truncation are already off (the copy serializes and parses it once more). CPU seconds
    on a 2-core CPU: Qwen3's 151k tokens 1.8 by ``from_tokenizer``, 1.3 here, 0.1 shared;
    Gemma 3's 262k 5.4, 3.9 and 0.7.

    Raises:
        ValueError: not a fast tokenizer (``from_tokenizer``'s error).
    """
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        from llguidance.hf import from_tokenizer

        return from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=sorted(eos_token_ids) or None)
    if backend.padding is not None or backend.truncation is not None:
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
    text = backend.to_str()
    eos = sorted(eos_token_ids) or hf_tokenizer.eos_token_id
    key = (hashlib.sha256(text.encode()).hexdigest(), n_vocab, json.dumps(eos))
    with _indexes_lock:
        other = _indexes.get(key)
        index = other._lltok if other is not None else None
    if index is None:
        index = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
        with _indexes_lock:
            _indexes[key] = owner  # (its _lltok is set as this returns)
    return index


def json_schema_grammar(schema: dict) -> str:
    """An llguidance grammar (its JSON form) accepting compact JSON valid for ``schema``."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)


def lark_grammar(lark: str) -> str:
    """An llguidance grammar from Lark text (``%json {...}`` embeds a JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammars:
    """Compiles grammars for one model's vocabulary.

    Args:
        hf_tokenizer: the model's Hugging Face fast tokenizer.
        n_vocab: entries in the model's logits (may exceed the tokenizer's vocabulary;
            the extra ids are never allowed).
        eos_token_ids: the ids that end a generation; a finished grammar allows only these.

    Building the vocabulary index takes about a second for a 150k vocabulary, so it is
    built on first use, once, in whichever (non-engine) thread asks first, or taken from
    another model on the same tokenizer (:func:`vocabulary_index`).
    """

    def __init__(self, hf_tokenizer, n_vocab: int, eos_token_ids):
        self._hf = hf_tokenizer
        self.n_vocab = n_vocab
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok: Optional[llguidance.LLTokenizer] = None
        self._lock = threading.Lock()
        self._problems: OrderedDict[tuple[str, bool], Optional[str]] = OrderedDict()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                self._lltok = vocabulary_index(self._hf, self.n_vocab, self.eos_token_ids, self)
            return self._lltok

    def lark_literal(self, text: str) -> str:
        """A Lark expression matching ``text``: ``<[id]>`` when ``text`` is one special
        token (llguidance never matches special tokens by their text, e.g. Qwen3's
        ``<tool_call>``), else a quoted string."""
        ids = self._hf.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self._tokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def mask(self, grammar: str, strict: bool = True) -> "TokenMask":
        """A fresh :class:`TokenMask` for ``grammar`` (from :func:`json_schema_grammar`
        or :func:`lark_grammar`).

        Raises:
            GrammarError: the grammar does not compile (the message says why), or, when
                ``strict``, uses JSON Schema keywords llguidance does not enforce (named;
                a relaxed grammar, :data:`JSON_RELAXED`, leaves them unenforced).
        """
        if strict:  # e.g. uniqueItems, contains, not: the output could break the schema
            _, notes = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
            unenforced = [n.split(":", 1)[1].strip() for n in notes if "Unimplemented keys" in n]
            if unenforced:
                raise GrammarError(f"keywords the grammar engine cannot enforce: {', '.join(unenforced)}")
        try:
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        except Exception as e:  # llguidance raises ValueError/RuntimeError on bad input
            raise GrammarError(str(e)) from e
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenMask(matcher, self.n_vocab)

    def check(self, grammar: str, strict: bool = True) -> None:
        """Compile ``grammar`` and drop it.

        Raises:
            GrammarError: it does not compile (see :meth:`mask`).
        """
        self.mask(grammar, strict)

    def problem(self, grammar: str, strict: bool = True) -> Optional[str]:
        """Why ``grammar`` does not compile (:meth:`mask`'s error), or None when it does.
        Remembered for the last 512 grammars asked about: agents send the same tools with
        every request."""
        key = (grammar, strict)
        with self._lock:
            if key in self._problems:
                self._problems.move_to_end(key)
                return self._problems[key]
        try:
            self.mask(grammar, strict)
            found = None
        except GrammarError as e:
            found = str(e)
        with self._lock:
            self._problems[key] = found
            while len(self._problems) > 512:
                self._problems.popitem(last=False)
        return found


ROLLBACK_DEPTH = 64  # tokens a TokenMask can take back (a draft is at most 16)


class TokenMask:
    """The logits processor of one constrained request: ``(tokens, logits [1, V]) ->
    logits [1, V]`` with every token the grammar forbids set to ``-inf``.

    ``BatchGenerator`` calls it once per decode step of its row. The first call sees
    the prompt; each later call's last token is the one sampled at the step before,
    which is fed to the matcher before the next mask is computed. Once the grammar is
    complete only the EOS ids are allowed, so the row ends with ``stop``.

    It never raises into the batch: a matcher error is kept in :attr:`error` and the
    row is steered to EOS; the engine then fails that request alone.
    """

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.error: Optional[str] = None
        self._started = False
        # per token fed, newest last: whether the matcher counted it. A stopped matcher
        # (grammar complete) takes an end token without counting it, so rolling that
        # token back must not take back the one before (llguidance 1.x rolls back counted
        # tokens only: rollback(1) there undid the call's closing tag)
        self._counted: list[bool] = []
        self._words = np.zeros((1, (n_vocab + 31) // 32), dtype=np.int32)

    def validate(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from its current state (the
        first is the token the next call feeds); nothing is consumed."""
        try:
            return int(self.matcher.validate_tokens(tokens))
        except Exception:
            return 0

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` tokens fed (a rejected draft's): those the matcher
        counted (an end token fed to a complete grammar is not)."""
        if n <= 0 or self.error is not None:
            return
        taken, self._counted = self._counted[-n:], self._counted[:-n]
        counted = sum(taken)
        if counted and not self.matcher.rollback(counted):
            self.error = f"the grammar could not take back {n} tokens: {self.matcher.get_error()}"

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            if self._started:
                token = int(tokens[-1].item())
                counts = not self.matcher.is_stopped()
                if not self.matcher.consume_token(token):
                    raise RuntimeError(f"token {token} is outside the grammar: {self.matcher.get_error()}")
                self._counted.append(counts)
                if len(self._counted) > 4 * ROLLBACK_DEPTH:
                    del self._counted[:-ROLLBACK_DEPTH]
            self._started = True
            self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            if self.matcher.is_error():
                raise RuntimeError(self.matcher.get_error())
            allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: logits.shape[-1]]
            if not allowed.any():
                raise RuntimeError("the grammar allows no token")
            # An additive 0/-inf row: on the CPU backend twice as fast as mx.where.
            return logits + mx.array(_ADD[1 - allowed], dtype=logits.dtype)
        except Exception as e:
            if self.error is None:
                self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("constrained decoding failed: %s", self.error)
            return logits
