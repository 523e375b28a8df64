"""Custom-tool grammars for text inside a JSON string (gateway/conversation/escaped_grammar/).

The reference is llguidance itself: the raw grammar (or regex) is compiled as given and run
over the raw text, the escaped rules over ``json.dumps(s, ensure_ascii=False)[1:-1]``; both
run byte by byte through llguidance's byte tokenizer, so no model is needed. Members of the
raw language are drawn by a random walk through the raw grammar's own token masks, and
near-misses are members with a character inserted, deleted or replaced; the two must agree
on every string, and both kinds must occur. One test feeds a whole Qwen3 tool call, as
Qwen3's tokenizer splits it, through a matcher over that tokenizer.
``fixtures/codex_apply_patch.lark`` is the grammar Codex CLI 0.169 sends for its
``apply_patch`` tool, verbatim.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import pytest

from gateway.conversation.escaped_grammar import GrammarConversionError, escaped_lark, escaped_regex, json_escapes

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BYTES = llguidance.LLTokenizer("byte")
APPLY_PATCH = (FIXTURES / "codex_apply_patch.lark").read_text()
# Characters a mutation inserts: every JSON special, and what the grammars below care about.
PROBES = ['"', "\\", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f", "/", " ", "*", "+", "-", "@",
          ":", ",", ";", "=", "a", "Z", "7", "é", "€", "😀", "\u2028", "\x1c"]


def matcher(lark: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(BYTES, llguidance.LLMatcher.grammar_from_lark(lark))
    assert not m.is_error(), m.get_error()
    return m


def accepts(m: llguidance.LLMatcher, text: str) -> bool:
    m.reset()
    ids = list(text.encode())
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def esc(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


def sample(m: llguidance.LLMatcher, rng: random.Random, max_bytes: int = 300):
    """A random member of ``m``'s language (a walk through its byte masks), or None."""
    m.reset()
    out = bytearray()
    while len(out) < max_bytes:
        mask = m.compute_bitmask()
        allowed = [b for b in range(256) if mask[b // 8] >> (b % 8) & 1]
        if m.is_accepting() and (not allowed or rng.random() < 0.08):
            return out.decode()
        if not allowed:
            return None
        # lean towards JSON specials and ASCII, so that escapes and line ends are frequent
        r = rng.random()
        b = rng.choice(r < 0.3 and [x for x in allowed if x < 0x20 or x in b'"\\'] or
                       r < 0.7 and [x for x in allowed if x < 0x80] or allowed)
        assert m.consume_token(b)
        out.append(b)
    return None


def mutate(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s) + 1)
    op = rng.randrange(3)
    if op == 0 or not s:
        return s[:i] + rng.choice(PROBES) + s[i:]
    i = min(i, len(s) - 1)
    return s[:i] + (rng.choice(PROBES) if op == 1 else "") + s[i + 1:]


def strings(raw: llguidance.LLMatcher, seed: int, n: int, extra=()) -> list[str]:
    rng = random.Random(seed)
    members = [s for s in (sample(raw, rng) for _ in range(n)) if s is not None] + list(extra)
    return members + [mutate(rng.choice(members), rng) for _ in range(2 * n)]


def compare(raw: llguidance.LLMatcher, escaped: llguidance.LLMatcher, texts: list[str], wrap=lambda e: e):
    """(members, non-members, disagreements) over ``texts``."""
    verdicts = [(s, accepts(raw, s), accepts(escaped, wrap(esc(s)))) for s in texts]
    wrong = [(s, r) for s, r, e in verdicts if r != e]
    return sum(r for _, r, _ in verdicts), sum(not r for _, r, _ in verdicts), wrong


def check_lark(grammar: str, seed: int, n: int = 60, extra=(), keep=lambda s: True) -> int:
    rules, root = escaped_lark(grammar, "c0")
    raw, escaped = matcher(grammar), matcher(f"start: {root}\n{rules}")
    members, others, wrong = compare(raw, escaped, [s for s in strings(raw, seed, n, extra) if keep(s)])
    assert not wrong, f"escaped grammar disagrees with the raw one on {wrong[:5]}\n{rules}"
    assert members >= n // 3 and others >= 5, (members, others)
    return members


# ---------------------------------------------------------------------- Codex's apply_patch

PATCHES = [
    '*** Begin Patch\n*** Add File: src/a "quoted" \\ back\tslash.py\n+print("hi\\n")\n+\x01\x1f\x7f é€😀\n'
    "*** End Patch\n",
    "*** Begin Patch\n*** Update File: f.c\n*** Move to: g/h.c\n@@ int main() {\n-\treturn 0;\n+\treturn 1;\n"
    ' }\n@@\n+"\\"\r\n*** End of File\n*** Delete File: x\n*** End Patch',
]


def test_apply_patch_accepts_exactly_the_escaped_patches():
    assert all(accepts(matcher(APPLY_PATCH), p) for p in PATCHES)
    assert check_lark(APPLY_PATCH, seed=1, n=120, extra=PATCHES) >= 40


def test_apply_patch_inside_a_tool_call_with_the_hosts_own_names():
    """The rules sit in a host grammar whose own names are the raw grammar's (start, LF,
    hunk, ...), beside a second tool's rules under another prefix."""
    rules, root = escaped_lark(APPLY_PATCH, "c0")
    other, other_root = escaped_regex(r"[a-z]+\n", "c1")
    host = ('start: "<tool_call>" LF "{\\"name\\":" call "}" LF "</tool_call>"\n'
            'call: "\\"apply_patch\\",\\"arguments\\":{\\"input\\":\\"" ' + root + ' "\\"}"\n'
            '    | "\\"other\\",\\"arguments\\":{\\"input\\":\\"" ' + other_root + ' "\\"}"\n'
            'hunk: "x"\nLF: "\\n"\n' + rules + other)
    escaped = matcher(host)
    raw = matcher(APPLY_PATCH)
    call = lambda name, e: f'<tool_call>\n{{"name":"{name}","arguments":{{"input":"{e}"}}}}\n</tool_call>'
    members, others, wrong = compare(raw, escaped, strings(raw, 2, 40, PATCHES), lambda e: call("apply_patch", e))
    assert not wrong and members and others
    assert accepts(escaped, call("other", esc("abc\n")))
    assert not accepts(escaped, call("other", esc("abc")))
    assert not accepts(escaped, call("apply_patch", esc("abc\n")))


def test_only_pythons_escapes_are_accepted():
    """``\\/``, ``\\u0022``, ``\\u000a``, uppercase hex and raw specials are valid JSON or
    close to it, but not what json.dumps writes: the grammar holds the input to one form."""
    rules, root = escaped_lark(APPLY_PATCH, "c0")
    escaped = matcher(f"start: {root}\n{rules}")
    patch = PATCHES[0].replace("src/a", "src/a\x1f/")
    good = esc(patch)
    assert accepts(escaped, good)
    for bad in (good.replace("/", "\\/", 1), good.replace('\\"', "\\u0022", 1), good.replace("\\n", "\\u000a", 1),
                good.replace("\\u001f", "\\u001F", 1), good.replace("\\t", "\t", 1), good.replace('\\"', '"', 1),
                good.replace("\\\\", "\\", 1), good.replace("é", "\\u00e9", 1)):
        assert bad != good and not accepts(escaped, bad), bad


def test_a_wrong_escape_breaks_the_checks(monkeypatch):
    """The checks above can fail: with ``"`` escaped as ``\\u0022`` inside the converter,
    the comparison finds members it rejects."""
    monkeypatch.setattr(json_escapes, "esc", lambda c: "\\u0022" if c == '"' else esc(c))
    rules, root = escaped_lark(APPLY_PATCH, "c0")
    raw = matcher(APPLY_PATCH)
    _, _, wrong = compare(raw, matcher(f"start: {root}\n{rules}"), PATCHES)
    assert wrong


def test_a_qwen3_tool_call_passes_token_by_token():
    """A whole call, tokenized by Qwen3's tokenizer (multi-byte tokens spanning escapes and
    lexeme ends), is accepted by a matcher over that tokenizer; a patch whose end marker is
    glued to its last line is refused."""
    from conftest import TOKENIZERS, require_tokenizers
    from tokenizers import Tokenizer

    require_tokenizers("qwen3")
    path = str(TOKENIZERS / "qwen3" / "tokenizer.json")
    hf, tok = Tokenizer.from_file(path), llguidance.LLTokenizer(path)
    rules, root = escaped_lark(APPLY_PATCH, "c0")
    host = 'start: "{\\"name\\":\\"apply_patch\\",\\"arguments\\":{\\"input\\":\\"" ' + root + ' "\\"}}"\n' + rules
    grammar = llguidance.LLMatcher.grammar_from_lark(host)
    for patch, ok in [(PATCHES[1], True), (PATCHES[0], True), (PATCHES[0].replace("😀\n", "😀"), False)]:
        text = json.dumps({"name": "apply_patch", "arguments": {"input": patch}}, ensure_ascii=False,
                          separators=(",", ":"))
        ids = hf.encode(text, add_special_tokens=False).ids
        m = llguidance.LLMatcher(tok, grammar)
        assert (m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()) == ok


# ---------------------------------------------------------------------- hand-written grammars

GRAMMARS = {
    "quotes and escapes": r'''
start: item (";" item)*
item: KEY "=" (ESCAPED_STRING | VALUE | "\"\\\"" | "\\" "n"?)
KEY: /[a-z_]+/
VALUE: /[^;"\\\n]+/ | /'(?:[^'\\]|\\.)*'/
%import common.ESCAPED_STRING
''',
    "lines, tabs and control characters": r'''
start: line+
line: INDENT? WORD ("\t" /[^\n\t\x00\x1f]*/)* NL
INDENT: /[ \t]+/
WORD: /[\w"\\]+/
NL: /\r?\n/ | "\x00" | "\u001f"
''',
    "dot with and without s, negated classes": r'''
start: DOTS "\n" body
DOTS: /.{0,6}/
body: /(?s:a.*z)?/ | /x(.)y/s | /[^"]*"/ | /[^\x00-\x08\\]+/i
''',
    "case-insensitive keywords, unicode, ranges, repeats": r'''
start: "SELECT"i COLS "from"i NAME ("where\n"i COND)? ";"
COLS: /\s+/ (NAME ("," NAME){0,3} | "*") /\s+/
NAME: ("a".."z" | "é" | "\u00c0".."\u00ff" | DIGIT)~1..8 -> name
COND: /[^;]+/
%import common.DIGIT
''',
    "imports, aliases, options, nesting": r'''
start: (comment | stmt)+
!stmt: CNAME "=" expr NEWLINE -> assign
?expr: SIGNED_NUMBER | CNAME | ESCAPED_STRING | "(" expr ")"
comment[capture]: SH_COMMENT NEWLINE | C_COMMENT
%import common (CNAME, SIGNED_NUMBER, ESCAPED_STRING, NEWLINE)
%import common.SH_COMMENT
%import common.C_COMMENT
''',
    "lazy and stop rules": r'''
start: note "|" tail
note[lazy]: /(?s:.*)\n/
tail[suffix="\""]: /[^|]*/
''',
}


@pytest.mark.parametrize("name", GRAMMARS)
def test_hand_written_grammars(name):
    check_lark(GRAMMARS[name], seed=list(GRAMMARS).index(name))


IGNORING = r'''
start: pair ("," pair)*
pair: KEY ":" value
?value: NUMBER | "true" | list
list: "[" [value ("," value)*] "]"
KEY: /"[^"\n]*"/
%import common.NUMBER
%import common.WS
%ignore WS
'''


def test_ignored_text_between_lexemes():
    """``%ignore`` text is allowed between lexemes, not before the first. llguidance also
    skips it after the last lexeme where another one could follow; the escaped grammar
    never ends in ignored text (the one difference, in the direction that keeps every
    generated input valid)."""
    check_lark(IGNORING, seed=9, keep=lambda s: s == s.rstrip(" \t\f\r\n"))
    rules, root = escaped_lark(IGNORING, "c0")
    raw, escaped = matcher(IGNORING), matcher(f"start: {root}\n{rules}")
    assert accepts(raw, '"k":[1]\n') and not accepts(escaped, esc('"k":[1]\n'))
    assert not accepts(raw, ' "k":1') and not accepts(escaped, esc(' "k":1'))
    assert accepts(escaped, esc('"k\t" :\r\n[1 , true,[]]\t,"j":2'))


REGEXES = [r"^[a-z]+(\n[a-z]+)*$", r"(?s).{0,5}", r'[^"\\]*', r"\s+", r"\S\W\w+\t\d*", r'(?i)ab"c\\x',
           r".*", r"[\x00-\x1f]+|\n", r"(a|\n|\\|\")*", r"\p{L}+\P{L}?", r"[[:cntrl:]--\n][[:^alpha:]]",
           r"x{2,4}(\t|y){1,3}", r'("[^"]*"|\\.)*', r"[\w&&[^a-m]]+\r", r"(?x) a \  b # comment", r"\u{1F600}|\x0c",
           r"[^\n]{2,12}\n?", r"(?s:.){0,20}x", r"(a.{2,}){1,3}"]


@pytest.mark.parametrize("regex", REGEXES)
def test_regexes(regex):
    rules, root = escaped_regex(regex, "r")
    raw = llguidance.LLMatcher(BYTES, llguidance.LLMatcher.grammar_from_regex(regex))
    members, others, wrong = compare(raw, matcher(f"start: {root}\n{rules}"), strings(raw, 3, 40, [""]))
    assert not wrong, f"{wrong[:5]}\n{rules}"
    assert members and others


ATOMS = ["a", "b", r"\n", r"\t", '"', r"\\", r"\x00", ".", "[^a]", '[a\n"]', r"\s", r"[\x00-\x1f]", "é", "(?s:.)"]


def random_regex(rng: random.Random, depth: int) -> str:
    kind = rng.randrange(6) if depth else 0
    if kind <= 1:
        return rng.choice(ATOMS)
    if kind == 2:
        return "".join(random_regex(rng, depth - 1) for _ in range(rng.randint(2, 3)))
    if kind == 3:
        return "(?:" + "|".join(random_regex(rng, depth - 1) for _ in range(rng.randint(2, 3))) + ")"
    return f"(?:{random_regex(rng, depth - 1)}){rng.choice(['*', '+', '?', '{1,3}', '{0,2}', '{2}', '{2,}', '*?'])}"


def test_random_regexes():
    """Random nestings of concatenation, alternation and repeats over atoms that hold
    specials: every (head, middle, tail) combination of the decomposition gets exercised."""
    rng, checked = random.Random(7), 0
    for i in range(60):
        regex = random_regex(rng, 3)
        rules, root = escaped_regex(regex, "r")
        raw = llguidance.LLMatcher(BYTES, llguidance.LLMatcher.grammar_from_regex(regex))
        members, others, wrong = compare(raw, matcher(f"start: {root}\n{rules}"), strings(raw, i, 10, [""]))
        assert not wrong, (regex, wrong[:3], rules)
        checked += members + others
    assert checked > 1000


def test_a_greedy_commitment_at_a_special_is_not_kept():
    """The documented limit: llguidance's lexer extends the raw lexeme /a\n?/ over the
    newline, so the raw grammar rejects "a" "\nb"; the escaped one reads the newline's
    escape as either terminal's and accepts. Grammars whose terminals do not compete at
    specials (apply_patch's) are converted exactly."""
    grammar = 'start: A B\nA: /a\\n?/\nB: /\\nb/'
    rules, root = escaped_lark(grammar, "c0")
    assert not accepts(matcher(grammar), "a\nb") and accepts(matcher(f"start: {root}\n{rules}"), esc("a\nb"))


def test_backslash_s_is_rusts():
    """Rust's ``\\s`` lacks U+001C..U+001F, which Python's has: membership comes from
    llguidance, so the escaped form allows ``\\u000b`` but not ``\\u001c``."""
    rules, root = escaped_regex(r"\s", "r")
    m = matcher(f"start: {root}\n{rules}")
    assert [accepts(m, esc(c)) for c in "\t\n\x0b\x0c\r \x1c\x1f"] == [True] * 6 + [False] * 2


@pytest.mark.parametrize("grammar, construct", [
    ('start: <|im_end|> "a"', "special tokens"), ('start: %json {"type": "string"}', "%json"),
    ("start: @other", "grammar references"), ('%llguidance {}\nstart: "a"', "%llguidance"),
    ('start: A\nA: /(a)\\1/', "backreference"), ('start: A\nA: /a(?=b)/', "look-around"),
    ('start: A\nA: /a(?<!b)/', "look-around"), ('start: /a\\bc/', "word boundary"), ('start: /a^b/', "anchor"),
    ('start: A\nA: "a" & /./', "&"), ('start: A\nA: ~"a"', "~"), ('start: x{"a"}\nx{t}: t', "templates"),
    ('start: A\nA.2: "a"', "priorities"), ('start: x\nx[max_tokens=3]: /a+/', "max_tokens"),
    ('start: x\nx[temperature=0.5]: /a+/', "temperature"), ("%import other.X\nstart: X", "%import"),
    ("start: A\nA: A \"a\" | \"b\"", "refers to itself"), ('start: /(?-u:a)/', "flags"), ("x: \"a\"", "start"),
    ("start: /.{0,72}/", "at most 32"),
])
def test_refused_constructs(grammar, construct):
    with pytest.raises(GrammarConversionError, match=construct):
        escaped_lark(grammar, "c0")


def test_prefix_must_be_a_name():
    with pytest.raises(GrammarConversionError):
        escaped_lark('start: "a"', "c-0")
