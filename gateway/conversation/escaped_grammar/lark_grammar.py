"""An llguidance Lark grammar's escaped form: its terminals, rules, options and
``%ignore``, as Lark rules over escaped lexemes.

A terminal's expression becomes a regex node (named terminals inlined, ``%import
common.X`` as its regex), its escaped language a terminal when that is one lexeme, else a
rule. Rules keep their marks (``?rule``, ``!rule``) and options; a ``lazy``, ``stop=`` or
``suffix=`` rule stays one lexeme over the escaped text, exact since it ends at its first
match. ``%ignore`` becomes explicit optional lexemes between the grammar's lexemes (a
``%ignore`` line would apply to the whole host grammar).

Sources: llguidance's lexer (parser/src/earley/lexer.rs: ``%ignore`` skipped after a
lexeme).
"""

from __future__ import annotations

import json
import re
from typing import Optional

from gateway.conversation.escaped_grammar.errors import GrammarConversionError
from gateway.conversation.escaped_grammar.escaped_languages import EscapedLanguages
from gateway.conversation.escaped_grammar.json_escapes import SPECIALS, rx_char
from gateway.conversation.escaped_grammar.lark_reader import COMMON, LarkReader, lark_atom
from gateway.conversation.escaped_grammar.regex_nodes import EPS, alt, char_set, class_set, join, quant, rep, rx, seq
from gateway.conversation.escaped_grammar.rust_regex import RustRegex


class LarkConverter(EscapedLanguages):
    """Converts one Lark grammar (:meth:`lark`) into escaped rules under one prefix.

    Args:
        prefix: as for :class:`EscapedLanguages`.
    """

    def __init__(self, prefix: str):
        super().__init__(prefix)
        self.rules, self.terms, self.term_asts, self.busy = {}, {}, {}, set()
        self.rule_names, self.term_names, self.lexeme_rules, self.first_names = {}, {}, set(), {}
        self.ig = ""  # the optional ignore lexemes rendered before each lexeme, when %ignore
        self.nullable: dict = {}  # rule -> whether it matches the empty string (%ignore only)

    def term_ast(self, node: tuple) -> tuple:
        """The regex node of a terminal's expression (named terminals inlined)."""
        kind = node[0]
        if kind in ("seq", "alt"):
            return (seq if kind == "seq" else alt)(*(self.term_ast(x) for x in node[1]))
        if kind == "rep":
            return rep(self.term_ast(node[1]), node[2], node[3])
        if kind == "str":
            return seq(*(char_set(c, node[2]) for c in node[1]))
        if kind == "rx":
            return RustRegex(node[1], node[2]).parse()
        if kind == "range":
            a, b = node[1], node[2]
            if len(a) != 1 or len(b) != 1 or a > b:
                raise GrammarConversionError(f"the range {a!r}..{b!r}")
            return class_set(f"[{rx_char(a)}-{rx_char(b)}]", "")
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
        """``(rules, root)`` for ``grammar``, as :func:`escaped_lark` returns them."""
        ignores = []
        for item in LarkReader(grammar).items():
            if item[0] == "ignore":
                ignores.append(item[1])
            elif item[0] == "term":
                self.add(self.terms, item[1], item[2])
            elif item[0] == "rule":
                marks, bare = re.fullmatch(r"([!?]?)(.*)", item[1]).groups()
                self.add(self.rules, bare, (marks, item[2], item[3]))
            else:
                for path, local in item[1]:  # an import
                    if len(path) != 2 or path[0] != "common" or path[1] not in COMMON:
                        raise GrammarConversionError(f"%import {'.'.join(path)}: only common.* names are known")
                    self.add(self.terms, local, ("rx", COMMON[path[1]], ""))
        if "start" not in self.rules:
            raise GrammarConversionError("the grammar has no rule 'start'")
        self.rule_names = {n: self.fresh(f"{self.p}_{n}") for n in self.rules}
        self.names.update(f"{self.P}_{n}" for n in self.terms)
        for n in self.terms:
            self.term_names[n] = self.define(f"{self.P}_{n}", self.esc(self.term_ast(("name", n))), True)
        if ignores:
            self.ig = self.define(f"{self.P}__IGNORE", self.esc(self.term_ast(alt(*ignores)))) + "* "
        bodies = {}
        for n, (marks, attrs, body) in self.rules.items():
            opts, lexeme = self.options(attrs)
            if lexeme:
                self.lexeme_rules.add(n)
                self.out.append(f"{marks}{self.rule_names[n]}{opts}: /{rx(self.term_ast(body), True)}/")
            else:
                bodies[n] = (marks, opts, body)
        # once every lexeme rule is known: a body may name one defined after it
        bodies = {n: (marks, opts, self.gexpr(body)) for n, (marks, opts, body) in bodies.items()}
        for n, (marks, opts, g) in bodies.items():
            self.out.append(f"{marks}{self.rule_names[n]}{opts}: {self.render(g)}")
        root = self.rule_names["start"]
        if self.ig and "start" in bodies:
            root = self.between_lexemes(bodies)
        return self.finish(), root

    @staticmethod
    def add(table: dict, name: str, body) -> None:
        """Defines ``name`` in ``table``; GrammarConversionError when it already is."""
        if name in table:
            raise GrammarConversionError(f"{name} is defined twice")
        table[name] = body

    def options(self, attrs: list) -> tuple[str, bool]:
        """The rule options, escaped, and whether they make the rule one lexeme."""
        out, lexeme = [], False
        for key, value in attrs:
            if key in ("stop", "suffix") and value[1] != '""':
                out.append(f"{key}=/{rx(self.term_ast(lark_atom(value)), True)}/")
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
        """Lark text of the rule body ``g``, each lexeme after the ignore (when any)."""
        kind = g[0]
        if kind == "lex":
            return self.ig + g[1]
        if kind == "ref":
            return self.rule_names[g[1]]
        if kind == "seq":
            return " ".join(self.render(x) for x in g[1]) or '""'
        if kind == "alt":
            return f"({' | '.join(self.render(x) for x in g[1])})"
        return '""' if g[3] == 0 else f"({self.render(g[1])}){quant(g[2], g[3])}"

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
                    alts.append(join(f, *(self.render(y) for y in g[1][i + 1:])))
                if not self.is_nullable(x):
                    break
        elif (f := self.first(g[1])) and g[3] != 0:
            rest = ("rep", g[1], 0 if self.is_nullable(g[1]) else max(g[2] - 1, 0), g[3] and g[3] - 1)
            alts = [join(f, self.render(rest))]
        return None if not alts else alts[0] if len(alts) == 1 else f"({' | '.join(alts)})"
