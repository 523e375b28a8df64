"""From generated token ids to OpenAI text deltas: detokenize, stop strings, reasoning.

Runs on the async side, one :class:`TextAssembler` per request. Text that might be the
start of a stop string or of a ``<think>``/``</think>`` tag is held back until it is
known not to be one, so no client ever sees half a stop string.

Bytes that end in an incomplete UTF-8 character are held until it completes (mlx-lm's
streaming detokenizer holds whatever decodes to a trailing U+FFFD). Bytes that can never
become valid UTF-8 (a lone continuation byte, ``0xC0``) are released as U+FFFD as soon as
no incomplete character follows them, as decoding the whole answer shows them; mlx-lm's detokenizer would hold them, and all
text after them, until a token that decodes cleanly, which in an answer of such bytes is
its end.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable, Optional


def holdback(text: str, needles: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a needle."""
    best = 0
    for n in needles:
        for k in range(min(len(n) - 1, len(text)), best, -1):
            if text.endswith(n[:k]):
                best = k
                break
    return best


def _token_bytes(detok) -> Optional[Callable[[int], Optional[bytes]]]:
    """``token id -> bytes`` for mlx-lm's byte-level BPE detokenizer (GPT-2's byte map,
    read from its ``tokenmap``; None for a token with a character outside that map, which
    the detokenizer's ``finalize`` cannot decode), else None (other detokenizers keep
    their own holding)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    from compat.mlx_lm import byte_decoder

    if not isinstance(detok, BPEStreamingDetokenizer):
        return None
    table, tokenmap = byte_decoder(), detok.tokenmap

    def token_bytes(token: int) -> Optional[bytes]:
        piece = tokenmap[token] if token < len(tokenmap) else "!"  # mlx-lm's fallback
        if not all(c in table for c in piece):
            return None
        return bytes(table[c] for c in piece)

    return token_bytes


def ends_in_invalid_bytes(raw: bytes) -> bool:
    """``raw`` decodes to text ending in U+FFFD for bytes that no later byte can make
    valid, with no incomplete UTF-8 character after them (one incremental decode: its
    pending bytes are such a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(raw, final=False)
    return text.endswith("\ufffd") and not decoder.getstate()[0]


@dataclass
class Delta:
    """New text for the client: ``content`` and/or ``reasoning`` (thinking) text."""

    content: str = ""
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning)


@dataclass
class TextAssembler:
    """Turns token ids into text deltas for one request.

    Args:
        tokenizer: the mlx-lm ``TokenizerWrapper`` (its streaming detokenizer is used).
        stop: stop strings; output ends before the first match.
        think: ``(start_tag, end_tag)`` when the model emits reasoning, else None.
        in_reasoning: true when the prompt already opened a think block.
        skip_ids: token ids with no text of their own (EOS).
    """

    tokenizer: object
    stop: list[str] = field(default_factory=list)
    think: Optional[tuple[str, str]] = None
    in_reasoning: bool = False
    skip_ids: frozenset = frozenset()
    stopped: bool = False
    matched: Optional[str] = None  # the stop string that ended the output

    def __post_init__(self):
        self._detok = self.tokenizer.detokenizer
        self._raw = ""  # text not yet released past the stop-string filter
        self._split = ""  # text not yet released past the reasoning splitter
        self._seen_content = False
        self._after_reasoning = False
        self._token_bytes = _token_bytes(self._detok)
        self._held: list[int] = []  # tokens the detokenizer holds (their text not released)

    def feed(self, token: int) -> Delta:
        """Add one token; returns the text that can be released now."""
        if self.stopped or token in self.skip_ids:
            return Delta()
        self._detok.add_token(token)
        text = self._detok.last_segment
        if text or self._token_bytes is None:
            self._held.clear()
        else:
            self._held.append(token)
            text = self._release_invalid()
        return self._push(text, final=False)

    def _release_invalid(self) -> str:
        """The held tokens' text when it is held only for bytes that can never become
        valid UTF-8 (U+FFFD in their place, as the detokenizer's ``finalize`` writes
        them), else ""."""
        pieces = [self._token_bytes(t) for t in self._held]
        if any(p is None for p in pieces):
            return ""  # an added token's own characters: left to the detokenizer, as before
        raw = b"".join(pieces)
        if not ends_in_invalid_bytes(raw):
            return ""  # a lone space the detokenizer may trim, or a character to complete
        self._detok.finalize()  # flushes its held bytes; it goes on decoding after this
        self._held.clear()
        return self._detok.last_segment

    def finish(self) -> Delta:
        """Flush everything held back (call once, at the end)."""
        if not self.stopped:
            self._detok.finalize()
            return self._push(self._detok.last_segment, final=True)
        return self._release_split(final=True)

    def _push(self, text: str, final: bool) -> Delta:
        self._raw += text
        for s in self.stop:
            i = self._raw.find(s)
            if i >= 0:
                self._raw = self._raw[:i]
                self.stopped = True
                self.matched = s
        keep = 0 if (final or self.stopped) else holdback(self._raw, self.stop)
        out, self._raw = self._raw[: len(self._raw) - keep], self._raw[len(self._raw) - keep :]
        self._split += out
        return self._release_split(final or self.stopped)

    def _release_split(self, final: bool) -> Delta:
        delta = Delta()
        if self.think is None:
            delta.content, self._split = self._split, ""
            return delta
        start, end = self.think
        while self._split:
            if self.in_reasoning:
                i = self._split.find(end)
                if i >= 0:
                    delta.reasoning += self._split[:i]
                    self._split = self._split[i + len(end) :]
                    self.in_reasoning = False
                    self._after_reasoning = True
                    continue
                keep = 0 if final else holdback(self._split, [end])
                delta.reasoning += self._split[: len(self._split) - keep]
                self._split = self._split[len(self._split) - keep :]
                break
            if not self._seen_content:
                stripped = self._split.lstrip()
                if stripped.startswith(start):
                    self._split = stripped[len(start) :]
                    self.in_reasoning = True
                    continue
                if not final and (not stripped or start.startswith(stripped)):
                    # could still become a think tag. Before any reasoning, only the tag's
                    # possible start is held and whitespace before it goes out now, as
                    # SGLang's reasoning parser does (held, a first token of whitespace
                    # waited for the next decode step); after a think block, its blank
                    # lines are held, to be dropped below as layout
                    if not self._after_reasoning:
                        delta.content += self._split[: len(self._split) - len(stripped)]
                        self._split = stripped
                    break
            self._seen_content = True
            if self._after_reasoning:  # the blank lines after </think> are layout
                self._split = self._split.lstrip("\n")
                if not self._split:
                    break
                self._after_reasoning = False
            delta.content += self._split
            self._split = ""
        return delta
