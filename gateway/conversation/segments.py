"""Tokenizing rendered chats in segments, each segment's tokens kept for the next request.

A chat rendered by its template is mostly text the gateway tokenized before: the system
prompt and every earlier turn of an agent's conversation, the same page an extension asks
about again. Hugging Face tokenizers split their input at special added tokens
(``<|im_start|>``, ``<|im_end|>``, ...) before normalizing and pre-tokenizing the text
between them, so the tokens of a rendered chat are the tokens of its pieces cut right
after each special token, one after the other. :class:`SegmentEncoder` cuts there,
takes the pieces it tokenized recently from a bounded LRU and tokenizes the rest in one
``encode_batch`` call (which runs without the GIL).

Some tokenizers treat the first piece of an input differently (a SentencePiece
``Metaspace`` pre-tokenizer with ``prepend_scheme="first"`` adds its space to the
first piece only), so the split is checked, not assumed: short probes after each special
token when the encoder is made, then the first :data:`VERIFY_FIRST` chats of each
tokenizer (pieces are trusted once that many checks agreed) and one in
:data:`AUDIT_EVERY` later are also tokenized whole and compared; one difference turns
segments off for that tokenizer for the process's life (the whole tokenization is what
the request then gets).
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, Optional

from gateway.conversation.templates import encode_with_ends

log = logging.getLogger("mlx_gateway")

VERIFY_FIRST = 4  # chats of a tokenizer tokenized both ways before segments are trusted
AUDIT_EVERY = 32  # later, one chat in this many is tokenized both ways again
MAX_CHARS = 1 << 20  # characters of segments kept per tokenizer (about 250k tokens)
MIN_CHARS = 64  # shorter segments are tokenized every time, not kept
PROBED = 8  # special tokens probed when an encoder is made

_encoders: "weakref.WeakKeyDictionary[Any, SegmentEncoder]" = weakref.WeakKeyDictionary()
_encoders_lock = threading.Lock()


def encode_chat(tokenizer: Any, text: str) -> tuple[list[int], Optional[list[int]]]:
    """The tokens of a rendered chat ``text`` and the end character of each, as
    :func:`gateway.conversation.templates.encode_with_ends` gives them, from the tokenizer's
    :class:`SegmentEncoder` (made on first use)."""
    with _encoders_lock:
        enc = _encoders.get(tokenizer)
        if enc is None:
            enc = _encoders[tokenizer] = SegmentEncoder(tokenizer)
    return enc.encode(text)


def _agree(whole: tuple[list[int], Optional[list[int]]], pieces: tuple[list[int], list[int]]) -> bool:
    """The pieces' tokens (and ends, where the whole chat's are usable) are the whole's."""
    return whole[0] == pieces[0] and (whole[1] is None or whole[1] == pieces[1])


