"""A custom tool's grammar, for its input as it appears inside a JSON string.

OpenAI's Responses API lets a ``custom`` tool constrain its free-form input with a grammar
(``format: {type: "grammar", syntax: "lark" | "regex", definition}``; Codex CLI's
``apply_patch`` sends a Lark grammar). Open models write a call as JSON, e.g. Qwen3's
``{"name": "apply_patch", "arguments": {"input": "..."}}``, so the grammar must hold of the
input *escaped*: each character c appears as esc(c), JSON string escaping as
``json.dumps(s, ensure_ascii=False)[1:-1]`` writes it (``"`` -> ``\\"``, ``\\`` -> ``\\\\``,
``\\n \\r \\t \\b \\f``, other characters below U+0020 -> ``\\u00xx``, everything else
unchanged). The escaped language is the image of the raw one under the homomorphism esc,
so it is again context-free: apply esc to every terminal. :func:`escaped_lark` and
:func:`escaped_regex` build it as Lark rules (llguidance's dialect, docs/syntax.md in
guidance-ai/llguidance) to append to a host grammar.

Why not just escape each terminal's regex: llguidance lexes greedily with one byte of
lookahead (a lexeme ends where the next byte cannot extend it). Raw ``/(.*)/ LF`` ends the
line at the newline; escaped, the line's lexeme reads the ``\\`` of ``\\n`` as the start of
``\\\\`` or ``\\t``, then fails on ``n``. So every lexeme here is either a *run* (text
without specials, i.e. ``"``, ``\\`` and U+0000..U+001F) or exactly one escape sequence,
and a raw terminal becomes a rule over such lexemes: every ``\\`` starts a lexeme, and the
parser, not the lexer, decides which terminal a special belongs to. A raw regex R is
decomposed bottom-up into (P, parts): P its strings without specials (a run regex), and
parts (h, m, t): runs h and t around a middle m that starts and ends with an escape. In a
concatenation the tail run of the left side and the head run of the right side merge into
one lexeme, so runs are never adjacent inside a terminal (adjacent runs would steal text
from each other); a star loops its middles through left-recursive helper rules.

Supported: string literals (``"..."i`` too), ``"a".."z"``, regexes with flags i m s x U,
classes (nested, ``&&``/``--``/``~~``, ``\\p{..}``, POSIX), ``.``, ``\\d \\w \\s`` and
negations, escapes, groups (named, flag groups), alternation, repeats (greedy or lazy: the
same language), anchors at the ends (dropped); ``->`` aliases (dropped); ``?rule``,
``!rule``; rule options ``capture``, ``lazy``, ``stop=``/``suffix=`` (such a rule stays one
lexeme, exact since it ends at its first match); ``%import common.X``; ``%ignore``, as
explicit optional lexemes between the grammar's lexemes (a ``%ignore`` line would apply
to the whole host grammar). Membership of specials in a class is decided by llguidance
itself, so it follows Rust's regex semantics (``\\s`` lacks U+001C..U+001F, unlike
Python's). Refused (:class:`GrammarConversionError`, naming the construct): special
tokens, ``%json``/``%regex``/``%lark``/``%llguidance``/``%declare``/``%override``,
``@grammar`` references, the ``&``/``~`` operators, templates, priorities, parametric
rules, ``max_tokens``/``temperature``, look-around, backreferences, word boundaries,
inner anchors, ``(?-u)``.

Limits. (1) Where llguidance's lexer would commit to extending the current raw lexeme over
a special although the next terminal could start there, the escaped grammar keeps both
readings, so for raw grammars whose terminals compete at specials it accepts a few more
strings; apply_patch's terminals do not compete. (2) llguidance also skips ``%ignore``
text after the last lexeme where another could follow; the escaped grammar never ends in
ignored text. (3) ``S{m,n}`` over a set holding specials is counted exactly by O(n^2)
rules, so n is at most 32; other bounded repeats of escapable text are expanded, up to a
size limit. (4) Very ambiguous regexes (nested repeats that fold into no simpler form)
become ambiguous rules, which can exceed llguidance's Earley item limit on long inputs.
(5) Captures hold escaped text.

Sources: llguidance's Lark dialect (docs/syntax.md) and lexer (parser/src/earley/lexer.rs:
greedy, one byte of lookahead; ``%ignore`` skipped after a lexeme), Lark's common.lark for
the ``%import common`` names, RFC 8259 section 7 and CPython's ``json`` encoder for esc.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Optional

__all__ = ["GrammarConversionError", "escaped_lark", "escaped_regex"]

SPECIALS = '"\\' + "".join(map(chr, range(32)))
_SPECIAL_CLASS = r'[\x00-\x1f"\\]'
_NON_SPECIAL = r'[^\x00-\x1f"\\]'
_SIZE_LIMIT = 200_000  # characters of output for one grammar
_MAX_COUNT = 32  # S{m,n} over escapable characters: O(n^2) parts, and Earley items, beyond
EPS = ("seq", ())
# Lark's common.lark names, as llguidance defines them (regexes written here).
_COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+", "_EXP": r"[eE][+-]?[0-9]+",
    "FLOAT": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+",
    "NUMBER": r"[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+",
    "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"', "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]", "WORD": r"[A-Za-z]+", "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(?:\r?\n)+",
    "SH_COMMENT": r"#[^\n]*", "CPP_COMMENT": r"\/\/[^\n]*", "SQL_COMMENT": r"--[^\n]*",
    "C_COMMENT": r"\/\*[^*]*\*+(?:[^\/*][^*]*\*+)*\/",
}
_COMMON["SIGNED_FLOAT"] = rf"[+-]?(?:{_COMMON['FLOAT']})"
_COMMON["SIGNED_NUMBER"] = rf"[+-]?(?:{_COMMON['NUMBER']})"


class GrammarConversionError(ValueError):
    """The grammar uses a construct that has no escaped form here (the message names it),
    or is not a valid grammar."""


def escaped_lark(grammar: str, prefix: str) -> tuple[str, str]:
    """Lark rules matching exactly esc(s) for every s that ``grammar`` matches.

    Args:
        grammar: an llguidance-dialect Lark grammar for the raw text, rooted at ``start``.
        prefix: letters and digits; every name defined here starts with it (rules
            ``<prefix>_start``, terminals ``<PREFIX>_LF``; a terminal that needs several
            lexemes once escaped becomes a rule ``<prefix>_name``), so the rules can be
            appended to a host grammar, or beside another tool's under another prefix
            (prefixes compare without case).

    Returns:
        ``(rules, root)``: Lark text and the name of the rule to reference from the host,
        between the lexemes that open and close the JSON string. The host must not have a
        ``%ignore`` of its own (llguidance would skip it inside the string too).

    Raises:
        GrammarConversionError: a construct with no escaped form (named), or a bad grammar.
    """
    return _Converter(prefix).lark(grammar)


def escaped_regex(regex: str, prefix: str) -> tuple[str, str]:
    """Lark rules whose rule ``root`` matches exactly esc(s) for each s that ``regex``
    (Rust regex syntax, matched against the whole input) matches; as :func:`escaped_lark`.
    """
    conv = _Converter(prefix)
    root = conv.fresh(f"{conv.p}_start")
    conv.out.append(f"{root}: {conv.lexeme(conv.esc(_Regex(regex, '').parse()))}")
    return conv.finish(), root


# ------------------------------------------------------------------ escapes and classes
def _esc(c: str) -> str:
    return json.dumps(c, ensure_ascii=False)[1:-1]


def _rx_char(c: str) -> str:
    """``c`` as a regex atom (Rust syntax), safe inside ``/.../`` and ``[...]``."""
    if c in "\\.+*?()|[]{}^$#&-~/":
        return "\\" + c
    return c if " " <= c < "\x7f" else f"\\x{{{ord(c):x}}}"


def _escape_rx(sp: frozenset) -> str:
    """A regex for one escape sequence of any special in ``sp``."""
    codes = [_esc(c) for c in sorted(sp)]
    short = "".join(_rx_char(e[1]) for e in codes if len(e) == 2)
    alts = [f"\\\\[{short}]"] if short else []
    for hi in "01":  # \u00XX with lowercase hex XX, as json.dumps writes it
        low = "".join(e[5] for e in codes if len(e) == 6 and e[4] == hi)
        alts += [f"\\\\u00{hi}{_hex_class(low)}"] if low else []
    return alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"


def _hex_class(digits: str) -> str:
    out = []
    for block in ("0123456789", "abcdef"):
        run = ""
        for d in block + " ":
            if d in digits:
                run += d
                continue
            out.append(run if len(run) < 3 else f"{run[0]}-{run[-1]}")
            run = ""
    return f"[{''.join(out)}]"


@functools.cache
def _byte_tokenizer():
    import llguidance

    return llguidance.LLTokenizer("byte")


def _matcher(regex: str):
    import llguidance

    try:
        m = llguidance.LLMatcher(_byte_tokenizer(), llguidance.LLMatcher.grammar_from_regex(regex))
    except Exception as e:  # llguidance raises ValueError/RuntimeError for bad regexes
        raise GrammarConversionError(f"invalid regex {regex!r}: {e}") from e
    if m.is_error():
        raise GrammarConversionError(f"invalid regex {regex!r}: {m.get_error()}")
    return m


@functools.lru_cache(maxsize=4096)
def _class_set(item: str, flags: str) -> tuple:
    """A set node for the class ``item`` (text valid inside ``[...]``): its non-special
    part as a regex (None when empty) and the specials it holds, decided by llguidance."""
    wrap = (lambda r: f"(?{flags}:{r})") if flags else (lambda r: r)
    m, sp = _matcher(wrap(item)), set()
    for c in SPECIALS:
        m.reset()
        if m.validate_tokens([ord(c)]) == 1 and m.consume_tokens([ord(c)]) and m.is_accepting():
            sp.add(c)
    if not sp:
        return ("set", wrap(item), frozenset())
    n = wrap(f"[{item}--{_SPECIAL_CLASS}]")
    return ("set", n if any(bytes(_matcher(n).compute_bitmask())[:32]) else None, frozenset(sp))


def _char(c: str, flags: str) -> tuple:
    if c in SPECIALS:
        return ("set", None, frozenset(c))
    rx = _rx_char(c)
    return ("set", f"(?i:{rx})" if "i" in flags and c.lower() != c.upper() else rx, frozenset())


def _seq(*xs) -> tuple:
    flat = [y for x in xs for y in (x[1] if x[0] == "seq" else (x,))]
    return flat[0] if len(flat) == 1 else ("seq", tuple(flat))  # () is EPS


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _alt(*xs) -> tuple:
    """An alternation; its single characters merge into one set (overlapping sets would
    make the rules ambiguous, which costs the Earley parser items)."""
    flat = list(dict.fromkeys(y for x in xs for y in (x[1] if x[0] == "alt" else (x,))))
    sets = [x for x in flat if x[0] == "set"]
    if len(sets) > 1:
        runs = [x[1] for x in sets if x[1]]
        one = ("set", (f"(?:{'|'.join(runs)})" if len(runs) > 1 else runs[0]) if runs else None,
               frozenset().union(*(x[2] for x in sets)))
        flat = [one if x is sets[0] else x for x in flat if x[0] != "set" or x is sets[0]]
    return flat[0] if len(flat) == 1 else ("alt", tuple(flat))


def _rep(x: tuple, m: int, n: Optional[int]) -> tuple:
    """``x{m,n}``; nested repeats that only add ambiguity fold: (x{a,}){m,n} is x{am,}
    when m > 0 or a = 0, so is (x{a,b}){m,} when a <= 1, and (x?){m,n} is x{0,n}."""
    if n == 0 or x == EPS:
        return EPS
    if (m, n) == (1, 1):
        return x
    if x[0] == "rep" and (x[3] is None and (m or not x[2]) or n is None and x[2] <= 1):
        return ("rep", x[1], x[2] * m, None)
    if x[0] == "rep" and (x[2], x[3]) == (0, 1):
        return ("rep", x[1], 0, n)
    return ("rep", x, m, n)


def _quant(m: int, n: Optional[int]) -> str:
    return {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((m, n)) or (
        f"{{{m}}}" if m == n else f"{{{m},{'' if n is None else n}}}")


def _rx(node: tuple, full: bool = False) -> str:
    """Regex text of ``node``; ``full`` includes the escapes of its specials (one lexeme)."""
    kind = node[0]
    if kind == "set":
        alts = [a for a in (node[1], full and node[2] and _escape_rx(node[2])) if a]
        return alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"
    if kind == "seq":
        return "".join(f"(?:{_rx(x, full)})" if x[0] == "alt" else _rx(x, full) for x in node[1])
    if kind == "alt":
        return "|".join(_rx(x, full) for x in node[1])
    inner = _rx(node[1], full)
    return f"{inner if node[1][0] == 'set' else f'(?:{inner})'}{_quant(node[2], node[3])}"


def _run(node: tuple) -> str:
    return "" if node == EPS else f"/{_rx(node)}/"


# ------------------------------------------------------------------ regex parser (Rust syntax)
class _Regex:
    """Parses a regex into nodes: ``("set", run regex | None, specials)``, ``("seq", xs)``,
    ``("alt", xs)``, ``("rep", x, min, max | None)``."""

    def __init__(self, text: str, flags: str):
        self.s, self.i, self.flags = text, 0, set(flags)
        if "l" in self.flags:
            raise GrammarConversionError("the regex flag 'l' is not supported")

    def fail(self, what: str):
        raise GrammarConversionError(f"{what} in regex {self.s!r} (at {self.i})")

    def parse(self) -> tuple:
        node = self.alt(set(self.flags), top=True)
        if self.i < len(self.s):
            self.fail("unbalanced ')'")
        return node

    def alt(self, flags: set, top: bool = False) -> tuple:
        branches = [self.seq(flags, top)]
        while self.s.startswith("|", self.i):
            self.i += 1
            branches.append(self.seq(flags, top))
        return _alt(*branches)

    def seq(self, flags: set, top: bool) -> tuple:
        items, s = [], self.s
        while True:
            if "x" in flags:
                self.i = re.compile(r"(?:\s|#[^\n]*)*").match(s, self.i).end()
            if self.i >= len(s) or s[self.i] in "|)":
                return _seq(*items) if items else EPS
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
        s = self.s
        while self.i < len(s):
            q = re.compile(r"[*+?]|\{(\d+)(,(\d*))?\}").match(s, self.i)
            if not q:
                return atom
            self.i = q.end()
            if q[0] in "*+?":
                m, n = {"*": (0, None), "+": (1, None), "?": (0, 1)}[q[0]]
            else:
                m, n = int(q[1]), (int(q[3]) if q[3] else None) if q[2] else int(q[1])
            if n is not None and n < m:
                self.fail("a repeat {m,n} with n < m")
            self.i += s.startswith("?", self.i)  # lazy: the same language
            atom = _rep(atom, m, n)
        return atom

    def atom(self, flags: set) -> Optional[tuple]:
        s, c = self.s, self.s[self.i]
        fl = "".join(f for f in "ix" if f in flags)
        if c == "(":
            return self.group(flags)
        if c == "[":
            return _class_set(self.class_text(), fl)
        if c == ".":
            self.i += 1
            return ("set", _NON_SPECIAL, frozenset(SPECIALS if "s" in flags else SPECIALS.replace("\n", "")))
        if c in "*+?":
            self.fail("a repeat with nothing to repeat")
        if c != "\\":
            self.i += 1
            return _char(c, fl)
        e = re.compile(r"\\(?:[pP](?:\{[^}]*\}|.)|x(?:\{[0-9a-fA-F]+\}|[0-9a-fA-F]{2})|u(?:\{[0-9a-fA-F]+\}|"
                       r"[0-9a-fA-F]{4})|U(?:\{[0-9a-fA-F]+\}|[0-9a-fA-F]{8})|.)", re.S).match(s, self.i)
        if not e:
            self.fail("a trailing backslash")
        self.i, k = e.end(), e[0][1]
        if k in "dDwWsSpP":
            return _class_set(e[0], fl)
        if k in "xuU":
            return _char(chr(int(e[0][2:].strip("{}"), 16)), fl)
        if k in "ntrfva":
            return _char({"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}[k], fl)
        if k.isdigit():
            self.fail("a backreference")
        if k in "bB<>":
            self.fail("a word boundary")
        if k.isalnum():
            self.fail(f"the escape {e[0]!r}")
        return _char(k, fl)

    def group(self, flags: set) -> Optional[tuple]:
        m = re.compile(r"\((?:\?(P?<\w+>|<[=!]|[=!]|([a-zA-Z-]*)([:)]))|(?!\?))").match(self.s, self.i)
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
        node = self.alt(inner)
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
                e = re.compile(r"\\(?:[pPxuU]\{[^}]*\}|.)", re.S).match(s, self.i)
                out.append(e[0])
                self.i = e.end()
                continue
            if c == "[" and (p := re.compile(r"\[:\^?[a-z]+:\]").match(s, self.i)):
                out.append(p[0])
                self.i = p.end()
                continue
            out.append("\\/" if c == "/" else c if " " <= c != "\x7f" else f"\\x{{{ord(c):x}}}")
            self.i += 1
            if c == "[":
                depth += 1
                lead = re.compile(r"\^?\]?").match(s, self.i)[0]
                out.append(lead)
                self.i += len(lead)
            elif c == "]":
                depth -= 1
                if depth == 0:
                    return "".join(out)
        self.fail("an unclosed class")


# ------------------------------------------------------------------ Lark reader (llguidance dialect)
_LARK_TOKENS = [(k, re.compile(r)) for k, r in [
    ("nl", r"(?:\r?\n)+[ \t]*"), ("skip", r"[ \t]+|(?:#|//)[^\n]*"),
    ("str", r'"(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2})|[^"\\\x00-\x1f\x7f])*"i?'),
    ("rx", r"/(?:\\[\s\S]|[^/\\])+/[imslux]*"), ("rule", r"!?[_?]?[a-z][_a-z0-9-]*"),
    ("term", r"_?[A-Z][_A-Z0-9-]*"), ("num", r"[+-]?[0-9]+"), ("special", r"<[^<>\s]+>"),
    ("ref", r"@[a-zA-Z0-9_-]+"), ("dir", r"%[a-z]+"), ("op", r"->|\.\.|::|[:|()\[\]{},=.~&?*+_]")]]
_REFUSED_TOKENS = {"special": "special tokens like {}", "ref": "grammar references like {}"}


def _lark_string(tok: str) -> tuple[str, str]:
    flags = "i" if tok.endswith("i") else ""
    inner = re.sub(r"\\x([0-9a-fA-F]{2})|\\.", lambda m: "\\u00" + m[1] if m[1] else m[0], tok[1:-1 - len(flags)])
    return json.loads(f'"{inner}"'), flags


class _Lark:
    """Reads Lark text into items: ``("rule", name, attrs, body)``, ``("term", name, body)``,
    ``("ignore", body)``, ``("import", [(path, local name)])``; bodies are nodes over atoms
    ``("name", n)``, ``("str", s, flags)``, ``("rx", text, flags)``, ``("range", a, b)``."""

    def __init__(self, text: str):
        self.t, i = [], 0
        while i < len(text):
            matches = ((k, rx.match(text, i)) for k, rx in _LARK_TOKENS)
            kind, m = max(matches, key=lambda km: km[1].end() if km[1] else -1)  # longest; first on ties
            if m is None or m.end() == i:
                raise GrammarConversionError(f"cannot read the grammar at {text[i:i + 20]!r}")
            if kind in _REFUSED_TOKENS or kind == "dir" and m[0] not in ("%ignore", "%import"):
                raise GrammarConversionError(f"{_REFUSED_TOKENS.get(kind, '{}').format(m[0])} cannot be escaped")
            if kind != "skip":
                self.t.append((kind, m[0]))
            i = m.end()
        self.t.append(("eof", ""))
        self.i = 0

    def peek(self, value: Optional[str] = None, kind: Optional[str] = None, ahead: int = 0) -> bool:
        k, v = self.t[min(self.i + ahead, len(self.t) - 1)]
        return (value is None or v == value and k == "op") and (kind is None or k == kind)

    def take(self, value: Optional[str] = None, kind: Optional[str] = None) -> str:
        if not self.peek(value, kind):
            raise GrammarConversionError(f"unexpected {self.t[self.i][1]!r} in the grammar (expected {value or kind})")
        self.i += 1
        return self.t[self.i - 1][1]

    def items(self) -> list:
        out = []
        while not self.peek(kind="eof"):
            if not self.peek(kind="nl"):
                out.append(self.item())
            if not self.peek(kind="eof"):
                self.take(kind="nl")
        return out

    def item(self) -> tuple:
        if self.peek(kind="rule") or self.peek(kind="term"):
            kind, name = self.t[self.i][0], self.take()
            if self.peek("{") or self.peek("::") or self.peek("."):
                raise GrammarConversionError(f"templates, parametric rules and priorities ({name}) cannot be escaped")
            attrs = self.attrs() if kind == "rule" and self.peek("[") else []
            self.take(":")
            return ("rule", name, attrs, self.expansions()) if kind == "rule" else ("term", name, self.expansions())
        if self.take(kind="dir") == "%ignore":
            return ("ignore", self.expansions())
        path = [self.take()]
        while self.peek("."):
            self.i += 1
            path.append(self.take())
        if self.peek("->"):
            self.i += 1
            return ("import", [(path, self.take())])
        if not self.peek("("):
            return ("import", [(path, path[-1])])
        self.take("(")
        names = [self.take()]
        while self.peek(","):
            self.i += 1
            names.append(self.take())
        self.take(")")
        return ("import", [(path + [n], n) for n in names])

    def attrs(self) -> list:
        self.take("[")
        out = []
        while not self.peek("]"):
            key, value = self.take(kind="rule"), None
            if key not in ("capture", "stop_capture", "lazy", "stop", "suffix"):
                raise GrammarConversionError(f"the rule option {key} cannot be escaped")
            if self.peek("="):
                self.i += 2
                value = self.t[self.i - 1]
            out.append((key, value))
            if not self.peek(","):
                break
            self.i += 1
        self.take("]")
        return out

    def expansions(self) -> tuple:
        alts = [self.alias()]
        while self.peek("|") or self.peek(kind="nl") and self.peek("|", ahead=1):
            self.i += 1 + self.peek(kind="nl")
            alts.append(self.alias())
        return _alt(*alts)

    def alias(self) -> tuple:
        items = []
        ends = ("|", ")", "]", "}", "&", "->")
        while not (self.peek(kind="nl") or self.peek(kind="eof") or any(self.peek(v) for v in ends)):
            items.append(self.expr())
        if self.peek("&"):
            raise GrammarConversionError("the & operator cannot be escaped")
        if self.peek("->"):  # an alias names a tree node: nothing to match
            self.i += 1
            self.take(kind="rule")
        return _seq(*items)

    def expr(self) -> tuple:
        atom, v = self.atom(), self.t[self.i][1]
        if self.peek(v) and v in ("?", "*", "+"):
            self.i += 1
            return ("rep", atom, *{"?": (0, 1), "*": (0, None), "+": (1, None)}[v])
        if self.peek("~") and self.peek(kind="num", ahead=1):
            self.i += 1
            m = n = int(self.take(kind="num"))
            if self.peek(".."):
                self.i += 1
                n = int(self.take(kind="num"))
            return ("rep", atom, m, n)
        if self.peek("{"):
            self.i += 1
            m = n = 0 if self.peek(",") else int(self.take(kind="num"))
            if self.peek(","):
                self.i += 1
                n = None if self.peek("}") else int(self.take(kind="num"))
            self.take("}")
            return ("rep", atom, m, n)
        return atom

    def atom(self) -> tuple:
        kind, v = self.t[self.i]
        self.i += 1
        if kind == "op" and v in "([":
            body = self.expansions()
            self.take(")" if v == "(" else "]")
            return body if v == "(" else ("rep", body, 0, 1)
        if kind == "str" and self.peek(".."):
            self.i += 1
            return ("range", _lark_string(v)[0], _lark_string(self.take(kind="str"))[0])
        if kind in ("str", "rx", "rule", "term"):
            if kind in ("rule", "term") and (self.peek("::") or self.peek("{") and not (
                    self.peek(kind="num", ahead=1) or self.peek(",", ahead=1))):
                raise GrammarConversionError(f"templates and parametric rules ({v}) cannot be escaped")
            return _value((kind, v))
        if v == "~":
            raise GrammarConversionError("the ~ (negation) operator cannot be escaped")
        raise GrammarConversionError(f"unexpected {v!r} in the grammar")


def _value(tok: tuple) -> tuple:
    kind, v = tok
    if kind == "str":
        return ("str", *_lark_string(v))
    if kind == "rx":
        return ("rx", v[1:v.rindex("/")], v[v.rindex("/") + 1:])
    if kind in ("rule", "term"):
        return ("name", v)
    raise GrammarConversionError(f"unexpected {v!r} in the grammar")


# ------------------------------------------------------------------ the conversion
class _Converter:
    """Builds the escaped rules (``out``) under one prefix. An escaped language is held as
    ``(P, parts)``: P a run node for its strings without specials (None: none), parts
    ``(head run, middle Lark text, tail run)`` for the others (see the module docstring)."""

    def __init__(self, prefix: str):
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", prefix):
            raise GrammarConversionError(f"prefix {prefix!r}: letters and digits, starting with a letter")
        self.p, self.P, self.names, self.out, self.ig = prefix.lower(), prefix.upper(), set(), [], ""
        self.rules, self.terms, self.term_asts, self.busy = {}, {}, {}, set()
        self.rule_names, self.term_names, self.lexeme_rules, self.first_names, self.escapes = {}, {}, {}, {}, {}
        self.middles: dict = {}

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def finish(self) -> str:
        text = "\n".join(self.out) + "\n"
        if len(text) > _SIZE_LIMIT:
            raise GrammarConversionError(f"the escaped grammar is too large ({len(text)} characters)")
        return text

    # -- escaped languages
    def esc(self, node: tuple) -> tuple:
        kind = node[0]
        if kind == "set":
            if node[2] and node[2] not in self.escapes:
                self.escapes[node[2]] = self.fresh(f"{self.P}__ESC")
                self.out.append(f"{self.escapes[node[2]]}: /{_escape_rx(node[2])}/")
            return (("set", node[1], frozenset()) if node[1] else None,
                    ((EPS, self.escapes[node[2]], EPS),) if node[2] else ())
        if kind == "seq":
            out = (EPS, ())
            for x in node[1]:
                out = self.concat(out, self.esc(x))
            return out
        if kind == "alt":
            es = [self.esc(x) for x in node[1]]
            ps = [e[0] for e in es if e[0] is not None]
            return (_alt(*ps) if ps else None), self.group([p for e in es for p in e[1]])
        _, x, m, n = node
        if x[0] == "set" and x[2] and n is not None:
            return self.counted(x, m, n)
        X = self.esc(x)
        xp, xparts = X
        if not xparts:
            if xp is None or xp == EPS or n == 0:
                return (EPS if m == 0 or xp == EPS else None), ()
            return _rep(xp, m, n), ()
        out = (EPS, ())
        for _ in range(m):
            out = self.concat(out, X)
        if n is None:
            return self.concat(out, self.star(X))
        tail = (EPS, ())  # x{0,k} as (x(x(...)?)?)?, not x?x?...x? (ambiguous)
        for _ in range(n - m):
            p, parts = self.concat(X, tail)
            tail = (EPS if p is None else _rep(p, 0, 1)), parts
        return self.concat(out, tail)

    def counted(self, x: tuple, m: int, n: int) -> tuple:
        """S{m,n} for a set S holding specials, exactly and without the blow-up of
        expanding it: runs of a and b characters around a middle of lo..hi characters,
        lo = max(1, m-a-b), hi = n-a-b, one helper rule per (lo, hi)."""
        if n > _MAX_COUNT:
            raise GrammarConversionError(f"a repeat {{{m},{n}}} over characters JSON escapes: at most "
                                         f"{_MAX_COUNT} can be counted")
        run, esc = (("set", x[1], frozenset()) if x[1] else None), self.esc(("set", None, x[2]))[1][0][1]
        if run is None:
            return (EPS if m == 0 else None), ((EPS, f"({esc}){_quant(max(m, 1), n)}", EPS),)
        return _rep(run, m, n), self.group([(_rep(run, a, a), self.middle(max(1, m - a - b), n - a - b, run, esc),
                                              _rep(run, b, b)) for a in range(n) for b in range(n - a)])

    def middle(self, lo: int, hi: int, run: tuple, esc: str) -> str:
        if hi == 1:
            return esc
        if (lo, hi, run, esc) not in self.middles:
            name = self.middles[lo, hi, run, esc] = self.fresh(f"{self.p}__mid")
            alts = [esc] if lo <= 1 else []
            alts += [_join(self.middle(max(1, lo - 1 - r), hi - 1 - r, run, esc), _run(_rep(run, r, r)), esc)
                     for r in range(hi - 1)]
            self.out.append(f"{name}: {' | '.join(alts)}")
        return self.middles[lo, hi, run, esc]

    def concat(self, a: tuple, b: tuple) -> tuple:
        (pa, qa), (pb, qb) = a, b
        parts = [(h, m, _seq(t, pb)) for h, m, t in qa] if pb is not None else []
        parts += [(_seq(pa, h), m, t) for h, m, t in qb] if pa is not None else []
        parts += [(h1, _join(m1, _run(_seq(t1, h2)), m2), t2) for h1, m1, t1 in qa for h2, m2, t2 in qb]
        return (_seq(pa, pb) if pa is not None and pb is not None else None), self.group(parts)

    def group(self, parts: list) -> tuple:
        by_ends: dict = {}
        for h, m, t in parts:
            by_ends.setdefault((h, t), {})[m] = None
        out = tuple((h, next(iter(ms)) if len(ms) == 1 else f"({' | '.join(ms)})", t) for (h, t), ms in by_ends.items())
        if sum(len(m) for _, m, _ in out) > _SIZE_LIMIT:
            raise GrammarConversionError("a repeat {m,n} over characters JSON escapes is too large to convert")
        return out

    def star(self, x: tuple) -> tuple:
        """X*: no special, or Q h m (t Q h m)* t Q with Q = P*; one left-recursive helper
        rule per (first head, last tail) when the parts have several."""
        p, parts = x
        q = EPS if p is None else _rep(p, 0, None)
        if len(parts) == 1:
            (h, m, t), = parts
            return q, ((_seq(q, h), f"({m} ({_join(_run(_seq(t, q, h)), m)})*)", _seq(t, q)),)
        heads, tails = list(dict.fromkeys(h for h, _, _ in parts)), list(dict.fromkeys(t for _, _, t in parts))
        loop = {(a, b): self.fresh(f"{self.p}__loop") for a in heads for b in tails}
        for (a, b), name in loop.items():
            alts = [m for h, m, t in parts if (h, t) == (a, b)]
            alts += [_join(loop[a, b2], _run(_seq(b2, q, h)), m) for b2 in tails for h, m, t in parts if t == b]
            self.out.append(f"{name}: {' | '.join(alts)}")
        return q, self.group([(_seq(q, a), loop[a, b], _seq(b, q)) for a in heads for b in tails])

    def lexeme(self, e: tuple) -> str:
        """Lark text matching the escaped language ``e``."""
        p, parts = e
        alts = ([f"/{_rx(p)}/" if p != EPS else '""'] if p is not None else [])
        alts += [_join(_run(h), m, _run(t)) for h, m, t in parts]
        if not alts:
            raise GrammarConversionError("a terminal that matches nothing")
        return alts[0] if len(alts) == 1 else f"({' | '.join(alts)})"

    def define(self, base: str, e: tuple, reserved: bool = False) -> str:
        """Defines ``e`` as a terminal named ``base`` when it is one lexeme (a run, or one
        escape), else as a rule (lowercase); returns the name."""
        text, (p, parts) = self.lexeme(e), e
        single = not parts if p is not None else len(parts) == 1 and parts[0][::2] == (EPS, EPS) and (
            parts[0][1] in self.escapes.values())
        if single and text != '""':
            name = base if reserved else self.fresh(base)
        else:
            name = self.fresh(base.lower())
        self.out.append(f"{name}: {text}")
        return name

    # -- the grammar
    def term_ast(self, node: tuple) -> tuple:
        """The regex node of a terminal's expression (named terminals inlined)."""
        kind = node[0]
        if kind in ("seq", "alt"):
            return (_seq if kind == "seq" else _alt)(*(self.term_ast(x) for x in node[1]))
        if kind == "rep":
            return _rep(self.term_ast(node[1]), node[2], node[3])
        if kind == "str":
            return _seq(*(_char(c, node[2]) for c in node[1]))
        if kind == "rx":
            return _Regex(node[1], node[2]).parse()
        if kind == "range":
            a, b = node[1], node[2]
            if len(a) != 1 or len(b) != 1 or a > b:
                raise GrammarConversionError(f"the range {a!r}..{b!r}")
            return _class_set(f"[{_rx_char(a)}-{_rx_char(b)}]", "")
        name = node[1]
        if name not in self.terms:
            raise GrammarConversionError(f"{name!r} in a terminal is not a terminal")
        if name in self.busy:
            raise GrammarConversionError(f"the terminal {name} refers to itself")
        if name not in self.term_asts:
            self.busy.add(name)
            self.term_asts[name] = self.term_ast(self.terms[name])
            self.busy.discard(name)
        return self.term_asts[name]

    def lark(self, grammar: str) -> tuple[str, str]:
        ignores = []
        for item in _Lark(grammar).items():
            if item[0] == "ignore":
                ignores.append(item[1])
            elif item[0] == "term":
                self.add(self.terms, item[1], item[2])
            elif item[0] == "rule":
                marks, bare = re.fullmatch(r"([!?]?)(.*)", item[1]).groups()
                self.add(self.rules, bare, (marks, item[2], item[3]))
            for path, local in item[1] if item[0] == "import" else ():
                if len(path) != 2 or path[0] != "common" or path[1] not in _COMMON:
                    raise GrammarConversionError(f"%import {'.'.join(path)}: only common.* names are known")
                self.add(self.terms, local, ("rx", _COMMON[path[1]], ""))
        if "start" not in self.rules:
            raise GrammarConversionError("the grammar has no rule 'start'")
        self.rule_names = {n: self.fresh(f"{self.p}_{n}") for n in self.rules}
        self.names.update(f"{self.P}_{n}" for n in self.terms)
        for n in self.terms:
            self.term_names[n] = self.define(f"{self.P}_{n}", self.esc(self.term_ast(("name", n))), True)
        if ignores:
            self.ig = self.define(f"{self.P}__IGNORE", self.esc(self.term_ast(_alt(*ignores)))) + "* "
        bodies = {}
        for n, (marks, attrs, body) in self.rules.items():
            opts, lexeme = self.options(attrs)
            if lexeme:
                self.lexeme_rules[n] = True
                self.out.append(f"{marks}{self.rule_names[n]}{opts}: /{_rx(self.term_ast(body), True)}/")
            else:
                bodies[n] = (marks, opts, body)
        bodies = {n: (marks, opts, self.gexpr(body)) for n, (marks, opts, body) in bodies.items()}
        for n, (marks, opts, g) in bodies.items():
            self.out.append(f"{marks}{self.rule_names[n]}{opts}: {self.render(g)}")
        root = self.rule_names["start"]
        if self.ig and "start" in bodies:
            root = self.between_lexemes(bodies)
        return self.finish(), root

    @staticmethod
    def add(table: dict, name: str, body) -> None:
        if name in table:
            raise GrammarConversionError(f"{name} is defined twice")
        table[name] = body

    def options(self, attrs: list) -> tuple[str, bool]:
        """The rule options, escaped, and whether they make the rule one lexeme."""
        out, lexeme = [], False
        for key, value in attrs:
            if key in ("stop", "suffix") and value[1] != '""':
                out.append(f"{key}=/{_rx(self.term_ast(_value(value)), True)}/")
            else:
                out.append(key if value is None else f"{key}={value[1]}")
            lexeme |= key in ("lazy", "stop", "suffix")
        return (f"[{', '.join(out)}]" if out else ""), lexeme

    def gexpr(self, node: tuple) -> tuple:
        """A rule body as ``("lex", Lark text)``, ``("ref", rule)``, seq, alt, rep."""
        kind = node[0]
        if kind in ("seq", "alt"):
            return (kind, tuple(self.gexpr(x) for x in node[1]))
        if kind == "rep":
            return ("rep", self.gexpr(node[1]), node[2], node[3])
        if kind == "name":
            if node[1] in self.lexeme_rules:
                return ("lex", self.rule_names[node[1]])
            if node[1] in self.rules:
                return ("ref", node[1])
            if node[1] in self.terms:
                return ("lex", self.term_names[node[1]])
            raise GrammarConversionError(f"{node[1]!r} is not defined")
        if kind == "str" and not set(node[1]) & set(SPECIALS):
            return ("lex", json.dumps(node[1]) + node[2]) if node[1] else EPS
        return ("lex", self.lexeme(self.esc(self.term_ast(node))))

    def render(self, g: tuple) -> str:
        kind = g[0]
        if kind == "lex":
            return self.ig + g[1]
        if kind == "ref":
            return self.rule_names[g[1]]
        if kind == "seq":
            return " ".join(self.render(x) for x in g[1]) or '""'
        if kind == "alt":
            return f"({' | '.join(self.render(x) for x in g[1])})"
        return '""' if g[3] == 0 else f"({self.render(g[1])}){_quant(g[2], g[3])}"

    # -- %ignore: llguidance skips it between lexemes only, not before the first or after the last
    def between_lexemes(self, bodies: dict) -> str:
        """Every lexeme is rendered after an optional ignore; a ``_first`` variant of each
        rule drops the ignore before its first lexeme, and the root starts with it."""
        self.nullable, nonempty = dict.fromkeys(bodies, False), dict.fromkeys(bodies, False)
        changed = True
        while changed:
            changed = False
            for n, (_, _, g) in bodies.items():
                now = (self.is_nullable(g), self.is_nonempty(g, nonempty))
                changed |= now != (self.nullable[n], nonempty[n])
                self.nullable[n], nonempty[n] = now
        self.first_names = {n: self.fresh(f"{self.rule_names[n]}_first") for n in bodies if nonempty[n]}
        for n, name in self.first_names.items():
            self.out.append(f"{name}{bodies[n][1]}: {self.first(bodies[n][2])}")
        root = self.fresh(f"{self.p}__root")
        alts = [self.first_names["start"]] if "start" in self.first_names else []
        alts += ['""'] if self.nullable["start"] else []
        self.out.append(f"{root}: {' | '.join(alts)}")
        return root

    def is_nullable(self, g: tuple) -> bool:
        kind = g[0]
        if kind in ("lex", "ref"):
            return kind == "ref" and self.nullable.get(g[1], False)
        if kind in ("seq", "alt"):
            return (all if kind == "seq" else any)(self.is_nullable(x) for x in g[1])
        return g[2] == 0 or self.is_nullable(g[1])

    def is_nonempty(self, g: tuple, table: dict) -> bool:
        kind = g[0]
        if kind in ("lex", "ref"):
            return kind == "lex" or table[g[1]]
        if kind in ("seq", "alt"):
            return any(self.is_nonempty(x, table) for x in g[1])
        return g[3] != 0 and self.is_nonempty(g[1], table)

    def first(self, g: tuple) -> Optional[str]:
        """``g``'s strings of at least one lexeme, without the ignore before the first."""
        kind, alts = g[0], []
        if kind in ("lex", "ref"):
            return g[1] if kind == "lex" else self.first_names.get(g[1])
        if kind == "alt":
            alts = [f for x in g[1] if (f := self.first(x))]
        elif kind == "seq":
            for i, x in enumerate(g[1]):
                if f := self.first(x):
                    alts.append(_join(f, *(self.render(y) for y in g[1][i + 1:])))
                if not self.is_nullable(x):
                    break
        elif (f := self.first(g[1])) and g[3] != 0:
            rest = ("rep", g[1], 0 if self.is_nullable(g[1]) else max(g[2] - 1, 0), g[3] and g[3] - 1)
            alts = [_join(f, self.render(rest))]
        return None if not alts else alts[0] if len(alts) == 1 else f"({' | '.join(alts)})"
