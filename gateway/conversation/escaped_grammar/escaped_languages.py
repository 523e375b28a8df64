"""Escaped languages: the JSON-escaped form of a regex node, as Lark lexemes and rules.

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

Sources: llguidance's lexer (parser/src/earley/lexer.rs: greedy, one byte of lookahead).
"""

from __future__ import annotations

import re

from gateway.conversation.escaped_grammar.errors import GrammarConversionError
from gateway.conversation.escaped_grammar.json_escapes import escape_rx
from gateway.conversation.escaped_grammar.regex_nodes import EPS, alt, join, quant, rep, run_lexeme, rx, seq

_SIZE_LIMIT = 200_000  # characters of output for one grammar
_MAX_COUNT = 32  # S{m,n} over escapable characters: O(n^2) parts, and Earley items, beyond


class EscapedLanguages:
    """Builds the escaped rules (``out``) under one prefix. An escaped language is held as
    ``(P, parts)``: P a run node for its strings without specials (None: none), parts
    ``(head run, middle Lark text, tail run)`` for the others (see the module docstring).

    Args:
        prefix: letters and digits, starting with a letter; every name defined here
            starts with it, lowercase for rules, uppercase for terminals.

    Raises:
        GrammarConversionError: a bad prefix; from :meth:`finish`, :meth:`esc` and
            :meth:`lexeme`, output over the size limit or a language with no strings.
    """

    def __init__(self, prefix: str):
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", prefix):
            raise GrammarConversionError(f"prefix {prefix!r}: letters and digits, starting with a letter")
        self.p, self.P, self.names, self.out = prefix.lower(), prefix.upper(), set(), []
        self.escapes: dict = {}  # specials -> the terminal of their escape sequences
        self.middles: dict = {}  # (lo, hi, run, escape terminal) -> the rule counting them

    def fresh(self, base: str) -> str:
        """``base``, or ``base_2``, ``base_3``... where it is taken; now taken."""
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def finish(self) -> str:
        """The rules written so far, as Lark text."""
        text = "\n".join(self.out) + "\n"
        if len(text) > _SIZE_LIMIT:
            raise GrammarConversionError(f"the escaped grammar is too large ({len(text)} characters)")
        return text

    def escape_terminal(self, specials: frozenset) -> str:
        """The terminal of one escape sequence of any of ``specials`` (defined once)."""
        if specials not in self.escapes:
            self.escapes[specials] = self.fresh(f"{self.P}__ESC")
            self.out.append(f"{self.escapes[specials]}: /{escape_rx(specials)}/")
        return self.escapes[specials]

    def esc(self, node: tuple) -> tuple:
        """The escaped language of the regex node ``node``, as ``(P, parts)``."""
        kind = node[0]
        if kind == "set":
            return (("set", node[1], frozenset()) if node[1] else None,
                    ((EPS, self.escape_terminal(node[2]), EPS),) if node[2] else ())
        if kind == "seq":
            out = (EPS, ())
            for x in node[1]:
                out = self.concat(out, self.esc(x))
            return out
        if kind == "alt":
            es = [self.esc(x) for x in node[1]]
            ps = [e[0] for e in es if e[0] is not None]
            return (alt(*ps) if ps else None), self.group([p for e in es for p in e[1]])
        _, x, m, n = node
        if x[0] == "set" and x[2] and n is not None:
            return self.counted(x, m, n)
        X = self.esc(x)
        xp, xparts = X
        if not xparts:
            if xp is None or xp == EPS or n == 0:
                return (EPS if m == 0 or xp == EPS else None), ()
            return rep(xp, m, n), ()
        out = (EPS, ())
        for _ in range(m):
            out = self.concat(out, X)
        if n is None:
            return self.concat(out, self.star(X))
        tail = (EPS, ())  # x{0,k} as (x(x(...)?)?)?, not x?x?...x? (ambiguous)
        for _ in range(n - m):
            p, parts = self.concat(X, tail)
            tail = (EPS if p is None else rep(p, 0, 1)), parts
        return self.concat(out, tail)

    def counted(self, x: tuple, m: int, n: int) -> tuple:
        """S{m,n} for a set S holding specials, exactly and without the blow-up of
        expanding it: runs of a and b characters around a middle of lo..hi characters,
        lo = max(1, m-a-b), hi = n-a-b, one helper rule per (lo, hi)."""
        if n > _MAX_COUNT:
            raise GrammarConversionError(f"a repeat {{{m},{n}}} over characters JSON escapes: at most "
                                         f"{_MAX_COUNT} can be counted")
        run, esc = (("set", x[1], frozenset()) if x[1] else None), self.escape_terminal(x[2])
        if run is None:
            return (EPS if m == 0 else None), ((EPS, f"({esc}){quant(max(m, 1), n)}", EPS),)
        return rep(run, m, n), self.group([(rep(run, a, a), self.middle(max(1, m - a - b), n - a - b, run, esc),
                                              rep(run, b, b)) for a in range(n) for b in range(n - a)])

    def middle(self, lo: int, hi: int, run: tuple, esc: str) -> str:
        if hi == 1:
            return esc
        if (lo, hi, run, esc) not in self.middles:
            name = self.middles[lo, hi, run, esc] = self.fresh(f"{self.p}__mid")
            alts = [esc] if lo <= 1 else []
            alts += [join(self.middle(max(1, lo - 1 - r), hi - 1 - r, run, esc), run_lexeme(rep(run, r, r)), esc)
                     for r in range(hi - 1)]
            self.out.append(f"{name}: {' | '.join(alts)}")
        return self.middles[lo, hi, run, esc]

    def concat(self, a: tuple, b: tuple) -> tuple:
        """The language of ``a`` then ``b``; a tail run of ``a`` and a head run of ``b``
        merge into one run (never two runs side by side)."""
        (pa, qa), (pb, qb) = a, b
        parts = [(h, m, seq(t, pb)) for h, m, t in qa] if pb is not None else []
        parts += [(seq(pa, h), m, t) for h, m, t in qb] if pa is not None else []
        parts += [(h1, join(m1, run_lexeme(seq(t1, h2)), m2), t2) for h1, m1, t1 in qa for h2, m2, t2 in qb]
        return (seq(pa, pb) if pa is not None and pb is not None else None), self.group(parts)

    def group(self, parts: list) -> tuple:
        """``parts`` with the same head and tail merged: their middles alternate."""
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
        q = EPS if p is None else rep(p, 0, None)
        if len(parts) == 1:
            (h, m, t), = parts
            return q, ((seq(q, h), f"({m} ({join(run_lexeme(seq(t, q, h)), m)})*)", seq(t, q)),)
        heads, tails = list(dict.fromkeys(h for h, _, _ in parts)), list(dict.fromkeys(t for _, _, t in parts))
        loop = {(a, b): self.fresh(f"{self.p}__loop") for a in heads for b in tails}
        for (a, b), name in loop.items():
            alts = [m for h, m, t in parts if (h, t) == (a, b)]
            alts += [join(loop[a, b2], run_lexeme(seq(b2, q, h)), m) for b2 in tails for h, m, t in parts if t == b]
            self.out.append(f"{name}: {' | '.join(alts)}")
        return q, self.group([(seq(q, a), loop[a, b], seq(b, q)) for a in heads for b in tails])

    def lexeme(self, e: tuple) -> str:
        """Lark text matching the escaped language ``e``."""
        p, parts = e
        alts = ([f"/{rx(p)}/" if p != EPS else '""'] if p is not None else [])
        alts += [join(run_lexeme(h), m, run_lexeme(t)) for h, m, t in parts]
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
