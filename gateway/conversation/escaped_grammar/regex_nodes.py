"""Regexes as nodes split at the JSON specials: building them, and writing them back.

A node is ``("set", run regex | None, specials)`` (one character: the regex of its
non-special members, and the specials it holds), ``("seq", xs)``, ``("alt", xs)`` or
``("rep", x, min, max | None)``; :data:`EPS` is the empty sequence. Which specials a
class holds is decided by llguidance itself, so it follows Rust's regex semantics.
"""

from __future__ import annotations

import functools
from typing import Optional

from gateway.conversation.escaped_grammar.errors import GrammarConversionError
from gateway.conversation.escaped_grammar.json_escapes import NON_SPECIAL, SPECIAL_CLASS, SPECIALS, escape_rx, rx_char

EPS = ("seq", ())


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
def class_set(item: str, flags: str) -> tuple:
    """A set node for the class ``item`` (text valid inside ``[...]``): its non-special
    part as a regex (None when empty) and the specials it holds, decided by llguidance.

    Raises:
        GrammarConversionError: llguidance cannot read the class.
    """
    wrap = (lambda r: f"(?{flags}:{r})") if flags else (lambda r: r)
    m, sp = _matcher(wrap(item)), set()
    for c in SPECIALS:
        m.reset()
        if m.validate_tokens([ord(c)]) == 1 and m.consume_tokens([ord(c)]) and m.is_accepting():
            sp.add(c)
    if not sp:
        return ("set", wrap(item), frozenset())
    n = wrap(f"[{item}--{SPECIAL_CLASS}]")
    return ("set", n if any(bytes(_matcher(n).compute_bitmask())[:32]) else None, frozenset(sp))


def char_set(c: str, flags: str) -> tuple:
    """A set node for the character ``c`` (either case under the flag i)."""
    if c in SPECIALS:
        return ("set", None, frozenset(c))
    atom = rx_char(c)
    return ("set", f"(?i:{atom})" if "i" in flags and c.lower() != c.upper() else atom, frozenset())


def any_char(dot_all: bool) -> tuple:
    """The set node of ``.``: any character, the newline only under the flag s."""
    return ("set", NON_SPECIAL, frozenset(SPECIALS if dot_all else SPECIALS.replace("\n", "")))


def seq(*xs) -> tuple:
    flat = [y for x in xs for y in (x[1] if x[0] == "seq" else (x,))]
    return flat[0] if len(flat) == 1 else ("seq", tuple(flat))  # () is EPS


def alt(*xs) -> tuple:
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


def rep(x: tuple, m: int, n: Optional[int]) -> tuple:
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


def quant(m: int, n: Optional[int]) -> str:
    """The quantifier ``{m,n}`` in its shortest form (``*``, ``+``, ``?``, ``{m}``)."""
    return {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((m, n)) or (
        f"{{{m}}}" if m == n else f"{{{m},{'' if n is None else n}}}")


def rx(node: tuple, full: bool = False) -> str:
    """Regex text of ``node``; ``full`` includes the escapes of its specials (one lexeme)."""
    kind = node[0]
    if kind == "set":
        alts = [a for a in (node[1], full and node[2] and escape_rx(node[2])) if a]
        return alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"
    if kind == "seq":
        return "".join(f"(?:{rx(x, full)})" if x[0] == "alt" else rx(x, full) for x in node[1])
    if kind == "alt":
        return "|".join(rx(x, full) for x in node[1])
    inner = rx(node[1], full)
    return f"{inner if node[1][0] == 'set' else f'(?:{inner})'}{quant(node[2], node[3])}"


def run_lexeme(node: tuple) -> str:
    """Lark text of the run ``node`` as a ``/.../`` lexeme; empty for :data:`EPS`."""
    return "" if node == EPS else f"/{rx(node)}/"


def join(*parts: str) -> str:
    """Lark texts in sequence, the empty ones left out."""
    return " ".join(p for p in parts if p)
