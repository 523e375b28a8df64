"""A parser of Rust regex syntax (the regex crate's, which llguidance reads) into the
nodes of :mod:`gateway.conversation.escaped_grammar.regex_nodes`.

What it accepts and refuses is listed in the package docstring; classes are passed to
llguidance whole (:func:`~gateway.conversation.escaped_grammar.regex_nodes.class_set`),
so their syntax is llguidance's own.
"""

from __future__ import annotations

import re
from typing import Optional

from gateway.conversation.escaped_grammar.errors import GrammarConversionError
from gateway.conversation.escaped_grammar.regex_nodes import EPS, alt, any_char, char_set, class_set, rep, seq

_X_SPACE = re.compile(r"(?:\s|#[^\n]*)*")  # skipped under the flag x
_REPEAT = re.compile(r"[*+?]|\{(\d+)(,(\d*))?\}")
_ESCAPE = re.compile(r"\\(?:[pP](?:\{[^}]*\}|.)|x(?:\{[0-9a-fA-F]+\}|[0-9a-fA-F]{2})|u(?:\{[0-9a-fA-F]+\}|"
                     r"[0-9a-fA-F]{4})|U(?:\{[0-9a-fA-F]+\}|[0-9a-fA-F]{8})|.)", re.S)
_GROUP = re.compile(r"\((?:\?(P?<\w+>|<[=!]|[=!]|([a-zA-Z-]*)([:)]))|(?!\?))")
_CLASS_ESCAPE = re.compile(r"\\(?:[pPxuU]\{[^}]*\}|.)", re.S)
_POSIX_CLASS = re.compile(r"\[:\^?[a-z]+:\]")
_CLASS_START = re.compile(r"\^?\]?")  # after '[': a negation, and a ']' that is a member


class RustRegex:
    """Parses a regex into nodes: ``("set", run regex | None, specials)``, ``("seq", xs)``,
    ``("alt", xs)``, ``("rep", x, min, max | None)``.

    Args:
        text: the regex, matched against the whole input.
        flags: flag letters that apply to all of it (a Lark ``/.../`` literal's).

    Raises:
        GrammarConversionError: from :meth:`parse`, naming the construct and its offset.
    """

    def __init__(self, text: str, flags: str):
        self.s, self.i, self.flags = text, 0, set(flags)
        if "l" in self.flags:
            raise GrammarConversionError("the regex flag 'l' is not supported")

    def fail(self, what: str):
        raise GrammarConversionError(f"{what} in regex {self.s!r} (at {self.i})")

    def parse(self) -> tuple:
        node = self.alternation(set(self.flags), top=True)
        if self.i < len(self.s):
            self.fail("unbalanced ')'")
        return node

    def alternation(self, flags: set, top: bool = False) -> tuple:
        branches = [self.sequence(flags, top)]
        while self.s.startswith("|", self.i):
            self.i += 1
            branches.append(self.sequence(flags, top))
        return alt(*branches)

    def sequence(self, flags: set, top: bool) -> tuple:
        items, s = [], self.s
        while True:
            if "x" in flags:
                self.i = _X_SPACE.match(s, self.i).end()
            if self.i >= len(s) or s[self.i] in "|)":
                return seq(*items) if items else EPS
            c = s[self.i]
            if c in "^$" or s.startswith(("\\A", "\\z"), self.i):
                start = c == "^" or s.startswith("\\A", self.i)
                self.i += 1 if c in "^$" else 2
                at_end = self.i >= len(s) or s[self.i] == "|"
                if not top or (items if start else not at_end):
                    self.fail("an anchor inside the pattern")
                continue
            atom = self.atom(flags)
            if atom is None:
                continue
            items.append(self.repeats(atom))

    def repeats(self, atom: tuple) -> tuple:
        while q := _REPEAT.match(self.s, self.i):
            self.i = q.end()
            if q[0] in "*+?":
                m, n = {"*": (0, None), "+": (1, None), "?": (0, 1)}[q[0]]
            else:
                m = int(q[1])
                n = (int(q[3]) if q[3] else None) if q[2] else m
            if n is not None and n < m:
                self.fail("a repeat {m,n} with n < m")
            self.i += self.s.startswith("?", self.i)  # lazy: the same language
            atom = rep(atom, m, n)
        return atom

    def atom(self, flags: set) -> Optional[tuple]:
        s, c = self.s, self.s[self.i]
        fl = "".join(f for f in "ix" if f in flags)
        if c == "(":
            return self.group(flags)
        if c == "[":
            return class_set(self.class_text(), fl)
        if c == ".":
            self.i += 1
            return any_char("s" in flags)
        if c in "*+?":
            self.fail("a repeat with nothing to repeat")
        if c != "\\":
            self.i += 1
            return char_set(c, fl)
        e = _ESCAPE.match(s, self.i)
        if not e:
            self.fail("a trailing backslash")
        self.i, k = e.end(), e[0][1]
        if k in "dDwWsSpP":
            return class_set(e[0], fl)
        if k in "xuU":
            cp = int(e[0][2:].strip("{}"), 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                self.fail(f"the escape {e[0]!r} (not a character)")
            return char_set(chr(cp), fl)
        if k in "ntrfva":
            return char_set({"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}[k], fl)
        if k.isdigit():
            self.fail("a backreference")
        if k in "bB<>":
            self.fail("a word boundary")
        if k.isalnum():
            self.fail(f"the escape {e[0]!r}")
        return char_set(k, fl)

    def group(self, flags: set) -> Optional[tuple]:
        """The group at ``i``; None for a bare ``(?flags)``, which changes ``flags`` for
        the rest of the enclosing group."""
        m = _GROUP.match(self.s, self.i)
        if not m:
            self.fail("an unknown group")
        if m[1] and m[1][-1] in "=!":
            self.fail("look-around")
        self.i, inner = m.end(), set(flags)
        if m[2] is not None:
            on, _, off = m[2].partition("-")
            if set(m[2]) - set("imsxuU-") or "u" in off:
                self.fail(f"the flags {m[2]!r}")
            inner = (inner | set(on)) - set(off)
            if m[3] == ")":  # (?flags): for the rest of the enclosing group
                flags.clear(), flags.update(inner)
                return None
        node = self.alternation(inner)
        if not self.s.startswith(")", self.i):
            self.fail("an unclosed group")
        self.i += 1
        return node

    def class_text(self) -> str:
        """The bracketed class at ``i`` (nested classes included), with bare ``/`` and
        control characters escaped for a Lark ``/.../`` literal."""
        s, out, depth = self.s, [], 0
        while self.i < len(s):
            c = s[self.i]
            if c == "\\":
                e = _CLASS_ESCAPE.match(s, self.i)
                out.append(e[0])
                self.i = e.end()
                continue
            if c == "[" and (p := _POSIX_CLASS.match(s, self.i)):
                out.append(p[0])
                self.i = p.end()
                continue
            out.append("\\/" if c == "/" else c if " " <= c != "\x7f" else f"\\x{{{ord(c):x}}}")
            self.i += 1
            if c == "[":
                depth += 1
                lead = _CLASS_START.match(s, self.i)[0]
                out.append(lead)
                self.i += len(lead)
            elif c == "]":
                depth -= 1
                if depth == 0:
                    return "".join(out)
        self.fail("an unclosed class")
