"""A reader of llguidance's Lark dialect, into items whose bodies are nodes.

The reader knows the whole dialect's syntax and refuses, naming it, what has no escaped
form: special tokens, ``%json``/``%regex``/``%lark``/``%llguidance``/``%declare``/
``%override`` (any directive but ``%ignore`` and ``%import``), ``@grammar`` references,
the ``&``/``~`` operators, templates, priorities, parametric rules, rule options other than
``capture``, ``stop_capture``, ``lazy``, ``stop`` and ``suffix``. ``->`` aliases are read
and dropped (they name tree nodes; nothing to match).

Sources: llguidance's Lark dialect (docs/syntax.md in guidance-ai/llguidance), Lark's
common.lark for the ``%import common`` names.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from gateway.conversation.escaped_grammar.errors import GrammarConversionError
from gateway.conversation.escaped_grammar.regex_nodes import alt, seq

# Lark's common.lark names, as llguidance defines them (regexes written here).
COMMON = {
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
COMMON["SIGNED_FLOAT"] = rf"[+-]?(?:{COMMON['FLOAT']})"
COMMON["SIGNED_NUMBER"] = rf"[+-]?(?:{COMMON['NUMBER']})"

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


class LarkReader:
    """Reads Lark text into items: ``("rule", name, attrs, body)``, ``("term", name, body)``,
    ``("ignore", body)``, ``("import", [(path, local name)])``; bodies are nodes over atoms
    ``("name", n)``, ``("str", s, flags)``, ``("rx", text, flags)``, ``("range", a, b)``.

    Raises:
        GrammarConversionError: text that is not Lark, or a construct with no escaped form
            (named), from the constructor (tokens) or :meth:`items` (the rest).
    """

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
        """The grammar's items, in their order."""
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
        return alt(*alts)

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
        return seq(*items)

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
            return self._counted(atom, m, n)
        if self.peek("{"):
            self.i += 1
            m = n = 0 if self.peek(",") else int(self.take(kind="num"))
            if self.peek(","):
                self.i += 1
                n = None if self.peek("}") else int(self.take(kind="num"))
            self.take("}")
            return self._counted(atom, m, n)
        return atom

    @staticmethod
    def _counted(atom: tuple, m: int, n: Optional[int]) -> tuple:
        """A repeat of ``atom`` ``m`` to ``n`` times (None: no bound), checked as llguidance
        checks its raw grammar.

        Raises:
            GrammarConversionError: a negative count, or a bound below the count.
        """
        if m < 0 or (n is not None and n < m):
            raise GrammarConversionError(f"a repeat of {m} to {n} times")
        return ("rep", atom, m, n)

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
            return lark_atom((kind, v))
        if v == "~":
            raise GrammarConversionError("the ~ (negation) operator cannot be escaped")
        raise GrammarConversionError(f"unexpected {v!r} in the grammar")


def lark_atom(tok: tuple) -> tuple:
    """The atom of a string, regex or name token ``(kind, text)``.

    Raises:
        GrammarConversionError: a token of another kind.
    """
    kind, v = tok
    if kind == "str":
        return ("str", *_lark_string(v))
    if kind == "rx":
        return ("rx", v[1:v.rindex("/")], v[v.rindex("/") + 1:])
    if kind in ("rule", "term"):
        return ("name", v)
    raise GrammarConversionError(f"unexpected {v!r} in the grammar")