class SegmentEncoder:
    """A tokenizer's segment cache (thread-safe; see the module docstring).

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (or a Hugging Face tokenizer); without a
            fast (Rust) tokenizer behind it, every chat is tokenized whole.
        max_chars: characters of segments kept (least recently used go first).
    """

    def __init__(self, tokenizer: Any, max_chars: int = MAX_CHARS):
        self._tokenizer = weakref.ref(tokenizer)  # the encoders' map is keyed by it: no strong reference
        self.max_chars = max_chars
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
        self._specials: list[str] = []
        self._cut = self._cut_pattern(hf) if self._backend is not None else None
        self.checked = 0  # chats tokenized in pieces so far
        self.verified = 0  # of those, checks against the whole chat that agreed
        self.hit_chars = self.miss_chars = 0  # characters whose tokens were kept / tokenized
        self._kept: "OrderedDict[str, tuple[list[int], list[int]]]" = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.exact = self._cut is not None and self._probe(tokenizer)  # False once a check found a difference
        self.hit_chars = self.miss_chars = 0

    def _cut_pattern(self, hf) -> Optional[re.Pattern]:
        """A regex matching the special added tokens a chat may be cut after: those that
        strip no whitespace around them and match their text as is (kept in
        ``_specials``)."""
        decoder = getattr(hf, "added_tokens_decoder", None) or {}
        self._specials = sorted({t.content for t in decoder.values() if t.content and getattr(t, "special", False)
                                 and not (t.lstrip or t.rstrip or t.single_word or t.normalized)},
                                key=len, reverse=True)
        if not self._specials:
            return None
        return re.compile("|".join(re.escape(t) for t in self._specials))

    def _probe(self, tokenizer) -> bool:
        """Pieces add up on short texts that start every way a piece can (a letter, a
        space, a new line, punctuation) after special tokens (up to :data:`PROBED`, those
        in the chat template first): a tokenizer that treats
        an input's start specially (SentencePiece's ``prepend_scheme="first"``) fails
        here, before any request."""
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else ""
        # those the chat template writes first; a few suffice (Llama 3 has 256 reserved ones)
        ranked = sorted(self._specials, key=lambda t: t not in template)[:PROBED]
        for special in ranked:
            for after in ("x y", " x", "\nx", ".x", "\n\n x"):
                text = "a b" + special + after
                if not _agree(encode_with_ends(tokenizer, text), self._by_segments(text, keep=False)):
                    return False
        return True

    def _segments(self, text: str) -> list[tuple[int, str]]:
        """``(start, piece)`` of ``text`` cut right after each special token."""
        out, start = [], 0
        for m in self._cut.finditer(text):
            out.append((start, text[start:m.end()]))
            start = m.end()
        if start < len(text):
            out.append((start, text[start:]))
        return out

    def encode(self, text: str) -> tuple[list[int], Optional[list[int]]]:
        """The tokens of ``text`` (no special tokens added) and each one's end character
        (None when the offsets are unusable), as :func:`encode_with_ends`."""
        tokenizer = self._tokenizer()
        if not self.exact:
            return encode_with_ends(tokenizer, text)
        ids, ends = self._by_segments(text)
        with self._lock:
            self.checked += 1
            # pieces are trusted once VERIFY_FIRST checks have agreed (not merely begun)
            check = self.verified < VERIFY_FIRST or self.checked % AUDIT_EVERY == 0
        if check:
            whole = encode_with_ends(tokenizer, text)
            if not _agree(whole, (ids, ends)):
                self.exact = False
                with self._lock:
                    self._kept.clear()
                    self._chars = 0
                log.warning("this tokenizer does not tokenize a chat as its pieces between special tokens; "
                            "chats are tokenized whole from now on")
                return whole
            with self._lock:
                self.verified += 1
        if any(a > b for a, b in zip(ends, ends[1:])):
            return ids, None
        return ids, ends

    def _by_segments(self, text: str, keep: bool = True) -> tuple[list[int], list[int]]:
        pieces = self._segments(text)
        found: dict[int, tuple[list[int], list[int]]] = {}
        with self._lock:
            for k, (_, piece) in enumerate(pieces):
                kept = self._kept.get(piece)
                if kept is not None:
                    self._kept.move_to_end(piece)
                    found[k] = kept
        missing = [k for k in range(len(pieces)) if k not in found]
        if missing:
            encodings = self._backend.encode_batch([pieces[k][1] for k in missing], add_special_tokens=False)
            new = {k: (list(e.ids), [end for _, end in e.offsets]) for k, e in zip(missing, encodings)}
            found.update(new)
            if keep:
                self._keep({pieces[k][1]: v for k, v in new.items() if len(pieces[k][1]) >= MIN_CHARS})
        missed = sum(len(pieces[k][1]) for k in missing)
        with self._lock:
            self.miss_chars += missed
            self.hit_chars += len(text) - missed
        ids: list[int] = []
        ends: list[int] = []
        for k, (start, _) in enumerate(pieces):
            piece_ids, piece_ends = found[k]
            ids.extend(piece_ids)
            ends.extend(start + e for e in piece_ends)
        return ids, ends

    def _keep(self, new: dict[str, tuple[list[int], list[int]]]) -> None:
        with self._lock:
            for piece, value in new.items():
                if piece in self._kept or len(piece) > self.max_chars // 4:
                    continue
                self._kept[piece] = value
                self._chars += len(piece)
            while self._chars > self.max_chars and self._kept:
                piece, _ = self._kept.popitem(last=False)
                self._chars -= len(piece)
