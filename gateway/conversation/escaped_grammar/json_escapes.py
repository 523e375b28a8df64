"""JSON string escaping, character by character, and its escape sequences as regexes.

esc(c) is how ``json.dumps(s, ensure_ascii=False)[1:-1]`` writes the character c:
``"`` -> ``\\"``, ``\\`` -> ``\\\\``, ``\\n \\r \\t \\b \\f``, other characters below
U+0020 -> ``\\u00xx`` (lowercase hex), everything else unchanged. The characters esc
changes are the *specials*.

Sources: RFC 8259 section 7 and CPython's ``json`` encoder.
"""

from __future__ import annotations

import json

SPECIALS = '"\\' + "".join(map(chr, range(32)))
SPECIAL_CLASS = r'[\x00-\x1f"\\]'
NON_SPECIAL = r'[^\x00-\x1f"\\]'


def esc(c: str) -> str:
    return json.dumps(c, ensure_ascii=False)[1:-1]


def rx_char(c: str) -> str:
    """``c`` as a regex atom (Rust syntax), safe inside ``/.../`` and ``[...]``."""
    if c in "\\.+*?()|[]{}^$#&-~/":
        return "\\" + c
    return c if " " <= c < "\x7f" else f"\\x{{{ord(c):x}}}"


def escape_rx(sp: frozenset) -> str:
    """A regex for one escape sequence of any special in ``sp``."""
    codes = [esc(c) for c in sorted(sp)]
    short = "".join(rx_char(e[1]) for e in codes if len(e) == 2)
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
